"""Process groups and collectives: with ``p2p.py`` (gloo's point-to-point batches) the only modules that call
torch.distributed collectives.

A :class:`ShardGroup` holds the shard group (size G) and, for hybrid sharding, the replica group (the ranks
holding the same shard, size W/G), and runs the engine's collectives with the torch and backend at hand.
:class:`Collectives` is what the engine asks of it: the interface the tests' stand-ins for a group implement too.
(The per-attempt key spaces of a torchelastic restart are ``elastic.py``'s.)
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import datetime
import time
import weakref
from typing import Any, Callable, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

import torch
import torch.distributed as dist

from ._compat import is_fake, set_group_timeout
from .options import FlatShardOptions
from .spans import mark_sent
from .int8 import dequantize_blocks, quantize_for_reduction, sum_dequantized
from .handles import DONE, Handle, followed_by, waited  # (DONE: also the tests' and benchmarks' name for it)
from . import p2p
from .p2p import Members


@runtime_checkable
class Collectives(Protocol):
    """What the engine needs of a shard group (:class:`ShardGroup`; the tests' single-process stand-ins, which
    ``tests/test_engine.py`` checks against this): sizes, ranks, and the three collectives of a step, each returning
    a handle with ``wait()``."""

    world_size: int
    world_rank: int
    shard_size: int
    is_hybrid: bool

    def all_gather(self, outputs: Sequence[torch.Tensor], shards: Sequence[torch.Tensor], async_op: bool = True,
                   kind: str = "other gather", in_node: bool = False) -> Any:
        """Every rank's ``shards[i]`` into ``outputs[i]``, in rank order, as one collective (``in_node``: within the
        node group; ``kind`` labels the bytes)."""

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, async_op: bool = True) -> Any:
        """The sum of every rank's ``full``, this rank's part into ``output``."""

    def all_reduce_replicas(self, tensor: torch.Tensor, async_op: bool = True) -> Any:
        """Sum ``tensor`` over the ranks holding the same shard (hybrid sharding)."""
# torch >= 2.13 names the single-tensor collectives *_single; older versions use *_tensor.
_all_gather_flat: Callable = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat: Callable = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# A gloo worker thread drops a finished collective's tensors a moment after ``wait()`` returns.  If the script ends in
# that moment and the tensors' last reference is the worker's, the drop needs the GIL during interpreter
# finalization; Python ends the thread with pthread_exit, whose unwind through ProcessGroupGloo::runLoop calls
# std::terminate ("terminate called without an active exception"): the rank aborts after its work is done and the
# launcher reports the job failed.  Plain torch does it too: 200 async all-reduces then exit aborted 26 of 30
# 2-rank torchrun launches here (torch 2.13), 0 of 20 with a 0.1 s pause at exit, 0 of 20 after
# destroy_process_group() (which a wrapped model's own references to its groups can keep from running the
# destructor).  So a process that built a ShardGroup pauses at exit, after every later-registered handler (an
# asynchronous save's join runs first), and lets the workers finish.
_EXIT_PAUSE_S = 0.2
_exit_pause_registered = False


def _let_gloo_finish_at_exit() -> None:
    global _exit_pause_registered
    if not _exit_pause_registered:
        _exit_pause_registered = True
        atexit.register(time.sleep, _EXIT_PAUSE_S)


class ShardGroup:
    """The shard group and optional replica group of one wrapped model.

    ``options.fsdp_group_size`` None (or the world size) shards over every rank of ``process_group``; G builds W/G shard
    groups of G consecutive ranks and G replica groups joining rank ``i`` of each (HYBRID_SHARD).  ``shard_size`` is
    the shard group's size.  The collective settings are ``options``' ``gloo_p2p``, ``reduce_scatter_via_all_reduce``
    and ``timeout_s``.  Machines are blocks of ``ranks_per_node`` consecutive ranks: ``sent`` counts the bytes this
    rank sends, by kind and by whether they cross machines, and with ``node_local_backward_gather`` the node groups
    (the shard group's members on one machine) gather units in backward (``all_gather(..., in_node=True)``) and
    gradients are reduced inside the machine first, then across machines over the column groups (the shard group's
    members with this rank's index on their machine): :meth:`reduce_scatter`."""

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None,
                 options: Optional[FlatShardOptions] = None) -> None:
        options = options or FlatShardOptions.from_environment()
        shard_size = options.fsdp_group_size
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("accel_flatshard needs torch.distributed to be initialised: call "
                               "torch.distributed.init_process_group(...) (or use accelerate launch / torchrun) first")
        self.world_group = process_group or dist.group.WORLD
        self.world_size = dist.get_world_size(self.world_group)
        self.world_rank = dist.get_rank(self.world_group)
        # e.g. "gloo", "nccl", or "cuda:nccl,cpu:gloo" when accelerate asks for both
        self.backend = str(dist.get_backend(self.world_group))
        self.uses_nccl, self.uses_gloo = "nccl" in self.backend, "gloo" in self.backend
        _let_gloo_finish_at_exit()
        if options.timeout_s != FlatShardOptions.__dataclass_fields__["timeout_s"].default:
            # set by the user: it bounds the engine's collectives on the launcher's group too (sharding over every
            # rank), whose own timeout (30 min by default) would keep a rank cut off from its peers that long
            set_group_timeout(self.world_group, datetime.timedelta(seconds=options.timeout_s))
        if shard_size is None or shard_size == self.world_size:
            self.shard_group, self.replica_group, self.shard_size = self.world_group, None, self.world_size
        else:
            if shard_size < 1 or self.world_size % shard_size != 0:
                raise ValueError(
                    f"fsdp_group_size={shard_size} must divide the world size {self.world_size}; "
                    f"choose one of {[d for d in range(1, self.world_size + 1) if self.world_size % d == 0]}"
                )
            if not _spans_the_world(self.world_group):  # (the subgroups below are made of global ranks)
                raise ValueError(f"hybrid sharding (fsdp_group_size={shard_size}) over a process_group needs that "
                                 "group to hold every rank, in rank order (e.g. dist.new_group(range(world_size))); "
                                 "pass process_group=None to shard over the default group")
            self.shard_size = shard_size
            timeout = datetime.timedelta(seconds=options.timeout_s)
            self.shard_group = _subgroup_containing(
                [list(range(s, s + shard_size)) for s in range(0, self.world_size, shard_size)], timeout)
            self.replica_group = _subgroup_containing(
                [list(range(i, self.world_size, shard_size)) for i in range(shard_size)], timeout)
        # gloo's point-to-point waits ignore the group's timeout (a recv from a peer behind a dead link never ends):
        # bounded here by timeout_s; NCCL's are not (a bounded wait there blocks the host until the kernel ends)
        self.p2p_timeout = (datetime.timedelta(seconds=options.timeout_s) if self.uses_gloo and not self.uses_nccl
                            else None)
        self.shard_rank = dist.get_rank(self.shard_group)
        self.ranks_per_node = options.ranks_per_node or self.world_size  # (None: every rank on one machine)
        self.shard = self._members(self.shard_group)
        self.peers = self._peers_by_machine()
        self.replicas = self._members(self.replica_group) if self.replica_group is not None else None
        self.node, self.column = (self._node_groups(options) if options.node_local_backward_gather
                                  else (None, None))
        # gloo's all_gather_single / reduce_scatter_single stage through temporaries (152 MiB: 262 / 165 ms,
        # all-reduce 88 ms; isend/irecv straight into / out of the slots 99 ms, benchmarks/comm_bench.py): on
        # gloo both run as point-to-point batches unless FLATSHARD_GLOO_P2P=0.
        p2p = options.gloo_p2p
        self.via_p2p = p2p if p2p is not None else (self.uses_gloo and not self.uses_nccl)
        self.reduce_scatter_via_all_reduce = options.reduce_scatter_via_all_reduce and not self.via_p2p
        self.bytes_gathered = self.bytes_reduced = 0  # counters for tests and the profiler
        # bytes this rank sent, by (kind, "intra" | "inter" machine), counted as the point-to-point exchange sends
        self.sent: "collections.Counter[tuple]" = collections.Counter()
        self.device: Optional[torch.device] = None  # the model's device (bind_device)
        self.collectives_at_one_rank = False  # True: real collectives at group size 1 too (gpu_check's NCCL part)

    def _members(self, group: Any) -> Members:
        ranks = (list(range(self.world_size)) if group is dist.group.WORLD
                 else dist.get_process_group_ranks(group))
        node = self.world_rank // self.ranks_per_node
        on_node = sum(r // self.ranks_per_node == node for r in ranks) - 1
        return Members(group, len(ranks), dist.get_rank(group), on_node, self.p2p_timeout)

    def _peers_by_machine(self) -> str:
        """The ranks this rank's collectives wait for, by machine, for the error when one fails."""
        me, groups = dist.get_rank(), [g for g in (self.shard_group, self.replica_group) if g is not None]
        machines: dict = {}
        for rank in sorted({r for g in groups for r in dist.get_process_group_ranks(g)} - {me}):
            machines.setdefault(rank // self.ranks_per_node, []).append(str(rank))
        where = "; ".join(f"machine {m}: rank{'s' * (len(r) > 1)} {', '.join(r)}" for m, r in machines.items())
        return f"this rank is on machine {me // self.ranks_per_node}; its peers: {where or 'none'}"

    def _node_groups(self, options: FlatShardOptions) -> Tuple[Optional[Members], Optional[Members]]:
        """The shard group's members on this rank's machine (the node group: backward gathers and the first half of a
        reduction stay inside it) and those with this rank's index on each machine (the column group: the second
        half of a reduction); (None, None) when the whole shard group is on one machine: nothing crosses machines."""
        n, g = self.ranks_per_node, self.shard_size
        if n >= g:
            return None, None
        if g % n or self.world_group is not dist.group.WORLD:
            raise ValueError(f"node_local_backward_gather: the shard group ({g} ranks) must be whole machines of "
                             f"ranks_per_node={n} ranks of the default process group; set ranks_per_node to a divisor "
                             "of the shard group size (LOCAL_WORLD_SIZE under accelerate launch / torchrun)")
        timeout, machines = datetime.timedelta(seconds=options.timeout_s), g // n
        blocks = [list(range(s + k * n, s + (k + 1) * n)) for s in range(0, self.world_size, g)
                  for k in range(machines)]
        columns = [[s + k * n + i for k in range(machines)] for s in range(0, self.world_size, g) for i in range(n)]
        node, column = _subgroup_containing(blocks, timeout), _subgroup_containing(columns, timeout)
        return (Members(node, n, dist.get_rank(node), n - 1, self.p2p_timeout),
                Members(column, machines, dist.get_rank(column), 0, self.p2p_timeout))

    def _count(self, kind: str, members: Members, per_peer: int) -> None:
        """What this rank sends to each other member, split by machine (and marked for a running profiler)."""
        intra, inter = per_peer * members.on_node, per_peer * (members.size - 1 - members.on_node)
        self.sent[kind, "intra"] += intra
        self.sent[kind, "inter"] += inter
        mark_sent(kind, intra, inter)

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

    def all_gather(self, outputs: Sequence[torch.Tensor], shards: Sequence[torch.Tensor], async_op: bool = True,
                   kind: str = "other gather", in_node: bool = False):
        """Gather every rank's ``shards[i]`` into ``outputs[i]`` (rank order) as one collective: one unit's flat
        parameters, of any dtypes, over the shard group (``in_node``: its node group, hpZ).  With point-to-point, one
        batch straight into every output's slots (hpZ's gathers over the shard group: across machines over the column
        group, then inside the machine, ``p2p.all_gather_in_two``); else one all-gather (of several shards: packed as
        bytes, copied out into the outputs once it completes).  ``kind`` labels the bytes sent ("forward gather")."""
        members = self.node if in_node else self.shard
        sizes = [s.numel() * s.element_size() for s in shards]
        self.bytes_gathered += sum(sizes)
        if self.via_p2p and self.crosses_in_two_stages and not in_node:  # hpZ: each shard crosses machines once
            self._count(kind, self.column, sum(sizes))
            self._count(kind, self.node, self.column.size * sum(sizes))
            return waited(p2p.all_gather_in_two(self.node, self.column, outputs, shards), async_op)
        self._count(kind, members, sum(sizes))
        if members.size == 1 and not self.collectives_at_one_rank:
            for output, shard in zip(outputs, shards):
                output.copy_(shard)
            return DONE
        if self.via_p2p:
            return waited(p2p.all_gather(members, outputs, shards), async_op)
        if len(shards) == 1:
            work = _all_gather_flat(outputs[0], shards[0], group=members.group, async_op=async_op)
            return work if async_op else DONE
        packed = torch.cat([s.reshape(-1).view(torch.uint8) for s in shards])
        gathered = torch.empty(members.size * packed.numel(), dtype=torch.uint8, device=packed.device)
        work = _all_gather_flat(gathered, packed, group=members.group, async_op=async_op)

        def copy_out() -> None:  # rank-major [rank][flat 0 | flat 1 | ...] -> each flat's [rank 0 | rank 1 | ...]
            rows, start = gathered.view(members.size, -1), 0
            for output, shard, size in zip(outputs, shards, sizes):
                output.view(members.size, -1).copy_(rows[:, start : start + size].view(shard.dtype))
                start += size

        return waited(Handle([work] if async_op else [], then=copy_out), async_op)

    def all_gather_quantized(self, outputs: Sequence[torch.Tensor], codes: Sequence[Tuple[torch.Tensor, torch.Tensor]],
                             block: int, what: str, async_op: bool = True, kind: str = "other gather") -> Any:
        """:meth:`all_gather` of the shards as block-wise int8 with a float32 scale a block: ``codes``, one
        ``(int8, scales)`` a shard (``int8.quantize_blocks``: each rank quantizes its own shard, so no block straddles
        two), dequantized into ``outputs`` (their dtype) once it completes.  A non-finite value travels as a nan scale
        (``propagate_non_finite``), so that every rank raises the same error, which ``what`` names with the rank that
        holds it (a rank raising alone would leave the others waiting)."""
        sends, receives = [], []
        for q, scales in codes:
            sends += [q, scales]
            receives += [q.new_empty(self.shard_size * q.numel()), scales.new_empty(self.shard_size * scales.numel())]
        work = self.all_gather(receives, sends, async_op=async_op, kind=kind)

        def dequantize() -> None:
            for i, output in enumerate(outputs):
                q, scales = receives[2 * i].view(self.shard_size, -1), receives[2 * i + 1].view(self.shard_size, -1)
                bad = ~torch.isfinite(scales).all(dim=1)  # (one check a gather: on CUDA, a wait for its stream)
                if not is_fake(bad) and bool(bad.any()):
                    raise ValueError(f"accel_flatshard int8 quantization of {what}: the shard of rank(s) "
                                     f"{bad.nonzero().flatten().tolist()} holds non-finite values (inf or nan); an "
                                     "int8 block cannot carry them (set quantized_all_gather off to train on)")
                dequantize_blocks(q, scales, block, out=output)

        return followed_by(work, dequantize, async_op)

    def reduce_scatter_quantized(self, output: torch.Tensor, full: torch.Tensor, block: int, what: str,
                                 async_op: bool = True, propagate_non_finite: bool = False) -> Any:
        """Sum ``full`` over the shard group into this rank's ``output`` (float32) through int8 (ZeRO++'s qgZ): each
        rank quantizes every rank's chunk (``quantize.py``), one all-to-all sends each its chunks, which it
        dequantizes and sums in float32, in rank order, once the exchange completes."""
        q, scales = quantize_for_reduction(full, self.shard_size, block, what,
                                           propagate_non_finite=propagate_non_finite)
        got_q, got_scales = torch.empty_like(q), torch.empty_like(scales)
        self.bytes_reduced += q.numel() + scales.numel() * scales.element_size()
        self._count("reduction", self.shard, q.shape[1] + scales.shape[1] * scales.element_size())
        work = p2p.all_to_all(self.shard, list(zip(got_q, got_scales)), list(zip(q, scales)), async_op)
        return followed_by(work, lambda: sum_dequantized(got_q, got_scales, block, output), async_op)

    @property
    def crosses_in_two_stages(self) -> bool:
        """Whether the shard group's collectives cross machines over the column group and run the rest inside the
        machine (hpZ): a shard group over 2 machines or more, of 2 ranks or more each (with 1, the column group is the
        shard group)."""
        return self.column is not None and self.node.size > 1

    @property
    def reduces_in_two_stages(self) -> bool:
        """Whether :meth:`reduce_scatter` sums inside the machine first, then 1/N across (:attr:`crosses_in_two_stages`,
        unless reductions run as all-reduces)."""
        return self.crosses_in_two_stages and not self.reduce_scatter_via_all_reduce

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, async_op: bool = True):
        """Sum ``full`` over the shard group into this rank's ``output`` (via all-reduce: ``full`` is reduced in place
        and this rank's part copied out once the work is complete; with node groups: :meth:`_reduce_scatter_in_two`)."""
        if self.reduces_in_two_stages:  # (its first stage counts the bytes reduced)
            return self._reduce_scatter_in_two(output, full, async_op)
        self.bytes_reduced += full.numel() * full.element_size()
        self._count("reduction", self.shard, output.numel() * output.element_size())
        if self.shard_size == 1 and not self.collectives_at_one_rank:
            output.copy_(full)
            return DONE
        if self.via_p2p:
            return waited(p2p.reduce_scatter(self.shard, [output], [full]), async_op)
        if not self.reduce_scatter_via_all_reduce:
            work = _reduce_scatter_flat(output, full, group=self.shard_group, async_op=async_op)
            return work if async_op else DONE
        work = dist.all_reduce(full, group=self.shard_group, async_op=async_op)
        return waited(Handle([work] if async_op else [], then=lambda: self.take_reduced_shard(output, full)), async_op)

    def reduce_scatter_inside_machine(self, partial: torch.Tensor, full: torch.Tensor, async_op: bool = True) -> Any:
        """hpZ's first stage (:meth:`_reduce_scatter_in_two`): the machine's sums of the chunks this rank's column
        owns into ``partial`` (numel: the column group's size x a shard); nothing crosses machines."""
        node, column = self.node, self.column
        self.bytes_reduced += full.numel() * full.element_size()
        self._count("reduction", node, partial.numel() * partial.element_size())
        blocks, parts = full.view(column.size, -1), partial.view(column.size, -1)
        if self.via_p2p:
            return waited(p2p.reduce_scatter(node, list(parts), list(blocks)), async_op)
        works = [_reduce_scatter_flat(part, block, group=node.group, async_op=async_op)
                 for part, block in zip(parts, blocks)]
        return Handle(works) if async_op else DONE

    def reduce_scatter_across_machines(self, output: torch.Tensor, partial: torch.Tensor, async_op: bool = True) -> Any:
        """hpZ's second stage: :meth:`reduce_scatter_inside_machine`'s ``partial`` reduce-scattered over the column
        group (this rank's peers on the other machines) into ``output``, a shard."""
        self._count("reduction", self.column, output.numel() * output.element_size())
        if self.via_p2p:
            return waited(p2p.reduce_scatter(self.column, [output], [partial]), async_op)
        work = _reduce_scatter_flat(output, partial, group=self.column.group, async_op=async_op)
        return work if async_op else DONE

    def _reduce_scatter_in_two(self, output: torch.Tensor, full: torch.Tensor, async_op: bool) -> Any:
        """hpZ's reduction, exact (only the order of the sums differs): first inside the machine, then 1/N of it across
        machines (N ranks per machine, M machines in the shard group).  Shard rank k*N + i (machine k, index i) owns
        chunk k*N + i of ``full``.  (1) Over the node group, block k' of ``full`` (the chunks of machine k''s ranks)
        is reduce-scattered: index i receives the machine's sum of chunk k'*N + i, for every k' (``partial``, M
        chunks).  (2) Over the column group, ``partial`` is reduce-scattered: machine k receives the sum of chunk
        k*N + i over every machine.  Per rank, (M - 1) chunks cross machines instead of (M - 1) N: 1/N of FULL_SHARD's
        reduction bytes.  Here the second exchange starts when the handle is waited for; the engine issues the two
        stages itself, so that the second overlaps the backward (``engine.py``)."""
        partial = output.new_empty(self.column.size * output.numel())
        first = self.reduce_scatter_inside_machine(partial, full, async_op)
        return followed_by(first, lambda: self.reduce_scatter_across_machines(output, partial, async_op=False),
                           async_op)

    def take_reduced_shard(self, output: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """Via all-reduce: this rank's part of the reduced ``full``, copied into ``output``."""
        n = output.numel()
        return output.copy_(full[self.shard_rank * n : (self.shard_rank + 1) * n])

    def all_to_all(self, outputs: Sequence[Sequence[torch.Tensor]], inputs: Sequence[Sequence[torch.Tensor]],
                   async_op: bool = True) -> Any:
        """Exchange lists of tensors over the shard group: ``inputs[r]`` goes to shard rank ``r``, whose
        ``outputs[s]`` (same lengths, matched in order) receives what shard rank ``s`` sent it; a rank's own
        pair is copied.  Point-to-point sends and receives straight from and into the tensors, which may be
        views (the matrix optimizers' exchange, ``matrix_optim.py``: no packing, no staging copy)."""
        if self.shard_size == 1 and not self.collectives_at_one_rank:
            for out, inp in zip(outputs[0], inputs[0]):
                out.copy_(inp)
            return DONE
        # (the shard group is consecutive world ranks: shard rank p is world rank world_rank - shard_rank + p)
        node = self.world_rank // self.ranks_per_node
        for peer, tensors in enumerate(inputs):
            if peer != self.shard_rank:
                nbytes = sum(t.numel() * t.element_size() for t in tensors)
                same = (self.world_rank - self.shard_rank + peer) // self.ranks_per_node == node
                self.sent["matrix exchange", "intra" if same else "inter"] += nbytes
                mark_sent("matrix exchange", nbytes if same else 0, 0 if same else nbytes)
        return p2p.all_to_all(self.shard, outputs, inputs, async_op)

    def all_reduce_replicas(self, tensor: torch.Tensor, async_op: bool = True):
        """Sum a reduced shard over the replica group (hybrid sharding only)."""
        # (a ring all-reduce sends 2 (R - 1) / R of the tensor: to each of the R - 1 others, 2 / R of it)
        nbytes = tensor.numel() * tensor.element_size()
        self._count("replica all-reduce", self.replicas, 2 * nbytes // self.replicas.size)
        work = dist.all_reduce(tensor, group=self.replica_group, async_op=async_op)
        return work if async_op else DONE

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, over_world: bool = False) -> torch.Tensor:
        """Blocking all-reduce of ``tensor`` in place over the shard group (``over_world``: every rank)."""
        size, group = (self.world_size, self.world_group) if over_world else (self.shard_size, self.shard_group)
        if size > 1:
            dist.all_reduce(tensor, op=op, group=group)
        return tensor


def _spans_the_world(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is the default group or one holding every rank in rank order (as haiscale's examples
    build it), so that its rank i is global rank i."""
    return group is dist.group.WORLD or dist.get_process_group_ranks(group) == list(range(dist.get_world_size()))


def _subgroup_containing(rank_lists: List[List[int]], timeout: datetime.timedelta) -> dist.ProcessGroup:
    """Create one group per rank list (collective) and return the one holding this rank; the timeout
    (``timeout_s``) makes a dead peer raise in the others instead of hanging them."""
    return dist.new_subgroups_by_enumeration(rank_lists, timeout=timeout)[0]


# ---------------------------------------------------------------------- objects, agreement on a failure
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


def broadcast_tensor(group: Optional[dist.ProcessGroup], tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrite ``tensor`` with group rank ``src``'s copy (in place) and return it."""
    if _size(group) > 1:
        root = _global_rank0(group) if src == 0 else dist.get_global_rank(group, src)
        dist.broadcast(tensor, src=root, group=group)
    return tensor


def barrier(group: Optional[dist.ProcessGroup]) -> None:
    if _size(group) > 1:
        with _on_model_device(group):
            dist.barrier(group=group)


def agree_on_failure(group: Optional[dist.ProcessGroup], failure: Any = None,
                     timeout: Optional[datetime.timedelta] = None) -> List[Tuple[int, Any]]:
    """Collective: which ranks of ``group`` failed, as ``(group rank, failure)`` pairs in rank order (``[]``: none
    did), the same list on every rank, so that a rank that fails makes every rank raise instead of leaving the
    others waiting in the next collective.  The one way ranks agree on a failure (:func:`agree_on_error`, the
    asynchronous save's outcome, a sharded save's commit, a collective state dict's arrival check all ask it).

    ``failure``: None (this rank succeeded), a message, or an exception (it travels as its class name and message).
    ``timeout``: an arrival check instead (``group`` a gloo group, ``failure`` None): a monitored barrier; a rank
    that does not come within ``timeout`` is this rank's failure, why (the missing ranks) returned at once and
    only here (the others may not be there to hear it)."""
    rank = 0 if _size(group) == 1 else dist.get_rank(group)
    if timeout is not None:
        try:
            dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
        except RuntimeError as e:
            return [(rank, str(e).strip())]
        return []
    mine = (type(failure).__name__, str(failure)) if isinstance(failure, BaseException) else failure
    everyone = all_gather_object(group, mine) if _size(group) > 1 else [mine]
    return [(r, f) for r, f in enumerate(everyone) if f is not None]


def agree_on_error(group: Optional[dist.ProcessGroup], error: Optional[BaseException],
                   error_types: Sequence[type] = (), default: type = RuntimeError) -> None:
    """Collective (:func:`agree_on_failure`): raise on every rank if any had an error: its own, else the first
    failing rank's class (by name in ``error_types``, else ``default``) and message."""
    failed = agree_on_failure(group, error)
    if error is not None:
        raise error
    if failed:
        rank, (cls_name, message) = failed[0]
        cls = next((t for t in error_types if t.__name__ == cls_name), default)
        raise cls(f"rank {rank} failed: {message}")


def new_gloo_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A gloo group over the ranks of ``group`` (collective over them): monitored_barrier needs gloo."""
    ranks = (list(range(dist.get_world_size(group))) if group is dist.group.WORLD
             else dist.get_process_group_ranks(group))
    return dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
