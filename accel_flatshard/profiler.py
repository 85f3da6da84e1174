"""Per-step phase timings and a Chrome-trace timeline of collectives against compute.

Off by default: the engine calls ``profiler.span(name, label)`` around every all-gather issue/wait and
reduce-scatter issue/wait, and the default :data:`NULL_PROFILER` answers with one shared no-op context
(no clock read, no allocation).  Switch it on from code::

    prof = Profiler(print_every=10)                      # table on rank 0 every 10 steps
    model = FullyShardedDataParallel(model, auto_wrap_policy=..., profiler=prof)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    prof.attach(model, optimizer)                        # forward/backward/optimizer timing
    for batch in loader:
        model(**batch).loss.backward()
        optimizer.step(); optimizer.zero_grad()          # the optimizer hook ends the step
    print(prof.summary())
    prof.export_chrome_trace("trace_rank{rank}.json")    # open in https://ui.perfetto.dev

or with ``FLATSHARD_PROFILE=DIR`` in the environment (:meth:`Profiler.from_env`; the wrapper picks it
up through :func:`profiler_for`): every wrapped model then profiles itself, prints the table every ``FLATSHARD_PROFILE_EVERY`` (default 10) steps on
rank 0 and writes ``DIR/flatshard_trace_rank{r}.json`` each time.

Per step it records (milliseconds, summed over the step's micro-batches):

* ``forward``/``backward``/``optimizer``: wall time of the root forward, of backward (first gradient
  at the root's outputs -> end of the autograd engine's callbacks, which includes the final
  reduce-scatter wait) and of ``optimizer.step()``;
* ``fwd all-gather wait``/``bwd all-gather wait``/``reduce-scatter wait``: time the training thread
  was blocked on collectives (exposed communication); ``*issue`` the time spent starting them
  (allocation, dtype cast, enqueue);
* ``forward compute``/``backward compute``: the phase wall time minus the above;
* ``step``: from the step's first forward (or first recorded event) to its end (the optimizer step or
  :meth:`step`), so time spent between steps (data loading) is not included; ``peak RSS``/
  ``peak CUDA``: the process' peak resident set (Linux) / CUDA peak allocated memory during the step.

CPU timestamps only: on CUDA the waits are stream waits (they return at once), so pass
``sync_cuda=True`` to synchronise at phase boundaries when phase times must include GPU work.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import json
import os
import statistics
import threading
import time
from typing import Any, Deque, Dict, List, Optional, Tuple

import torch

__all__ = ["NULL_PROFILER", "Profiler", "profiler_for"]

_NULL_CONTEXT = contextlib.nullcontext()


class _NullProfiler:
    """The engine's default: every span is the same shared no-op context."""

    enabled = False

    def span(self, name: str, label: str = ""):
        return _NULL_CONTEXT

    def attach(self, model: Any, optimizer: Any = None, units: bool = True) -> "_NullProfiler":
        return self


NULL_PROFILER = _NullProfiler()
_ENV_PROFILER: Optional["Profiler"] = None


def profiler_for(profiler: Any = None) -> Any:
    """What a wrapper should use: ``profiler`` if given, else the process' profiler configured by
    ``FLATSHARD_PROFILE`` (one per process, shared by every wrapped model), else :data:`NULL_PROFILER`.

    In ``FullyShardedDataParallel.__init__``::

        profiler = profiler_for(profiler)      # before building the Engine; pass it to Engine(...)
        # (the rest of the constructor)
        profiler.attach(self)                  # last line: forward/backward (and, from the env, optimizer) hooks
    """
    global _ENV_PROFILER
    if profiler is not None:
        return profiler
    if _ENV_PROFILER is None:
        _ENV_PROFILER = Profiler.from_env()
        if _ENV_PROFILER is not None:
            _ENV_PROFILER._from_env = True
    return _ENV_PROFILER if _ENV_PROFILER is not None else NULL_PROFILER

