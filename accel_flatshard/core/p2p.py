"""gloo's collectives as point-to-point batches: all-gather, reduce-scatter and all-to-all over a :class:`Members`.

gloo's ``all_gather_single`` / ``reduce_scatter_single`` stage through temporaries; batches of ``isend`` / ``irecv``
straight into and out of the tensors' slots do not (``comm.py``).  Every rank posts the same transfers in the same
order, which is what matches them (per pair of ranks and tag), so batches may overlap.  Large messages go as
alternating pieces (:func:`exchange`), and each wait is bounded by the group's ``p2p_timeout``.  Layout: a gathered
or reduced buffer is ``[member 0 | member 1 | ...]``, equal chunks in member order.
"""
from __future__ import annotations

import datetime
import itertools
from typing import Any, List, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from .handles import Handle, bounded, waited


class Members(NamedTuple):
    """A process group as the collectives use it: the group, its size, this rank's index in it, and how many of the
    other members run on this rank's machine (the rest send across machines)."""

    group: Any
    size: int
    rank: int
    on_node: int
    p2p_timeout: Optional[datetime.timedelta] = None


def all_gather(members: Members, outputs: Sequence[torch.Tensor], shards: Sequence[torch.Tensor]) -> Handle:
    """All-gathers as one batch of sends and receives straight into the outputs' slots."""
    ops = []
    for output, shard in zip(outputs, shards):
        slots = output.chunk(members.size)
        slots[members.rank].copy_(shard)
        for peer in range(members.size):
            if peer != members.rank:
                ops.append(dist.P2POp(dist.isend, shard, group=members.group, group_peer=peer, tag=1))
                ops.append(dist.P2POp(dist.irecv, slots[peer], group=members.group, group_peer=peer, tag=1))
    return Handle(exchange(ops, members))


def all_gather_in_two(node: Members, column: Members, outputs: Sequence[torch.Tensor],
                      shards: Sequence[torch.Tensor]) -> Handle:
    """All-gathers over a shard group of M machines x N ranks (shard rank k*N + i: machine k, index i), each shard
    crossing machines once: (1) over the column group (index i on every machine) each rank sends its shard to its
    peers, so that it holds slots k'*N + i for every k'; (2) once that is done, over the node group, it sends those M
    slots to each rank of its machine and receives theirs.  Per machine, (M - 1) N shards come in across machines
    instead of (M - 1) N^2."""
    i, k = node.rank, column.rank
    first, mine = [], []
    for output, shard in zip(outputs, shards):
        slots = output.chunk(node.size * column.size)
        slots[k * node.size + i].copy_(shard)
        mine.append(slots)
        for peer in range(column.size):
            if peer != k:
                first.append(dist.P2POp(dist.isend, shard, group=column.group, group_peer=peer, tag=1))
                first.append(dist.P2POp(dist.irecv, slots[peer * node.size + i], group=column.group,
                                        group_peer=peer, tag=1))

    def inside_the_machine() -> None:  # (in machine order on both ends: that is what matches them)
        ops = []
        for slots in mine:
            for peer in range(node.size):
                if peer != i:
                    for m in range(column.size):
                        ops.append(dist.P2POp(dist.isend, slots[m * node.size + i], group=node.group,
                                              group_peer=peer, tag=4))
                        ops.append(dist.P2POp(dist.irecv, slots[m * node.size + peer], group=node.group,
                                              group_peer=peer, tag=4))
        for work in exchange(ops, node):
            work.wait()

    return Handle(exchange(first, column), then=inside_the_machine)  # (a column has 2 machines or more)


def reduce_scatter(members: Members, outputs: Sequence[torch.Tensor], fulls: Sequence[torch.Tensor]) -> Handle:
    """Reduce-scatters of each ``fulls[j]`` into ``outputs[j]`` over ``members``, as one batch of sends of every
    peer's chunk and receives of theirs copies of ours; ``wait()`` sums them into the outputs (in rank order, so every
    rank adds in the same order)."""
    peers = [r for r in range(members.size) if r != members.rank]
    ops, sums = [], []
    for output, full in zip(outputs, fulls):
        chunks = full.chunk(members.size)
        received = torch.empty(len(peers), output.numel(), dtype=full.dtype, device=full.device)
        for i, peer in enumerate(peers):
            ops.append(dist.P2POp(dist.isend, chunks[peer], group=members.group, group_peer=peer, tag=2))
            ops.append(dist.P2POp(dist.irecv, received[i], group=members.group, group_peer=peer, tag=2))
        parts = [chunks[r] if r == members.rank else received[peers.index(r)] for r in range(members.size)]
        sums.append((output, parts))

    def sum_into_outputs() -> None:
        for output, parts in sums:
            if len(parts) == 1:
                output.copy_(parts[0])
                continue
            torch.add(parts[0], parts[1], out=output)  # one pass: the first part is not copied before the adds
            for part in parts[2:]:
                output.add_(part)

    return Handle(exchange(ops, members) if ops else [], then=sum_into_outputs)


def all_to_all(members: Members, outputs: Sequence[Sequence[torch.Tensor]], inputs: Sequence[Sequence[torch.Tensor]],
               async_op: bool) -> Any:
    """``inputs[r]`` (a list of tensors) to member r, whose ``outputs[s]`` (same lengths, matched in order) receives
    what member s sent; one point-to-point batch (a rank's own list is copied)."""
    ops = []
    for output, source in zip(outputs[members.rank], inputs[members.rank]):
        output.copy_(source)
    for peer in range(members.size):
        if peer != members.rank:
            ops += [dist.P2POp(dist.isend, t, group=members.group, group_peer=peer, tag=3) for t in inputs[peer]]
            ops += [dist.P2POp(dist.irecv, t, group=members.group, group_peer=peer, tag=3) for t in outputs[peer]]
    return waited(Handle(exchange(ops, members) if ops else []), async_op)


# gloo moves one pair's send and receive over one socket: a large send posted before a large receive leaves the
# other direction idle until it is written (an exchange of 6.3 MB over a 1 Gbit/s link ran at 0.52 Gbit/s each way).
# Posted as alternating pieces both directions stay busy (0.94 Gbit/s; docs/communication.md, "The link bench").
P2P_PIECE_BYTES = 2 << 20


def pieces(op: Any) -> List[Any]:
    """``op`` as sends / receives of consecutive pieces of at most :data:`P2P_PIECE_BYTES` (both ends split a message
    alike: its sizes are the same on both)."""
    t = op.tensor
    step = max(1, P2P_PIECE_BYTES // t.element_size())
    if t.numel() <= step or not t.is_contiguous():
        return [op]
    return [dist.P2POp(op.op, piece, group=op.group, group_peer=op.group_peer, tag=op.tag)
            for piece in t.view(-1).split(step)]


def exchange(ops: List[Any], members: Members) -> List[Any]:
    """``dist.batch_isend_irecv(ops)`` with large messages in pieces, sends and receives alternating (each keeps its
    order, which is what matches them per pair and tag); each work's wait bounded by ``members.p2p_timeout``."""
    sends = [piece for op in ops if op.op is dist.isend for piece in pieces(op)]
    receives = [piece for op in ops if op.op is not dist.isend for piece in pieces(op)]
    alternating = [op for pair in itertools.zip_longest(sends, receives) for op in pair if op is not None]
    works = dist.batch_isend_irecv(alternating)
    return works if members.p2p_timeout is None else [bounded(w, members.p2p_timeout) for w in works]
