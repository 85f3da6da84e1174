"""The schedule's mechanics: when collectives start, on which stream, what waits for them, when buffers die.

One engine serves every unit of a wrapped model; the units' state machine (``unit.py``) decides *which* unit to
gather or reduce and when.  It is written once against the device adapter (``device.py``): every stream, event,
wait and buffer lifetime is an adapter call, so the same lines run CUDA (:class:`~.device.CudaStreams`), gloo/CPU
(:class:`~.device.HostAdapter`), the planner's recording adapters and the tests' simulator; docs/architecture-details.md
section 5 says how they differ and what the bookkeeping (gathers in flight, pending reductions) guarantees.  Besides:

* Gradients are divided by ``f`` before the sum and by ``W / f`` after (FSDP1's pre/post divide), so W
  loss-scaled fp16 gradients do not overflow in the sum; without float16 and with W a power of two, by W after the
  sum alone (bitwise the same: each factor is an exact scaling; one pass over a shard, not over every full gradient).
* Hybrid sharding: the replica all-reduce follows the reduce-scatter (``adapter.after``): on CUDA it is issued at
  once on its own stream behind the reduce-scatter's event, so it does not serialise the next unit's
  reduce-scatter; on gloo it is issued once the reduce-scatter is done.  hpZ's reduction is issued the same way:
  its first stage (inside the machine) as the reduce-scatter, its second (across machines) as the replica stage, so
  that the slow one runs behind the next units' backward instead of blocking it.
* Deferred reductions (``defer_cross_machine_reduce``, FSDP2's ``set_requires_all_reduce(False)``): a micro-batch
  reduces only inside the shard group (hybrid) or the machine (hpZ's first stage); the partial sums are carried
  (``_carried``, a shard, or 1/N of the gradient with hpZ) and added in before the syncing micro-batch's one
  crossing (the replica all-reduce, hpZ's second stage).  Sums are linear: pre/post divide apply as before.
* CPU offload: the reduced shard's copy to its host buffer (``offload.py``) follows the reduction the same way; a
  reduced shard's device copy is dropped once that copy is issued (same-stream reuse is ordered).
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import torch

from .comm import Collectives
from .device import ADAPTER, CudaStreams, HostAdapter
from .flat_param import FlatParameter
from .handles import Handle, followed_by, issued, start, wait_for
from .int8 import quantize_blocks
from .offload import HostOffload
from .options import FlatShardOptions
from .spans import span

# Completing older reductions during backward frees their full gradients early (CPU, llama-40M: step peak 458 ->
# 356 MiB, fewer page faults; CUDA: this many full gradients at the peak instead of DDP's all).
MAX_PENDING_REDUCTIONS = 2


@dataclass
class _PendingReduce:
    """One unit's reduction in flight: its buffers, and the completions of its steps (each a handle)."""

    flat: FlatParameter
    reduced: Handle  # completion of the reduce-scatter
    full_grad: Optional[torch.Tensor]  # kept alive until its reduction is complete
    shard_out: Optional[torch.Tensor]  # the reduced shard (None once offload copied it to the host)
    label: str
    replicas: Optional[Handle] = None  # completion of the replica all-reduce (hybrid sharding)
    host_grad: Optional[torch.Tensor] = None  # offload: the host buffer the reduced shard is copied into
    copied: Optional[Handle] = None  # offload: completion of the copy into ``host_grad``
    postdivide: float = 1.0  # what the reduced shard is still to be divided by (Engine._divisors)
    deferred: bool = False  # a partial sum (inside the shard group / machine), carried to the syncing micro-batch


def gradient_predivide_factor(world_size: int) -> int:
    """torch FSDP1's split of the 1/W average: divide by this before the sum, by W / it after."""
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return factor


