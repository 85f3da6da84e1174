"""Planning for the link between machines (``accel-flatshard plan --link 1gbit``): each candidate configuration's step
time from the bytes it sends per step over a link model plus a compute estimate, and the fastest one that fits.

The bytes are the engine's own: :func:`run.predict` runs the real wrapper on fake tensors and its ``ShardGroup``
counts what this rank sends, by kind and by whether it crosses machines (``comm.ShardGroup.sent``), with machines as
blocks of ``ranks_per_node = world_size / num_machines`` consecutive ranks.  Per optimizer step (``seconds``)::

    flop_rate  = FLOPs(step) / compute_s                            # this host's rank, from the reference step
    compute    = compute_s + (GLOO_FLOP_PER_BYTE * (sent - sent_ref) + INT8_FLOP_PER_BYTE * quantized) / flop_rate
    wire       = across / rate + crossings * latency
    step       = max(compute, wire) + EXPOSED_SHARE * min(compute, wire)   # (EXPOSED_SHARE 1 without prefetch)

``compute_s``: one rank's step of the reference configuration (FULL_SHARD, exact collectives) with no cross-machine
limit (``--compute_ms``: measured with the link unshaped, or on one machine), else 6 x parameters x tokens FLOPs at
``HARDWARE``'s rate.  ``sent``: the bytes this rank sends per step, inside and across machines (gloo moves them with
the rank's CPU: NCCL's do not count); ``quantized``: the bytes of the units gathered and gradients reduced through int8,
as exact tensors (each rank dequantizes the whole unit and quantizes its share); ``across``: the bytes per step
leaving the busier machine (its ranks' bytes across: rank 0's, the fullest, times ranks per machine); ``crossings``:
this rank's collectives that send across machines (each waits a latency at least).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, List, Optional, Tuple

import torch

from .run import Prediction

# (plan/__init__.py's Planner and Config are taken, not imported: the command line imports both modules, and the
# import chain stays as short as before)
Planner = Config = Any

# CPU work per byte a rank sends over gloo (TCP: copies and checksums on the rank's own core), in FLOPs of the model's
# step: comm.py's measurement on this host, 152 MiB sent point-to-point in 99 ms (0.62 ns per byte), at the rank's
# rate in the 2 x 1 bench (llama-27M, 42.1 GFLOP per step in 1.147 s: 36.7 GFLOP/s).  Stated in FLOPs, not seconds,
# so that it slows down with the rank as compute does (2 ranks sharing a core: both half as fast).
GLOO_FLOP_PER_BYTE = 23.0
# int8's quantize and dequantize per byte of the exact tensors (qwZ: a unit's shard quantized, the whole unit
# dequantized; qgZ: the full gradient quantized, the received chunks summed), since int8.py works in cache-sized
# pieces: the 2 x 1 bench's unshaped rows (2026-12-05, after the change), ours+int8 0.668 s against ours 0.688 s, plus
# the 0.041 s of gloo work its 110 MB fewer bytes saved = 0.021 s for 294.8 MB of exact tensors (0.07 ns per byte) at
# the rank's 61 GFLOP/s.  (Before the change: 40, from 1.397 s against 1.147 s.)
INT8_FLOP_PER_BYTE = 4.4
# how much of the shorter of compute and wire stays exposed: with prefetch the longer one hides the shorter one only
# in part, because the forward's gathers overlap the forward's compute alone, the backward's the backward's, each pass
# starts with a gather nothing hides, and a gloo rank moves its bytes with its own core.  Measured on the bench's
# shaped rows (2 x 1, 2 x 2, 4 micro-batches; 2026-12-05): (step - max) / min between 0.3 and 0.6 for every
# configuration but hpZ (0.8) and the 10 Gbit/s rows (about 0); 0.5 keeps every one within 16%.  Without prefetch
# nothing overlaps (1).  On GPUs (NCCL, its own copy engines) it is lower.
EXPOSED_SHARE = 0.5

_RATE_UNITS = {"tbit": 1e12, "gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
_LATENCY_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


@dataclasses.dataclass(frozen=True)
class Link:
    """The link between machines: its rate (bits per second, each direction) and latency (seconds)."""

    bits_per_s: float
    latency_s: float = 0.0

    def __str__(self) -> str:
        latency = f", latency {self.latency_s * 1e3:g} ms" if self.latency_s else ""
        return f"{self.bits_per_s / 1e9:g} Gbit/s{latency}"


def parse_link(text: str) -> Link:
    """``--link``: a rate with a unit (``1gbit``, ``400mbit``, ``2.5gbit``) and optionally ``:`` a latency
    (``10gbit:0.2ms``; units s, ms, us)."""
    rate, colon, latency = text.strip().lower().partition(":")
    rate_match = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*(tbit|gbit|mbit|kbit)", rate.strip())
    latency_match = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*(s|ms|us)", latency.strip()) if colon else None
    if not rate_match or (colon and not latency_match):
        raise ValueError(f"--link {text!r}: expected a rate in tbit, gbit, mbit or kbit (per second), optionally "
                         "':' a latency in s, ms or us, e.g. --link 1gbit or --link 10gbit:0.2ms")
    bits = float(rate_match.group(1)) * _RATE_UNITS[rate_match.group(2)]
    if bits <= 0:
        raise ValueError(f"--link {text!r}: the rate must be positive")
    seconds = float(latency_match.group(1)) * _LATENCY_UNITS[latency_match.group(2)] if latency_match else 0.0
    return Link(bits, seconds)


@dataclasses.dataclass
class LinkRow:
    """One candidate under a link: its bytes per step, the predicted step and its parts, and its peak."""

    name: str  # e.g. "FULL_SHARD + int8"
    cfg: Config
    lossy: bool  # int8 collectives
    prediction: Prediction
    sent: Dict[Tuple[str, str], int]  # this rank's bytes per step, by (kind, "intra" | "inter")
    across_bytes: int  # leaving the busier machine per step
    crossings: int
    compute_s: float
    wire_s: float
    step_s: float
    fits: bool = True


def step_traffic(pred: Prediction, micro_steps: int) -> Tuple[Dict[Tuple[str, str], int], int]:
    """This rank's bytes per optimizer step by (kind, where) and its collectives across machines: the measured step's
    first micro-step for all but the last (alike: none reduces under no_sync, each does with sync_each_batch), its
    last for the last."""
    sent: Dict[Tuple[str, str], int] = {}
    counts = [(micro_steps - 1, pred.sent[0]), (1, pred.sent[-1])] if micro_steps > 1 else [(1, pred.sent[-1])]
    for times, micro in counts:
        for key, nbytes in micro.items():
            sent[key] = sent.get(key, 0) + times * nbytes
    crossings = (micro_steps - 1) * pred.crossings[0] + pred.crossings[-1] if micro_steps > 1 else pred.crossings[-1]
    return sent, crossings


def candidates(planner: Planner, launched: Config) -> List[Tuple[str, Config]]:
    """FULL_SHARD, SHARD_GRAD_OP, and with several ranks per machine HYBRID_SHARD (a shard group per machine) and hpZ,
    each exact and with int8 weights and gradients; the launch's other options (prefetch, AC, batch) kept."""
    W, N = planner.world_size, planner.world_size // planner.num_machines
    base = launched.replace(ranks_per_node=N, fsdp_group_size=None, reshard_after_forward=True,
                            node_local_backward_gather=False, quantized_all_gather=False, quantized_reduce=False)
    kinds = [("FULL_SHARD", {}), ("SHARD_GRAD_OP", {"reshard_after_forward": False})]
    if 1 < N < W:
        kinds += [(f"HYBRID_SHARD (group {N}: a machine)", {"fsdp_group_size": N}),
                  ("FULL_SHARD + hpZ", {"node_local_backward_gather": True})]
    return [(name + suffix, base.replace(**kw, quantized_all_gather=q, quantized_reduce=q))
            for name, kw in kinds for suffix, q in (("", False), (" + int8", True))]


