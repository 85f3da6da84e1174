"""Profiling sessions on torch.profiler: the phase table of the engine's spans, ``FLATSHARD_PROFILE``.

The engine's ``record_function`` spans (``core/spans.py``: one flag check when no profiler runs) show in a
torch.profiler trace next to the real ops: ``forward`` / ``backward`` (``forward[unit]`` per unit), ``all_gather[unit]``
/ ``reduce_scatter[unit]`` (issuing), ``wait_*`` (the training thread blocked on communication: exposed) and
``all_gather_rate_limit`` (the host waiting for freed gathered buffers, CUDA); :data:`_ENGINE_SPANS` maps them to the
rows of :func:`phase_table`.  ``FLATSHARD_PROFILE=DIR`` (``1``: the table only) starts a profiler that steps at every
optimizer step and every ``FLATSHARD_PROFILE_EVERY`` (N) steps writes ``DIR/flatshard_trace_rank{r}.json`` and
``DIR/flatshard_phases_rank{r}.md`` for the last N - 1 steps (the first is warm-up); rank 0 prints the table.
"""
from __future__ import annotations

import atexit
import collections
import itertools
import os
import statistics
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from ..core import options, registry
from ..core._compat import profiler_enabled


# the bytes a step sends, by kind (ShardGroup's labels) and machine: the rows under the phase table
SENT_KINDS = ("forward gather", "backward gather", "reduction", "replica all-reduce", "other gather")


# (metric key, table label); the order of the table's rows.  Indented rows split the row above them;
# the leaf rows (every row but step, forward, backward, exposed_comm) add up to the step.
PHASE_ROWS: Tuple[Tuple[str, str], ...] = (
    ("step", "step (wall)"),
    ("forward", "forward (wall)"),
    ("fwd_ag_wait", "  fwd all-gather wait"),
    ("fwd_ag_issue", "  fwd all-gather issue"),
    ("fwd_rate_limit", "  fwd all-gather rate-limit wait (host)"),
    ("fwd_compute", "  forward compute"),
    ("backward", "backward (wall)"),
    ("bwd_ag_wait", "  bwd all-gather wait"),
    ("bwd_ag_issue", "  bwd all-gather issue"),
    ("bwd_rate_limit", "  bwd all-gather rate-limit wait (host)"),
    ("rs_issue", "  reduce-scatter issue"),
    ("rs_wait", "  reduce-scatter wait"),
    ("bwd_compute", "  backward compute"),
    ("optimizer", "optimizer step"),
    ("other", "other (outside the phases)"),
    ("exposed_comm", "exposed comm (all waits)"),
)
# engine span -> its row inside the forward span, inside the backward span (None, or outside both: "other")
_ENGINE_SPANS = {
    "wait_all_gather": ("fwd_ag_wait", "bwd_ag_wait"),
    "all_gather": ("fwd_ag_issue", "bwd_ag_issue"),
    "all_gather_rate_limit": ("fwd_rate_limit", "bwd_rate_limit"),
    "reduce_scatter": (None, "rs_issue"),
    "wait_reduce_scatter": (None, "rs_wait"),
    "wait_replica_all_reduce": (None, "rs_wait"),  # hybrid sharding: the second half of the reduction
    "wait_offload_copy": (None, "rs_wait"),  # CPU offload: the gradient's device -> host copy
}


