"""docs/figures/step_timeline.png (issue 47): one training step per rank and stream kind, from the profiler's trace.

Three parts, each usable alone:

* ``--train``: the run the figure shows, started by ``accelerate launch --config_file
  accelerate_configs/cpu_2proc.yaml tools/step_timeline.py --train ...`` with ``FLATSHARD_PROFILE=DIR``: a small
  Llama built from its config (nothing downloaded) trained for a few steps through accel_flatshard's Accelerator;
  the engine's profiler writes ``DIR/flatshard_trace_rank{r}.json`` (accel_flatshard/tools/profiling.py);
* :func:`timeline_rows`: a Chrome trace's ``flatshard::*`` spans of one step as rows per (rank, stream kind):
  compute (``forward[unit]`` / ``backward`` / the optimizer step), all-gather, reduce-scatter.  On CPU/gloo the
  "streams" are the asynchronous work handles: an all-gather row holds its issue (``all_gather[unit]``) and the
  training thread's wait on it (``wait_all_gather[unit]``, exposed), the same for reduce-scatter;
* :func:`plot_timeline`: those rows as a PNG, coloured per unit, waits hatched (:func:`rows_from_dir`: of the
  profiled steps, the one whose slowest rank was fastest: the least disturbed by other load on a shared host).

``python tools/step_timeline.py --trace-dir DIR --out PNG --title ...`` plots existing traces.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import sys
import textwrap
from typing import Any, Dict, List, Optional, Sequence, Tuple

STREAMS = ("compute", "all-gather", "reduce-scatter")
# engine span name -> (stream kind, what the bar is)
_SPAN_STREAM = {
    "forward": ("compute", "compute"), "backward": ("compute", "compute"),
    "all_gather": ("all-gather", "issue"), "wait_all_gather": ("all-gather", "wait"),
    "all_gather_rate_limit": ("all-gather", "wait"),
    "reduce_scatter": ("reduce-scatter", "issue"), "wait_reduce_scatter": ("reduce-scatter", "wait"),
    "wait_replica_all_reduce": ("reduce-scatter", "wait"), "wait_offload_copy": ("reduce-scatter", "wait"),
}
_SPAN = re.compile(r"^flatshard::(?P<name>[a-z_]+)(?:\[(?P<unit>[^\]]*)\])?$")


@dataclasses.dataclass(frozen=True)
class Bar:
    """One span of a row: start and length in ms from the step's start, the unit ("" if none), and what it is:
    ``compute``, ``optimizer``, ``issue`` (the training thread starting a collective), ``in flight`` (from its issue
    to the end of the wait on its handle: the asynchronous work) or ``wait`` (the training thread blocked: exposed)."""

    start_ms: float
    length_ms: float
    what: str
    unit: str


def _complete_events(trace: Any) -> List[Dict[str, Any]]:
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def last_step(events: Sequence[Dict[str, Any]]) -> Tuple[float, float]:
    """(start, end) in us of the trace's last ``ProfilerStep#N`` span; without one, the whole trace."""
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("ProfilerStep#")]
    if steps:
        return max(steps)
    return min(e["ts"] for e in events), max(e["ts"] + e["dur"] for e in events)


