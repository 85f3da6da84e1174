"""Real NCCL collectives of the engine on ONE GPU (part ``nccl-1gpu`` of gpu_check.py, run by gpu_check.sh).

At world size 1 the engine normally skips its collectives (a copy instead: ``ShardGroup.shard_size == 1``),
and NCCL refuses two ranks on one GPU.  So this part builds a 1-rank NCCL group and turns the skip off
(``ShardGroup.collectives_at_one_rank``); for the hybrid schedule it also gives the group a 1-rank NCCL replica
group, so the replica all-reduce is issued too.  Every training step then issues, on the engine's side
streams and with ``async_op=False`` inside ``torch.cuda.stream(side)`` (how the engine issues them):

* the all-gather of every flat parameter (``all_gather_into_tensor`` on torch 2.11, ``all_gather_single`` on
  2.13+: whichever ``accel_flatshard.core.comm`` picked, printed),
* the reduce-scatter of every gradient (``reduce_scatter_tensor`` / ``reduce_scatter_single``),
* under hybrid sharding the all-reduce over the replica group, on its own stream.

Checked: each call is counted; losses and final parameters equal a single-process run of the plain model
(``--tol``) and the engine's own W=1 copy path bitwise-or-within-tol, for the prefetch schedule (default), no
prefetch, hybrid, and bf16 compute, as is and in slow-GPU mode (``gpu_check_slow.py``: the compute stream and
the side streams fall behind the host, so a missing wait reads unwritten buffers).

The streams are observed from outside, not assumed (the engine's ``collective()`` always enters its side
stream, so asking it would prove nothing): each collective call runs inside a ``gpu_check::<kind>`` profiler
range, and torch.profiler (CUPTI) reports the device stream of every kernel / copy launched inside it (by
correlation id); the compute stream is the one the forward's and backward's matrix multiplies ran on.  PASS
when the device work of every all-gather and reduce-scatter was seen and none of it ran on the compute stream
(an in-place 1-rank all-reduce may launch nothing: reported).  On CPU there are no streams: the sub-check is
reported as skipped, never as passed.

    python benchmarks/gpu_check.py --part nccl-1gpu          # one GPU
    python benchmarks/gpu_check.py --device cpu --part nccl-1gpu   # CPU smoke: gloo, the same calls
"""
from __future__ import annotations

import bisect
import contextlib
import json
import os
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from accel_flatshard import MixedPrecision
from accel_flatshard.core import comm, fully_sharded as _fully_sharded
from gpu_check_slow import MODES, slow_gpu

COMPUTE_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")  # launched on the compute stream

