"""The schedule's mechanics: when collectives start, on which stream, what waits for them, when buffers die.

One engine serves every unit of a wrapped model; the units' state machine (``unit.py``) decides *which* unit to
gather or reduce and when.  It is written once against a device adapter: :class:`CudaStreams` (NCCL),
:class:`HostAdapter` (gloo, CPU) or the tests' simulator (``tests/sim_cuda.py`` subclasses :class:`CudaStreams`
with a fake ``torch.cuda``, so it runs exactly this code); docs/ARCHITECTURE.md section 5 says how they differ
and what the bookkeeping (gathers in flight, free events, pending reductions) guarantees.  Besides:

* Gradients are divided by ``f`` before the sum and by ``W / f`` after (FSDP1's pre/post divide), so W
  loss-scaled fp16 gradients do not overflow in the sum.
* Hybrid sharding: the replica all-reduce runs on its own stream, chained to the reduce-scatter's event, so it
  does not serialise the next unit's reduce-scatter (CUDA); on gloo it starts once the reduce-scatter is done.
* CPU offload: ``offload.py``'s copies; a reduced shard's device copy is dropped once its copy to the host is
  issued (same-stream reuse is ordered).
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional

import torch

from ._compat import map_tensors
from .comm import ShardGroup
from .flat_param import FlatParameter
from .offload import HostOffload
from .profiler import span


# The adapter of engines made meanwhile (default: the device's); the memory planner's records memory (plan/run.py)
ADAPTER: contextvars.ContextVar = contextvars.ContextVar("flatshard_adapter", default=None)

# FSDP2's side-stream priority: communication kernels go ahead of queued compute kernels (lower = higher)
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


class HostAdapter:
    """CPU / gloo: no streams; collectives are asynchronous work handles that block on ``wait()``.  Also the
    base of :class:`CudaStreams`: moves between host and device, non-blocking (from pinned memory) on CUDA."""

    stream_ordered = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def _nothing(self, *args: Any, **kwargs: Any) -> None:
        return None

    # no streams or events (None): the host waits on work handles; note_alloc / note_free serve the tests' simulator
    compute_stream = side_stream = record = _nothing
    wait_stream = wait_event = synchronize = record_stream = note_alloc = note_free = _nothing

    def on(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def collective(self, stream: Any, issue: Callable[[bool], Any], keep: Optional[torch.Tensor] = None) -> Any:
        """Run ``issue(async_op=True)``; the handle blocks the host until the work finished."""
        return _WorkWait(issue(True), keep)

    def move_inputs(self, args: Any, kwargs: Any) -> Any:
        """Inputs on another device are moved to the model's (as torch FSDP does at the root)."""
        move = lambda t: t if t.device == self.device else t.to(self.device, non_blocking=self.stream_ordered)
        return map_tensors(move, (args, kwargs))

    # CPU offload (offload.py): on CUDA host buffers are pinned, so that both copies run asynchronously to the host
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
        # of spinning a core for the whole wait (README, "CUDA events")
        event = self.api.Event(blocking=True)
        event.record(stream)
        return event

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def collective(self, stream: Any, issue: Callable[[bool], Any], keep: Optional[torch.Tensor] = None) -> Any:
        """Run ``issue(async_op=False)`` on ``stream`` (asynchronous to the host); ``keep`` was allocated on
        ``stream`` and may be dropped at once (same-stream reuse is ordered)."""
        with self.on(stream):
            issue(False)
            return _EventWait(self, self.record(stream))


@dataclass
class _PendingReduce:
    flat: FlatParameter
    reduced: Any  # completion of the reduce-scatter (event wait or work handle)
    full_grad: Optional[torch.Tensor]  # kept alive until its reduction is complete
    shard_out: torch.Tensor
    label: str
    replicas: Any = None  # completion of the replica all-reduce (hybrid sharding)
    host_grad: Optional[torch.Tensor] = None  # offload: the host buffer the reduced shard is copied into
    copied: Any = None  # offload on CUDA: event behind the device -> host copy


def gradient_predivide_factor(world_size: int) -> int:
    """torch FSDP1's split of the 1/W average: divide by this before the sum, by W / it after."""
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return factor


