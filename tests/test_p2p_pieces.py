"""gloo point-to-point messages larger than ``comm.P2P_PIECE_BYTES`` go as alternating pieces (both directions of a
pair's socket busy at once): the collectives built on them give exactly what torch's own collectives give.  The piece
size is made tiny here so that every message of the test is split, into uneven pieces too."""
from __future__ import annotations

import torch
import torch.distributed as dist

from dist_helpers import spawn


def _collectives_in_pieces_worker(rank: int, world_size: int):
    from accel_flatshard.core import comm

    comm.P2P_PIECE_BYTES = 40  # (10 float32 elements: messages of 1 to 39 pieces, the last one short)
    group = comm.ShardGroup()
    assert group.shard.p2p_timeout is not None or not group.uses_gloo  # (the p2p path: gloo)
    g = torch.Generator().manual_seed(rank)
    shard = torch.randn(37, generator=g)
    gathered = torch.empty(37 * world_size)
    group.all_gather([gathered], [shard]).wait()
    expected = [torch.empty(37) for _ in range(world_size)]
    dist.all_gather(expected, shard)
    full = torch.randn(37 * world_size, generator=g)
    reduced = torch.empty(37)
    group.reduce_scatter(reduced, full.clone()).wait()
    total = full.clone()
    dist.all_reduce(total)
    inputs = [[torch.full((23,), float(rank * 10 + peer)), torch.arange(5.0) + rank] for peer in range(world_size)]
    outputs = [[torch.empty(23), torch.empty(5)] for _ in range(world_size)]
    group.all_to_all(outputs, inputs, async_op=False)
    return (torch.equal(gathered, torch.cat(expected)), (reduced - total.chunk(world_size)[rank]).abs().max().item(),
            all(torch.equal(outputs[s][0], torch.full((23,), float(s * 10 + rank))) and
                torch.equal(outputs[s][1], torch.arange(5.0) + s) for s in range(world_size)))


def test_collectives_in_pieces_equal_torchs_own():
    for gathered_equal, reduce_error, all_to_all_equal in spawn(3, _collectives_in_pieces_worker):
        assert gathered_equal and all_to_all_equal
        assert reduce_error < 1e-6  # (the sums' order differs from gloo's all-reduce)
