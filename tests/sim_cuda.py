"""A CPU simulation of CUDA streams (tests only): checks the engine's CUDA schedule without a GPU.

The engine's real CUDA code path (``accel_flatshard.core.device.CudaStreams``) runs against
:class:`SimulatedCuda`, which stands in for ``torch.cuda`` (``Stream``, ``Event``, ``current_stream``,
``stream``).  Kernels and collectives really run (on CPU tensors, synchronously); what is simulated is
their ordering on a GPU that is *infinitely slow* relative to the host: nothing is known complete until a
stream or the host waited on it.

Model
-----
* Each stream has a position (one step per op issued on it) and a vector clock (the positions of other
  streams that happen-before its current work).  Events carry clocks; ``wait_event`` / ``wait_stream``
  merge them into a stream's clock, ``Event.synchronize`` and ``.item()`` into the host's.  Work the host
  enqueues happens after everything the host has seen complete (each step merges the host's clock).
* Every aten op (and every c10d collective) is observed by a ``TorchDispatchMode`` while the simulation is
  active (``with sim:``).  It runs on the current stream of the simulated device; the schema says which
  arguments it reads and which it writes (in-place / out arguments; for collectives the table
  ``_C10D_WRITES``).  So the optimizer's in-place update of a shard, autograd's gradients, copies, and a
  collective's output (written when the collective is *issued* on its stream, not when the buffer was
  allocated) are all tracked, per storage.
* Checks (``sim.violations``): a read on one stream of a storage whose last write on another stream does
  not happen-before it (read after write); a write that does not happen after the last reads and write on
  other streams (write after read / write); a free (storage death, or the adapter's ``release`` of a
  resized storage) while a stream other than the allocating one may still use it, unless the allocating
  stream, the host or a stream registered with ``record_stream`` knows that use is done; ``record_stream``
  keeps the block reserved until the host has seen that stream pass the free (``peak`` counts such
  buffers as alive).  A ``record_stream`` of a storage already resized to 0 keeps nothing (on a GPU the
  block went back to its pool at the resize).
* Per-stream pools: a block comes from its allocating stream's pool and may still be in use by that
  stream's earlier work, so another stream that uses a buffer first must be ordered after the allocation
  (an op's output is covered by the write check; a resize, e.g. the gathered buffer, by this one).
* Labels: the adapter's ``alloc_gathered`` and ``reduction_input`` name buffers ("unsharded", "full_grad"); ``peak[kind]``
  is the most buffers of a kind alive at once.  A violation names the tensor (a watched model's shard,
  gradient or gathered buffer: ``local_shard of model.layers.1[0]``; or ``sim.name(tensor, label)``), the
  streams (side streams by role: ``all_gather:side0``; ``host``) and the op (``aten::add_``).

Host memory and copies (for CPU offload)
----------------------------------------
Every storage has a placement, ``"device"`` unless declared otherwise with :meth:`SimulatedCuda.place`
(``"host"``, optionally ``pinned``).  An op whose tensors are all on the host runs on the host (a
pseudo-stream ``sim.host`` whose knowledge is the host clock), so a host read of a buffer that a device
stream wrote (e.g. a CPU optimizer step on a gradient copied back on a side stream) must follow an event
synchronize.  An op that mixes host and device tensors (a host<->device copy) runs on the current stream;
the host then waits for that stream (as ``cudaMemcpy`` does) unless the copy is ``non_blocking`` and its
host side pinned.
Crossings (:class:`_Crossings`, a ``TorchFunctionMode``): a tensor in device memory reports ``device`` cuda:<index>
and ``is_cuda``; ``.to()`` / ``.cpu()`` / ``.cuda()`` between host and device are copies on the current stream
(:meth:`SimulatedCuda.convert`): device -> host blocking (the host waits) or ``non_blocking`` (into pinned memory,
asynchronous: the host must synchronise before reading it); host -> device blocking unless ``non_blocking`` from
pinned memory; a factory with ``device="cuda"`` allocates on the current stream.  The host reads memory outside
ops too: ``torch.save``, safetensors (``save_pretrained``), ``tolist()`` (:meth:`SimulatedCuda.host_read`;
``numpy()`` of device memory is reported, as CUDA raises).  Host synchronisations are counted by event kind
(``event_syncs``: blocking, spinning, implicit); the simulator has no clock, so it counts waits, not their time.
:meth:`SimulatedCuda.device_storages` / :meth:`assert_on_host` check that nothing persistent lives on the
device; ``peak_bytes["device"]`` is the device's peak of tracked bytes.

CPU offload: ``SimCudaStreams`` makes the adapter's ``host_empty`` buffers pinned host memory and its
``to_device`` / ``to_host`` copies ops of the current stream (the copy reads one side, writes the other);
:func:`simulate_cuda` declares an offloaded model's existing host shards pinned host memory.

Use :func:`simulate_cuda` on a wrapped model to make its engine run the CUDA code path (several models may
share one simulator; ``group=`` gives the engine a stand-in shard group, e.g. hybrid sharding in one process).
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from accel_flatshard.core._compat import map_tensors
from accel_flatshard.core.device import CudaStreams

# c10d ops: indices of the arguments a collective writes (the others are read); unknown ones: all written
_C10D_WRITES = {
    "c10d::_allgather_base_": {0}, "c10d::allgather_": {0}, "c10d::allgather_into_tensor_coalesced_": {0},
    "c10d::_reduce_scatter_base_": {0}, "c10d::reduce_scatter_": {0},
    "c10d::reduce_scatter_tensor_coalesced_": {0}, "c10d::allreduce_": {0}, "c10d::broadcast_": {0},
    "c10d::recv_": {0}, "c10d::send": set(), "c10d::barrier": set(),
}


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread for a simulated test (restored after): the simulator runs thousands of tiny ops,
    and on a loaded 2-core machine two OpenMP threads spin for each (3 us per op on one thread, 500 us
    measured on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class SimStream:
    _ids = itertools.count()

    def __init__(self, sim: "SimulatedCuda", index: int, priority: int = 0, name: str = "") -> None:
        self.sim, self.index, self.priority = sim, index, priority
        self.device = torch.device("cuda", max(index, 0))
        self.name = name or f"side{next(self._ids)}"
        self.pos = 0
        self.clock: Dict["SimStream", int] = {}

    def __repr__(self) -> str:
        return f"<stream {self.name} cuda:{self.index} prio={self.priority}>"

    def step(self) -> int:
        self.sim.streams_used.add(self.index)
        _merge(self.clock, self.sim.host_clock)  # enqueued after whatever the host has seen complete
        self.pos += 1
        return self.pos

    def knows(self, stream: "SimStream", pos: int) -> bool:
        return stream is self or self.clock.get(stream, 0) >= pos

    def wait_event(self, event: "SimEvent") -> None:
        self.sim.streams_used.add(self.index)
        _merge(self.clock, event.clock)
        self.sim.log.append(("wait_event", self.name, event.source))

    def wait_stream(self, other: "SimStream") -> None:
        event = SimEvent(self.sim)
        event.record(other)
        self.wait_event(event)


class _HostStream(SimStream):
    """The host as a pseudo-stream: its ops are done at once, its knowledge is the host clock."""

    def __init__(self, sim: "SimulatedCuda") -> None:
        super().__init__(sim, -1, 0, "host")
        self.clock = sim.host_clock

    def step(self) -> int:
        self.pos += 1
        self.clock[self] = self.pos
        return self.pos


class SimEvent:
    """``kind``: "blocking" (``blocking=True``: the host thread sleeps in ``synchronize``), "spinning" (torch's
    default: it busy-waits on a core), "implicit" (the simulator's own: a blocking copy, ``.item()``)."""

    def __init__(self, sim: "SimulatedCuda", kind: str = "implicit") -> None:
        self.sim, self.clock, self.source, self.kind = sim, {}, None, kind

    def record(self, stream: Optional[SimStream] = None) -> None:
        stream = stream if stream is not None else self.sim.current_stream()
        self.sim.streams_used.add(stream.index)
        self.clock = dict(stream.clock)
        self.clock[stream] = max(self.clock.get(stream, 0), stream.pos)
        self.source = stream.name

    def synchronize(self) -> None:
        _merge(self.sim.host_clock, self.clock)
        self.sim.host_syncs += 1
        self.sim.event_syncs[self.kind] += 1


def _merge(into: Dict[SimStream, int], other: Dict[SimStream, int]) -> None:
    for stream, pos in other.items():
        if into.get(stream, 0) < pos:
            into[stream] = pos


@dataclass
class _Buffer:
    """One allocation: a storage from its allocation (or resize) to its free."""

    kind: str
    alloc_stream: SimStream
    nbytes: int
    placement: str = "device"
    alloc_pos: int = 0  # the allocating stream's position: its pool's block may be in use by work up to there
    key: int = 0  # the storage's ``_cdata``
    label: Optional[str] = None  # a name given by the test (``sim.name``) or by the adapter (alloc_gathered, reduction_input)
    pinned: bool = False
    write: Optional[tuple] = None  # (stream, pos) of the last write
    reads: Dict[SimStream, int] = field(default_factory=dict)  # since the last write
    uses: Dict[SimStream, int] = field(default_factory=dict)  # every read or write, for the free check
    last_op: Dict[SimStream, str] = field(default_factory=dict)  # the op of each stream's last use
    recorded: set = field(default_factory=set)
    pending: Optional[Dict[SimStream, int]] = None  # after free: held until the host knows these

    def alive(self, host_clock: Dict[SimStream, int]) -> bool:
        if self.pending is None:
            return True
        return not all(host_clock.get(s, 0) >= p for s, p in self.pending.items())


def _storage(t: torch.Tensor) -> Optional[torch.UntypedStorage]:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def _tensors(value: Any) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class SimulatedCuda(TorchDispatchMode):
    """``torch.cuda`` look-alike for ``CudaStreams(api=...)`` plus the op tracker (``with sim:``).

    ``device_index`` is the simulated model's device; ``current_device`` what ``torch.cuda.current_device()``
    would return (used when a stream is asked for without a device)."""

    def __init__(self, device_index: int = 0, current_device: int = 0) -> None:
        super().__init__()
        self.device_index, self.current_device = device_index, current_device
        self._current: Dict[int, SimStream] = {}
        self._default: Dict[int, SimStream] = {}
        self.host_clock: Dict[SimStream, int] = {}
        self.host = _HostStream(self)
        self.host_syncs = 0
        self.event_syncs: Dict[str, int] = collections.Counter()  # host synchronisations by SimEvent.kind
        self.streams_used: set = set()
        self.log: List[tuple] = []
        self.violations: List[str] = []
        self.moved_inputs: List[torch.Tensor] = []
        self._buffers: Dict[int, _Buffer] = {}  # by storage (``_cdata``)
        self._finalizers: set = set()
        self._keyed: Dict[Any, int] = {}  # engine key (a FlatParameter) -> storage
        self._dead: List[_Buffer] = []
        self.peak: Dict[str, int] = {}
        self.peak_bytes: Dict[str, int] = {}
        self._live_kinds: Dict[str, int] = collections.Counter()  # buffers alive (or held back), by kind
        self._live_bytes: Dict[str, int] = collections.Counter()  # their bytes, by placement
        self.side_streams: List[SimStream] = []
        self._models: List[Any] = []  # weak references to the wrapped models whose buffers violations name

    # ------------------------------------------------------------------ entering: ops, crossings, host readers
    def __enter__(self):
        self._crossings = _Crossings(self)
        self._crossings.__enter__()
        self._readers = _HostReaders(self)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._readers.close()
            self._crossings.__exit__(*exc)

    # ------------------------------------------------------------------ torch.cuda surface
    def default_stream(self, index: int) -> SimStream:
        if index not in self._default:
            self._default[index] = SimStream(self, index, 0, f"compute{index}")
        return self._default[index]

    def current_stream(self, device: Any = None) -> SimStream:
        index = device if isinstance(device, int) else None if device is None else torch.device(device).index
        if index is None:
            index = self.current_device
        return self._current.get(index) or self.default_stream(index)

    def Stream(self, device: Any = None, priority: int = 0) -> SimStream:  # noqa: N802 - torch.cuda name
        index = self.current_device if device is None else torch.device(device).index
        stream = SimStream(self, index, priority)
        self.side_streams.append(stream)
        return stream

    def Event(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> SimEvent:  # noqa: N802
        return SimEvent(self, "blocking" if blocking else "spinning")

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

    # ------------------------------------------------------------------ buffers
    def _buffer(self, storage: torch.UntypedStorage, stream: SimStream, kind: str = "tensor") -> _Buffer:
        key = storage._cdata
        buf = self._buffers.get(key)
        if buf is None:
            # first sight of a storage made outside the simulation: by a host op, host memory; otherwise
            # allocated by the host on the default stream (a device tensor made before the simulation)
            if stream is self.host:
                buf = self._new(storage, stream, kind, "host")
            else:
                buf = self._new(storage, self.default_stream(self.device_index), kind)
                buf.alloc_pos = 0  # before the simulation: before any op of the simulated streams
        return buf

    def _new(self, storage: torch.UntypedStorage, stream: SimStream, kind: str, placement: str = "device") -> _Buffer:
        key = storage._cdata
        if key in self._buffers:  # a storage seen before and re-allocated (a resize): the old life ends
            self._tally(self._buffers.pop(key), -1)
        buf = _Buffer(kind, stream, storage.nbytes(), placement, alloc_pos=stream.pos, key=key)
        self._buffers[key] = buf
        if key not in self._finalizers:
            self._finalizers.add(key)
            weakref.finalize(storage, self._storage_died, key)
        self._tally(buf, +1)
        self._count(kind)
        return buf

    def _tally(self, buf: _Buffer, sign: int) -> None:
        self._live_kinds[buf.kind] += sign
        self._live_bytes[buf.placement] += sign * buf.nbytes

    def _storage_died(self, key: int) -> None:
        self._finalizers.discard(key)
        if key in self._buffers:
            self._free(key)

    def _count(self, kind: str) -> None:
        """Update the peaks (buffers held back by ``record_stream`` count until the host saw them free)."""
        if self._dead:
            still = []
            for b in self._dead:
                (still.append(b) if b.alive(self.host_clock) else self._tally(b, -1))
            self._dead = still
        if kind != "tensor":
            self.peak[kind] = max(self.peak.get(kind, 0), self._live_kinds[kind])
        for where in ("device", "host"):
            self.peak_bytes[where] = max(self.peak_bytes.get(where, 0), self._live_bytes[where])

    def _free(self, key: int) -> None:
        buf = self._buffers.pop(key)
        for stream, pos in buf.uses.items():
            # the block goes back to its allocation stream's pool, held (record_stream) until every recorded
            # stream is past the free: safe if one of them (or the host) knows the use is done
            safe = (stream is buf.alloc_stream or stream in buf.recorded or buf.alloc_stream.knows(stream, pos)
                    or any(r.knows(stream, pos) for r in buf.recorded) or self.host_clock.get(stream, 0) >= pos)
            if not safe:
                self.violations.append(f"{buf.label or buf.kind} freed while {stream.name} may still use it "
                                       f"(allocated on {buf.alloc_stream.name}, no record_stream; last used there "
                                       f"by {buf.last_op.get(stream)})")
        buf.pending = {s: s.pos for s in buf.recorded if s is not buf.alloc_stream}
        if buf.alive(self.host_clock):
            self._dead.append(buf)
        else:
            self._tally(buf, -1)
        self.log.append(("free", buf.alloc_stream.name, buf.kind))

    def name(self, tensor: torch.Tensor, label: str) -> None:
        """Name ``tensor``'s storage in violations (a wrapped model's shards and gradients are named already)."""
        self._buffer(tensor.untyped_storage(), self.current_stream(self.device_index)).label = label

    def watch(self, model: Any) -> None:
        """Name the buffers of a wrapped model (shards, gradients, gathered parameters) in violations."""
        self._models.append(weakref.ref(model))

    def _describe(self, buf: _Buffer) -> str:
        if buf.label is not None:
            return buf.label
        for ref in self._models:
            model = ref()
            for unit in model.units if model is not None else ():
                offload = model.schedule.engine.offload
                staging = offload._staging if offload is not None else {}
                for i, flat in enumerate(unit.flat_params):
                    named = [("local_shard", flat.local_shard), ("sharded_grad", flat.sharded_grad),
                             ("unsharded", flat.unsharded)]
                    named += [("staged grad", t) for t in staging.get(flat, ())]
                    named += [(f"grad of {slot.fqn}", p.grad) for slot, p in zip(flat.layout.slots, flat.params)]
                    for what, t in named:
                        if t is not None and (st := _storage(t)) is not None and st._cdata == buf.key:
                            return f"{what} of {unit.name}[{i}]"
        return buf.kind

    # ------------------------------------------------------------------ op tracking
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunction():  # (the simulator's own tensor calls are not host crossings)
            return self._dispatch(func, args, kwargs or {})

    def _dispatch(self, func, args, kwargs):
        schema = func._schema
        reads, writes, non_blocking = [], [], False
        if schema.name.startswith("c10d::"):
            written = _C10D_WRITES.get(schema.name)
            for i, value in enumerate(args):
                (writes if written is None or i in written else reads).extend(_tensors(value))
        else:
            named = dict(zip([a.name for a in schema.arguments], args))
            named.update(kwargs)
            for arg in schema.arguments:
                ts = _tensors(named.get(arg.name))
                (writes if arg.alias_info is not None and arg.alias_info.is_write else reads).extend(ts)
            non_blocking = bool(named.get("non_blocking", False))
        out = func(*args, **kwargs)
        self._on_op(schema, reads, writes, out, non_blocking)
        return out

    def _placement(self, t: torch.Tensor) -> Optional[_Buffer]:
        storage = _storage(t)
        if storage is None or storage.nbytes() == 0:
            return None
        return self._buffers.get(storage._cdata)

    def _on_op(self, schema, reads: List[torch.Tensor], writes: List[torch.Tensor], out: Any,
               non_blocking: bool = False) -> None:
        known = [b for b in map(self._placement, reads + writes) if b is not None]
        on_host = bool(known) and all(b.placement == "host" for b in known)
        stream = self.host if on_host else self.current_stream(self.device_index)
        pos = stream.step()
        if schema.name.startswith("c10d::"):
            self.log.append(("collective", stream.name, schema.name))
        seen = set()
        for t, is_write in [(t, False) for t in reads] + [(t, True) for t in writes]:
            storage = _storage(t)
            if storage is None or storage.nbytes() == 0:
                continue
            buf = self._buffer(storage, stream)
            self._check(buf, stream, is_write, schema.name)
            if (storage._cdata, is_write) in seen:
                continue
            seen.add((storage._cdata, is_write))
            if is_write:
                buf.write, buf.reads = (stream, pos), {}
            else:
                buf.reads[stream] = pos
                if buf.kind != "tensor":
                    self.log.append(("read", stream.name, buf.kind))
            buf.uses[stream], buf.last_op[stream] = pos, schema.name
        # new outputs (no alias to an argument): allocated on this stream, written at this position
        returns = schema.returns
        outs = [out] if len(returns) == 1 else list(out) if isinstance(out, (tuple, list)) else []
        for ret, value in zip(returns, outs):
            if ret.alias_info is not None:
                continue
            for t in _tensors(value):
                storage = _storage(t)
                if storage is None or storage.nbytes() == 0:
                    continue
                placement = "host" if on_host else "device"
                buf = self._new(storage, stream, "tensor", placement)
                buf.write, buf.uses[stream], buf.last_op[stream] = (stream, pos), pos, schema.name
        mixed = {b.placement for b in known}
        if mixed == {"host", "device"} and not (non_blocking and all(b.pinned for b in known if b.placement == "host")):
            self._host_waits_for(stream)  # a host<->device copy blocks the host unless pinned and non_blocking
        if schema.name == "aten::_local_scalar_dense":  # .item(): the host waits for the stream
            self._host_waits_for(stream)

    def _host_waits_for(self, stream: SimStream) -> None:
        event = SimEvent(self)
        event.record(stream)
        event.synchronize()

    def _check(self, buf: _Buffer, stream: SimStream, is_write: bool, op: str) -> None:
        """Violations name the tensor, the stream (``host`` for host work) and the op."""
        unwritten_there = buf.write is None or buf.write[0] is not buf.alloc_stream  # (else: the check below)
        if (buf.placement == "device" and unwritten_there and stream is not buf.alloc_stream
                and stream not in buf.uses and not stream.knows(buf.alloc_stream, buf.alloc_pos)):
            # the caching allocator's pools are per stream: the block may still be in use by the allocating
            # stream's earlier work (a buffer freed there and reused), which this stream is not ordered after
            self.violations.append(f"{self._describe(buf)} used on {stream.name} before it waited for its "
                                   f"allocation on {buf.alloc_stream.name} (by {op}; that stream's pool block may "
                                   "still be in use there)")
        if buf.write is not None:
            w_stream, w_pos = buf.write
            if not stream.knows(w_stream, w_pos):
                what = "written" if is_write else "read"
                verb = "write" if is_write else "read"
                self.violations.append(f"{self._describe(buf)} {verb} on {stream.name} before its write on "
                                       f"{w_stream.name} was waited for ({what} too early, by {op})")
        if is_write:
            for r_stream, r_pos in buf.reads.items():
                if not stream.knows(r_stream, r_pos):
                    self.violations.append(f"{self._describe(buf)} written on {stream.name} while {r_stream.name} "
                                           f"may still read it (by {op})")

    # ------------------------------------------------------------------ host <-> device crossings
    def convert(self, src: torch.Tensor, device: Any, dtype: Optional[torch.dtype], non_blocking: bool,
             copy: bool) -> torch.Tensor:
        """``src.to(device, dtype, non_blocking, copy)`` with ``device`` "cpu" (the host), "cuda" (the simulated
        device) or None, as CUDA does it:

        * device -> host: a copy on the current stream.  Blocking: the host waits for that stream.
          ``non_blocking``: the result is pinned memory (torch pins it) and the copy is asynchronous: the host may
          read it only after synchronising on an event (or the stream) behind the copy;
        * host -> device: a copy on the current stream; the host waits for it unless ``non_blocking`` from
          pinned memory (from pageable memory CUDA stages it: synchronous to the host, as for ``copy_``);
        * otherwise (same memory): torch's own conversion (no copy unless the dtype changes or ``copy``)."""
        target = None if device is None else "device" if _is_cuda(device) else "host"
        storage = _storage(src)
        buf = self._buffer(storage, self.current_stream(self.device_index)) if storage is not None and storage.nbytes() else None
        here = buf.placement if buf is not None else target
        if target is None or target == here:
            return torch.Tensor.to(src, dtype=dtype or src.dtype, non_blocking=non_blocking, copy=copy)
        if target == "host":  # device -> host
            out = torch.Tensor.to(src, "cpu", dtype=dtype or src.dtype, non_blocking=non_blocking, copy=True)
            landed = self._buffers.get(out.untyped_storage()._cdata)
            if landed is None:  # nothing copied (an empty slice)
                return out
            self._tally(landed, -1)
            landed.placement, landed.pinned = "host", non_blocking
            self._tally(landed, +1)
            if not non_blocking:
                self._host_waits_for(landed.write[0])
            return out
        out = torch.empty(src.shape, dtype=dtype or src.dtype)  # host -> device: a buffer of the current stream
        out.copy_(src, non_blocking=non_blocking)
        return out

    def on_device(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is in the simulated device's memory (``tensor.device`` is then ``cuda:<index>``); a
        tensor the simulation has not seen yet was made before it, on the device."""
        storage = _storage(tensor)
        if storage is None or tensor.device.type != "cpu":  # (meta, fake: not simulated)
            return False
        buf = self._buffers.get(storage._cdata) if storage.nbytes() else None
        return buf is None or buf.placement == "device"

    def host_read(self, tensor: torch.Tensor, what: str) -> None:
        """The host reads ``tensor``'s memory outside an op (``torch.save``, safetensors, ``tolist``): host memory
        must be known written (an asynchronous copy into it synchronised); device memory is read through a
        blocking copy on the current stream (``numpy()`` of a CUDA tensor raises)."""
        storage = _storage(tensor)
        if storage is None or storage.nbytes() == 0:
            return
        stream = self.current_stream(self.device_index)
        buf = self._buffer(storage, stream)
        if buf.placement == "device":
            if what == "numpy()":
                self.violations.append(f"{self._describe(buf)}: numpy() of a device tensor (CUDA raises; copy it "
                                       "to the host first)")
            pos = stream.step()
        else:
            stream, pos = self.host, self.host.step()
        self._check(buf, stream, False, what)
        buf.reads[stream] = buf.uses[stream] = pos
        buf.last_op[stream] = what
        if stream is not self.host:
            self._host_waits_for(stream)

    # ------------------------------------------------------------------ adapter notes
    def alloc(self, tensor: torch.Tensor, kind: str, key: Any) -> _Buffer:
        stream = self.current_stream(self.device_index)
        storage = tensor.untyped_storage()
        if key is not None:  # a resized storage (the gathered buffer): a new allocation each time
            self._keyed[key] = storage._cdata
            buf = self._new(storage, stream, kind)
            fqns = [slot.fqn for slot in getattr(getattr(key, "layout", None), "slots", ())]
            buf.label = f"{kind} flat parameter [{fqns[0]}, ...]" if fqns else None
        else:
            buf = self._buffer(storage, stream, kind)
            self._tally(buf, -1)
            buf.kind = kind
            self._tally(buf, +1)
            self._count(kind)
        self.log.append(("alloc", stream.name, kind))
        return buf

    def free(self, key: Any) -> None:
        storage_key = self._keyed.pop(key, None)
        if storage_key in self._buffers:
            self._free(storage_key)

    def record_stream(self, tensor: torch.Tensor, stream: SimStream) -> None:
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:  # resized to 0 already: the block went back to its pool, nothing to keep
            self.log.append(("record_stream of an empty storage", stream.name, None))
            return
        buf = self._buffers.get(storage._cdata)
        if buf is not None:
            buf.recorded.add(stream)

    def move(self, tensor: torch.Tensor) -> torch.Tensor:
        self.moved_inputs.append(tensor)
        return tensor

    # ------------------------------------------------------------------ placement (host memory)
    def place(self, tensor: torch.Tensor, placement: str, pinned: bool = False) -> None:
        """Declare ``tensor``'s storage as living in ``placement`` ("host" or "device").

        A tensor a device stream wrote and now declared host memory was copied there by a blocking copy
        (``.to("cpu")``, which the simulated device cannot tell from a device op): the host waits for it."""
        if placement not in ("host", "device"):
            raise ValueError(f"sim_cuda: placement must be 'host' or 'device', got {placement!r}")
        storage = tensor.untyped_storage()
        stream = self.host if placement == "host" else self.current_stream()
        if storage._cdata in self._buffers:
            buf = self._buffers[storage._cdata]
        else:  # not seen yet: counted in the right memory from the start (peak_bytes)
            buf = self._new(storage, stream, "tensor", placement)
        if placement == "host" and buf.placement == "device" and buf.write is not None:
            self._host_waits_for(buf.write[0])
        self._tally(buf, -1)
        buf.placement, buf.pinned = placement, pinned and placement == "host"
        self._tally(buf, +1)

    def device_storages(self) -> List[_Buffer]:
        """Buffers alive on the simulated device (referenced, or held back by ``record_stream``)."""
        self._count("tensor")
        return [b for b in list(self._buffers.values()) + self._dead if b.placement == "device"]

    def assert_on_host(self, tensors: Dict[str, torch.Tensor]) -> None:
        """Raise naming every tensor of ``tensors`` (name -> tensor) that lives on the simulated device."""
        on_device = [name for name, t in tensors.items()
                     if (b := self._placement(t)) is None or b.placement != "host"]
        if on_device:
            raise AssertionError(f"sim_cuda: persistent state on the device: {on_device}")


def _is_cuda(device: Any) -> bool:
    if isinstance(device, int):  # torch reads a bare index as a CUDA device
        return True
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda"


_DEVICE, _IS_CUDA = torch.Tensor.device, torch.Tensor.is_cuda  # (getters: ``func.__self__`` is the descriptor)


class _Crossings(TorchFunctionMode):
    """Calls that cross between host and device memory, which CPU tensors alone cannot show: ``.to()``,
    ``.cpu()``, ``.cuda()`` (:meth:`SimulatedCuda.convert`), factories on the simulated device (``device="cuda"``:
    a CPU tensor allocated on the current stream), host reads outside an op (``tolist``, ``numpy``)."""

    def __init__(self, sim: SimulatedCuda) -> None:
        super().__init__()
        self.sim = sim

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = getattr(func, "__self__", None)
        if owner is _DEVICE or owner is _IS_CUDA:  # a tensor in the simulated device's memory says so
            on_device = self.sim.on_device(args[0])
            if owner is _IS_CUDA:
                return on_device
            return torch.device("cuda", self.sim.device_index) if on_device else func(*args, **kwargs)
        if func is torch.Tensor.to:
            if len(args) > 1 and isinstance(args[1], torch.Tensor):  # to(other): other's memory and dtype
                other = args[1]
                device, dtype = ("cuda" if self.sim.on_device(other) else "cpu"), other.dtype
                non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            else:
                device, dtype, non_blocking, _ = torch._C._nn._parse_to(
                    *args[1:], **{k: v for k, v in kwargs.items() if k != "copy"})
            return self.sim.convert(args[0], device, dtype, non_blocking, kwargs.get("copy", False))
        if func is torch.Tensor.cpu:
            return self.sim.convert(args[0], "cpu", None, False, False)
        if func is torch.Tensor.cuda:
            return self.sim.convert(args[0], "cuda", None, bool(kwargs.get("non_blocking", False)), False)
        if func in (torch.Tensor.tolist, torch.Tensor.numpy):
            self.sim.host_read(args[0], f"{func.__name__}()")
        elif _is_cuda(kwargs.get("device")):
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


# the simulated device's memory, for code that asks torch.cuda (generation's budget)
SIMULATED_DEVICE_BYTES = 80 * 2**30


class _HostReaders:
    """While a simulation runs: ``torch.save`` and safetensors' serialisation read their tensors on the host
    (:meth:`SimulatedCuda.host_read`); ``torch.cuda.mem_get_info`` answers for the simulated device."""

    def __init__(self, sim: SimulatedCuda) -> None:
        import safetensors.torch

        if not hasattr(safetensors.torch, "_to_ndarray"):
            raise RuntimeError("sim_cuda: safetensors.torch._to_ndarray (where save_file reads a tensor) is gone "
                               "in this safetensors version: update sim_cuda._HostReaders")
        self.saved = [(torch, "save", torch.save), (torch.serialization, "save", torch.serialization.save),
                      (safetensors.torch, "_to_ndarray", safetensors.torch._to_ndarray),
                      (torch.cuda, "mem_get_info", torch.cuda.mem_get_info)]
        save, to_ndarray = torch.save, safetensors.torch._to_ndarray

        def saving(obj, *args, **kwargs):
            for t in _all_tensors(obj):
                sim.host_read(t, "torch.save")
            return save(obj, *args, **kwargs)

        def serialising(tensor):
            sim.host_read(tensor, "safetensors")
            return to_ndarray(tensor)

        def mem_get_info(device=None):
            return SIMULATED_DEVICE_BYTES - sim._live_bytes["device"], SIMULATED_DEVICE_BYTES

        for (module, name, _), fn in zip(self.saved, (saving, saving, serialising, mem_get_info)):
            setattr(module, name, fn)

    def close(self) -> None:
        for module, name, original in self.saved:
            setattr(module, name, original)


def _all_tensors(obj: Any) -> List[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _all_tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _all_tensors(v)]
    return []


class SimCudaStreams(CudaStreams):
    """The production CUDA adapter with the simulated ``torch.cuda``; lifetime notes go to the simulator."""

    def __init__(self, device: torch.device, sim: SimulatedCuda) -> None:
        super().__init__(device, api=sim)
        self.sim = sim

    def side_stream(self, role: str) -> Any:
        stream = super().side_stream(role)
        if not stream.name.startswith(role):
            stream.name = f"{role}:{stream.name}"  # violations name the stream by its role
        return stream

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        self.sim.record_stream(tensor, stream)

    def move_inputs(self, args: Any, kwargs: Any) -> Any:
        # the simulated device's tensors are CPU tensors: inputs are recorded as moved, not copied
        return map_tensors(self.sim.move, (args, kwargs))

    # CPU offload: pinned host buffers and the copies between host and device (tensors stay CPU tensors)
    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with _disable_current_modes():  # allocated by the host, not an op of a stream
            tensor = torch.empty(numel, dtype=dtype)
        self.sim.place(tensor, "host", pinned=True)
        return tensor

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        # a fresh device buffer on the current stream, written there by the copy (which reads the host)
        out = torch.empty(host.shape, dtype=host.dtype)
        out.copy_(host, non_blocking=True)
        return out

    def to_host(self, src: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(src, non_blocking=True)

    # the gathered buffers (grown and resized to 0, not made by ops) and the full gradients are named for the simulator
    def alloc_gathered(self, flat: Any) -> torch.Tensor:
        out = super().alloc_gathered(flat)
        self.sim.alloc(out, "unsharded", flat)
        return out

    def release(self, flat: Any) -> None:
        super().release(flat)
        self.sim.free(flat)

    def reduction_input(self, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        full = super().reduction_input(grad, dtype)
        self.sim.alloc(full, "full_grad", None)
        return full

    def scratch(self, numel: int, dtype: torch.dtype, kind: str) -> torch.Tensor:
        out = torch.empty(numel, dtype=dtype)  # (the simulated device's tensors are CPU tensors)
        self.sim.alloc(out, kind, None)
        return out

    def secondary_copy(self, part: torch.Tensor) -> torch.Tensor:
        copy = super().secondary_copy(part)
        self.sim.alloc(copy, "secondary", None)
        return copy


def sim_adapter(sim: SimulatedCuda) -> SimCudaStreams:
    """An adapter for ``Engine(streams=...)`` on the simulated ``cuda:<sim.device_index>``."""
    return SimCudaStreams(torch.device("cuda", sim.device_index), sim)


def simulate_cuda(model: Any, device_index: int = 0, current_device: int = 0, group: Any = None,
                  sim: Optional[SimulatedCuda] = None) -> SimulatedCuda:
    """Make a wrapped model's engine run the CUDA code path on the simulator (before its first step): the simulated
    adapter is attached to the model's own engine (``Engine.attach``), which keeps every setting.

    ``group``: a stand-in for the engine's shard group (e.g. ``test_sim_paths.IdenticalReplicas``: hybrid
    sharding in one process); ``sim``: a simulator that runs another model already (each model has its own streams, as
    on a GPU).  Run the model inside ``with sim:`` so that its ops are observed."""
    sim = sim or SimulatedCuda(device_index, current_device)
    engine = model.schedule.engine
    adapter = sim_adapter(sim)
    # the engine's device is the simulated one (what a GPU run has): what it makes there (the norm of
    # clip_grad_norm_) and copies to the host are crossings the simulator sees (_Crossings)
    engine.device = adapter.device
    engine.attach(adapter, group)
    if engine.offload is not None:
        # CPU offload: the host buffers made at wrap time are the simulated host's pinned memory
        for host in engine.offload.host_buffers:  # only what offload.py allocated as host memory
            sim.place(host, "host", pinned=True)
    for unit in model.schedule.units:
        for flat in unit.flat_params:  # made on the host before the simulation; on a GPU: the device's
            flat.device = adapter.device
    sim.watch(model)
    return sim
