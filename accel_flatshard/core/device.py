"""The device adapter: streams, events and buffers, so that one engine (``engine.py``) runs CUDA and gloo/CPU alike.

Every decision that differs between a stream-ordered device and a host that blocks on work handles is a method of
the adapter, never a branch in the engine (docs/architecture-details.md section 5):

* where work runs (:meth:`HostAdapter.side_stream`, :meth:`HostAdapter.on`), what waits
  (:meth:`HostAdapter.wait_stream`, :meth:`HostAdapter.wait_event`, :meth:`HostAdapter.synchronize`) and what is
  recorded (:meth:`HostAdapter.record`);
* how a collective is issued and completed (:meth:`HostAdapter.collective`: a work handle the host waits for, or an
  event the compute stream waits for), and work that must follow another (:meth:`HostAdapter.after`: issued at
  once behind an event on CUDA; on the host, issued by the handle's ``start()`` once its input is complete); every
  completion is a :class:`~.handles.Handle`;
* the gathered buffers' lifetime (:meth:`HostAdapter.alloc_gathered`, :meth:`HostAdapter.free_gathered` and its
  :meth:`HostAdapter.release`, and the gather rate limit :meth:`HostAdapter.wait_for_freed`), the full gradient
  handed to a reduction (:meth:`HostAdapter.reduction_input`), buffers of work beside the step
  (:meth:`HostAdapter.scratch`), host memory for offload and snapshots (:meth:`HostAdapter.host_empty`,
  :meth:`HostAdapter.to_device`, :meth:`HostAdapter.to_host`), and how much memory is free (:func:`free_bytes`).

:class:`HostAdapter` is gloo/CPU, :class:`CudaStreams` NCCL; the planner's recording adapters (``plan/run.py``) and
the tests' simulator (``tests/sim_cuda.py``) subclass them and extend ``alloc_gathered``, ``release`` and
``reduction_input`` to count bytes (each still does the real work).
``ADAPTER`` sets the adapter class of engines made meanwhile (the planner's).
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import os
from typing import Any, Callable, Deque

import torch

from ._compat import map_tensors
from .flat_param import FlatParameter
from .handles import Handle
from .spans import span

# The adapter of engines made meanwhile (default: the device's); the memory planner's records memory (plan/run.py)
ADAPTER: contextvars.ContextVar = contextvars.ContextVar("flatshard_adapter", default=None)

# FSDP2's side-stream priority: communication kernels go ahead of queued compute kernels (lower = higher)
HIGH_PRIORITY = -1


def free_bytes(device: torch.device) -> int:
    """What this process can still allocate on ``device``: on CUDA the device's free memory plus what torch's caching
    allocator holds unused; else the host's MemAvailable."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0]) + cached
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


