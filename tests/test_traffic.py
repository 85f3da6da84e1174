"""Fewer bytes on the wire, exactly (issue 42): one all-gather per unit and pass, and backward gathers that stay
inside the machine (hpZ).

* A unit whose parameters form several flat parameters (a LoRA block: frozen base and trainable adapters; a root with
  a frozen embedding) issues one all-gather per pass, counted from the profiler's markers, and trains exactly as
  with one all-gather per flat parameter and as DDP.
* ``node_local_backward_gather`` at W=4 emulating 2 machines x 2 ranks (``ranks_per_node=2``): the bytes that cross
  machines per step are at most 2/3 of FULL_SHARD's without it (its backward all-gathers never cross, its reductions
  send 1/N across), training equals DDP's losses (and under hybrid sharding too), and a checkpoint resumes exactly.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy
from dist_helpers import spawn
from models import batches, full_params, global_mean, gpt2, llama, param_groups, train

STEPS = 4


def _lora_llama():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(llama(n_layer=3), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    for name, p in model.named_parameters():  # (PEFT's init makes B zero: give the adapters a gradient of their own)
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def _frozen_embedding_gpt2():
    """GPT-2 with its position embedding frozen: the root unit holds it beside the (tied) token embedding and the
    final norm, so its parameters form a frozen and a trainable flat parameter."""
    model = gpt2(n_layer=3)
    model.transformer.wpe.weight.requires_grad_(False)
    return model


MAKERS = {"lora": _lora_llama, "frozen-embedding": _frozen_embedding_gpt2}


def _counted_step(wrapped, x, rank, world_size):
    """One training forward and backward under the profiler: (all-gather collectives, unit gathers issued)."""
    from torch.profiler import profile

    from accel_flatshard.tools.profiling import step_phases

    with profile() as prof:
        local = x.chunk(world_size)[rank]
        wrapped(local, labels=local).loss.backward()
    names = [e.name for e in prof.events()]
    steps = step_phases(prof.events())
    return steps[0].get("all-gathers", 0), sum(n.startswith("flatshard::all_gather[") for n in names)


def _packed_runs(rank, world_size, name, p2p):
    torch.manual_seed(0)
    data = batches(STEPS, batch=world_size * 2)
    ddp = DDP(MAKERS[name]())
    out = {"ddp": train(ddp, data, rank, world_size, lr=1e-2)}
    for packed in (True, False):
        model = MAKERS[name]()
        wrapped = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model),
                                           pack_all_gathers=packed, gloo_p2p=p2p)
        multi = [u.name for u in wrapped.units if len(u.flat_params) > 1]
        collectives, gathers = _counted_step(wrapped, data[0], rank, world_size)
        wrapped.zero_grad(set_to_none=True)
        out[packed] = dict(losses=train(wrapped, data, rank, world_size, lr=1e-2), multi=multi,
                           collectives=collectives, gathers=gathers, params=full_params(wrapped))
    return out


@pytest.mark.parametrize("name,p2p", [("lora", True), ("frozen-embedding", True), ("lora", False)],
                         ids=["lora", "frozen-embedding", "lora-gloo-collectives"])
def test_one_all_gather_per_unit_and_pass_trains_exactly_as_per_flat_parameter_and_as_ddp(name, p2p):
    """Point-to-point (gloo's default) receives each flat parameter straight into its slot; with gloo's collectives
    (as NCCL's) the shards travel packed as bytes and are copied out."""
    out = spawn(2, _packed_runs, name, p2p)[0]
    packed, separate = out[True], out[False]
    assert packed["multi"], "the model must have units of several flat parameters"
    assert packed["collectives"] == packed["gathers"]  # one collective per unit gather (forward and backward)
    assert separate["collectives"] > separate["gathers"]  # (per flat parameter: more than one for some units)
    assert packed["losses"] == separate["losses"]  # bitwise: the same bytes arrive, only fewer messages
    assert all(torch.equal(packed["params"][k], separate["params"][k]) for k in packed["params"])
    assert max(abs(a - b) for a, b in zip(packed["losses"], out["ddp"])) <= 1e-6


# ---------------------------------------------------------------------- hpZ: 2 machines x 2 ranks, emulated
def _cross_machine_bytes(rank, world_size, name, settings):
    """Bytes this rank sends across machines in one step, by kind, and the step's losses against DDP's."""
    data = batches(STEPS, batch=world_size * 2)
    ddp_losses = train(DDP(HPZ_MODELS[name]()), data, rank, world_size)
    model = HPZ_MODELS[name]()
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model), ranks_per_node=2,
                                       **settings)
    opt = torch.optim.AdamW(param_groups(wrapped), lr=1e-3)  # (train's own optimizer, kept across the calls)
    losses = train(wrapped, data[:1], rank, world_size, optimizer=opt)
    before = dict(wrapped.shard_group.sent)
    losses += train(wrapped, data[1:2], rank, world_size, optimizer=opt)  # (a steady step: the second)
    step = {k: v - before.get(k, 0) for k, v in wrapped.shard_group.sent.items()}
    losses += train(wrapped, data[2:], rank, world_size, optimizer=opt)
    return ddp_losses, losses, step, wrapped.shard_group.node is not None