def _model_flops(planner: Planner, cfg: Config) -> float:
    """FLOPs of one rank's optimizer step: 6 x parameters x tokens (8 with activation checkpointing)."""
    return (6 + 2 * cfg.options.activation_checkpointing) * planner.numel * planner.batch_size * planner.tokens


def _quantized_bytes(planner: Planner, cfg: Config, exact: Dict[Tuple[str, str], int],
                     sent: Dict[Tuple[str, str], int]) -> float:
    """Bytes of the exact tensors int8 carries per step: each kind whose bytes int8 cut (the exact form's, over the
    shard group of G: a rank sends (G - 1) / G of a whole unit or gradient)."""
    G = cfg.shard_size(planner.world_size)
    kinds = {kind for kind, _ in exact}
    by_kind = lambda counts, kind: sum(v for (k, _), v in counts.items() if k == kind)  # noqa: E731
    cut = [k for k in kinds if by_kind(sent, k) < 0.5 * by_kind(exact, k)]
    return sum(by_kind(exact, k) for k in cut) * G / max(1, G - 1)


def estimated_compute_s(planner: Planner, launched: Config, flops_per_s: float) -> float:
    """Without ``--compute_ms``: the reference's step from its FLOPs at ``flops_per_s`` (half precision; fp32 a
    quarter of it), as ``plan.step_time`` counts compute."""
    rate = flops_per_s / (4 if (planner.param_dtype or torch.float32) == torch.float32 else 1)
    return _model_flops(planner, launched) / rate


