"""gloo point-to-point messages larger than ``p2p.P2P_PIECE_BYTES`` go as alternating pieces (both directions of a
pair's socket busy at once): the collectives built on them give exactly what torch's own collectives give.  The piece
size is made tiny here so that every message of the test is split, into uneven pieces too.  hpZ's gather in two
stages (across machines, then inside) and reduction in two stages equal them too."""
from __future__ import annotations

import torch
import torch.distributed as dist

from dist_helpers import spawn


def _collectives_in_pieces_worker(rank: int, world_size: int):
    from accel_flatshard.core import comm, p2p

    p2p.P2P_PIECE_BYTES = 40  # (10 float32 elements: messages of 1 to 39 pieces, the last one short)
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


def _hpz_collectives_worker(rank: int, world_size: int):
    from accel_flatshard.core import comm, p2p
    from accel_flatshard.core.options import FlatShardOptions

    p2p.P2P_PIECE_BYTES = 40
    group = comm.ShardGroup(options=FlatShardOptions(node_local_backward_gather=True, ranks_per_node=2))
    assert group.reduces_in_two_stages and group.via_p2p
    g = torch.Generator().manual_seed(rank)
    shards = [torch.randn(37, generator=g), torch.randn(12, generator=g).to(torch.bfloat16)]  # (a packed unit)
    gathered = [torch.empty(world_size * s.numel(), dtype=s.dtype) for s in shards]
    group.all_gather(gathered, shards, kind="forward gather").wait()
    expected = []
    for shard in shards:
        parts = [torch.empty_like(shard) for _ in range(world_size)]
        dist.all_gather(parts, shard)
        expected.append(torch.cat(parts))
    full = torch.randn(37 * world_size, generator=g)
    reduced = torch.empty(37)
    group.reduce_scatter(reduced, full.clone()).wait()
    total = full.clone()
    dist.all_reduce(total)
    return (all(torch.equal(a, b) for a, b in zip(gathered, expected)),
            (reduced - total.chunk(world_size)[rank]).abs().max().item(), dict(group.sent))


def test_hpz_gathers_and_reduces_in_two_stages_equal_torchs_own_and_cross_machines_once():
    """2 machines x 2 ranks: each shard crosses machines once (to its column peer), not once per rank there."""
    for gathered_equal, reduce_error, sent in spawn(4, _hpz_collectives_worker):
        assert gathered_equal and reduce_error < 1e-6
        shard_bytes = 37 * 4 + 12 * 2
        assert sent["forward gather", "inter"] == shard_bytes  # (FULL_SHARD's: 2 x, one to each rank there)
        assert sent["forward gather", "intra"] == 2 * shard_bytes  # (the shard and its column peer's)
        assert sent["reduction", "inter"] == 37 * 4
