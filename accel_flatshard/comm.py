"""Process groups and collectives: the only module that calls torch.distributed collectives.

A :class:`ShardGroup` holds the shard group (size G) and, for hybrid sharding, the replica group (the ranks
holding the same shard, size W/G), and runs the engine's collectives with the torch and backend at hand.
:class:`Collectives` is what the engine asks of it: the interface the tests' stand-ins for a group implement too.
"""
from __future__ import annotations

import contextlib
import datetime
import weakref
from typing import Any, Callable, List, Optional, Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist

from .options import FlatShardOptions


class _Works:
    """Several work handles (and an optional completion step) as one; none: work that already finished."""

    def __init__(self, works=(), then=None) -> None:
        self.works, self.then = list(works), then

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        self.works = []
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return True


DONE = _Works()  # a synchronous call, or world size 1


@runtime_checkable
class Collectives(Protocol):
    """What the engine needs of a shard group (:class:`ShardGroup`; the tests' single-process stand-ins, which
    ``tests/test_engine.py`` checks against this): sizes, ranks, and the three collectives of a step, each returning
    a handle with ``wait()``."""

    world_size: int
    world_rank: int
    shard_size: int
    is_hybrid: bool

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = True) -> Any:
        """Every rank's ``shard`` into ``output``, in rank order."""

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, async_op: bool = True) -> Any:
        """The sum of every rank's ``full``, this rank's part into ``output``."""

    def all_reduce_replicas(self, tensor: torch.Tensor, async_op: bool = True) -> Any:
        """Sum ``tensor`` over the ranks holding the same shard (hybrid sharding)."""