class Engine:
    """Issues and completes the all-gathers and reduce-scatters of one wrapped model."""

    def __init__(self, group: ShardGroup, device: torch.device, reduce_dtype: Optional[torch.dtype] = None,
                 max_inflight_all_gathers: int = 2, max_pending_reductions: int = 2, streams: Any = None,
                 offload: bool = False) -> None:
        self.group, self.device = group, device
        if streams is None:  # (the tests pass a simulated adapter; the memory planner sets ADAPTER)
            streams = (ADAPTER.get() or (CudaStreams if device.type == "cuda" else HostAdapter))(device)
        self.streams = streams
        self.use_streams = self.streams.stream_ordered
        self.reduce_dtype = reduce_dtype
        self.max_inflight = max(1, max_inflight_all_gathers)
        # Completing older reductions during backward frees their full gradients early (CPU, llama-40M: step
        # peak 458 -> 356 MiB, fewer page faults; CUDA: N full gradients at the peak instead of DDP's all).
        self.max_pending_reductions = max(1, max_pending_reductions)
        self.predivide = float(gradient_predivide_factor(group.world_size))
        self.postdivide = group.world_size / self.predivide
        self.all_gather_stream = self.streams.side_stream("all_gather")
        self.reduce_scatter_stream = self.streams.side_stream("reduce_scatter")
        self.replica_stream = self.streams.side_stream("replica_all_reduce") if group.is_hybrid else None
        self._gathers: Dict[FlatParameter, tuple] = {}  # in flight, oldest first: (handle, label)
        self._free_events: Deque[Any] = collections.deque()
        self._reduces: Deque[_PendingReduce] = collections.deque()  # full gradient still alive
        self._reduced: List[_PendingReduce] = []  # full gradient dropped, result not yet accumulated
        self._shards_written = False  # drained for a shard write: the next gather waits for the compute stream
        self.offload: Optional[HostOffload] = HostOffload(self.streams) if offload else None

    def begin_step(self) -> None:
        """Called at the root's pre-forward: gathers must see the optimizer's latest update."""
        self.streams.wait_stream(self.all_gather_stream, self.streams.compute_stream())
        self._shards_written = False

    def unshard(self, flat: FlatParameter, label: str = "") -> None:
        """Start gathering ``flat`` (sharded: its unit's state says so)."""
        if self._shards_written:  # e.g. load_state_dict between forward and backward wrote on the compute stream
            self.begin_step()
        while len(self._gathers) >= self.max_inflight:
            self.wait_unshard(next(iter(self._gathers)))  # the oldest
        self._wait_for_freed_buffers()
        s = self.streams
        with span("all_gather", label):
            with s.on(self.all_gather_stream):
                out = flat.alloc_unsharded()
                s.note_alloc(out, "unsharded", flat)
                source = s.to_device(flat.local_shard) if self.offload else flat.local_shard  # offload: host shard
                shard = source.to(flat.compute_dtype)
                del source
            handle = s.collective(self.all_gather_stream,
                                  lambda async_op: self.group.all_gather(out, shard, async_op=async_op), keep=shard)
        self._gathers[flat] = (handle, label)  # (in issue order)

    def _wait_for_freed_buffers(self) -> None:
        """CUDA: block the host until the compute stream is done with all but the newest freed buffers."""
        while len(self._free_events) >= self.max_inflight:
            with span("all_gather_rate_limit"):
                self.streams.synchronize(self._free_events.popleft())

    def wait_unshard(self, flat: FlatParameter) -> None:
        """Block (gloo) or make the compute stream wait (CUDA) until ``flat`` is gathered, unless waited for already."""
        entry = self._gathers.pop(flat, None)
        if entry is None:
            return
        handle, label = entry  # (the label it was issued under)
        with span("wait_all_gather", label):
            _wait(handle, f"all-gather of unit {label or '?'}", self.group)

    def reshard(self, flat: FlatParameter) -> None:
        """Free the unsharded buffer (gathered and waited for) once every reader is done with it."""
        s = self.streams
        compute = s.compute_stream()
        # allocated on the all-gather stream, read on the compute stream: not reusable before those reads
        s.record_stream(flat.unsharded, compute)
        flat.free_unsharded()
        s.note_free(flat)
        event = s.record(compute)
        if event is not None:
            self._free_events.append(event)

    def reduce_grad(self, flat: FlatParameter, full_grad: torch.Tensor, label: str = "") -> None:
        """Start reducing a full flat gradient to this rank's shard (averaged over all ranks)."""
        s = self.streams
        label = label or "?"
        while len(self._reduces) >= self.max_pending_reductions:
            self._complete_reduction(self._reduces.popleft())
        dtype = self.reduce_dtype or full_grad.dtype
        with span("reduce_scatter", label):
            # on the compute stream, where the gradient was produced: it can be dropped once the compute
            # stream waited for the reduction, without record_stream
            full = full_grad.to(dtype)
            del full_grad
            if self.predivide != 1:
                full.div_(self.predivide)
            s.note_alloc(full, "full_grad")
            s.wait_stream(self.reduce_scatter_stream, s.compute_stream())
            with s.on(self.reduce_scatter_stream):
                shard_out = torch.empty(flat.layout.shard_numel, dtype=dtype, device=full.device)

            def issue(async_op: bool, shard_out: torch.Tensor = shard_out, full: torch.Tensor = full) -> Any:
                work = self.group.reduce_scatter(shard_out, full, async_op=async_op)
                if not async_op:
                    self.group.take_reduced_shard(shard_out, full)
                return work

            handle = s.collective(self.reduce_scatter_stream, issue)
        pending = _PendingReduce(flat, handle, full, shard_out, label)
        del full, shard_out
        if self.use_streams:
            self._start_replica_reduce(pending)
            if self.offload is not None:
                self._copy_grad_to_host(pending)
        self._reduces.append(pending)

    def _copy_grad_to_host(self, r: _PendingReduce) -> None:
        """Offload: post-divide the reduced shard, cast it to the shard's dtype and copy it to its host
        buffer, on the stream that wrote it last (CUDA) or on the host once it is complete (gloo)."""
        s = self.streams
        stream = self.replica_stream if r.replicas is not None else self.reduce_scatter_stream
        with s.on(stream):
            shard = r.shard_out
            if self.postdivide != 1:
                shard.mul_(1.0 / self.postdivide)
            shard = shard.to(r.flat.dtype)
            r.host_grad = self.offload.grad_target(r.flat)
            s.to_host(shard, r.host_grad)
            if stream is not self.reduce_scatter_stream:
                # allocated on the reduce-scatter stream, last read on the replica stream
                s.record_stream(r.shard_out, stream)
            del shard
            r.copied = s.record(stream)
        r.shard_out = None  # the device copy is dropped now: device memory holds no gradient shard

    def _start_replica_reduce(self, r: _PendingReduce) -> None:
        """Hybrid sharding: sum the reduced shard over the replicas (own stream on CUDA)."""
        if not self.group.is_hybrid:
            return
        s = self.streams
        if self.use_streams:
            s.wait_event(self.replica_stream, r.reduced.event)
        r.replicas = s.collective(
            self.replica_stream, lambda async_op: self.group.all_reduce_replicas(r.shard_out, async_op=async_op)
        )

    def _complete_reduction(self, r: _PendingReduce) -> None:
        """The reduce-scatter of ``r`` is waited for; its full gradient is dropped."""
        with span("wait_reduce_scatter", r.label):
            _wait(r.reduced, f"gradient reduction of unit {r.label}", self.group)
            if not self.use_streams:
                self.group.take_reduced_shard(r.shard_out, r.full_grad)
        r.full_grad = None
        if not self.use_streams:
            self._start_replica_reduce(r)
        self._reduced.append(r)

    def finish_reduces(self) -> None:
        """Wait for every pending reduction and add the results to the sharded gradients."""
        while self._reduces:
            self._complete_reduction(self._reduces.popleft())
        done, self._reduced = self._reduced, []
        if not done:
            return
        compute = self.streams.compute_stream()
        scale = 1.0 / self.postdivide
        if any(r.replicas is not None for r in done):
            with span("wait_replica_all_reduce"):
                for r in done:
                    if r.replicas is not None:
                        _wait(r.replicas, f"replica all-reduce of unit {r.label}", self.group)
        if self.offload is not None:
            self._accumulate_host_grads(done)
            return
        for r in done:
            # allocated on the reduce-scatter stream, kept as the sharded gradient used on the compute stream
            self.streams.record_stream(r.shard_out, compute)
            if scale != 1.0:
                r.shard_out.mul_(scale)
            r.flat.accumulate_sharded_grad(r.shard_out)

    def _accumulate_host_grads(self, done: List[_PendingReduce]) -> None:
        """Offload: wait for every device -> host copy, then hand the host buffers to the parameters."""
        s = self.streams
        # counted as reduction wait (exposed communication) in the profiler's phase table
        with span("wait_offload_copy"):
            for r in done:
                if not self.use_streams:
                    self._copy_grad_to_host(r)
                elif r.copied is not None:
                    s.synchronize(r.copied)
        for r in done:
            r.flat.accumulate_sharded_grad(r.host_grad)
        self.offload.targets_consumed()

    def drain_discarding_reductions(self) -> None:
        """Wait for outstanding reductions without using their results (after an aborted backward).  The
        reshards that follow wait for gathers in flight; an offload copy into a host buffer may still run:
        the next copy into it is on the same stream, and the host reads it after the next backward's."""
        pending, self._reduces = list(self._reduces), collections.deque()
        done, self._reduced = self._reduced, []
        if self.offload is not None:
            self.offload.targets_consumed()
        for r in pending:
            _wait(r.reduced, f"gradient reduction of unit {r.label}", self.group)
        for r in pending + done:  # (on CUDA the replica all-reduce of a pending one is issued too)
            if r.replicas is not None:
                _wait(r.replicas, f"replica all-reduce of unit {r.label}", self.group)
                if r.shard_out is not None:  # allocated on the reduce-scatter stream, written on the replica's
                    self.streams.record_stream(r.shard_out, self.streams.compute_stream())

    def drain(self) -> None:
        """Finish the gathers in flight before code outside the step reads or writes the shards."""
        for flat in list(self._gathers):
            self.wait_unshard(flat)
        if self.offload is not None:
            self.offload.wait_for_host_to_device_copies()
        self._shards_written = True


def _wait(handle, what: str, group: ShardGroup) -> None:
    """Wait for a collective; if it fails (a peer died, the timeout expired) say which one it was."""
    try:
        handle.wait()
    except Exception as exc:  # noqa: BLE001 - re-raised with context
        raise RuntimeError(
            f"accel_flatshard: {what} failed on rank {group.world_rank} of {group.world_size} "
            f"(shard group size {group.shard_size}). A peer rank probably died or stopped participating, "
            f"or the process-group timeout expired. Original error: {exc}"
        ) from exc