HPZ_MODELS = {"llama": lambda: llama(n_layer=4), "lora": _lora_llama}


@pytest.mark.parametrize("name", list(HPZ_MODELS))
def test_node_local_backward_gather_keeps_backward_gathers_inside_the_machine_halves_the_reduction_across_it(name):
    """Against FULL_SHARD's, the backward gathers' cross-machine bytes are gone, and the forward gathers' and the
    reduction's fall to 1/N (each shard crosses to its column peer once, then is gathered inside the machine; the
    reduction sums inside the machine first, then exchanges 1/N of each gradient across; N = 2 ranks per machine):
    at most 1/2 of FULL_SHARD's cross.  Training equals DDP's losses within 1e-6."""
    full_shard = spawn(4, _cross_machine_bytes, name, {})
    hpz = spawn(4, _cross_machine_bytes, name, {"node_local_backward_gather": True})
    for (ddp, losses, _, _) in full_shard + hpz:
        assert max(abs(a - b) for a, b in zip(losses, ddp)) <= 1e-6
    assert all(node for *_, node in hpz)
    for (_, _, before, _), (_, _, after, _) in zip(full_shard, hpz):
        inter = lambda sent: sum(v for (kind, where), v in sent.items() if where == "inter")  # noqa: E731
        assert after[("backward gather", "inter")] == 0 < before[("backward gather", "inter")]
        assert 2 * after[("reduction", "inter")] == before[("reduction", "inter")] > 0
        assert 2 * after[("forward gather", "inter")] == before[("forward gather", "inter")] > 0
        assert after[("forward gather", "intra")] > before[("forward gather", "intra")]
        assert after[("backward gather", "intra")] > before[("backward gather", "intra")]  # (now inside the machine)
        assert after[("reduction", "intra")] > before[("reduction", "intra")]
        assert inter(after) / inter(before) <= 1 / 2, (after, before)


def test_node_local_reduction_through_gloos_collectives_trains_like_ddp():
    """The two-stage reduction through reduce-scatter collectives (NCCL's path; here gloo's, without point-to-point)
    sends what the point-to-point one sends and trains like DDP."""
    settings = {"node_local_backward_gather": True, "gloo_p2p": False}
    for (ddp, losses, step, node) in spawn(4, _cross_machine_bytes, "llama", settings):
        assert node and max(abs(a - b) for a, b in zip(losses, ddp)) <= 1e-6
        assert step[("reduction", "inter")] > 0 and step[("backward gather", "inter")] == 0


def test_node_local_reduction_under_hybrid_sharding_trains_like_ddp():
    """Hybrid sharding over 2 shard groups of 2 machines x 2 ranks (W=8): each shard group reduces in two stages,
    then the replicas all-reduce; losses equal DDP's, and half the shard group's reduction crosses machines."""
    settings = {"fsdp_group_size": 4, "node_local_backward_gather": True}
    for (ddp, losses, step, node) in spawn(8, _cross_machine_bytes, "llama", settings):
        assert node and max(abs(a - b) for a, b in zip(losses, ddp)) <= 1e-6
        assert step[("backward gather", "inter")] == 0
        assert step[("reduction", "inter")] * 2 == step[("reduction", "intra")]  # (1 chunk across, 2 inside)
        assert step[("replica all-reduce", "inter")] > 0


def _hybrid_hpz(rank, world_size):
    """Hybrid sharding over machines of one rank (ranks_per_node=1): shard groups of 2 span two machines, the
    secondary slice is the whole unit, the backward gather a local copy; losses against DDP's."""
    data = batches(STEPS, batch=world_size * 2)
    ddp_losses = train(DDP(llama(n_layer=3)), data, rank, world_size)
    model = llama(n_layer=3)
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model), fsdp_group_size=2,
                                       ranks_per_node=1, node_local_backward_gather=True)
    losses = train(wrapped, data, rank, world_size)
    return ddp_losses, losses, wrapped.shard_group.sent[("backward gather", "inter")]


def test_node_local_backward_gather_under_hybrid_sharding_trains_like_ddp():
    for ddp_losses, losses, backward_inter in spawn(4, _hybrid_hpz):
        assert max(abs(a - b) for a, b in zip(losses, ddp_losses)) <= 1e-6
        assert backward_inter == 0