# (metric key, table label); the order of the table's rows
_METRICS: Tuple[Tuple[str, str], ...] = (
    ("step", "step (wall)"),
    ("forward", "forward (wall)"),
    ("fwd_ag_wait", "  fwd all-gather wait"),
    ("fwd_ag_issue", "  fwd all-gather issue"),
    ("fwd_compute", "  forward compute"),
    ("backward", "backward (wall)"),
    ("bwd_ag_wait", "  bwd all-gather wait"),
    ("bwd_ag_issue", "  bwd all-gather issue"),
    ("rs_issue", "  reduce-scatter issue"),
    ("rs_wait", "  reduce-scatter wait"),
    ("bwd_compute", "  backward compute"),
    ("optimizer", "optimizer step"),
    ("other", "other (outside the phases)"),
    ("exposed_comm", "exposed comm (all waits)"),
)
_PHASES = ("forward", "backward", "optimizer")
_MAX_EVENTS_PER_STEP = 200_000
_COLLECTIVE_SPANS = ("all_gather_issue", "all_gather_wait", "reduce_scatter_issue", "reduce_scatter_wait")


class _Span:
    __slots__ = ("prof", "name", "label", "t0")

    def __init__(self, prof: "Profiler", name: str, label: str) -> None:
        self.prof, self.name, self.label = prof, name, label

    def __enter__(self) -> "_Span":
        self.t0 = time.perf_counter_ns()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.prof._record(self.name, self.label, self.t0, time.perf_counter_ns())