def timeline_rows(trace: Any, rank: int, step: Optional[Tuple[float, float]] = None
                  ) -> Dict[Tuple[int, str], List[Bar]]:
    """``{(rank, stream kind): [Bar, ...]}`` for the spans of one step of a Chrome trace (``step``: its (start, end)
    in us, default the last ``ProfilerStep``), each row sorted by start.

    compute: ``forward[unit]``, then the ``backward`` span cut at each ``reduce_scatter[unit]`` issue (the part
    before a unit's reduce-scatter is its backward: its gradients are ready when it is issued; the rest, after the
    last one, has no unit) and ``Optimizer.step``.  all-gather / reduce-scatter: each collective's issue, its
    ``in flight`` span (issue start to the end of the wait on it) and the wait."""
    events = _complete_events(trace)
    s0, s1 = step or last_step(events)
    ms = lambda us: round(us / 1e3, 3)  # noqa: E731
    rows: Dict[Tuple[int, str], List[Bar]] = {(rank, kind): [] for kind in STREAMS}
    backward: List[Tuple[float, float]] = []
    issued: Dict[Tuple[str, str], float] = {}  # (stream, unit) -> issue start (us) of the collective not waited yet
    cuts: List[Tuple[float, str]] = []  # (reduce-scatter issue start, unit)
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        t0, t1 = e["ts"], e["ts"] + e["dur"]
        if not s0 <= t0 < s1:
            continue
        if e["name"].startswith("Optimizer.step#"):
            rows[(rank, "compute")].append(Bar(ms(t0 - s0), ms(e["dur"]), "optimizer", ""))
            continue
        m = _SPAN.match(e["name"])
        if m is None or m["name"] not in _SPAN_STREAM or (m["name"] == "forward" and not m["unit"]):
            continue
        unit = m["unit"] or ""
        kind, what = _SPAN_STREAM[m["name"]]
        if m["name"] == "backward":
            backward.append((t0, t1))
            continue
        rows[(rank, kind)].append(Bar(ms(t0 - s0), ms(e["dur"]), what, unit))
        if what == "issue":
            issued[(kind, unit)] = t0
            if kind == "reduce-scatter":
                cuts.append((t0, unit))
        elif what == "wait" and (kind, unit) in issued:
            start = issued.pop((kind, unit))
            rows[(rank, kind)].append(Bar(ms(start - s0), ms(t1 - start), "in flight", unit))
    for b0, b1 in backward:
        start = b0
        for cut, unit in sorted(c for c in cuts if b0 <= c[0] < b1):
            rows[(rank, "compute")].append(Bar(ms(start - s0), ms(cut - start), "compute", unit))
            start = cut
        rows[(rank, "compute")].append(Bar(ms(start - s0), ms(b1 - start), "compute", ""))
    order = {"in flight": 0, "compute": 1, "optimizer": 1, "issue": 2, "wait": 3}  # (drawn in this order)
    for key in rows:
        rows[key].sort(key=lambda b: (order[b.what], b.start_ms))
    return rows


def profiler_steps(trace: Any) -> Dict[str, Tuple[float, float]]:
    """``{"ProfilerStep#N": (start, end) in us}`` of a Chrome trace."""
    return {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in _complete_events(trace)
            if e["name"].startswith("ProfilerStep#")}


def rows_from_dir(trace_dir: str) -> Tuple[Dict[Tuple[int, str], List[Bar]], str]:
    """The rows of every ``flatshard_trace_rank{r}.json`` of ``trace_dir`` at one profiler step, and its name: of the
    steps every rank recorded, the one whose slowest rank was fastest (the least disturbed by other load on the
    host); without profiler steps, each whole trace."""
    paths = sorted(glob.glob(os.path.join(trace_dir, "flatshard_trace_rank*.json")))
    if not paths:
        raise FileNotFoundError(f"{trace_dir}: no flatshard_trace_rank*.json (run with FLATSHARD_PROFILE={trace_dir})")
    traces = {}
    for path in paths:
        with open(path) as f:
            traces[int(re.search(r"rank(\d+)\.json$", path).group(1))] = json.load(f)
    steps = {rank: profiler_steps(t) for rank, t in traces.items()}
    common = set.intersection(*(set(s) for s in steps.values()))
    chosen = min(common, key=lambda n: (max(s[n][1] - s[n][0] for s in steps.values()), n)) if common else ""
    rows: Dict[Tuple[int, str], List[Bar]] = {}
    for rank, trace in traces.items():
        rows.update(timeline_rows(trace, rank, steps[rank][chosen] if chosen else None))
    return rows, chosen