class HostAdapter:
    """CPU / gloo: no streams (``None``); collectives are asynchronous work handles that block the host on ``wait()``,
    and a freed buffer is free at once.  Also the base of :class:`CudaStreams`: moves between host and device,
    non-blocking (from pinned memory) on CUDA."""

    stream_ordered = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def _nothing(self, *args: Any, **kwargs: Any) -> None:
        return None

    # no streams or events: the host waits on work handles
    compute_stream = side_stream = record = _nothing
    wait_stream = wait_event = synchronize = record_stream = _nothing

    def on(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def collective(self, stream: Any, issue: Callable[[bool], Any], keep: Any = None) -> Any:
        """Run ``issue(async_op=True)``; the handle blocks the host until the work finished (``keep`` lives until
        then)."""
        return Handle([issue(True)], keep=keep)

    def after(self, before: Any, stream: Any, issue: Callable[[bool], Any], to_host: bool = False) -> Any:
        """``issue(async_op)`` (on ``stream``) once ``before`` completed: here when the handle's ``start()`` or
        ``wait()`` asks, and the engine has completed ``before`` by then (its input exists); ``issue`` returns a
        work handle (a collective) or None (a copy, done when it returns)."""
        return Handle(issue=lambda: issue(True))

    # ---- buffers
    def alloc_gathered(self, flat: FlatParameter) -> torch.Tensor:
        """Grow ``flat``'s gathered buffer (on the current stream); returns the alias the all-gather writes."""
        return flat.alloc_unsharded()

    def free_gathered(self, flat: FlatParameter) -> None:
        """Free ``flat``'s gathered buffer once every reader is done with it (here: now)."""
        self.release(flat)

    def release(self, flat: FlatParameter) -> None:
        """Give ``flat``'s gathered buffer back to the allocator (its storage resized to 0 bytes)."""
        flat.free_unsharded()

    def wait_for_freed(self, limit: int) -> None:
        """Before another gather: block until at most ``limit`` - 1 freed buffers are still read (CUDA only)."""

    def secondary_copy(self, part: torch.Tensor) -> torch.Tensor:
        """A copy of ``part`` of a gathered buffer, made on the compute stream (hpZ's secondary slice)."""
        return part.clone()

    def scratch(self, numel: int, dtype: torch.dtype, kind: str) -> torch.Tensor:
        """A buffer on the model's device for work beside the step's (``kind`` names it: the matrix optimizers'
        exchange buffers, ``matrix_optim.py``), made on the current stream."""
        return torch.empty(numel, dtype=dtype, device=self.device)

    def reduction_input(self, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The full gradient in the reduce dtype, on the compute stream (``grad`` itself when it has that dtype: the
        engine owns it and divides it in place)."""
        return grad.to(dtype)

    def move_inputs(self, args: Any, kwargs: Any) -> Any:
        """Inputs on another device are moved to the model's (as torch FSDP does at the root)."""
        move = lambda t: t if t.device == self.device else t.to(self.device, non_blocking=self.stream_ordered)
        return map_tensors(move, (args, kwargs))

    # CPU offload (offload.py) and host snapshots (state/commit.py): on CUDA host buffers are pinned, so that
    # both copies run asynchronously to the host
    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=self.stream_ordered)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """Host -> device on the current stream; the result belongs to that stream."""
        return host.to(self.device, non_blocking=self.stream_ordered)

    def to_host(self, src: torch.Tensor, out: torch.Tensor) -> None:
        """Device -> host on the current stream (CUDA: ``out`` is ready once an event recorded behind it is)."""
        out.copy_(src, non_blocking=self.stream_ordered)


class CudaStreams(HostAdapter):
    """CUDA / NCCL: side streams of the model's device, events, ``record_stream``; ``api`` is ``torch.cuda`` or
    the tests' simulator (``Stream``, ``Event``, ``current_stream``, ``stream``)."""

    stream_ordered = True

    def __init__(self, device: torch.device, api: Any = None) -> None:
        super().__init__(device)
        self.api = api if api is not None else torch.cuda
        self._side = {}
        self._free_events: Deque[Any] = collections.deque()  # one per freed gathered buffer the GPU may still read

    def compute_stream(self) -> Any:
        # the model's device, explicitly: current_stream() without a device is the *current device's* stream
        return self.api.current_stream(self.device)

    def side_stream(self, role: str) -> Any:
        if role not in self._side:
            self._side[role] = self.api.Stream(device=self.device, priority=HIGH_PRIORITY)
        return self._side[role]

    def on(self, stream: Any) -> contextlib.AbstractContextManager:
        return self.api.stream(stream)

    def wait_stream(self, waiter: Any, producer: Any) -> None:
        waiter.wait_stream(producer)

    def wait_event(self, waiter: Any, event: Any) -> None:
        waiter.wait_event(event)

    def record(self, stream: Any) -> Any:
        # blocking: a host that synchronises on it (the gather rate limit, the offload copies) sleeps instead
        # of spinning a core for the whole wait (docs/gpu.md, CUDA events)
        event = self.api.Event(blocking=True)
        event.record(stream)
        return event

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        if tensor.device.type != "cpu":  # (host memory, e.g. an offloaded shard a snapshot copies, has no streams)
            tensor.record_stream(stream)

    def collective(self, stream: Any, issue: Callable[[bool], Any], keep: Any = None) -> Any:
        """Run ``issue(async_op=False)`` on ``stream`` (asynchronous to the host); ``keep`` was allocated on
        ``stream`` and may be dropped at once (same-stream reuse is ordered)."""
        with self.on(stream):
            issue(False)
            return Handle(event=self.record(stream), adapter=self)

    def after(self, before: Any, stream: Any, issue: Callable[[bool], Any], to_host: bool = False) -> Any:
        """``issue(async_op=False)`` on ``stream`` now, ordered behind ``before``'s event; its completion is an event
        the compute stream waits for (``to_host``: the host synchronises on it, for copies the host reads)."""
        self.wait_event(stream, before.event)
        with self.on(stream):
            issue(False)
        return Handle(event=self.record(stream), adapter=self, to_host=to_host)

    def free_gathered(self, flat: FlatParameter) -> None:
        # allocated on the all-gather stream, read on the compute stream: not reusable before those reads
        compute = self.compute_stream()
        self.record_stream(flat.unsharded, compute)
        self.release(flat)
        self._free_events.append(self.record(compute))

    def wait_for_freed(self, limit: int) -> None:
        # so the host cannot run a whole forward ahead and hold a gathered copy of every unit
        while len(self._free_events) >= limit:
            with span("all_gather_rate_limit"):
                self.synchronize(self._free_events.popleft())