def plan_link(planner: Planner, launched: Config, link: Link, compute_s: float,
              device_memory: Optional[int] = None) -> List[LinkRow]:
    """Every candidate's predicted step under ``link`` (the module's formula), fastest first; ``fits``: its peak
    within ``device_memory`` (None: not checked).  ``compute_s``: the reference's step (FULL_SHARD, exact) with no
    link limit (:func:`estimated_compute_s` without a measurement)."""
    if planner.num_machines < 2 or planner.world_size % planner.num_machines:
        raise ValueError(f"--link plans the traffic between machines: --num_machines {planner.num_machines} must be "
                         f"2 or more and divide the {planner.world_size} processes")
    micro_steps = planner.batch_size // launched.micro_batch
    N = planner.world_size // planner.num_machines
    rows = candidates(planner, launched)
    flop_rate = _model_flops(planner, rows[0][1]) / compute_s
    gloo = 0.0 if planner.device == "cuda" else GLOO_FLOP_PER_BYTE  # (NCCL moves bytes without the rank's CPU)
    traffic = {name: step_traffic(planner.predict(cfg), micro_steps) for name, cfg in rows}
    sent_ref = sum(traffic[rows[0][0]][0].values())
    out = []
    for name, cfg in rows:
        sent, crossings = traffic[name]
        o, lossy = cfg.options, cfg.options.quantized_all_gather or cfg.options.quantized_reduce
        exact = traffic[name.replace(" + int8", "")][0]
        quantized = _quantized_bytes(planner, cfg, exact, sent) if lossy else 0.0
        compute = compute_s + (gloo * (sum(sent.values()) - sent_ref) + INT8_FLOP_PER_BYTE * quantized) / flop_rate
        across = N * sum(v for (_, where), v in sent.items() if where == "inter")
        wire = across * 8 / link.bits_per_s + crossings * link.latency_s
        exposed = EXPOSED_SHARE if o.forward_prefetch or o.backward_prefetch else 1.0
        pred = planner.predict(cfg)
        out.append(LinkRow(name, cfg, lossy, pred, sent, across, crossings, compute, wire,
                           max(compute, wire) + exposed * min(compute, wire),
                           device_memory is None or pred.peak_bytes <= device_memory))
    return sorted(out, key=lambda r: r.step_s)


