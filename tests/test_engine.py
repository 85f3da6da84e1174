"""Behaviour of the wrapped model: names, state dicts, tied/frozen parameters, odd call patterns, memory."""
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy
from dist_helpers import spawn
from models import batches, full_params, global_mean, gpt2, param_groups, train
from toy import Block, Scale, Toy, toy_batches

TOL = 1e-6


def _wrap_toy(**toy_kwargs):
    model = Toy(**toy_kwargs)
    return FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy([Block, Scale]))


def _toy_steps(model, rank, world_size, scenario, steps=4):
    """Train the toy model; ``scenario`` picks the call pattern.  Returns losses and eval outputs."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01, momentum=0.9)
    losses, evals = [], []
    data = toy_batches(steps * 2, batch=8)
    for step in range(steps):
        x1, x2 = (d.chunk(world_size)[rank] for d in data[2 * step: 2 * step + 2])
        if scenario == "two_forwards":  # a second forward before backward
            loss = model(x1) + model(x2)
        else:
            loss = model(x1)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss, world_size))
        if scenario == "eval":
            with torch.no_grad():
                evals.append(global_mean(model(x2), world_size))
    return losses, evals


def _toy_worker(rank, world_size, scenario, toy_kwargs):
    wrapped = _wrap_toy(**toy_kwargs)
    units = {u.name: u for u in wrapped.units}
    root_fqns = [s.fqn for f in units["<root>"].flat_params for s in f.layout.slots]
    losses, evals = _toy_steps(wrapped, rank, world_size, scenario)
    frozen_grads = [p.grad for n, p in wrapped.named_parameters() if not p.requires_grad]
    return losses, evals, full_params(wrapped), root_fqns, sorted(units), frozen_grads, wrapped.shard_group.bytes_reduced


@pytest.mark.parametrize("scenario,toy_kwargs", [
    ("plain", {}),
    ("two_forwards", {}),
    ("eval", {"freeze_embed": True}),
])
def test_toy_model_matches_single_process(scenario, toy_kwargs):
    reference = Toy(**toy_kwargs)
    ref_losses, ref_evals = _toy_steps(reference, 0, 1, scenario)
    losses, evals, params, root_fqns, unit_names, frozen_grads, _ = spawn(2, _toy_worker, scenario, toy_kwargs)[0]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < TOL
    assert max((abs(a - b) for a, b in zip(evals, ref_evals)), default=0) < TOL
    ref_sd = reference.state_dict()
    assert params.keys() == ref_sd.keys()
    assert max((params[k] - ref_sd[k]).abs().max().item() for k in ref_sd) < 1e-5
    # the weight tied across blocks 0 and 2 lives once, in their common ancestor (the root unit)
    assert "blocks.0.lin.weight" in root_fqns and "blocks.2.lin.weight" not in root_fqns
    assert unit_names == ["<root>", "blocks.0", "blocks.1", "blocks.2", "scale"]
    assert all(g is None for g in frozen_grads)


def _names_worker(rank, world_size):
    model = gpt2()
    before = dict(model.named_parameters())
    plain_sd = {k: v.clone() for k, v in model.state_dict().items()}
    opt_before_wrap = torch.optim.AdamW(param_groups(model), lr=1e-3)
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model))
    after = dict(wrapped.named_parameters())
    same_objects = before.keys() == after.keys() and all(before[k] is after[k] for k in before)
    local_sd = wrapped.local_state_dict()
    with wrapped.summon_full_params():
        inside = {k: v.clone() for k, v in wrapped.state_dict().items()}
        # load_state_dict inside summon writes through to the shards
        wrapped.load_state_dict({k: v * 0 + 0.5 if v.is_floating_point() else v for k, v in inside.items()})
    after_load = full_params(wrapped)
    with wrapped.summon_full_params():
        wrapped.load_state_dict(inside)
    # outside summon: each rank's shard, saved and loaded per rank
    saved_local = {k: v.clone() for k, v in wrapped.local_state_dict().items()}
    for p in wrapped.parameters():
        p.data.zero_()
    wrapped.load_local_state_dict(saved_local)
    restored = full_params(wrapped)
    # the optimizer made before wrapping trains the sharded model (state is 1-D, sharded)
    train(wrapped, batches(2, batch=world_size * 2), rank, world_size, optimizer=opt_before_wrap)
    state_shapes = [s["exp_avg"].shape for s in opt_before_wrap.state.values()]
    tied = model.lm_head.weight is model.transformer.wte.weight
    root_slots = [s.fqn for f in wrapped.units[0].flat_params for s in f.layout.slots]
    return dict(same_objects=same_objects, plain=plain_sd, inside=inside, after_load=after_load, restored=restored,
                local_shapes={k: tuple(v.shape) for k, v in local_sd.items()}, state_shapes=state_shapes,
                tied=tied, root_slots=root_slots)


def test_names_state_dicts_and_optimizer_made_before_wrapping():
    results = spawn(2, _names_worker)
    for r in results:
        assert r["same_objects"], "named_parameters must yield the original names and Parameter objects"
        assert r["inside"].keys() == r["plain"].keys()
        for k in r["plain"]:
            assert torch.equal(r["inside"][k], r["plain"][k]), k
            assert torch.equal(r["restored"][k], r["plain"][k]), k
        param_names = dict(gpt2().named_parameters()).keys()
        assert all(torch.all(r["after_load"][k] == 0.5) for k in param_names), "load inside summon must write back"
        assert all(len(r["local_shapes"][k]) == 1 for k in param_names), "outside summon, state_dict holds 1-D shards"
        assert all(len(s) == 1 for s in r["state_shapes"]), "optimizer state must be sharded (1-D)"
        assert r["tied"]
        assert r["root_slots"].count("transformer.wte.weight") == 1 and "lm_head.weight" not in r["root_slots"]
    # the two ranks' local shards partition each parameter
    for name, p in gpt2().named_parameters():
        assert sum(int(torch.tensor(r["local_shapes"][name]).prod()) for r in results) == p.numel(), name


def _memory_worker(rank, world_size):
    from models import llama
    data = batches(2, batch=world_size * 2)
    def footprint(model, opt):
        if hasattr(model, "flat_params"):  # count the real storage: shards and sharded grads, padding included
            return model.sharded_bytes() + sum(t.numel() * t.element_size() for s in opt.state.values()
                                               for t in s.values() if torch.is_tensor(t) and t.dim())
        tensors = {id(p): p for p in model.parameters()}
        tensors.update({id(p.grad): p.grad for p in model.parameters() if p.grad is not None})
        tensors.update({id(t): t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()})
        return sum(t.numel() * t.element_size() for t in tensors.values())
    ddp = DDP(llama())
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    train(ddp, data, rank, world_size, optimizer=ddp_opt)
    ddp(data[0], labels=data[0]).loss.backward()  # measure with gradients present
    model = llama()
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model))
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    train(wrapped, data, rank, world_size, optimizer=opt)
    wrapped(data[0], labels=data[0]).loss.backward()
    padding = sum((f.layout.padded_numel - f.layout.unpadded_numel) * f.local_shard.element_size() * 4 // world_size
                  for f in wrapped.flat_params)
    unsharded_alive = [f.unsharded.untyped_storage().nbytes() for f in wrapped.flat_params]
    return footprint(ddp.module, ddp_opt), footprint(wrapped, opt), padding, unsharded_alive


@pytest.mark.parametrize("world_size", [2, 4])
def test_params_grads_and_optimizer_state_are_one_over_w_of_ddp(world_size):
    for ddp_bytes, our_bytes, padding, unsharded_alive in spawn(world_size, _memory_worker):
        assert our_bytes <= ddp_bytes / world_size + padding + 64, (our_bytes, ddp_bytes)
        assert our_bytes >= ddp_bytes / world_size * 0.99
        assert not any(unsharded_alive), "no unit may stay gathered after a step"


def _embedding_gathers_worker(rank, world_size, checkpointing):
    from accel_flatshard.core.wrap import checkpoint_units
    from models import first_grads, llama

    data = batches(1, batch=world_size * 2)
    ddp_grads = {k.removeprefix("module."): g for k, g in first_grads(DDP(llama()), data[0], rank, world_size).items()}
    model = llama()
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model))
    if checkpointing:
        checkpoint_units(wrapped.module, [u.module for u in wrapped.units if not u.is_root])
    schedule = wrapped.schedule
    gathers, unshard = [], schedule.engine.unshard
    schedule.engine.unshard = lambda flats, label="", secondary=None, codes=None: (
        gathers.append((label, schedule.in_backward)), unshard(flats, label, secondary, codes))[1]
    grads = first_grads(wrapped, data[0], rank, world_size)
    error = max((grads[k] - ddp_grads[k]).abs().max().item() for k in ddp_grads)
    return gathers, error, grads.keys() == ddp_grads.keys()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_an_untied_input_embedding_is_gathered_for_its_forward_only(checkpointing):
    """Embedding's backward reads the indices, not the weight: its unit is not gathered again for backward
    (a recomputation of its forward under activation checkpointing gathers it), and the gradients equal DDP's."""
    gathers, error, same_keys = spawn(2, _embedding_gathers_worker, checkpointing)[0]
    embedding = "model.embed_tokens"
    assert gathers.count((embedding, False)) == 1
    assert gathers.count((embedding, True)) == (1 if checkpointing else 0), gathers
    assert gathers.count(("model.layers.0", True)) == 1, "a block is gathered again for its backward"
    assert same_keys and error < 1e-6, error


