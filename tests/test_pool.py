"""The engine's buffer pool (pool.py): on gloo the gathered buffers and full gradients of one step reuse the
blocks of the last, within the schedule's bound, and training is bitwise what it is without the pool."""
import pytest
import torch

from accel_flatshard import FullyShardedDataParallel, MixedPrecision, transformer_auto_wrap_policy
from accel_flatshard.pool import BufferPool
from accel_flatshard.wrap import checkpoint_units
from dist_helpers import spawn
from models import batches, llama, train
from sim_cuda import simulate_cuda

MODES = {"plain": {}, "bf16 (fp32 reduce)": {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16,
                                                                                 reduce_dtype=torch.float32)}}


def _wrap(mode: str, pool: bool, checkpointing: bool = False) -> FullyShardedDataParallel:
    model = llama(n_layer=3)
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model), **MODES[mode])
    if checkpointing:
        checkpoint_units(wrapped.module, [u.module for u in wrapped.units if not u.is_root])
    if not pool:
        wrapped._schedule.engine.pool = None  # (as a CUDA engine: every buffer fresh)
    return wrapped


def _reuse_worker(rank: int, world_size: int):
    wrapped = _wrap("plain", pool=True)
    pool = wrapped._schedule.engine.pool
    most_free, fill, sizes = 0, pool.fill, set()

    def watched_fill(storage, nbytes):
        nonlocal most_free
        most_free = max(most_free, len(pool._free))
        sizes.add(nbytes)
        fill(storage, nbytes)

    pool.fill = watched_fill
    per_step = []
    for x in batches(3, batch=2 * world_size):
        requests, fresh = pool.requests, pool.fresh_blocks
        train(wrapped, [x], rank, world_size)
        per_step.append((pool.requests - requests, pool.fresh_blocks - fresh))
    return per_step, most_free, pool.max_free_blocks, len(sizes)


def test_a_step_reuses_the_blocks_of_the_last_within_the_schedules_bound():
    per_step, most_free, bound, sizes = spawn(2, _reuse_worker)[0]
    units = 5  # embedding, 3 blocks, root (head + norm): gathered for forward and backward, one gradient each
    for requests, fresh in per_step:
        assert requests >= 2 * units, per_step
    assert per_step[0][1] > per_step[-1][1], per_step
    # in a steady step a fresh block is the rare case: at most one per buffer size (where the bound pushed out
    # the block of that size), 3 of 15 requests here
    assert per_step[-1][1] <= min(sizes, per_step[-1][0] // 4), (per_step, sizes)
    assert bound == 2 + 1 + 2  # limit_all_gathers + root, max_pending_reductions
    assert most_free <= bound


def _equal_worker(rank: int, world_size: int, mode: str, checkpointing: bool, accumulate: bool):
    results = []
    for pool in (True, False):
        wrapped = _wrap(mode, pool, checkpointing)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
        losses = []
        for x in batches(3, batch=4 * world_size):
            local = x.chunk(world_size)[rank]
            micro = local.chunk(2) if accumulate else [local]
            for i, part in enumerate(micro):
                with wrapped.no_sync() if i < len(micro) - 1 else torch.enable_grad():
                    loss = wrapped(part, labels=part).loss
                    loss.backward()
                losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
        shards = [f.local_shard.clone() for f in wrapped.flat_params]
        state = [t.clone() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        results.append((losses, shards, state, wrapped._schedule.engine.pool))
    (pooled, shards, state, pool), (plain, plain_shards, plain_state, _) = results
    assert pool is not None and pool.requests > 0
    same = all(torch.equal(a, b) for a, b in zip(pooled + shards + state, plain + plain_shards + plain_state))
    return same, [float(v) for v in pooled]


@pytest.mark.parametrize("mode, checkpointing, accumulate", [
    ("plain", False, False), ("plain", True, True), ("bf16 (fp32 reduce)", False, True)])
def test_pooled_training_is_bitwise_the_unpooled(mode, checkpointing, accumulate):
    """losses, parameter shards and optimizer state after 3 steps (no_sync accumulation: the gradients of the
    quiet micro-batches are summed in a pooled block; bf16: the fp32 cast for the reduction is a pooled block)."""
    for same, losses in spawn(2, _equal_worker, mode, checkpointing, accumulate):
        assert same, losses


def test_a_full_gradient_something_else_holds_stays_with_its_holder():
    pool = BufferPool(max_free_blocks=2)
    grad = torch.arange(8.0)
    kept = grad[2:]  # e.g. a user's hook kept a view of it
    pool.give_back(grad)
    assert pool.free_bytes == 0 and torch.equal(kept, torch.arange(2.0, 8.0))
    del kept
    pool.give_back(grad)
    assert pool.free_bytes == 32 and grad.untyped_storage().nbytes() == 0


def test_the_pool_serves_the_newest_block_of_the_size_and_frees_the_oldest_beyond_its_bound():
    pool = BufferPool(max_free_blocks=3)
    blocks = [torch.empty(n, dtype=torch.uint8) for n in (64, 128, 64)]
    for block in blocks:
        pool.release(block.untyped_storage())
    newest = pool._free[-1]
    t = pool.tensor(16, torch.float32, torch.device("cpu"))  # 64 bytes: the newest 64-byte block
    assert t.untyped_storage().nbytes() == 64 and newest.nbytes() == 0 and pool.free_bytes == 192
    pool.tensor(100, torch.uint8, torch.device("cpu"))  # no 100-byte block: a fresh one
    assert pool.fresh_blocks == 1 and pool.free_bytes == 192
    for n in (32, 32):
        pool.release(torch.empty(n, dtype=torch.uint8).untyped_storage())
    assert [b.nbytes() for b in pool._free] == [128, 32, 32]  # the first 64-byte block, the oldest, went first


@pytest.mark.usefixtures("world_of_one")
def test_a_cuda_engine_leaves_reuse_to_the_caching_allocator():
    wrapped = _wrap("plain", pool=True)
    assert wrapped._schedule.engine.pool is not None
    simulate_cuda(wrapped)
    assert wrapped._schedule.engine.pool is None