def plot_timeline(rows: Dict[Tuple[int, str], List[Bar]], out: str, title: str) -> None:
    """The rows as horizontal bars (rank 0 on top), a colour per unit, exposed waits hatched, to a PNG at ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    keys = sorted(rows, key=lambda k: (k[0], STREAMS.index(k[1])))
    units = sorted({b.unit for bars in rows.values() for b in bars if b.unit}, key=_unit_order)
    cmap = plt.get_cmap("tab10" if len(units) <= 10 else "tab20")
    colour = {u: cmap(i % cmap.N) for i, u in enumerate(units)}
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(keys) + 1.9), dpi=90)
    for y, key in enumerate(reversed(keys)):
        for b in rows[key]:
            face = "0.45" if b.what == "optimizer" else colour.get(b.unit, "0.85")
            style = {"in flight": dict(alpha=0.3, height=0.5), "wait": dict(hatch="xxxx", edgecolor="black")}.get(
                b.what, {})
            h = style.pop("height", 0.76)
            ax.broken_barh([(b.start_ms, max(b.length_ms, 0.1))], (y - h / 2, h), facecolors=face,
                           linewidth=0.4 if b.what == "wait" else 0, **style)
    ax.set_yticks(range(len(keys)), [f"rank {r} {kind}" for r, kind in reversed(keys)], fontsize=8)
    ax.set_xlabel("ms from the step's start")
    ax.set_title("\n".join(textwrap.fill(line, 125) for line in title.splitlines()), fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    legend = [Patch(facecolor=colour[u], label=u) for u in units] + [
        Patch(facecolor="0.45", label="optimizer step"), Patch(facecolor="0.85", label="backward, no unit"),
        Patch(facecolor="0.6", alpha=0.3, label="collective in flight (async handle)"),
        Patch(facecolor="white", edgecolor="black", hatch="xxxx", label="exposed wait (training thread blocked)")]
    ax.legend(handles=legend, fontsize=7, ncol=min(4, len(legend)), loc="upper center",
              bbox_to_anchor=(0.5, -0.25), frameon=False)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def _unit_order(unit: str) -> Tuple[int, str]:
    numbers = re.findall(r"\d+", unit)
    return (int(numbers[-1]) if numbers else -1, unit)


# ---------------------------------------------------------------------- the run (under accelerate launch)
def train(args: argparse.Namespace) -> None:
    """A Llama of ``--layers`` x ``--hidden`` from its config, ``--steps`` AdamW steps of ``--batch`` x ``--seq``
    random tokens per rank through accel_flatshard's Accelerator (FLATSHARD_PROFILE set by the caller)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from accel_flatshard.integrations.accelerate import Accelerator

    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                         num_attention_heads=max(1, args.hidden // 64), vocab_size=args.vocab,
                         max_position_embeddings=args.seq, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    accelerator = Accelerator()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(accelerator.process_index)
    for _ in range(args.steps):
        x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        loss = model(input_ids=x, labels=x).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    if accelerator.is_main_process:
        print(f"[step_timeline] Llama {args.layers} x {args.hidden}, {params / 1e6:.2f} M parameters, "
              f"W={accelerator.num_processes}, loss {loss.item():.3f}", flush=True)
        if args.run_json:
            with open(args.run_json, "w") as f:
                json.dump({"params": params, "world_size": accelerator.num_processes, "layers": args.layers,
                           "hidden": args.hidden, "batch": args.batch, "seq": args.seq, "steps": args.steps}, f)
    accelerator.end_training()


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--train", action="store_true", help="train (under accelerate launch, FLATSHARD_PROFILE set)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--run-json", help="train: write the run's model size, W and batch here (the figure's title)")
    p.add_argument("--trace-dir", help="plot: the FLATSHARD_PROFILE directory")
    p.add_argument("--out", help="plot: the PNG")
    p.add_argument("--title", default="accel_flatshard step timeline, {step}", help="{step}: the profiler step drawn")
    args = p.parse_args(argv)
    if args.train:
        train(args)
    else:
        if not (args.trace_dir and args.out):
            p.error("give --train, or --trace-dir and --out")
        rows, step = rows_from_dir(args.trace_dir)
        plot_timeline(rows, args.out, args.title.replace("{step}", step or "the whole trace"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