class Engine:
    """Issues and completes the all-gathers and reduce-scatters of one wrapped model (its ``options``:
    ``limit_all_gathers``, ``offload_params``, ``mixed_precision``)."""

    def __init__(self, group: Collectives, device: torch.device, options: FlatShardOptions,
                 streams: Optional[HostAdapter] = None) -> None:
        self.device = device
        # the settings it reads, taken now (the model's options object is the wrapper's alone)
        self.limit_all_gathers, self.mixed_precision = options.limit_all_gathers, options.mixed_precision
        self.quantized_all_gather, self.quantized_reduce = options.quantized_all_gather, options.quantized_reduce
        self.quant_block = options.quant_block
        mp = options.mixed_precision
        self.reduce_dtype = mp.effective_reduce_dtype if mp else None
        self._gathers: Dict[Tuple[FlatParameter, ...], Tuple[Any, str]] = {}  # in flight, oldest first
        self._reduces: Deque[_PendingReduce] = collections.deque()  # full gradient still alive
        self._reduced: List[_PendingReduce] = []  # full gradient dropped, result not yet accumulated
        # flat parameter -> the sum of its deferred partial reductions since the last crossing (not divided yet)
        self._carried: Dict[FlatParameter, torch.Tensor] = {}
        self._shards_written = False  # drained for a shard write: the next gather waits for the compute stream
        self.phase = "forward"  # the schedule's pass ("forward" / "backward"): labels the all-gathers' bytes
        self.offload: Optional[HostOffload] = None
        # (the planner sets ADAPTER; the tests' simulator attaches its own before the first step)
        self.attach(streams or (ADAPTER.get() or (CudaStreams if device.type == "cuda" else HostAdapter))(device),
                    group)
        if options.offload_params:
            self.offload = HostOffload(self.streams)

    def attach(self, streams: HostAdapter, group: Optional[Collectives] = None) -> None:
        """Run on ``streams`` (and ``group``, a test's stand-in for one) from now on: at construction, or before the
        first step (the tests' CUDA simulator)."""
        if self._gathers or self._reduces or self._reduced:
            raise RuntimeError("an engine's adapter can change only while no collective is in flight")
        self.streams, self.group = streams, group or self.group
        self.predivide = float(gradient_predivide_factor(self.group.world_size))
        self.postdivide = self.group.world_size / self.predivide
        self.all_gather_stream = streams.side_stream("all_gather")
        self.reduce_scatter_stream = streams.side_stream("reduce_scatter")
        # the reduction's stage across machines: hybrid's replica all-reduce, hpZ's second stage
        self.replica_stream = streams.side_stream("replica_all_reduce") if self.can_defer_cross_machine else None
        if self.offload is not None:
            self.offload.streams = streams

    def _divisors(self, dtype: torch.dtype) -> Tuple[float, float]:
        """(before the sum, after it) for a reduction in ``dtype``: FSDP1's split for float16 (so that W loss-scaled
        gradients do not overflow in the sum) or W not a power of two; else all of it after the sum, bitwise the
        same (each factor is an exact scaling) in one pass over a shard instead of one over the full gradient."""
        W = self.group.world_size
        if dtype == torch.float16 or W & (W - 1):
            return self.predivide, self.postdivide
        return 1.0, float(W)

    def begin_step(self) -> None:
        """Called at the root's pre-forward: gathers must see the optimizer's latest update."""
        self.streams.wait_stream(self.all_gather_stream, self.streams.compute_stream())
        self._shards_written = False

    # ------------------------------------------------------------------ all-gather
    def unshard(self, flats: Sequence[FlatParameter], label: str = "", secondary: Any = None,
                codes: Optional[List[Tuple[torch.Tensor, torch.Tensor]]] = None
                ) -> Optional[List[Tuple[torch.Tensor, torch.Tensor]]]:
        """Start gathering a unit's flat parameters (sharded: its state says so); from its ``secondary`` slices
        inside the machine when it holds them (:meth:`keep_secondary`).  int8 (qwZ): returns the codes it sent (this
        rank's shards quantized: ``(int8, scales)`` a flat parameter), and sends ``codes`` when given instead of
        quantizing again: the unit's forward gather's, for its backward's (``unit.py``: the unit drops them whenever
        the shards may have changed)."""
        if not flats:  # (a unit that owns no parameter: a module whose parameters all belong to inner units)
            return None
        if self._shards_written:  # e.g. load_state_dict between forward and backward wrote on the compute stream
            self.begin_step()
        while len(self._gathers) >= self.limit_all_gathers:
            self.wait_unshard(next(iter(self._gathers)))  # the oldest
        s = self.streams
        s.wait_for_freed(self.limit_all_gathers)
        outs, kind, in_node = [f.gather_target for f in flats], f"{self.phase} gather", secondary is not None
        quantized = self.quantized_all_gather and not in_node  # int8 of the master shards, one collective
        what = f"unit {label} weights"
        with span("all_gather", label):
            with s.on(self.all_gather_stream):
                for flat in flats:
                    if flat.storage_owner is flat:  # (packed: the unit's one gathered storage, grown once)
                        s.alloc_gathered(flat)
                if not in_node:  # offload: the shard is host memory, copied to the device; the cast is sent
                    def master(f: FlatParameter) -> torch.Tensor:
                        return s.to_device(f.local_shard) if self.offload else f.local_shard

                    if quantized and codes is None:  # (a non-finite value travels as a nan scale: comm.py)
                        codes = [quantize_blocks(master(f), self.quant_block, what, propagate_non_finite=True)
                                 for f in flats]
                    # (else each copy is dropped once cast)
                    shards = None if quantized else [master(f).to(f.compute_dtype) for f in flats]
            if in_node:
                shards, ready = secondary
                s.wait_event(self.all_gather_stream, ready)  # (copied on the compute stream after the forward)
            if quantized:
                handle = s.collective(self.all_gather_stream, lambda async_op: self.group.all_gather_quantized(
                    outs, codes, self.quant_block, what, async_op=async_op, kind=kind), keep=codes)
                self._gathers[tuple(flats)] = ([handle], label)
                return codes
            # one collective for the unit when its flat parameters share one storage (pack_gathered), else one each
            batches = [(outs, shards)] if flats[0].storage_owner is flats[-1].storage_owner else zip(
                [[o] for o in outs], [[t] for t in shards])
            handles = [s.collective(self.all_gather_stream, lambda async_op, o=o, t=t: self.group.all_gather(
                o, t, async_op=async_op, kind=kind, in_node=in_node), keep=t) for o, t in batches]
        self._gathers[tuple(flats)] = (handles, label)  # (in issue order)
        return None

    @property
    def reuses_forward_codes(self) -> bool:
        """Whether a unit keeps its forward gather's int8 codes for its backward gather (qwZ, unless hpZ's backward
        gather inside the machine, which sends exact slices, replaces that gather)."""
        return self.quantized_all_gather and not self.node_local

    def wait_unshard(self, flats: Sequence[FlatParameter]) -> None:
        """Block (gloo) or make the compute stream wait (CUDA) until ``flats`` are gathered (unless waited for)."""
        entry = self._gathers.pop(tuple(flats), None)
        if entry is None:
            return
        handles, label = entry  # (the label it was issued under)
        with span("wait_all_gather", label):
            for handle in handles:
                wait_for(handle, f"all-gather of unit {label or '?'}", self.group)

    @property
    def node_local(self) -> bool:
        """Whether units keep secondary slices for a backward gather inside the machine (hpZ: the shard group spans
        machines and ``node_local_backward_gather`` is on)."""
        return getattr(self.group, "node", None) is not None

    def keep_secondary(self, flats: Sequence[FlatParameter]) -> Any:
        """hpZ: this rank's 1/N slice of each gathered flat parameter (N: its node group's size, ranks_per_node),
        copied on the compute stream once the unit's forward has read it; a later gather of the unit reads these
        slices inside the machine instead of every shard group member's shard (:meth:`unshard`)."""
        s, node = self.streams, self.group.node
        with span("keep_secondary"):
            parts = [s.secondary_copy(f.unsharded.detach().chunk(node.size)[node.rank]) for f in flats]
        return parts, s.record(s.compute_stream())

    def reshard(self, flats: Sequence[FlatParameter]) -> None:
        """Free the gathered buffers (gathered and waited for) once every reader is done with them."""
        for flat in flats:
            if flat.storage_owner is flat:
                self.streams.free_gathered(flat)

    # ------------------------------------------------------------------ reduce-scatter
    @property
    def can_defer_cross_machine(self) -> bool:
        """Whether a reduction has a part to defer: the replica all-reduce (hybrid) or hpZ's stage across machines
        (not with int8 gradients, whose all-to-all has no inside-the-machine stage)."""
        return self.group.is_hybrid or self._reduces_in_two_stages

    @property
    def _reduces_in_two_stages(self) -> bool:
        return bool(getattr(self.group, "reduces_in_two_stages", False)) and not self.quantized_reduce

    def reduce_grad(self, flat: FlatParameter, full_grad: torch.Tensor, label: str = "",
                    deferred: bool = False) -> None:
        """Start reducing a full flat gradient to this rank's shard (averaged over all ranks); ``deferred``: only its
        part inside the shard group / machine, carried to the next reduction that is not (:attr:`_carried`)."""
        s = self.streams
        label = label or "?"
        while len(self._reduces) >= MAX_PENDING_REDUCTIONS:
            self._complete_reduction(self._reduces.popleft())
        dtype = self.reduce_dtype or full_grad.dtype
        with span("reduce_scatter", label):
            # on the compute stream, where the gradient was produced: it can be dropped once the compute
            # stream waited for the reduction, without record_stream
            full = s.reduction_input(full_grad, dtype)
            del full_grad
            predivide, postdivide = self._divisors(dtype)
            if predivide != 1:
                full.div_(predivide)
            s.wait_stream(self.reduce_scatter_stream, s.compute_stream())
            quantized = self.quantized_reduce  # (int8 through an all-to-all, summed in float32)
            two_stages = self._reduces_in_two_stages
            carry = None if deferred else self._carried.pop(flat, None)  # (added once: popped)
            with s.on(self.reduce_scatter_stream):
                # hpZ's first stage: the machine's sums of this rank's column's chunks (column size x a shard);
                # deferred, they are the result (carried), else the second stage's input
                partial = torch.empty(flat.layout.shard_numel * self.group.column.size, dtype=dtype,
                                      device=full.device) if two_stages else None
                shard_out = partial if deferred and two_stages else torch.empty(
                    flat.layout.shard_numel, dtype=torch.float32 if quantized else dtype, device=full.device)
            if carry is not None:
                s.record_stream(carry, self.replica_stream)
            if two_stages:
                handle = s.collective(self.reduce_scatter_stream, lambda async_op, out=partial, full=full:
                                      self.group.reduce_scatter_inside_machine(out, full, async_op=async_op))
            elif quantized:  # (fp16 loss scaling: an overflow arrives as nan, so the grad scaler skips the step)
                fp16 = getattr(self.mixed_precision, "param_dtype", None) == torch.float16
                handle = s.collective(self.reduce_scatter_stream, lambda async_op, out=shard_out, full=full:
                                      self.group.reduce_scatter_quantized(
                                          out, full, self.quant_block, f"unit {label} gradients",
                                          async_op=async_op, propagate_non_finite=fp16))
            else:
                handle = s.collective(self.reduce_scatter_stream, lambda async_op, out=shard_out, full=full:
                                      self.group.reduce_scatter(out, full, async_op=async_op))
        r = _PendingReduce(flat, handle, full, shard_out, label, deferred=deferred, postdivide=postdivide)
        del full, shard_out
        if deferred:
            self._reduces.append(r)  # (finish_reduces carries it: no replica all-reduce, no offload copy)
            return
        if two_stages:
            # hpZ's stage across machines, issued once the first is done (gloo: when it is completed, so that it
            # runs behind the next units' backward instead of blocking it; CUDA: at once, behind its event)
            def across_machines(async_op: bool) -> Any:
                if carry is not None:  # the earlier micro-batches' machine sums: one crossing for the step
                    partial.add_(carry)
                s.record_stream(partial, self.replica_stream)  # allocated on the reduce-scatter stream
                work = self.group.reduce_scatter_across_machines(r.shard_out, partial, async_op=async_op)
                if not self.group.is_hybrid:
                    return work
                # hpZ shard groups of hybrid sharding: the replicas' all-reduce follows (gloo: when waited for)
                return followed_by(work, lambda: self.group.all_reduce_replicas(r.shard_out, async_op=False),
                                   async_op)

            r.replicas = s.after(r.reduced, self.replica_stream, across_machines)
        elif self.group.is_hybrid:
            def all_reduce_replicas(async_op: bool) -> Any:
                if carry is not None:  # the earlier micro-batches' partial sums: one all-reduce for the step
                    r.shard_out.add_(carry)
                return self.group.all_reduce_replicas(r.shard_out, async_op=async_op)

            r.replicas = s.after(r.reduced, self.replica_stream, all_reduce_replicas)
        if self.offload is not None:
            stream = self.replica_stream if r.replicas is not None else self.reduce_scatter_stream
            r.copied = s.after(r.replicas or r.reduced, stream, lambda _: self._copy_grad_to_host(r, stream),
                               to_host=True)
        self._reduces.append(r)

    def _copy_grad_to_host(self, r: _PendingReduce, stream: Any) -> None:
        """Offload: post-divide the reduced shard, cast it to the shard's dtype and copy it to its host buffer, on
        the stream that wrote it last."""
        s = self.streams
        shard = r.shard_out
        if r.postdivide != 1:
            shard.mul_(1.0 / r.postdivide)
        shard = shard.to(r.flat.dtype)
        r.host_grad = self.offload.grad_target(r.flat)
        s.to_host(shard, r.host_grad)
        if stream is not self.reduce_scatter_stream:
            s.record_stream(r.shard_out, stream)  # allocated on the reduce-scatter stream, last read on this one
        del shard
        r.shard_out = None  # the device copy is dropped now: device memory holds no gradient shard

    def _complete_reduction(self, r: _PendingReduce) -> None:
        """The reduce-scatter of ``r`` is waited for; its full gradient is dropped, what follows it is issued."""
        with span("wait_reduce_scatter", r.label):
            wait_for(r.reduced, f"gradient reduction of unit {r.label}", self.group)
        r.full_grad = None
        start(r.replicas)  # (gloo: the replica all-reduce starts now that its input exists)
        self._reduced.append(r)

    def finish_reduces(self) -> None:
        """Wait for every pending reduction and add the results to the sharded gradients (deferred ones: to the
        carried partial sums)."""
        while self._reduces:
            self._complete_reduction(self._reduces.popleft())
        done, self._reduced = self._reduced, []
        for r in (r for r in done if r.deferred):
            self.streams.record_stream(r.shard_out, self.streams.compute_stream())
            carried = self._carried.get(r.flat)
            self._carried[r.flat] = r.shard_out if carried is None else carried.add_(r.shard_out)
        done = [r for r in done if not r.deferred]
        if any(r.replicas is not None for r in done):
            with span("wait_replica_all_reduce"):
                for r in done:
                    if r.replicas is not None:
                        wait_for(r.replicas, f"replica all-reduce of unit {r.label}", self.group)
        if self.offload is not None:
            # counted as reduction wait (exposed communication) in the profiler's phase table
            with span("wait_offload_copy"):
                for r in done:
                    wait_for(r.copied, f"offload copy of unit {r.label}", self.group)
            for r in done:
                r.flat.accumulate_sharded_grad(r.host_grad)
            self.offload.targets_consumed()
            return
        compute = self.streams.compute_stream()
        for r in done:
            # allocated on the reduce-scatter stream, kept as the sharded gradient used on the compute stream
            self.streams.record_stream(r.shard_out, compute)
            if r.postdivide != 1.0:
                r.shard_out.mul_(1.0 / r.postdivide)
            r.flat.accumulate_sharded_grad(r.shard_out)

    def drain_discarding_reductions(self) -> None:
        """Wait for outstanding reductions without using their results (after an aborted backward).  The
        reshards that follow wait for gathers in flight; an offload copy into a host buffer may still run:
        the next copy into it is on the same stream, and the host reads it after the next backward's."""
        pending, self._reduces = list(self._reduces), collections.deque()
        done, self._reduced = self._reduced, []
        if self.offload is not None:
            self.offload.targets_consumed()
        for r in pending:
            wait_for(r.reduced, f"gradient reduction of unit {r.label}", self.group)
        for r in pending + done:  # (on CUDA the replica all-reduce of a pending one is issued too)
            if issued(r.replicas):
                wait_for(r.replicas, f"replica all-reduce of unit {r.label}", self.group)
                if r.shard_out is not None:  # allocated on the reduce-scatter stream, written on the replica's
                    self.streams.record_stream(r.shard_out, self.streams.compute_stream())

    def drain(self) -> None:
        """Finish the gathers in flight before code outside the step reads or writes the shards."""
        for flats in list(self._gathers):
            self.wait_unshard(flats)
        if self.offload is not None:
            self.offload.wait_for_host_to_device_copies()
        self._shards_written = True