# torch >= 2.13 names the single-tensor collectives *_single; older versions use *_tensor.
_all_gather_flat: Callable = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat: Callable = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ShardGroup:
    """The shard group and optional replica group of one wrapped model.

    ``options.group_size`` None (or the world size) shards over every rank of ``process_group``; G builds W/G shard
    groups of G consecutive ranks and G replica groups joining rank ``i`` of each (HYBRID_SHARD).  ``shard_size`` is
    the shard group's size.  The collective settings are ``options``' ``gloo_p2p``, ``reduce_scatter_via_all_reduce``
    and ``timeout_s``."""

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None,
                 options: Optional[FlatShardOptions] = None) -> None:
        options = options or FlatShardOptions.from_environment()
        shard_size = options.group_size
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("accel_flatshard needs torch.distributed to be initialised: call "
                               "torch.distributed.init_process_group(...) (or use accelerate launch / torchrun) first")
        self.world_group = process_group or dist.group.WORLD
        self.world_size = dist.get_world_size(self.world_group)
        self.world_rank = dist.get_rank(self.world_group)
        # e.g. "gloo", "nccl", or "cuda:nccl,cpu:gloo" when accelerate asks for both
        self.backend = str(dist.get_backend(self.world_group))
        self.uses_nccl, self.uses_gloo = "nccl" in self.backend, "gloo" in self.backend
        if shard_size is None or shard_size == self.world_size:
            self.shard_group, self.replica_group, self.shard_size = self.world_group, None, self.world_size
        else:
            if shard_size < 1 or self.world_size % shard_size != 0:
                raise ValueError(
                    f"group_size={shard_size} must divide the world size {self.world_size}; "
                    f"choose one of {[d for d in range(1, self.world_size + 1) if self.world_size % d == 0]}"
                )
            if self.world_group is not dist.group.WORLD:
                raise ValueError("hybrid sharding (group_size) needs the default process group")
            self.shard_size = shard_size
            timeout = datetime.timedelta(seconds=options.timeout_s)
            self.shard_group = _subgroup_containing(
                self.world_rank, [list(range(s, s + shard_size)) for s in range(0, self.world_size, shard_size)],
                timeout)
            self.replica_group = _subgroup_containing(
                self.world_rank, [list(range(i, self.world_size, shard_size)) for i in range(shard_size)], timeout)
        self.shard_rank = dist.get_rank(self.shard_group)
        # gloo's all_gather_single / reduce_scatter_single stage through temporaries (152 MiB: 262 / 165 ms,
        # all-reduce 88 ms; isend/irecv straight into / out of the slots 99 ms, benchmarks/comm_bench.py): on
        # gloo both run as point-to-point batches unless FLATSHARD_GLOO_P2P=0.
        p2p = options.gloo_p2p
        self.via_p2p = p2p if p2p is not None else (self.uses_gloo and not self.uses_nccl)
        self.reduce_scatter_via_all_reduce = options.reduce_scatter_via_all_reduce and not self.via_p2p
        self.bytes_gathered = self.bytes_reduced = 0  # counters for tests and the profiler
        self.device: Optional[torch.device] = None  # the model's device (bind_device)
        self.collectives_at_one_rank = False  # True: real collectives at group size 1 too (gpu_check's NCCL part)

    def bind_device(self, device: torch.device) -> None:
        """Run the norm's all-reduce and the object collectives on the model's device, not the current one."""
        self.device = device
        if device.type == "cuda":
            _CUDA_DEVICE_OF_GROUP[self.world_group] = device

    @property
    def replica_index(self) -> int:
        """Which shard group this rank belongs to (shard groups are consecutive blocks of ranks)."""
        return self.world_rank // self.shard_size

    @property
    def is_hybrid(self) -> bool:
        return self.replica_group is not None

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = True):
        """Gather every rank's ``shard`` into ``output`` (rank order)."""
        self.bytes_gathered += shard.numel() * shard.element_size()
        if self.shard_size == 1 and not self.collectives_at_one_rank:
            output.copy_(shard)
            return DONE
        if self.via_p2p:
            return _waited(self._all_gather_p2p(output, shard), async_op)
        work = _all_gather_flat(output, shard, group=self.shard_group, async_op=async_op)
        return work if async_op else DONE

    def _all_gather_p2p(self, output: torch.Tensor, shard: torch.Tensor) -> "_Works":
        """All-gather as one batch of sends and receives straight into the output's slots (safe to overlap
        other batches: every rank posts the same transfers, matched in order per pair of ranks and tag)."""
        slots = output.chunk(self.shard_size)
        slots[self.shard_rank].copy_(shard)
        ops = []
        for peer in range(self.shard_size):
            if peer != self.shard_rank:
                ops.append(dist.P2POp(dist.isend, shard, group=self.shard_group, group_peer=peer, tag=1))
                ops.append(dist.P2POp(dist.irecv, slots[peer], group=self.shard_group, group_peer=peer, tag=1))
        return _Works(dist.batch_isend_irecv(ops))

    def _reduce_scatter_p2p(self, output: torch.Tensor, full: torch.Tensor) -> "_Works":
        """Reduce-scatter as sends of every peer's chunk and receives of theirs copies of ours; ``wait()``
        sums them into ``output`` (in rank order, so every rank adds in the same order)."""
        chunks = full.chunk(self.shard_size)
        peers = [r for r in range(self.shard_size) if r != self.shard_rank]
        received = torch.empty(len(peers), output.numel(), dtype=full.dtype, device=full.device)
        ops = []
        for i, peer in enumerate(peers):
            ops.append(dist.P2POp(dist.isend, chunks[peer], group=self.shard_group, group_peer=peer, tag=2))
            ops.append(dist.P2POp(dist.irecv, received[i], group=self.shard_group, group_peer=peer, tag=2))

        def sum_into_output() -> None:
            parts = [chunks[r] if r == self.shard_rank else received[peers.index(r)] for r in range(self.shard_size)]
            if len(parts) == 1:
                output.copy_(parts[0])
                return
            torch.add(parts[0], parts[1], out=output)  # one pass: the first part is not copied before the adds
            for part in parts[2:]:
                output.add_(part)

        return _Works(dist.batch_isend_irecv(ops), then=sum_into_output)

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, async_op: bool = True):
        """Sum ``full`` over the shard group into this rank's ``output`` (via all-reduce: ``full`` is reduced in place
        and this rank's part copied out once the work is complete)."""
        self.bytes_reduced += full.numel() * full.element_size()
        if self.shard_size == 1 and not self.collectives_at_one_rank:
            output.copy_(full)
            return DONE
        if self.via_p2p:
            return _waited(self._reduce_scatter_p2p(output, full), async_op)
        if not self.reduce_scatter_via_all_reduce:
            work = _reduce_scatter_flat(output, full, group=self.shard_group, async_op=async_op)
            return work if async_op else DONE
        work = dist.all_reduce(full, group=self.shard_group, async_op=async_op)
        return _waited(_Works([work] if async_op else [], then=lambda: self.take_reduced_shard(output, full)), async_op)

    def take_reduced_shard(self, output: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """Via all-reduce: this rank's part of the reduced ``full``, copied into ``output``."""
        n = output.numel()
        return output.copy_(full[self.shard_rank * n : (self.shard_rank + 1) * n])

    def all_reduce_replicas(self, tensor: torch.Tensor, async_op: bool = True):
        """Sum a reduced shard over the replica group (hybrid sharding only)."""
        work = dist.all_reduce(tensor, group=self.replica_group, async_op=async_op)
        return work if async_op else DONE

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, over_world: bool = False) -> torch.Tensor:
        """Blocking all-reduce of ``tensor`` in place over the shard group (``over_world``: every rank)."""
        size, group = (self.world_size, self.world_group) if over_world else (self.shard_size, self.shard_group)
        if size > 1:
            dist.all_reduce(tensor, op=op, group=group)
        return tensor


