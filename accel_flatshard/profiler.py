"""Profiling on torch.profiler: the engine's ``flatshard::*`` spans, the phase table, ``FLATSHARD_PROFILE``.

The engine marks its phases with ``record_function`` spans, so a torch.profiler trace shows them next
to the real ops (and, on a GPU, next to the kernels and NCCL):

* ``flatshard::forward`` / ``flatshard::backward``: the root's forward; backward from the first gradient
  that reaches a unit to the end of the engine's end-of-backward callback (the final reduce-scatter wait);
* ``flatshard::all_gather[unit]`` / ``flatshard::reduce_scatter[unit]``: issuing a collective (allocation,
  dtype cast, enqueue); ``flatshard::wait_all_gather[unit]`` / ``flatshard::wait_reduce_scatter[unit]``:
  the training thread blocked on one (exposed communication); ``flatshard::wait_replica_all_reduce``
  (hybrid sharding) counts as reduce-scatter wait;
* ``flatshard::all_gather_rate_limit``: the host waiting for the compute stream to finish with freed
  gathered buffers before gathering more (CUDA, ``limit_all_gathers``): a host wait, not compute.

Spans cost one flag check when no profiler runs (:func:`span`).  Profile any run from code::

    from torch.profiler import profile
    with profile() as prof:                               # (+ ProfilerActivity.CUDA for kernels and NCCL)
        for batch in loader:
            model(**batch).loss.backward(); optimizer.step(); optimizer.zero_grad()
    print(phase_table(prof.events()))                     # where each step's time goes (a step ends with
    prof.export_chrome_trace(f"trace_rank{rank}.json")    # optimizer.step(), or ProfilerStep#N with a schedule)

or set ``FLATSHARD_PROFILE=DIR`` (``1``: table only): the first wrapped model starts a torch.profiler
that steps at every optimizer step; every ``FLATSHARD_PROFILE_EVERY`` (N) steps it writes
``DIR/flatshard_trace_rank{r}.json`` and ``DIR/flatshard_phases_rank{r}.md`` for the last N - 1 steps (the
first step of each cycle is the profiler's warm-up) and rank 0 prints the table.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import resource
import statistics
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch.autograd.profiler import record_function

from . import options
from ._compat import profiler_enabled

__all__ = ["PHASE_ROWS", "begin_span", "end_span", "phase_table", "span", "start_from_env", "step_phases"]

_NULL_CONTEXT = contextlib.nullcontext()


def span(name: str, label: str = "") -> contextlib.AbstractContextManager:
    """``record_function("flatshard::name[label]")`` while a torch profiler runs; else one shared no-op."""
    if not profiler_enabled():
        return _NULL_CONTEXT
    return record_function(f"flatshard::{name}[{label}]" if label else f"flatshard::{name}")


def begin_span(name: str) -> Optional[record_function]:
    """Open a span that a later hook closes with :func:`end_span` (forward / backward phases)."""
    if not profiler_enabled():
        return None
    handle = record_function(f"flatshard::{name}")
    handle.__enter__()
    return handle


def end_span(handle: Optional[record_function]) -> None:
    if handle is not None:
        handle.__exit__(None, None, None)


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
# engine span name -> metric key stem; "fwd_"/"bwd_" is prefixed where the phase matters
_ENGINE_SPANS = {
    "flatshard::wait_all_gather": "ag_wait",
    "flatshard::all_gather": "ag_issue",
    "flatshard::all_gather_rate_limit": "rate_limit",
    "flatshard::reduce_scatter": "rs_issue",
    "flatshard::wait_reduce_scatter": "rs_wait",
    "flatshard::wait_replica_all_reduce": "rs_wait",  # hybrid sharding: the second half of the reduction
    "flatshard::wait_offload_copy": "rs_wait",  # CPU offload: the gradient's device -> host copy
}
_OPTIMIZER_PREFIX = "Optimizer.step#"  # torch's own span around every optimizer's step()


def _kind(name: str) -> Optional[str]:
    if name.startswith(_OPTIMIZER_PREFIX):
        return "optimizer"
    if not name.startswith("flatshard::"):
        return None
    base = name.split("[", 1)[0]
    if base in ("flatshard::forward", "flatshard::backward"):
        return base[len("flatshard::"):]
    return _ENGINE_SPANS.get(base)


def _union_ms(intervals: List[Tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for t0, t1 in sorted(intervals):
        if t1 > end:
            total += t1 - max(t0, end)
            end = t1
    return total / 1e3


def _within(iv: Tuple[float, float], outer: List[Tuple[float, float]]) -> bool:
    return any(a <= iv[0] < b for a, b in outer)


def step_phases(events: Iterable[Any], step_prefix: str = "ProfilerStep#") -> List[Dict[str, float]]:
    """Milliseconds per phase for every step in a torch.profiler event list (``prof.events()``).

    A step is an event whose name starts with ``step_prefix`` (``prof.step()`` of a profiler with a
    ``schedule`` makes ``ProfilerStep#N``); without any, each optimizer step ends one (the first starts at
    the first span), and without those the whole list is one step.  Engine spans are assigned to the forward / backward span
    that contains them in time (backward may run on autograd's device thread); nested spans of one kind
    count once."""
    spans: Dict[str, List[Tuple[float, float]]] = {}
    steps: List[Tuple[float, float]] = []
    for e in events:
        t0, t1 = e.time_range.start, e.time_range.end
        if e.name.startswith(step_prefix):
            steps.append((t0, t1))
        kind = _kind(e.name)
        if kind is not None:
            spans.setdefault(kind, []).append((t0, t1))
    if not steps:  # a profiler without schedule records no ProfilerStep: optimizer steps end the steps
        every = sorted(iv for ivs in spans.values() for iv in ivs)
        if not every:
            return []
        start = every[0][0]
        for _, end in sorted(spans.get("optimizer", []), key=lambda iv: iv[1]):
            steps.append((start, end))
            start = end
        if not steps:
            steps = [(start, max(t1 for _, t1 in every))]
    out = []
    for s0, s1 in sorted(steps):
        inside = {k: [iv for iv in ivs if s0 <= iv[0] < s1] for k, ivs in spans.items()}
        ms = {key: 0.0 for key, _ in PHASE_ROWS}
        for p in ("forward", "backward", "optimizer"):
            ms[p] = _union_ms(inside.get(p, []))
        parts: Dict[str, List[Tuple[float, float]]] = {}
        for stem in set(_ENGINE_SPANS.values()):
            for iv in inside.get(stem, []):
                where = "fwd" if _within(iv, inside.get("forward", [])) else (
                    "bwd" if _within(iv, inside.get("backward", [])) else "")
                if where and not (stem.startswith("rs") and where == "fwd"):  # else: part of "other"
                    parts.setdefault(stem if stem.startswith("rs") else f"{where}_{stem}", []).append(iv)
        for key, ivs in parts.items():
            ms[key] = _union_ms(ivs)
        ms["step"] = (s1 - s0) / 1e3
        ms["fwd_compute"] = max(ms["forward"] - ms["fwd_ag_wait"] - ms["fwd_ag_issue"] - ms["fwd_rate_limit"], 0.0)
        ms["bwd_compute"] = max(ms["backward"] - ms["bwd_ag_wait"] - ms["bwd_ag_issue"] - ms["bwd_rate_limit"]
                                - ms["rs_issue"] - ms["rs_wait"], 0.0)
        ms["other"] = max(ms["step"] - ms["forward"] - ms["backward"] - ms["optimizer"], 0.0)
        ms["exposed_comm"] = ms["fwd_ag_wait"] + ms["bwd_ag_wait"] + ms["rs_wait"]
        out.append(ms)
    return out


def phase_table(events_or_steps: Any, title: str = "accel_flatshard profile", skip: int = 0) -> str:
    """A markdown table of per-step phase times (median, mean, max, % of step) from ``prof.events()`` or
    :func:`step_phases`'s result; ``skip`` leaves out the first steps (warm-up)."""
    steps = events_or_steps if isinstance(events_or_steps, list) and (
        not events_or_steps or isinstance(events_or_steps[0], dict)) else step_phases(events_or_steps)
    steps = steps[skip:] or steps
    if not steps:
        return f"{title}: no step recorded (no flatshard:: span or ProfilerStep in the events)"
    med = {k: statistics.median(s[k] for s in steps) for k, _ in PHASE_ROWS}
    lines = [f"{title}: {len(steps)} steps, ms per step", "| phase | median | mean | max | % of step |",
             "|---|---:|---:|---:|---:|"]
    for key, label in PHASE_ROWS:
        values = [s[key] for s in steps]
        lines.append(f"| {label} | {med[key]:.1f} | {statistics.fmean(values):.1f} | {max(values):.1f} "
                     f"| {100 * med[key] / (med['step'] or 1.0):.0f}% |")
    # process-lifetime peaks, read without resetting anything
    peak = f"peak RSS of the process so far: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB"
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        peak += f", peak CUDA allocated: {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB"
    return "\n".join(lines + [peak])


class _EnvProfiler:
    """``FLATSHARD_PROFILE``: a torch.profiler stepped by every optimizer step, writing every N steps."""

    def __init__(self, trace_dir: str, every: int, rank: int) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook
        from torch.profiler import ProfilerActivity, profile, schedule

        self.trace_dir, self.rank, self.cycles = trace_dir, rank, 0
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        warmup = 1 if every > 1 else 0
        self.prof = profile(activities=activities, on_trace_ready=self._ready,
                            schedule=schedule(wait=0, warmup=warmup, active=every - warmup))
        self.prof.start()
        self._hook = register_optimizer_step_post_hook(lambda *_: self.prof.step())
        atexit.register(self.stop)

    def _ready(self, prof: Any) -> None:
        self.cycles += 1
        table = phase_table(prof.events(), title=f"accel_flatshard profile, rank {self.rank}, cycle {self.cycles}")
        if self.rank == 0:
            print(table, flush=True)
        if self.trace_dir:
            from .checkpoint.atomic import write_atomic, write_text_atomic  # a reader never sees half a file

            os.makedirs(self.trace_dir, exist_ok=True)
            write_atomic(os.path.join(self.trace_dir, f"flatshard_trace_rank{self.rank}.json"), prof.export_chrome_trace)
            write_text_atomic(os.path.join(self.trace_dir, f"flatshard_phases_rank{self.rank}.md"), table + "\n")

    def stop(self) -> None:
        """Write the unfinished cycle and stop (at interpreter exit, or by tests)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
            self.prof.stop()


_ENV_PROFILER: Optional[_EnvProfiler] = None


def start_from_env(rank: int) -> Optional[_EnvProfiler]:
    """Called by every wrapper: start the process' profiler if ``FLATSHARD_PROFILE`` asks for one (once)."""
    global _ENV_PROFILER
    setting = options.get("FLATSHARD_PROFILE")
    if setting is None or _ENV_PROFILER is not None:
        return _ENV_PROFILER
    if profiler_enabled():
        raise RuntimeError("FLATSHARD_PROFILE is set but a torch.profiler is already running in this process; "
                           "unset FLATSHARD_PROFILE or stop the other profiler (only one can run)")
    _ENV_PROFILER = _EnvProfiler(setting, options.get("FLATSHARD_PROFILE_EVERY"), rank)
    return _ENV_PROFILER


def stop_env_profiler() -> None:
    global _ENV_PROFILER
    if _ENV_PROFILER is not None:
        _ENV_PROFILER.stop()
        _ENV_PROFILER = None
