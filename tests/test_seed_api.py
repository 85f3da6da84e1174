"""Code written for haiscale's FSDP (the seed: ``../shared/seed/``) runs unchanged: its constructor, with each of
its arguments by keyword and by position (``module, process_group, auto_wrap_policy, reshard_after_forward,
backward_prefetch, forward_prefetch, fsdp_group_size``), and its documented examples: the training loop, the full
checkpoint saved and loaded under ``summon_full_params`` (and loaded by a plain model), and the per-rank
``state_dict`` / ``load_state_dict``.  The reference is the same loop in one process on the global batch."""
import os

import pytest
import torch
import torch.distributed as dist

from accel_flatshard import BackwardPrefetch, FullyShardedDataParallel, transformer_auto_wrap_policy
from dist_helpers import spawn
from models import global_mean
from toy import Block, Scale, Toy, toy_batches

TOL = 1e-6
STEPS = 3

# one case per constructor argument of the seed; (world size, keyword arguments, positional arguments after module)
CASES = {
    "defaults": (2, {}, None),
    "process_group": (2, {"process_group": "world"}, None),
    "auto_wrap_policy": (2, {"auto_wrap_policy": "blocks"}, None),
    "reshard_after_forward": (2, {"auto_wrap_policy": "blocks", "reshard_after_forward": False}, None),
    "backward_prefetch_post": (2, {"auto_wrap_policy": "blocks", "backward_prefetch": BackwardPrefetch.BACKWARD_POST},
                               None),
    "backward_prefetch_none": (2, {"auto_wrap_policy": "blocks", "backward_prefetch": None}, None),
    "forward_prefetch": (2, {"auto_wrap_policy": "blocks", "forward_prefetch": True}, None),
    "fsdp_group_size": (4, {"auto_wrap_policy": "blocks", "fsdp_group_size": 2}, None),
    "positional": (4, None, ("world", "blocks", True, BackwardPrefetch.BACKWARD_PRE, False, 2)),
}


def _resolve(value):
    if value == "world":
        return dist.new_group(list(range(dist.get_world_size())))
    if value == "blocks":
        return transformer_auto_wrap_policy([Block, Scale])
    return value


def _seed_examples(rank, world_size, case, root):
    _, kwargs, positional = CASES[case]
    model = Toy()
    if positional is not None:
        model = FullyShardedDataParallel(model, *[_resolve(v) for v in positional])
    else:
        model = FullyShardedDataParallel(model, **{k: _resolve(v) for k, v in kwargs.items()})
    # the seed's training example, word for word but for the data
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = []
    for x in toy_batches(STEPS):
        optimizer.zero_grad()
        output = model(x.chunk(world_size)[rank])
        output.backward()
        optimizer.step()
        losses.append(global_mean(output, world_size))  # (not the seed's: the global batch's loss, to compare)
    # the seed's full checkpoint: saved by rank 0 inside summon_full_params
    with model.summon_full_params():
        if rank == 0:
            state = model.state_dict()
            torch.save(state, os.path.join(root, "model.pt"))
    dist.barrier()
    trained = {k: v.clone() for k, v in torch.load(os.path.join(root, "model.pt"), map_location="cpu").items()}
    # FSDP model loads the full checkpoint (after its parameters were changed, so the load is seen)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = torch.load(os.path.join(root, "model.pt"), map_location="cpu")
    with model.summon_full_params():
        model.load_state_dict(state)
    with model.summon_full_params():
        reloaded = {k: v.clone() for k, v in model.state_dict().items()}
    # a plain model loads it too
    model2 = Toy(seed=1)
    model2.load_state_dict(state)
    plain_loss = model2(toy_batches(1, seed=9)[0]).item()
    # per-rank checkpoints: every rank saves and loads its own file
    state = model.state_dict()
    torch.save(state, os.path.join(root, f"model{rank}.pt"))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = torch.load(os.path.join(root, f"model{rank}.pt"), map_location="cpu")
    model.load_state_dict(state)
    with model.summon_full_params():
        per_rank = {k: v.clone() for k, v in model.state_dict().items()}
    shard_size = model.shard_group.shard_size
    return losses, trained, reloaded, plain_loss, per_rank, shard_size


def _reference():
    model = Toy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = []
    for x in toy_batches(STEPS):
        optimizer.zero_grad()
        output = model(x)
        output.backward()
        optimizer.step()
        losses.append(output.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_seeds_examples_run_unchanged(case, tmp_path):
    world_size = CASES[case][0]
    ref_losses, ref_state = _reference()
    results = spawn(world_size, _seed_examples, case, str(tmp_path))
    for losses, trained, reloaded, plain_loss, per_rank, shard_size in results:
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < TOL
        assert trained.keys() == ref_state.keys()
        assert max((trained[k] - ref_state[k]).abs().max().item() for k in ref_state) < TOL
        assert all(torch.equal(reloaded[k], trained[k]) for k in trained)  # summon load: exact
        assert all(torch.equal(per_rank[k], trained[k]) for k in trained)  # per-rank round trip: exact
        reference_plain = Toy(seed=1)
        reference_plain.load_state_dict(trained)
        assert plain_loss == reference_plain(toy_batches(1, seed=9)[0]).item()
    if case in ("fsdp_group_size", "positional"):  # hybrid: shard groups of 2, two replicas
        assert {r[-1] for r in results} == {2}