def _resume(rank, world_size, tmp):
    from accel_flatshard.state import (load_sharded_model,
                                       load_sharded_optimizer,
                                       save_sharded_model,
                                       save_sharded_optimizer)

    data = batches(2 * STEPS, batch=world_size * 2)

    def wrapped_and_optimizer():
        model = llama(n_layer=3)
        wrapped = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model),
                                           ranks_per_node=2, node_local_backward_gather=True)
        return wrapped, torch.optim.AdamW(param_groups(wrapped), lr=1e-3)

    wrapped, opt = wrapped_and_optimizer()
    train(wrapped, data[:STEPS], rank, world_size, optimizer=opt)
    save_sharded_model(wrapped, f"{tmp}/model")
    save_sharded_optimizer(wrapped, opt, f"{tmp}/optim")
    uninterrupted = train(wrapped, data[STEPS:], rank, world_size, optimizer=opt)
    resumed, opt = wrapped_and_optimizer()
    load_sharded_model(resumed, f"{tmp}/model")
    load_sharded_optimizer(resumed, opt, f"{tmp}/optim")
    return uninterrupted, train(resumed, data[STEPS:], rank, world_size, optimizer=opt)


def test_a_checkpoint_taken_with_node_local_backward_gather_resumes_exactly(tmp_path):
    for uninterrupted, resumed in spawn(4, _resume, str(tmp_path)):
        assert resumed == uninterrupted


def _hpz_features(rank, world_size, feature):
    """Two optimizer steps of two micro-batches each with ``feature``, hpZ on (2 machines x 2 ranks, emulated),
    against the plain model on the concatenated global batches."""
    from accel_flatshard import CPUOffload

    data = batches(2 * 2, batch=world_size * 2)
    model = llama(n_layer=3)
    settings = dict(ranks_per_node=2, node_local_backward_gather=True)
    if feature == "offload":
        settings["cpu_offload"] = CPUOffload(offload_params=True)
    if feature == "prefetch off":
        settings.update(forward_prefetch=False, backward_prefetch=None)
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model), **settings)
    if feature == "activation checkpointing":
        wrapped.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    losses = []
    for step in range(2):
        for micro in range(2):
            local = data[2 * step + micro].chunk(world_size)[rank]
            quiet = feature == "no_sync" and micro == 0
            with wrapped.no_sync() if quiet else contextlib.nullcontext():
                loss = wrapped(local, labels=local).loss / 2
                loss.backward()
            losses.append(global_mean(loss.detach(), world_size))
        opt.step()
        opt.zero_grad()
    return losses, wrapped.shard_group.sent[("backward gather", "inter")]


@pytest.mark.parametrize("feature", ["accumulation", "no_sync", "activation checkpointing", "offload", "prefetch off"])
def test_node_local_backward_gather_with_each_feature_trains_like_the_plain_model(feature):
    data = batches(2 * 2, batch=4 * 2)
    model = llama(n_layer=3)
    opt, expected = torch.optim.SGD(model.parameters(), lr=0.1), []
    for step in range(2):
        for micro in range(2):
            loss = model(data[2 * step + micro], labels=data[2 * step + micro]).loss / 2
            loss.backward()
            expected.append(loss.item())
        opt.step()
        opt.zero_grad()
    for losses, backward_inter in spawn(4, _hpz_features, feature):
        assert max(abs(a - b) for a, b in zip(losses, expected)) <= 1e-6
        assert backward_inter == 0


def _profiled_bytes(rank, world_size):
    """The phase table's bytes per step against the group's counters over the same steps."""
    from torch.profiler import profile

    from accel_flatshard.tools.profiling import phase_table, step_phases

    data = batches(3, batch=world_size * 2)
    model = llama(n_layer=3)
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model), ranks_per_node=2)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    with profile() as prof:  # (each optimizer step ends a step of the table)
        before = dict(wrapped.shard_group.sent)
        for x in data:
            local = x.chunk(world_size)[rank]
            wrapped(local, labels=local).loss.backward()
            opt.step()
            opt.zero_grad()
    sent = {k: v - before.get(k, 0) for k, v in wrapped.shard_group.sent.items()}
    return step_phases(prof.events()), phase_table(prof.events()), sent


def test_the_phase_table_shows_the_bytes_each_step_sends_by_kind_and_machine():
    for steps, table, sent in spawn(4, _profiled_bytes):
        assert len(steps) == 3
        for kind, where in sent:
            assert sum(s.get(f"sent {kind} {where}", 0) for s in steps) == sent[kind, where]
        assert steps[-1]["sent forward gather inter"] > 0 and steps[-1]["sent reduction intra"] > 0
        assert "| backward gather |" in table and "| all-gather collectives |" in table
