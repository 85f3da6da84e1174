"""A CPU simulation of CUDA streams, for checking the engine's CUDA schedule without a GPU.

:class:`SimulatedCuda` stands in for ``torch.cuda`` (``Stream``, ``Event``, ``current_stream``,
``stream``) *and* receives the engine's buffer-lifetime notes (``CudaStreams(tracer=...)``).  Collectives
and kernels really run (on CPU, synchronously); what is simulated is their ordering on a GPU that is
*infinitely slow* relative to the host: nothing is known complete until a stream or the host waited on
it.  Each stream has a vector clock (which positions of which streams happen before its current work);
events carry clocks; ``wait_event`` / ``synchronize`` merge them.  From that it checks:

* a buffer is read on a stream only after its last write (the all-gather) happens-before the read;
* a buffer is freed on the host only when every stream that read it is done, or the allocator was told
  (``record_stream``) to hold it until that stream is;
* how many buffers of each kind are *alive* at worst: referenced, or freed but held back by
  ``record_stream`` until the host has seen the reading stream finish;
* which devices' streams were used, and which inputs were moved to the device.

Use :func:`simulate_cuda` around wrapping a model (tests) to make its engine run the CUDA code path.
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional

import torch

from .streams import CudaStreams, override_streams


class SimStream:
    _ids = itertools.count()

    def __init__(self, sim: "SimulatedCuda", index: int, priority: int = 0, name: str = "") -> None:
        self.sim, self.index, self.priority = sim, index, priority
        self.device = torch.device("cuda", index)
        self.name = name or f"side{next(self._ids)}"
        self.pos = 0
        self.clock: Dict["SimStream", int] = {}

    def __repr__(self) -> str:
        return f"<stream {self.name} cuda:{self.index} prio={self.priority}>"

    def step(self) -> int:
        self.sim.streams_used.add(self.index)
        self.pos += 1
        return self.pos

    def wait_event(self, event: "SimEvent") -> None:
        self.sim.streams_used.add(self.index)
        _merge(self.clock, event.clock)
        self.sim.log.append(("wait_event", self.name, event.source))

    def wait_stream(self, other: "SimStream") -> None:
        event = SimEvent(self.sim)
        event.record(other)
        self.wait_event(event)


class SimEvent:
    def __init__(self, sim: "SimulatedCuda") -> None:
        self.sim, self.clock, self.source = sim, {}, None

    def record(self, stream: Optional[SimStream] = None) -> None:
        stream = stream if stream is not None else self.sim.current_stream()
        self.sim.streams_used.add(stream.index)
        self.clock = dict(stream.clock)
        self.clock[stream] = max(self.clock.get(stream, 0), stream.pos)
        self.source = stream.name

    def synchronize(self) -> None:
        _merge(self.sim.host_clock, self.clock)
        self.sim.host_syncs += 1


def _merge(into: Dict[SimStream, int], other: Dict[SimStream, int]) -> None:
    for stream, pos in other.items():
        if into.get(stream, 0) < pos:
            into[stream] = pos


def _knows(clock: Dict[SimStream, int], stream: SimStream, pos: int) -> bool:
    return clock.get(stream, 0) >= pos


@dataclass
class _Buffer:
    kind: str
    alloc_stream: SimStream
    write: Optional[tuple] = None  # (stream, pos) of the last write
    reads: Dict[SimStream, int] = field(default_factory=dict)
    recorded: set = field(default_factory=set)
    pending: Optional[Dict[SimStream, int]] = None  # after free: held until the host knows these

    def alive(self, host_clock) -> bool:
        if self.pending is None:
            return True
        return not all(_knows(host_clock, s, p) for s, p in self.pending.items())


class SimulatedCuda:
    """``torch.cuda`` look-alike plus tracer; ``current_device`` is what ``torch.cuda.current_device()``
    would return (the default device index when none is given)."""

    def __init__(self, current_device: int = 0) -> None:
        self.current_device = current_device
        self._current: Dict[int, SimStream] = {}
        self._default: Dict[int, SimStream] = {}
        self.host_clock: Dict[SimStream, int] = {}
        self.host_syncs = 0
        self.streams_used: set = set()
        self.log: List[tuple] = []
        self.violations: List[str] = []
        self.moved_inputs: List[torch.Tensor] = []
        self._buffers: Dict[Any, _Buffer] = {}
        self._dead: List[_Buffer] = []
        self._by_storage: Dict[int, Any] = {}
        self.peak: Dict[str, int] = {}
        self.side_streams: List[SimStream] = []

    # ------------------------------------------------------------------ torch.cuda surface
    def default_stream(self, index: int) -> SimStream:
        if index not in self._default:
            self._default[index] = SimStream(self, index, 0, f"compute{index}")
        return self._default[index]

    def current_stream(self, device: Any = None) -> SimStream:
        index = self.current_device if device is None else torch.device(device).index
        if index is None:
            index = self.current_device
        return self._current.get(index) or self.default_stream(index)

    def Stream(self, device: Any = None, priority: int = 0) -> SimStream:  # noqa: N802 - torch.cuda name
        index = self.current_device if device is None else torch.device(device).index
        stream = SimStream(self, index, priority)
        self.side_streams.append(stream)
        return stream

    def Event(self) -> SimEvent:  # noqa: N802
        return SimEvent(self)

    @contextlib.contextmanager
    def stream(self, stream: SimStream) -> Iterator[None]:
        previous = self._current.get(stream.index)
        self._current[stream.index] = stream
        try:
            yield
        finally:
            if previous is None:
                self._current.pop(stream.index, None)
            else:
                self._current[stream.index] = previous

    # ------------------------------------------------------------------ tracer
    def alloc(self, device: torch.device, tensor: torch.Tensor, kind: str, key: Any) -> None:
        stream = self.current_stream(device)
        stream.step()
        if key is None:
            key = ("tensor", id(tensor))
            weakref.finalize(tensor, self.free, device, key)
        buf = _Buffer(kind, stream)
        self._buffers[key] = buf
        self._by_storage[tensor.untyped_storage().data_ptr()] = key
        self.log.append(("alloc", stream.name, kind))
        alive = self.alive(kind)
        self.peak[kind] = max(self.peak.get(kind, 0), alive)

    def write(self, device: torch.device, key: Any) -> None:
        stream = self.current_stream(device)
        self._buffers[key].write = (stream, stream.step())

    def read(self, device: torch.device, key: Any) -> None:
        stream = self.current_stream(device)
        if isinstance(key, torch.Tensor):
            key = ("tensor", id(key))
        buf = self._buffers[key]
        pos = stream.step()
        if buf.write is not None:
            w_stream, w_pos = buf.write
            if w_stream is not stream and not _knows(stream.clock, w_stream, w_pos):
                self.violations.append(f"{buf.kind} read on {stream.name} before its write on {w_stream.name} "
                                       "was waited for")
        buf.reads[stream] = pos
        self.log.append(("read", stream.name, buf.kind))

    def record_stream(self, tensor: torch.Tensor, stream: SimStream) -> None:
        key = self._by_storage.get(tensor.untyped_storage().data_ptr())
        if key in self._buffers:
            self._buffers[key].recorded.add(stream)

    def free(self, device: torch.device, key: Any) -> None:
        buf = self._buffers.pop(key, None)
        if buf is None:
            return
        for stream, pos in buf.reads.items():
            safe = (stream is buf.alloc_stream or stream in buf.recorded
                    or _knows(buf.alloc_stream.clock, stream, pos) or _knows(self.host_clock, stream, pos))
            if not safe:
                self.violations.append(f"{buf.kind} freed while {stream.name} may still read it")
        buf.pending = {s: s.pos for s in buf.recorded if s is not buf.alloc_stream}
        self._dead.append(buf)
        self.log.append(("free", buf.alloc_stream.name, buf.kind))

    def move(self, tensor: torch.Tensor) -> torch.Tensor:
        self.moved_inputs.append(tensor)
        return tensor

    # ------------------------------------------------------------------ queries
    def alive(self, kind: str) -> int:
        self._dead = [b for b in self._dead if b.alive(self.host_clock)]
        return sum(b.kind == kind for b in self._buffers.values()) + sum(b.kind == kind for b in self._dead)


@contextlib.contextmanager
def simulate_cuda(device_index: int = 0, current_device: int = 0) -> Iterator[SimulatedCuda]:
    """Models wrapped inside run the CUDA schedule (streams of ``cuda:device_index``) on CPU tensors."""
    sim = SimulatedCuda(current_device)
    with override_streams(lambda device: CudaStreams(torch.device("cuda", device_index), api=sim, tracer=sim)):
        yield sim