class Profiler:
    """Records the engine's collective spans and the phases of each training step.

    Args:
        print_every: print :meth:`summary` on rank 0 every this many steps (0: never).
        warmup: steps left out of the summary statistics (the first step records the unit order).
        trace_dir: write ``trace_dir/flatshard_trace_rank{r}.json`` whenever the table is printed and at
            interpreter exit.
        trace_steps: how many of the latest steps the trace keeps (bounded memory).
        history: how many steps' aggregated timings the summary keeps.
        track_memory: record the peak RSS (CPU, Linux) / peak CUDA memory of each step.
        sync_cuda: ``torch.cuda.synchronize()`` at phase boundaries so phases include GPU time.
        enabled: ``False`` makes :meth:`span` the shared no-op (for switching off at run time).
    """

    def __init__(
        self,
        print_every: int = 0,
        warmup: int = 1,
        trace_dir: Optional[str] = None,
        trace_steps: int = 20,
        history: int = 10000,
        track_memory: bool = True,
        sync_cuda: bool = False,
        enabled: bool = True,
    ) -> None:
        self.enabled = enabled
        self.print_every = print_every
        self.warmup = warmup
        self.trace_dir = trace_dir
        self.track_memory = track_memory
        self.sync_cuda = sync_cuda and torch.cuda.is_available()
        self.steps: Deque[Dict[str, float]] = collections.deque(maxlen=history)
        self.step_count = 0
        # raw events of the current step and of the latest finished steps:
        # (name, label, t0_ns, t1_ns, thread index, phase)
        self._events: List[tuple] = []
        self._trace: Deque[Tuple[int, int, int, List[tuple]]] = collections.deque(maxlen=max(1, trace_steps))
        self._phase: Optional[str] = None
        self._phase_t0 = 0
        self._backward_open = False
        self._step_t0: Optional[int] = None
        self._threads: Dict[int, int] = {}
        self._thread_names: List[str] = []
        self._handles: List[Any] = []
        self._attached: set = set()
        # perf_counter_ns is monotonic and shared by the processes of one host; the anchor converts it
        # to wall-clock time so that the traces of several ranks line up when loaded together.
        self._anchor_ns = time.time_ns() - time.perf_counter_ns()
        self._rank: Optional[int] = None
        self._from_env = False  # set by profiler_for(): then attach() hooks every optimizer by default
        self._atexit = False
        if trace_dir:
            self._register_atexit()

    # ------------------------------------------------------------------ construction from the environment
    @classmethod
    def from_env(cls) -> Optional["Profiler"]:
        """``FLATSHARD_PROFILE=DIR``: a profiler that prints every ``FLATSHARD_PROFILE_EVERY`` (10) steps and
        writes per-rank traces to DIR; ``FLATSHARD_PROFILE=1``: the table only.  Unset/empty/0: ``None``."""
        value = os.environ.get("FLATSHARD_PROFILE", "").strip()
        if value.lower() in ("", "0", "false", "off", "no"):
            return None
        every = int(os.environ.get("FLATSHARD_PROFILE_EVERY", "10"))
        trace_dir = None if value.lower() in ("1", "true", "on", "yes") else value
        return cls(print_every=every, trace_dir=trace_dir)

    # ------------------------------------------------------------------ the engine's interface
    def span(self, name: str, label: str = ""):
        """Context manager timing one engine operation (``all_gather_wait``, ...) of unit ``label``."""
        if not self.enabled:
            return _NULL_CONTEXT
        return _Span(self, name, label)

    def _record(self, name: str, label: str, t0: int, t1: int) -> None:
        if self._step_t0 is None:
            self._step_t0 = t0
        self._events.append((name, label, t0, t1, self._thread_index(), self._phase))
        if len(self._events) >= _MAX_EVENTS_PER_STEP:  # step() never called: keep memory bounded
            self.step()

    def _thread_index(self) -> int:
        ident = threading.get_ident()
        index = self._threads.get(ident)
        if index is None:
            index = self._threads[ident] = len(self._threads)
            self._thread_names.append(threading.current_thread().name)
        return index

    # ------------------------------------------------------------------ phases
    def _begin(self, phase: str) -> None:
        if not self.enabled:
            return
        self._cuda_sync()
        now = time.perf_counter_ns()
        if self._step_t0 is None:
            self._step_t0 = now
        self._phase, self._phase_t0 = phase, now

    def _end(self, phase: str, label: str = "") -> None:
        if not self.enabled or self._phase != phase:
            return
        self._cuda_sync()
        self._record(phase, label, self._phase_t0, time.perf_counter_ns())
        self._phase = None

    def _cuda_sync(self) -> None:
        if self.sync_cuda:
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time a block as one of the phases ``forward``, ``backward`` or ``optimizer`` (for code that
        does not use :meth:`attach`), e.g. ``with prof.phase("optimizer"): opt.step()``."""
        if name not in _PHASES:
            raise ValueError(f"phase must be one of {_PHASES}, got {name!r}")
        self._begin(name)
        try:
            yield
        finally:
            self._end(name)

    def optimizer_step(self):
        """``with prof.optimizer_step(): optimizer.step()`` - times the step and then ends it."""
        return _OptimizerContext(self)

    def attach(self, model: torch.nn.Module, optimizer: Any = None, units: bool = True) -> "Profiler":
        """Time forward and backward of ``model`` (the outermost module) and the optimizer step.

        ``optimizer``: hook this optimizer's ``step`` (its end also ends the profiler's step).  Without
        one, call :meth:`step` after each optimizer step, or use ``optimizer="all"`` to hook every
        torch optimizer in the process.  ``units``: also put each wrapped unit's forward in the trace.
        Calling it again for the same model or optimizer does nothing.  A profiler made from
        ``FLATSHARD_PROFILE`` (:func:`profiler_for`) hooks every optimizer unless given one.
        """
        if optimizer is None and self._from_env:
            optimizer = "all"
        if id(model) not in self._attached:
            self._attached.add(id(model))
            self._handles.append(model.register_forward_pre_hook(self._on_forward_pre, prepend=True))
            self._handles.append(model.register_forward_hook(self._on_forward_post))
            for unit in getattr(model, "units", []) if units else []:
                if unit.is_root:
                    continue
                self._handles.append(unit.module.register_forward_pre_hook(self._unit_pre(unit.name)))
                self._handles.append(unit.module.register_forward_hook(self._unit_post(unit.name)))
        key = "all" if isinstance(optimizer, str) else id(optimizer)
        if optimizer is not None and key not in self._attached:
            self._attached.add(key)
            if isinstance(optimizer, str):
                from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

                self._handles.append(register_optimizer_step_pre_hook(self._on_optimizer_pre))
                self._handles.append(register_optimizer_step_post_hook(self._on_optimizer_post))
            else:
                self._handles.append(optimizer.register_step_pre_hook(self._on_optimizer_pre))
                self._handles.append(optimizer.register_step_post_hook(self._on_optimizer_post))
        return self

    def detach(self) -> None:
        """Remove every hook that :meth:`attach` installed."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._attached = [], set()

    def _on_forward_pre(self, module: torch.nn.Module, args: Any) -> None:
        if self._backward_open:  # a forward inside backward (activation-checkpoint recomputation)
            return
        self._begin("forward")

    def _on_forward_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self.enabled or self._phase != "forward":
            return
        self._end("forward")
        if torch.is_grad_enabled():
            from ._compat import tensors_in

            tensors = [t for t in tensors_in(output) if t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, self._on_backward_start, mode="any")

    def _on_backward_start(self, grad: Any) -> None:
        if self._backward_open:
            return
        self._backward_open = True
        self._begin("backward")
        # Queued from inside backward, so it runs after the engine's own end-of-backward callback
        # (which waits for the reduce-scatters); re-queued once to stay last if that was queued later.
        from ._compat import queue_end_of_backward_callback as queue

        queue(lambda: queue(self._on_backward_end))

    def _on_backward_end(self) -> None:
        self._backward_open = False
        self._end("backward")

    def _unit_pre(self, name: str):
        def hook(module: torch.nn.Module, args: Any) -> None:
            if self.enabled:
                module.__dict__["_flatshard_prof_t0"] = time.perf_counter_ns()

        return hook

    def _unit_post(self, name: str):
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            t0 = module.__dict__.pop("_flatshard_prof_t0", None)
            if self.enabled and t0 is not None:
                self._record("unit_forward", name, t0, time.perf_counter_ns())

        return hook

    def _on_optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._begin("optimizer")

    def _on_optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._end("optimizer")
        self.step()

    # ------------------------------------------------------------------ steps
    def step(self) -> None:
        """End the current step: aggregate its events, print / write the trace when due."""
        if not self.enabled or not self._events:
            return
        now = time.perf_counter_ns()
        events, self._events = self._events, []
        start = self._step_t0 if self._step_t0 is not None else events[0][2]
        self._step_t0 = None  # the next step starts with its first forward / recorded event
        record = self._aggregate(events, now - start)
        if self.track_memory:
            record.update(_read_and_reset_peak_memory())
        self.steps.append(record)
        self._trace.append((self.step_count, start, now, events))
        self.step_count += 1
        if self.print_every and self.step_count % self.print_every == 0:
            if self.rank == 0:
                print(self.summary(), flush=True)
            if self.trace_dir:
                self.export_chrome_trace(os.path.join(self.trace_dir, "flatshard_trace_rank{rank}.json"))

    @staticmethod
    def _aggregate(events: List[tuple], step_ns: int) -> Dict[str, float]:
        ms = {key: 0.0 for key, _ in _METRICS}
        for name, _label, t0, t1, _tid, phase in events:
            d = (t1 - t0) / 1e6
            if name in _PHASES:
                ms[name] += d
            elif name == "all_gather_wait":
                ms["bwd_ag_wait" if phase == "backward" else "fwd_ag_wait"] += d
            elif name == "all_gather_issue":
                ms["bwd_ag_issue" if phase == "backward" else "fwd_ag_issue"] += d
            elif name == "reduce_scatter_issue":
                ms["rs_issue"] += d
            elif name == "reduce_scatter_wait":
                ms["rs_wait"] += d
        ms["step"] = step_ns / 1e6
        ms["fwd_compute"] = max(ms["forward"] - ms["fwd_ag_wait"] - ms["fwd_ag_issue"], 0.0)
        ms["bwd_compute"] = max(
            ms["backward"] - ms["bwd_ag_wait"] - ms["bwd_ag_issue"] - ms["rs_issue"] - ms["rs_wait"], 0.0
        )
        ms["other"] = max(ms["step"] - ms["forward"] - ms["backward"] - ms["optimizer"], 0.0)
        ms["exposed_comm"] = ms["fwd_ag_wait"] + ms["bwd_ag_wait"] + ms["rs_wait"]
        return ms

    def stats(self, reduce=statistics.median) -> Dict[str, float]:
        """Each metric reduced over the recorded steps after ``warmup`` (default: the median)."""
        steps = list(self.steps)[self.warmup :] or list(self.steps)
        if not steps:
            return {}
        return {key: reduce([s.get(key, 0.0) for s in steps]) for key in steps[-1]}

    def summary(self) -> str:
        """A markdown table of per-step timings (median, mean, max over steps after warmup)."""
        steps = list(self.steps)[self.warmup :] or list(self.steps)
        if not steps:
            return "accel_flatshard profiler: no complete step recorded yet (call step() or attach an optimizer)"
        med = {k: statistics.median([s.get(k, 0.0) for s in steps]) for k in steps[-1]}
        step_med = med["step"] or 1.0
        lines = [
            f"accel_flatshard profile, rank {self.rank}: steps {self.step_count - len(steps) + 1}-{self.step_count} "
            f"({len(steps)} steps, times in ms per step)",
            "| phase | median | mean | max | % of step |",
            "|---|---:|---:|---:|---:|",
        ]
        for key, title in _METRICS:
            values = [s.get(key, 0.0) for s in steps]
            lines.append(
                f"| {title} | {med[key]:.1f} | {statistics.fmean(values):.1f} | {max(values):.1f} "
                f"| {100 * med[key] / step_med:.0f}% |"
            )
        for key, title in (("peak_rss_mib", "peak RSS (MiB)"), ("peak_cuda_mib", "peak CUDA allocated (MiB)")):
            if key in med:
                lines.append(f"| {title} | {med[key]:.0f} | | {max(s.get(key, 0.0) for s in steps):.0f} | |")
        return "\n".join(lines)

    @property
    def rank(self) -> int:
        if self._rank is None:
            dist = torch.distributed
            if not (dist.is_available() and dist.is_initialized()):
                return 0
            self._rank = dist.get_rank()
        return self._rank

    # ------------------------------------------------------------------ chrome trace
    def chrome_trace(self) -> Dict[str, Any]:
        """The latest ``trace_steps`` steps (and the unfinished one) as a Chrome-trace dict.

        Lanes (threads) of process ``rank r``: the training thread(s), with nested ``step`` >
        ``forward``/``backward``/``optimizer`` > collective issue/wait spans; and "all-gather in
        flight" / "reduce-scatter in flight" lanes: each collective from its issue to the end of its
        wait (the latest moment it can have finished).
        """
        rank = self.rank
        steps = list(self._trace)
        if self._events:  # the unfinished step
            events = list(self._events)
            start = self._step_t0 if self._step_t0 is not None else min(e[2] for e in events)
            steps.append((self.step_count, start, max(e[3] for e in events), events))
        out: List[Dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
            {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
        ]
        for i, name in enumerate(self._thread_names):
            out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": i, "args": {"name": f"{name} (compute)"}})
        us = lambda ns: (ns + self._anchor_ns) / 1e3  # noqa: E731
        lanes: Dict[str, List[int]] = {"all_gather": [], "reduce_scatter": []}
        lane_base = {"all_gather": 1000, "reduce_scatter": 2000}
        for step, start, end, events in steps:
            if not events:
                continue
            out.append({"name": "step", "cat": "step", "ph": "X", "ts": us(start), "dur": (end - start) / 1e3,
                        "pid": rank, "tid": events[0][4], "args": {"step": step}})
            for name, label, t0, t1, tid, phase in events:
                cat = "comm" if name in _COLLECTIVE_SPANS else "compute"
                title = f"{name} {label}".strip() if name != "unit_forward" else f"forward {label}"
                out.append({"name": title, "cat": cat, "ph": "X", "ts": us(t0), "dur": (t1 - t0) / 1e3, "pid": rank,
                            "tid": tid, "args": {"step": step, "unit": label, "phase": phase or ""}})
            for kind, label, t0, t1 in _in_flight(events):
                lane = _free_lane(lanes[kind], t0, t1)
                out.append({"name": f"{kind} {label}".strip(), "cat": "comm_in_flight", "ph": "X", "ts": us(t0),
                            "dur": (t1 - t0) / 1e3, "pid": rank, "tid": lane_base[kind] + lane,
                            "args": {"step": step, "unit": label}})
        for kind, used in lanes.items():
            for i in range(len(used)):
                title = kind.replace("_", "-") + f" in flight ({i})"
                out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": lane_base[kind] + i,
                            "args": {"name": title}})
        return {"traceEvents": out, "displayTimeUnit": "ms",
                "otherData": {"producer": "accel_flatshard.profiler", "rank": rank, "steps": [s[0] for s in steps]}}

    def export_chrome_trace(self, path: str) -> str:
        """Write :meth:`chrome_trace` as JSON (``{rank}`` in ``path`` becomes the rank; a directory gets
        ``flatshard_trace_rank{r}.json``); written atomically; returns the path."""
        if os.path.isdir(path):
            path = os.path.join(path, "flatshard_trace_rank{rank}.json")
        path = path.replace("{rank}", str(self.rank))
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.chrome_trace(), f)
        os.replace(tmp, path)
        return path

    def _register_atexit(self) -> None:
        if not self._atexit:
            self._atexit = True
            atexit.register(self._write_at_exit)

    def _write_at_exit(self) -> None:
        if self.trace_dir and (self._trace or self._events):
            try:
                self.export_chrome_trace(os.path.join(self.trace_dir, "flatshard_trace_rank{rank}.json"))
            except Exception:  # noqa: BLE001 - never fail interpreter exit
                pass