def _union_ms(intervals: List[Tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for t0, t1 in sorted(intervals):
        if t1 > end:
            total += t1 - max(t0, end)
            end = t1
    return total / 1e3


def step_phases(events: Iterable[Any], step_prefix: str = "ProfilerStep#") -> List[Dict[str, float]]:
    """Milliseconds per phase for every step in a torch.profiler event list (``prof.events()``).

    A step is an event named ``step_prefix...`` (a scheduled profiler's ``ProfilerStep#N``); without any, each
    ``Optimizer.step#`` span ends one (else the whole list is one step).  Engine spans go to the forward /
    backward span containing them in time (backward may run on autograd's thread); nested ones count once."""
    spans: Dict[str, List[Tuple[float, float]]] = collections.defaultdict(list)  # "forward", an engine span, ...
    steps: List[Tuple[float, float]] = []
    sent: List[Tuple[float, str, int, int]] = []  # (when, kind, bytes inside / across machines)
    for e in events:
        interval = (e.time_range.start, e.time_range.end)
        if e.name.startswith(step_prefix):
            steps.append(interval)
        if e.name.startswith("Optimizer.step#"):
            spans["optimizer"].append(interval)
        elif e.name.startswith("flatshard::sent["):
            kind, intra, inter = e.name[len("flatshard::sent["):-1].split("|")
            sent.append((interval[0], kind, int(intra), int(inter)))
        elif e.name.startswith("flatshard::"):  # (forward[unit] counts as forward)
            spans[e.name[len("flatshard::"):].split("[", 1)[0]].append(interval)
    if not steps and spans:
        start = min(t0 for ivs in spans.values() for t0, _ in ivs)
        ends = sorted(t1 for _, t1 in spans["optimizer"]) or [max(t1 for ivs in spans.values() for _, t1 in ivs)]
        steps = list(zip([start] + ends, ends))
    out = []
    for s0, s1 in sorted(steps):
        inside = {k: [iv for iv in ivs if s0 <= iv[0] < s1] for k, ivs in spans.items()}
        within = lambda iv, phase: any(a <= iv[0] < b for a, b in inside.get(phase, []))  # noqa: E731
        parts = collections.defaultdict(list)
        for name, (in_forward, in_backward) in _ENGINE_SPANS.items():
            for iv in inside.get(name, []):
                row = in_forward if within(iv, "forward") else in_backward if within(iv, "backward") else None
                if row:
                    parts[row].append(iv)
        ms = {key: _union_ms(parts[key] if key in parts else inside.get(key, [])) for key, _ in PHASE_ROWS}
        ms["step"] = (s1 - s0) / 1e3
        ms["fwd_compute"] = max(ms["forward"] - ms["fwd_ag_wait"] - ms["fwd_ag_issue"] - ms["fwd_rate_limit"], 0.0)
        ms["bwd_compute"] = max(ms["backward"] - ms["bwd_ag_wait"] - ms["bwd_ag_issue"] - ms["bwd_rate_limit"]
                                - ms["rs_issue"] - ms["rs_wait"], 0.0)
        ms["other"] = max(ms["step"] - ms["forward"] - ms["backward"] - ms["optimizer"], 0.0)
        ms["exposed_comm"] = ms["fwd_ag_wait"] + ms["bwd_ag_wait"] + ms["rs_wait"]
        for when, kind, intra, inter in sent:
            if s0 <= when < s1:
                ms[f"sent {kind} intra"] = ms.get(f"sent {kind} intra", 0) + intra
                ms[f"sent {kind} inter"] = ms.get(f"sent {kind} inter", 0) + inter
                ms["all-gathers"] = ms.get("all-gathers", 0) + kind.endswith("gather")
        out.append(ms)
    return out


def phase_table(events_or_steps: Any, title: str = "accel_flatshard profile") -> str:
    """Markdown table of each phase's median, mean, max and % of step, from ``prof.events()`` or :func:`step_phases`."""
    steps = events_or_steps if isinstance(events_or_steps, list) and (
        not events_or_steps or isinstance(events_or_steps[0], dict)) else step_phases(events_or_steps)
    if not steps:
        return f"{title}: no step recorded (no flatshard:: span or ProfilerStep in the events)"
    lines = [f"{title}: {len(steps)} steps, ms per step", "| phase | median | mean | max | % of step |",
             "|---|---:|---:|---:|---:|"]
    step = statistics.median(s["step"] for s in steps) or 1.0
    for key, label in PHASE_ROWS:
        values = [s[key] for s in steps]
        median = statistics.median(values)
        lines.append(f"| {label} | {median:.1f} | {statistics.fmean(values):.1f} | {max(values):.1f} "
                     f"| {100 * median / step:.0f}% |")
    if any("all-gathers" in s for s in steps):  # the collectives' markers: bytes this rank sent per step
        lines += ["", "bytes sent per step by this rank (median) | inside the machine | across machines |",
                  "|---|---:|---:|"]
        for kind in SENT_KINDS:
            intra, inter = (statistics.median(s.get(f"sent {kind} {w}", 0) for s in steps) for w in ("intra", "inter"))
            if intra or inter:
                lines.append(f"| {kind} | {intra:,.0f} | {inter:,.0f} |")
        lines.append(f"| all-gather collectives | {statistics.median(s.get('all-gathers', 0) for s in steps):.0f} | |")
    return "\n".join(lines)


_ENV_PROFILER: Optional[Any] = None  # FLATSHARD_PROFILE's torch.profiler.profile (one per process)


def start_from_env(rank: int) -> Optional[Any]:
    """Start the process' profiler if ``FLATSHARD_PROFILE`` asks for one (once; see the module docstring)."""
    global _ENV_PROFILER
    trace_dir = options.get("FLATSHARD_PROFILE")
    if trace_dir is None or _ENV_PROFILER is not None:
        return _ENV_PROFILER
    if profiler_enabled():
        raise RuntimeError("FLATSHARD_PROFILE is set but a torch.profiler is already running in this process; "
                           "unset FLATSHARD_PROFILE or stop the other profiler (only one can run)")
    from torch.profiler import ProfilerActivity, profile, schedule

    cycles = itertools.count(1)

    def cycle_done(prof: Any) -> None:
        table = phase_table(prof.events(), title=f"accel_flatshard profile, rank {rank}, cycle {next(cycles)}")
        if rank == 0:
            print(table, flush=True)
        if trace_dir:
            from ..state.atomic import write_atomic, write_text_atomic  # a reader never sees half a file

            os.makedirs(trace_dir, exist_ok=True)
            write_atomic(os.path.join(trace_dir, f"flatshard_trace_rank{rank}.json"), prof.export_chrome_trace)
            write_text_atomic(os.path.join(trace_dir, f"flatshard_phases_rank{rank}.md"), table + "\n")

    every = options.get("FLATSHARD_PROFILE_EVERY")
    warmup = 1 if every > 1 else 0
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities, on_trace_ready=cycle_done,
                   schedule=schedule(wait=0, warmup=warmup, active=every - warmup))
    prof.start()
    registry.on_step(post=_step_profiler)  # (idempotent: one profiler per process)
    atexit.register(stop_env_profiler)
    _ENV_PROFILER = prof
    return prof


def stop_env_profiler() -> None:
    """Write the unfinished cycle and stop (at interpreter exit, or by tests)."""
    global _ENV_PROFILER
    if _ENV_PROFILER is not None:
        _ENV_PROFILER.stop()
        _ENV_PROFILER = None


def _step_profiler(optimizer: torch.optim.Optimizer, records: List[Any]) -> None:
    """After every optimizer step (``registry.on_step``): the running profiler steps too."""
    if _ENV_PROFILER is not None:
        _ENV_PROFILER.step()


def _on_wrap(record: registry.Prepared) -> None:
    """After a model is wrapped: one torch.profiler per process, if ``FLATSHARD_PROFILE`` asks for it."""
    if options.get("FLATSHARD_PROFILE") is not None:
        start_from_env(record.shard_group.world_rank)


registry.on_wrap(after=_on_wrap)