SCHEDULES = {
    "prefetch": ({}, False),  # the defaults: forward prefetch + BACKWARD_PRE
    "no-prefetch": ({"forward_prefetch": False, "backward_prefetch": None}, False),
    "hybrid": ({}, True),
    "bf16": ({"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}, False),
}


@contextlib.contextmanager
def issuing_one_rank_groups(hybrid: bool) -> Iterator[List[comm.ShardGroup]]:
    """Models wrapped inside get a ShardGroup that issues real collectives at size 1 (and, with ``hybrid``, a
    1-rank replica group: the replica all-reduce is issued too).  Yields the groups made."""
    made: List[comm.ShardGroup] = []
    original = _fully_sharded.ShardGroup

    class IssuingShardGroup(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.collectives_at_one_rank = True
            self.via_p2p = False  # (gloo smoke: the collectives, not point-to-point)
            if hybrid:
                self.replica_group = dist.new_group([0])
                self.replicas = self._members(self.replica_group)
            made.append(self)

    _fully_sharded.ShardGroup = IssuingShardGroup
    try:
        yield made
    finally:
        _fully_sharded.ShardGroup = original


@contextlib.contextmanager
def recording_collectives() -> Iterator[List[Tuple[str, bool]]]:
    """Every all-gather / reduce-scatter / all-reduce the engine issues: (name, async_op), each inside a
    ``gpu_check::<name>`` profiler range."""
    calls: List[Tuple[str, bool]] = []

    def recorder(name, fn):
        def record(*args, async_op=False, **kwargs):
            calls.append((name, async_op))
            with torch.profiler.record_function(f"gpu_check::{name}"):  # (the range the profiler attributes by)
                return fn(*args, async_op=async_op, **kwargs)
        return record

    saved = (comm._all_gather_flat, comm._reduce_scatter_flat, comm.dist.all_reduce)
    comm._all_gather_flat = recorder("all_gather", saved[0])
    comm._reduce_scatter_flat = recorder("reduce_scatter", saved[1])
    comm.dist.all_reduce = recorder("all_reduce", saved[2])
    try:
        yield calls
    finally:
        comm._all_gather_flat, comm._reduce_scatter_flat, comm.dist.all_reduce = saved


def _train_wrapped(gpu_check, family: str, device, data, kwargs, hybrid: bool, issue: bool,
                   trace: Optional[str] = None):
    """Train a wrapped model; returns (losses, full parameters, the calls recorded).  ``trace``: profile the
    training (CUDA) and write the chrome trace there."""
    with contextlib.ExitStack() as stack:
        if issue:
            stack.enter_context(issuing_one_rank_groups(hybrid))
        wrapped = gpu_check.wrap(gpu_check.small_model(family).to(device), **kwargs)
        calls = stack.enter_context(recording_collectives())
        prof = None
        if trace is not None:
            from torch.profiler import ProfilerActivity, profile

            prof = stack.enter_context(profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]))
        losses = gpu_check.train(wrapped, data)
        torch.cuda.synchronize(device) if prof is not None else None
    if prof is not None:
        prof.export_chrome_trace(trace)
    with wrapped.summon_full_params():
        params = {n: p.detach().clone() for n, p in wrapped.named_parameters()}
    return losses, params, calls


def observed_streams(trace: str) -> Tuple[Dict[str, set], Optional[object]]:
    """From a chrome trace: {collective kind: device streams its work ran on}, and the compute stream (where
    the matrix multiplies ran).  Device work is attributed to the innermost ``gpu_check::<kind>`` or compute
    op range on the same host thread that contains its launch (the runtime or driver call with its correlation
    id).  A kind seen that way nowhere falls back to the NCCL kernels named after it (``ncclDevKernel_AllGather``)."""
    with open(trace) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    ranges: Dict[object, List[Tuple[float, float, str]]] = {}  # host thread -> (start, end, label), by start
    for e in events:
        name = e.get("name", "")
        if e.get("cat") in ("cpu_op", "user_annotation") and (name.startswith("gpu_check::") or name in COMPUTE_OPS):
            label = name[len("gpu_check::"):] if name.startswith("gpu_check::") else "compute"
            ranges.setdefault(e.get("tid"), []).append((e["ts"], e["ts"] + e["dur"], label))
    starts = {}
    for tid, rs in ranges.items():
        rs.sort()
        starts[tid] = [r[0] for r in rs]
    launched = {}  # correlation id -> label
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            rs = ranges.get(e.get("tid"), [])
            i = bisect.bisect_right(starts.get(e.get("tid"), []), e["ts"])
            inside = [r for r in rs[max(0, i - 16):i] if r[1] >= e["ts"]]  # (ranges nest only a few deep)
            if inside:
                launched[e["args"]["correlation"]] = min(inside, key=lambda r: r[1] - r[0])[2]
    streams: Dict[str, Dict[object, int]] = {}
    by_name: Dict[str, set] = {}
    for e in events:
        args = e.get("args", {})
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        if args.get("correlation") in launched:
            per = streams.setdefault(launched[args["correlation"]], {})
            per[args.get("stream")] = per.get(args.get("stream"), 0) + 1
        name = e.get("name", "").lower().replace("_", "")
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            if "nccl" in name and kind.replace("_", "") in name:
                by_name.setdefault(kind, set()).add(args.get("stream"))
    compute = streams.pop("compute", {})
    seen = {k: set(v) for k, v in streams.items()}
    for kind, found in by_name.items():
        seen.setdefault(kind, found)
    return seen, (max(compute, key=compute.get) if compute else None)


def stream_check(trace: Optional[str], counts: Dict[str, int]) -> Tuple[Optional[bool], str]:
    """(True / False, or None where not applicable: CPU), and the line that says what was seen."""
    if trace is None:
        return None, "streams: SKIPPED (CPU)"
    try:
        seen, compute = observed_streams(trace)
    except Exception as exc:  # noqa: BLE001 - reported as a failed observation, with why
        return False, f"streams: NOT OBSERVED ({type(exc).__name__}: {str(exc)[:160]})"
    need = [k for k in ("all_gather", "reduce_scatter") if counts.get(k)]
    missing = [k for k in need if not seen.get(k)]
    on_compute = [k for k, s in seen.items() if compute in s]
    good = compute is not None and not missing and not on_compute
    text = ", ".join(f"{k} on {sorted(map(str, s))}" for k, s in sorted(seen.items()))
    if counts.get("all_reduce") and not seen.get("all_reduce"):
        text += ", all_reduce launched nothing (in place at 1 rank)"
    return good, (f"streams (profiler): compute {compute}; {text or 'no collective work seen'}"
                  + (f"; not seen: {missing}" if missing else "")
                  + (f"; ON THE COMPUTE STREAM: {on_compute}" if on_compute else ""))


def _max_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    return max((a[n].float() - b[n].float()).abs().max().item() for n in a)


def nccl_one_gpu(gpu_check, device: torch.device, steps: int, tol: float, out_dir: str = ".") -> bool:
    """See the module docstring.  ``gpu_check``: the gpu_check module (models, training loop)."""
    cuda = device.type == "cuda"
    print(f"  collectives: {comm._all_gather_flat.__name__}, {comm._reduce_scatter_flat.__name__} "
          f"(torch {torch.__version__}); backend {dist.get_backend()}", flush=True)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 1024, (4, 64), generator=g).to(device) for _ in range(steps)]
    ok, streams_checked = True, 0
    for family in ("gpt2", "llama", "llama-packed"):
        ref = gpu_check.small_model(family).to(device)
        ref_losses = gpu_check.train(ref, data)
        ref_params = {n: p.detach() for n, p in ref.named_parameters()}
        for mode, slow in MODES:
            for name, (kwargs, hybrid) in SCHEDULES.items():
                if (name == "bf16" and family == "gpt2") or (family == "llama-packed" and name != "prefetch"):
                    continue  # (llama-packed: the packed gather of two dtypes, copied out of one NCCL all-gather)
                # profiled: the runs as is (slow-GPU mode adds sleeps, not other streams)
                trace = os.path.join(out_dir, f"nccl_1gpu_{family}_{name}.json") if cuda and not slow else None
                with slow_gpu(device, slow):
                    losses, params, calls = _train_wrapped(gpu_check, family, device, data, kwargs, hybrid, True, trace)
                    copy_losses, copy_params, copy_calls = _train_wrapped(gpu_check, family, device, data, kwargs,
                                                                          hybrid, False)
                counts = {k: sum(1 for c in calls if c[0] == k) for k in ("all_gather", "reduce_scatter", "all_reduce")}
                issued = (counts["all_gather"] > 0 and counts["reduce_scatter"] > 0
                          and (counts["all_reduce"] > 0) == hybrid)
                on_streams, stream_text = stream_check(trace, counts) if not slow else (None, "streams: as is")
                streams_checked += on_streams is not None
                ref_tol = 0.05 if name == "bf16" else tol
                ldiff = max(abs(a - b) for a, b in zip(losses, ref_losses))
                pdiff = _max_diff(params, ref_params)
                copy_diff = max(_max_diff(params, copy_params), max(abs(a - b) for a, b in zip(losses, copy_losses)))
                good = (issued and on_streams is not False and not copy_calls and ldiff <= ref_tol and pdiff <= ref_tol
                        and copy_diff <= tol)
                ok &= good
                print(f"  {mode:8s} {family:5s} {name:11s} issued AG/RS/AR {counts['all_gather']}/"
                      f"{counts['reduce_scatter']}/{counts['all_reduce']} "
                      f"({'sync' if not any(c[1] for c in calls) else 'async'}); {stream_text}; vs plain "
                      f"max|dloss|={ldiff:.1e} max|dparam|={pdiff:.1e}; vs W=1 copy path {copy_diff:.1e}: "
                      f"{'PASS' if good else 'FAIL'}", flush=True)
    observed = f"observed in {streams_checked} runs" if streams_checked else \
        "SKIPPED (CPU: no device streams to observe; not passed)"
    print(f"  stream check: {observed}", flush=True)
    return ok