def _waited(work: "_Works", async_op: bool) -> "_Works":
    """A point-to-point batch, waited for when the call is synchronous."""
    if not async_op:
        work.wait()
    return work


def _subgroup_containing(rank: int, rank_lists: List[List[int]], timeout: datetime.timedelta) -> dist.ProcessGroup:
    """Create one group per rank list (collective) and return the one holding ``rank``; the timeout
    (``timeout_s``) makes a dead peer raise in the others instead of hanging them."""
    return dist.new_subgroups_by_enumeration(rank_lists, timeout=timeout)[0]


# ---------------------------------------------------------------------- objects, agreement, rendezvous
# Collectives for state-dict and checkpoint code; ``group`` None (one process): each returns the local value.
def _size(group: Optional[dist.ProcessGroup]) -> int:
    return 1 if group is None or not dist.is_initialized() else dist.get_world_size(group)


# process group -> the CUDA device of the model sharded over it: the current device is cuda:0 where a script
# moved its model to cuda:LOCAL_RANK without torch.cuda.set_device
_CUDA_DEVICE_OF_GROUP: "weakref.WeakKeyDictionary[dist.ProcessGroup, torch.device]" = weakref.WeakKeyDictionary()


def _on_model_device(group: dist.ProcessGroup) -> contextlib.AbstractContextManager:
    """torch's object collectives and barrier use the current CUDA device: make it the model's."""
    device = _CUDA_DEVICE_OF_GROUP.get(group)
    return torch.cuda.device(device) if device is not None else contextlib.nullcontext()


def _global_rank0(group: dist.ProcessGroup) -> int:
    return 0 if group is dist.group.WORLD else dist.get_global_rank(group, 0)


def broadcast_object(group: Optional[dist.ProcessGroup], obj: Any) -> Any:
    """Group rank 0's ``obj`` on every rank of ``group``."""
    if _size(group) == 1:
        return obj
    box = [obj]
    with _on_model_device(group):
        dist.broadcast_object_list(box, src=_global_rank0(group), group=group)
    return box[0]


def all_gather_object(group: Optional[dist.ProcessGroup], obj: Any) -> List[Any]:
    """Every rank's ``obj``, in group rank order (a fake group's ranks are all this process: the planner's)."""
    if _size(group) == 1 or dist.get_backend(group).startswith("fake"):
        return [obj] * _size(group)
    out: List[Any] = [None] * _size(group)
    with _on_model_device(group):
        dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_tensor(group: Optional[dist.ProcessGroup], tensor: torch.Tensor) -> torch.Tensor:
    """Overwrite ``tensor`` with group rank 0's copy (in place) and return it."""
    if _size(group) > 1:
        dist.broadcast(tensor, src=_global_rank0(group), group=group)
    return tensor


def barrier(group: Optional[dist.ProcessGroup]) -> None:
    if _size(group) > 1:
        with _on_model_device(group):
            dist.barrier(group=group)


def agree_on_error(group: Optional[dist.ProcessGroup], error: Optional[BaseException],
                   error_types: Sequence[type] = (), default: type = RuntimeError) -> None:
    """Collective: raise on every rank if any had an error (none is left waiting in the next collective): its
    own, else the first failing rank's class (by name in ``error_types``, else ``default``) and message."""
    if _size(group) > 1:
        mine = None if error is None else (type(error).__name__, str(error))
        failed = [(r, e) for r, e in enumerate(all_gather_object(group, mine)) if e is not None]
        if failed and error is None:
            rank, (cls_name, message) = failed[0]
            cls = next((t for t in error_types if t.__name__ == cls_name), default)
            raise cls(f"rank {rank} failed: {message}")
    if error is not None:
        raise error


def new_gloo_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A gloo group over the ranks of ``group`` (collective over them): monitored_barrier needs gloo."""
    ranks = (list(range(dist.get_world_size(group))) if group is dist.group.WORLD
             else dist.get_process_group_ranks(group))
    return dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)


def rendezvous_or_fail(gloo_group: dist.ProcessGroup, timeout: datetime.timedelta) -> Optional[str]:
    """Wait for every rank of ``gloo_group`` at a monitored barrier: None when all came, else why not (the
    waiting rank fails fast instead of hanging in the next collective until the process-group timeout)."""
    try:
        dist.monitored_barrier(group=gloo_group, timeout=timeout, wait_all_ranks=True)
    except RuntimeError as e:
        return str(e).strip()
    return None