def recommendation(rows: List[LinkRow]) -> Optional[LinkRow]:
    """The fastest candidate that fits (``rows``: :func:`plan_link`'s, fastest first)."""
    return next((r for r in rows if r.fits), None)


def reason(best: LinkRow, rows: List[LinkRow]) -> str:
    """Why ``best``: its bytes across and step against FULL_SHARD's (or, when it is FULL_SHARD, the runner-up's)."""
    mb = lambda r: f"{r.across_bytes / 1e6:,.0f} MB"  # noqa: E731
    other = next((r for r in rows if r.name == "FULL_SHARD" and r is not best), None) or next(
        (r for r in rows if r is not best and r.fits), None)
    if other is None:
        return f"{best.name}: the only configuration that fits"
    lossy = " (lossy: int8 weights and gradients, docs/communication.md)" if best.lossy else ""
    if best.across_bytes < other.across_bytes:
        why = f"{mb(best)} across machines per step instead of {mb(other)} ({other.name})"
    else:
        why = (f"{mb(best)} across machines per step against {mb(other)} ({other.name}), whose compute costs "
               f"{other.compute_s - best.compute_s:+.2f} s more")
    return f"{best.name}{lossy}: {why}; predicted {best.step_s:.2f} s per step instead of {other.step_s:.2f} s"


def link_report(planner: Planner, launched: Config, link: Link, compute_s: float, device_memory: Optional[int],
                settings: Any) -> Dict[str, Any]:
    """``report``'s ``link`` section: the candidates, fastest first, and the recommendation with its reason and
    what to set (``settings``: ``plan.settings``)."""
    rows = plan_link(planner, launched, link, compute_s, device_memory)
    best, W = recommendation(rows), planner.world_size
    out: Dict[str, Any] = {
        "link": str(link), "machines": planner.num_machines, "ranks_per_machine": W // planner.num_machines,
        "reference_compute_s": next(r.compute_s for r in rows if r.name == "FULL_SHARD"),
        "candidates": [{"name": r.name, "lossy": r.lossy, "strategy": r.cfg.strategy(W), "across_bytes_per_step":
                        r.across_bytes, "sent_per_rank": {f"{k} {w}": v for (k, w), v in sorted(r.sent.items())},
                        "crossings": r.crossings, "compute_s": r.compute_s, "wire_s": r.wire_s,
                        "step_s": r.step_s, "peak_bytes": r.prediction.peak_bytes, "fits": r.fits} for r in rows],
        "model": "step = max(compute, wire) + EXPOSED_SHARE x min(compute, wire); wire = bytes across / rate + "
                 "crossings x latency; compute = the reference's + (GLOO_FLOP_PER_BYTE x bytes sent beyond its own + "
                 "INT8_FLOP_PER_BYTE x bytes through int8) / the rank's FLOP rate (accel_flatshard/plan/link.py)",
        "constants": {"GLOO_FLOP_PER_BYTE": GLOO_FLOP_PER_BYTE, "INT8_FLOP_PER_BYTE": INT8_FLOP_PER_BYTE,
                      "EXPOSED_SHARE": EXPOSED_SHARE}}
    if best is not None:
        o = best.cfg.options
        out["recommended"] = {"name": best.name, "reason": reason(best, rows), "settings": settings(
            best.cfg, W, planner.batch_size) + [f"FLATSHARD_QUANTIZED_ALL_GATHER={int(o.quantized_all_gather)}",
                                                f"FLATSHARD_QUANTIZED_REDUCE={int(o.quantized_reduce)}",
                                                f"FLATSHARD_NODE_LOCAL_BACKWARD_GATHER="
                                                f"{int(o.node_local_backward_gather)}"]}
    return out
