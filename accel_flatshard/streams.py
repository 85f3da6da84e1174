"""Device adapters: the only module that touches CUDA streams and events.

The engine (``engine.py``) writes its schedule once against this small interface; an adapter maps it
onto a device:

* :class:`CudaStreams` (NCCL): collectives are issued synchronously on high-priority side streams of the
  model's device, so they run asynchronously to the host; completion is an event that the compute stream
  waits on.  Every stream is taken from the *model's* device (``current_stream(device)``), never from the
  current device, so ``model.to("cuda:1")`` without ``torch.cuda.set_device`` is safe.
* :class:`HostStreams` (gloo, CPU): no streams; collectives return work handles (``async_op=True``) whose
  ``wait()`` blocks the host, and gloo's threads overlap them with compute.

Both expose the same calls (``on``, ``wait_stream``, ``record``, ``synchronize``, ``record_stream``,
``collective``, the offload copies ``host_empty`` / ``to_device`` / ``to_host``, ``note_alloc`` /
``note_free``), so the bookkeeping in the engine (pending reductions, gathers in flight, when a buffer may
be freed) is one code path.  ``note_alloc`` / ``note_free`` name buffer lifetimes; they are no-ops on real
devices.  The tests' CUDA simulator (``tests/sim_cuda.py``) subclasses :class:`CudaStreams` with a fake
``torch.cuda`` and checks the schedule's invariants on CPU, so it runs exactly this code.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

from ._compat import map_tensors

# FSDP2 gives its all-gather / reduce-scatter streams high priority so that communication kernels are
# scheduled ahead of queued compute kernels (lower number = higher priority).
HIGH_PRIORITY = -1


class _EventWait:
    """Completion of work on a side stream: ``wait()`` makes the compute stream wait (host does not block)."""

    __slots__ = ("streams", "event")

    def __init__(self, streams: "CudaStreams", event: Any) -> None:
        self.streams, self.event = streams, event

    def wait(self) -> None:
        self.streams.compute_stream().wait_event(self.event)


class _WorkWait:
    """Completion of a gloo collective: ``wait()`` blocks the host; keeps its input alive until then."""

    __slots__ = ("work", "keep")

    def __init__(self, work: Any, keep: Optional[torch.Tensor]) -> None:
        self.work, self.keep = work, keep

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        self.work, self.keep = None, None


class HostStreams:
    """CPU / gloo: no streams; collectives are asynchronous work handles that block on ``wait()``."""

    stream_ordered = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def compute_stream(self) -> None:
        return None

    def side_stream(self, role: str) -> None:
        return None

    def on(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def wait_stream(self, waiter: Any, producer: Any) -> None:
        pass

    def wait_event(self, waiter: Any, event: Any) -> None:
        pass

    def record(self, stream: Any) -> None:
        return None

    def synchronize(self, event: Any) -> None:
        pass

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        pass

    def collective(self, stream: Any, issue: Callable[[bool], Any], keep: Optional[torch.Tensor] = None) -> _WorkWait:
        """Run ``issue(async_op=True)``; the handle blocks the host until the work finished."""
        return _WorkWait(issue(True), keep)

    def move_inputs(self, args: Any, kwargs: Any) -> Any:
        return _move_tensors((args, kwargs), self.device, lambda t: t.to(self.device))

    # CPU offload (offload.py): the host is the device, so nothing is pinned and copies are host copies
    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device)

    def to_host(self, src: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(src)

    # buffer lifetime names (used by the tests' simulator only)
    def note_alloc(self, tensor: torch.Tensor, kind: str, key: Any = None) -> None:
        pass

    def note_free(self, key: Any) -> None:
        pass


class CudaStreams:
    """CUDA / NCCL: side streams of the model's device, events, ``record_stream``.

    ``api`` is ``torch.cuda`` (the tests' simulator passes one with the same functions: ``Stream``,
    ``Event``, ``current_stream``, ``stream``).
    """

    stream_ordered = True

    def __init__(self, device: torch.device, api: Any = None) -> None:
        self.device = device
        self.api = api if api is not None else torch.cuda
        self._side = {}

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
        event = self.api.Event()
        event.record(stream)
        return event

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def collective(self, stream: Any, issue: Callable[[bool], Any], keep: Optional[torch.Tensor] = None) -> _EventWait:
        """Run ``issue(async_op=False)`` on ``stream`` (asynchronous to the host); ``keep`` was allocated on
        ``stream`` and may be dropped at once (same-stream reuse is ordered)."""
        with self.on(stream):
            issue(False)
            return _EventWait(self, self.record(stream))

    def move_inputs(self, args: Any, kwargs: Any) -> Any:
        return _move_tensors((args, kwargs), self.device, lambda t: t.to(self.device, non_blocking=True))

    # CPU offload (offload.py): host buffers are pinned so that both copies run asynchronously to the host
    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """Host -> device on the current stream; the result belongs to that stream."""
        return host.to(self.device, non_blocking=True)

    def to_host(self, src: torch.Tensor, out: torch.Tensor) -> None:
        """Device -> pinned host on the current stream; the host may read ``out`` only after synchronising
        on an event recorded behind it."""
        out.copy_(src, non_blocking=True)

    def note_alloc(self, tensor: torch.Tensor, kind: str, key: Any = None) -> None:
        pass

    def note_free(self, key: Any) -> None:
        pass


def _move_tensors(tree: Any, device: torch.device, move: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Inputs on another device are moved to the model's (as torch FSDP does at the root)."""
    return map_tensors(lambda t: t if t.device == device else move(t), tree)


def streams_for(device: torch.device) -> Any:
    """The adapter for a model on ``device`` (tests pass a simulated one through ``Engine(streams=...)``)."""
    return CudaStreams(device) if device.type == "cuda" else HostStreams(device)