class _Reorderable(Toy):
    """Runs its blocks in reverse order when ``reverse`` is set (data-dependent control flow)."""

    reverse = False

    def forward(self, x):
        x = self.embed(x)
        for block in (reversed(self.blocks) if self.reverse else self.blocks):
            x = block(x)
        return self.head(x).pow(2).mean()


def _reorder_steps(model, rank, world_size, record):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for step, x in enumerate(toy_batches(4)):
        (model.module if hasattr(model, "module") else model).reverse = step == 2
        local = x.chunk(world_size)[rank]
        loss = model(local)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss, world_size))
    return losses


def _reorder_worker(rank, world_size):
    import warnings
    from accel_flatshard import BackwardPrefetch

    wrapped = FullyShardedDataParallel(_Reorderable(tie_blocks=False), auto_wrap_policy=transformer_auto_wrap_policy([Block]),
                                       forward_prefetch=True, backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = _reorder_steps(wrapped, rank, world_size, True)
    messages = [str(w.message) for w in caught if "different order" in str(w.message)]
    return losses, messages


def test_a_changed_unit_order_warns_once_naming_both_orders_and_stays_exact():
    ref = _reorder_steps(_Reorderable(tie_blocks=False), 0, 1, False)
    losses, messages = spawn(2, _reorder_worker)[0]
    assert max(abs(a - b) for a, b in zip(losses, ref)) < TOL
    assert len(messages) == 1, messages
    assert "recorded: ['<root>', 'blocks.0', 'blocks.1', 'blocks.2']" in messages[0]
    assert "'blocks.2'" in messages[0].split("now (so far):")[1]


def test_the_groups_the_engine_runs_on_share_one_interface(world_of_one):
    """ShardGroup and the tests' single-process stand-ins (identical ranks, identical replicas) are all
    ``comm.Collectives``: what the engine asks of a group is written once."""
    from accel_flatshard.core.comm import Collectives, ShardGroup
    from test_sim_paths import IdenticalReplicas
    from test_streams import _IdenticalRanksGroup

    group = ShardGroup()
    for stand_in in (group, _IdenticalRanksGroup(4, 2), IdenticalReplicas(group)):
        assert isinstance(stand_in, Collectives), type(stand_in).__name__
    assert not isinstance(object(), Collectives)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_average_after_the_sum_is_bitwise_fsdp1s_split_for_a_power_of_two(world, dtype):
    """Engine._divisors: without float16 and with W a power of two the engine divides the summed shard by W instead of
    every full gradient by f before the sum and by W / f after; each factor is an exact scaling, so the gradients are
    bitwise the same, exact or through int8 (where the blocks' scales scale alike)."""
    from accel_flatshard.core.engine import gradient_predivide_factor
    from accel_flatshard.core.int8 import quantize_for_reduction, sum_dequantized

    g = torch.Generator().manual_seed(world)
    grads = [(torch.randn(4096, generator=g) * 10.0 ** torch.randint(-6, 3, (4096,), generator=g)).to(dtype)
             for _ in range(world)]
    pre = float(gradient_predivide_factor(world))
    split = sum(x / pre for x in grads) * (1.0 / (world / pre))
    after = sum(grads) * (1.0 / world)
    assert torch.equal(split, after)
    quantized = [quantize_for_reduction(x.float(), world, 256, "g") for x in grads]
    halves = [quantize_for_reduction(x.float() / pre, world, 256, "g") for x in grads]

    def reduced(parts, scale):  # rank 0's chunk: every source's row 0, summed in float32, then scaled
        q, s = torch.stack([p[0][0] for p in parts]), torch.stack([p[1][0] for p in parts])
        return sum_dequantized(q, s, 256, torch.empty(q.shape[1])) * scale

    assert torch.equal(reduced(halves, 1.0 / (world / pre)), reduced(quantized, 1.0 / world))