class _OptimizerContext:
    __slots__ = ("prof",)

    def __init__(self, prof: Profiler) -> None:
        self.prof = prof

    def __enter__(self) -> None:
        self.prof._begin("optimizer")

    def __exit__(self, *exc: Any) -> None:
        self.prof._end("optimizer")
        self.prof.step()


def _in_flight(events: List[tuple]):
    """Pair each collective's issue with the wait that completed it: (kind, label, issue start, wait end).

    An all-gather wait names its unit, or (when the engine waits for the oldest gather to bound the
    number in flight) none: it then completes the oldest outstanding gather.  One reduce-scatter wait
    completes every outstanding reduction.
    """
    gathers: Deque[Tuple[str, int]] = collections.deque()
    reduces: List[Tuple[str, int]] = []
    for name, label, t0, t1, _tid, _phase in sorted(events, key=lambda e: e[2]):
        if name == "all_gather_issue":
            gathers.append((label, t0))
        elif name == "all_gather_wait" and gathers:
            match = next((g for g in gathers if g[0] == label), None) if label else None
            match = match or gathers[0]
            gathers.remove(match)
            yield "all_gather", match[0], match[1], t1
        elif name == "reduce_scatter_issue":
            reduces.append((label, t0))
        elif name == "reduce_scatter_wait":
            for label_, start in reduces:
                yield "reduce_scatter", label_, start, t1
            reduces = []


def _free_lane(lanes: List[int], t0: int, t1: int) -> int:
    """Greedy interval partitioning: the first lane whose last interval ended by ``t0``."""
    for i, busy_until in enumerate(lanes):
        if busy_until <= t0:
            lanes[i] = t1
            return i
    lanes.append(t1)
    return len(lanes) - 1


def _read_and_reset_peak_memory() -> Dict[str, float]:
    out: Dict[str, float] = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["peak_cuda_mib"] = torch.cuda.max_memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    out["peak_rss_mib"] = int(line.split()[1]) / 1024
                    break
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass
    return out
