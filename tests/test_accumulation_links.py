"""Accumulation over slow links (issue 51, part 3): ``keep_gathered_across_micro_batches`` and
``defer_cross_machine_reduce``, at W=4 with 2 ranks per machine (two machines).

Each run trains 2 optimizer steps of 4 micro-batches (``no_sync`` on the first 3) of a tiny Llama and is held to a
single process training the same global batches with the same accumulation (losses, the first step's gradients,
the parameters after the steps), as tests/test_parity.py does; one more counts the bytes each step sends across
machines (``ShardGroup.sent``), one runs through accelerate's ``accumulate`` with the variables set, and one checks
the wrap-time error of a model with nothing to defer.
"""
import collections
import contextlib

import pytest
import torch
import torch.distributed as dist

from dist_helpers import spawn
from models import batches, full_params, global_mean, llama, llama_layer_class

STEPS, MICRO, LR = 2, 4, 1e-3
LOSS_TOL, GRAD_TOL, PARAM_TOL = 1e-6, 1e-6, 1e-5  # (tests/test_parity.py's)
MACHINES = dict(ranks_per_node=2)  # W=4: ranks 0-1 on one machine, 2-3 on the other
HYBRID = dict(MACHINES, fsdp_group_size=2)  # shard groups inside a machine, replicas across
HPZ = dict(MACHINES, node_local_backward_gather=True)  # one shard group over both machines
KEEP, DEFER = dict(keep_gathered_across_micro_batches=True), dict(defer_cross_machine_reduce=True)


def _data(world: int) -> list:
    return batches(STEPS * MICRO, batch=world)  # one row per rank and micro-batch


def _gathered_grads(wrapped) -> dict:
    """The sharded gradients, gathered over the shard group, by parameter name."""
    grads = {}
    for flat in wrapped.flat_params:
        if flat.sharded_grad is None:
            continue
        full = torch.empty(flat.layout.padded_numel, dtype=flat.sharded_grad.dtype)
        dist.all_gather_into_tensor(full, flat.sharded_grad.contiguous(), group=wrapped.shard_group.shard_group)
        for slot in flat.layout.slots:
            grads[slot.fqn] = full[slot.offset: slot.offset + slot.numel].view(slot.shape).clone()
    return grads


def _train(model, data, rank=0, world=1, raw=False):
    """``STEPS`` AdamW steps of ``len(data) // STEPS`` micro-batches each (no_sync on all but the last); returns the
    global-mean loss per step, the first step's gradients, and the bytes each step sent by (kind, intra | inter)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    sharded = hasattr(model, "flat_params")
    losses, grads, sent = [], None, []
    per_step = len(data) // STEPS
    for step in range(STEPS):
        before = collections.Counter(model.shard_group.sent) if sharded else None
        total = 0.0
        for i, x in enumerate(data[step * per_step:(step + 1) * per_step]):
            local = x.chunk(world)[rank]
            quiet = sharded and i < per_step - 1
            if raw:  # FSDP2's switches instead of no_sync (the wrapper's docstring example)
                model.set_reshard_after_backward(not quiet)
                model.set_requires_all_reduce(not quiet)
            with model.no_sync() if quiet and not raw else contextlib.nullcontext():
                loss = model(local, labels=local).loss / per_step
                loss.backward()
            total += global_mean(loss, world)
        if step == 0:
            grads = _gathered_grads(model) if sharded else {
                n: p.grad.detach().clone() for n, p in model.named_parameters()}
        if sharded:
            sent.append({k: v for k, v in (collections.Counter(model.shard_group.sent) - before).items()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses, grads, sent


def _wrap(settings: dict):
    from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy

    model = llama()
    return FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model), **settings)


def _sharded_runs(rank, world, runs, raw=False):
    """Each of ``runs`` (settings, global batches) on a fresh model: losses, first grads, params, bytes per step
    (``raw``: accumulating through set_reshard_after_backward / set_requires_all_reduce, not no_sync)."""
    out = []
    for settings, data in runs:
        wrapped = _wrap(settings)
        losses, grads, sent = _train(wrapped, data, rank, world, raw)
        out.append((losses, grads, full_params(wrapped), sent))
    return out


def _reference():
    model = llama()
    losses, grads, _ = _train(model, _data(4))
    return losses, grads, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _check_matches_reference(settings, raw=False):
    ref_losses, ref_grads, ref_params = _reference()
    losses, grads, params, sent = spawn(4, _sharded_runs, [(settings, _data(4))], raw)[0][0]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < LOSS_TOL, (losses, ref_losses)
    assert grads.keys() == ref_grads.keys()
    scale = max(g.abs().max().item() for g in ref_grads.values())
    grad_err = max((grads[k] - ref_grads[k]).abs().max().item() for k in grads) / scale
    assert grad_err < GRAD_TOL, grad_err
    assert params.keys() == ref_params.keys()
    param_err = max((params[k] - ref_params[k]).abs().max().item() for k in params)
    assert param_err < PARAM_TOL, param_err
    return sent


def test_hybrid_defer_cross_machine_reduce_matches_single_process():
    _check_matches_reference(dict(HYBRID, **DEFER))


@pytest.mark.ci
def test_hpz_defer_cross_machine_reduce_matches_single_process():
    _check_matches_reference(dict(HPZ, **DEFER))


@pytest.mark.ci
def test_full_shard_keep_gathered_across_micro_batches_matches_single_process():
    _check_matches_reference(dict(MACHINES, **KEEP))


@pytest.mark.ci
def test_hybrid_keep_gathered_and_defer_match_single_process():
    _check_matches_reference(dict(HYBRID, **KEEP, **DEFER))


def test_fsdp2_switches_in_a_raw_loop_match_single_process_and_cross_machines_once():
    """set_reshard_after_backward(False) and set_requires_all_reduce(False) on the first 3 micro-batches (hybrid):
    the reference's result, one replica all-reduce's bytes per step, and backward gathers only in the first
    micro-batch (the switch keeps units after backward; the input embedding, which its backward does not gather, is
    still gathered by every forward)."""
    sent = _check_matches_reference(HYBRID, raw=True)[-1]
    one_step = spawn(4, _sharded_runs, [(HYBRID, _data(4)[::MICRO])])[0][0][3][-1]
    assert _bytes(sent, "replica all-reduce", "inter") == _bytes(one_step, "replica all-reduce", "inter") > 0
    assert _bytes(sent, "backward gather", "intra") == _bytes(one_step, "backward gather", "intra") > 0
    assert _bytes(one_step, "forward gather", "intra") < _bytes(sent, "forward gather", "intra") \
        < 2 * _bytes(one_step, "forward gather", "intra")


def _bytes(sent: dict, kind: str, where: str) -> int:
    return sum(v for (k, w), v in sent.items() if k == kind and w == where)


def test_bytes_per_step_cross_machines_once_and_gather_once():
    """Per optimizer step (the second: the first records the order), 4 micro-batches with the options send across
    machines what one micro-batch sends without them (not 4x); keep_gathered gathers one forward's worth."""
    data, one_micro = _data(4), _data(4)[::MICRO]  # one micro-batch a step: the baseline
    runs = [(dict(HYBRID, **DEFER), data), (HYBRID, one_micro), (dict(HPZ, **DEFER), data), (HPZ, one_micro),
            (dict(MACHINES, **KEEP), data), (MACHINES, one_micro)]
    results = spawn(4, _sharded_runs, runs)
    for rank_results in results:
        (hd, h1, pd, p1, kd, k1) = [r[3][-1] for r in rank_results]
        # hybrid: the replica all-reduce (across machines) once a step; the reduce-scatter (inside) every micro-batch
        assert _bytes(hd, "replica all-reduce", "inter") == _bytes(h1, "replica all-reduce", "inter") > 0
        assert _bytes(hd, "reduction", "intra") == MICRO * _bytes(h1, "reduction", "intra") > 0
        # hpZ: the second stage once a step, the first (inside the machine) every micro-batch
        assert _bytes(pd, "reduction", "inter") == _bytes(p1, "reduction", "inter") > 0
        assert _bytes(pd, "reduction", "intra") == MICRO * _bytes(p1, "reduction", "intra") > 0
        # keep_gathered: each unit gathered once a step (in forward), none in backward
        gathered = sum(_bytes(kd, kind, w) for kind in ("forward gather", "backward gather")
                       for w in ("intra", "inter"))
        assert gathered == _bytes(k1, "forward gather", "intra") + _bytes(k1, "forward gather", "inter") > 0
        assert _bytes(k1, "backward gather", "inter") > 0  # (without it, backward gathers again)


def _accelerate_run(rank, world, env):
    """accelerate's ``accumulate`` over 4 micro-batches, the options from the environment."""
    import os

    from accelerate.state import AcceleratorState, GradientState

    from accel_flatshard.integrations.accelerate import Accelerator

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    os.environ.update(env)
    accelerator = Accelerator(gradient_accumulation_steps=MICRO)
    plain = llama()
    model, optimizer = accelerator.prepare(plain, torch.optim.AdamW(plain.parameters(), lr=LR))
    assert model.options.keep_gathered_across_micro_batches and model.options.defer_cross_machine_reduce
    losses, total = [], 0.0
    for i, x in enumerate(_data(world)):
        local = x.chunk(world)[rank]
        with accelerator.accumulate(model):
            loss = model(local, labels=local).loss
            total += global_mean(loss, world) / MICRO
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            losses.append(total)
            total = 0.0
    return losses, full_params(model)


@pytest.mark.ci
def test_accelerate_accumulate_with_the_variables_matches_single_process():
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
           "FSDP_TRANSFORMER_CLS_TO_WRAP": llama_layer_class().__name__, "FSDP_SHARDING_STRATEGY": "HYBRID_SHARD",
           "FLATSHARD_FSDP_GROUP_SIZE": "2", "FLATSHARD_RANKS_PER_NODE": "2",
           "FLATSHARD_KEEP_GATHERED_ACROSS_MICRO_BATCHES": "1", "FLATSHARD_DEFER_CROSS_MACHINE_REDUCE": "1"}
    ref_losses, _, ref_params = _reference()
    losses, params = spawn(4, _accelerate_run, env)[0]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < LOSS_TOL, (losses, ref_losses)
    assert max((params[k] - ref_params[k]).abs().max().item() for k in params) < PARAM_TOL


def _wrap_nothing_to_defer(rank, world):
    with pytest.raises(ValueError, match="defer_cross_machine_reduce.*FLATSHARD_DEFER_CROSS_MACHINE_REDUCE"):
        _wrap(dict(MACHINES, **DEFER))  # FULL_SHARD without hpZ: no stage that stays inside a machine
    return True


def test_defer_without_hybrid_or_hpz_is_refused_at_wrap_time():
    assert spawn(2, _wrap_nothing_to_defer) == [True, True]
