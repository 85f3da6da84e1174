"""``torch.optim.Muon`` over sharded matrices (issue 44; ``accel_flatshard/features/matrix_optim.py``).

Muon over the hidden 2-D matrices and AdamW over the rest, as torch's Muon docs split them, built before
``accelerator.prepare`` and handed to it with the model.  The reference is what a user would pick: DDP running the
same optimizers on the same global batch (and one process, to know how far DDP itself is from it).  Each run:
10 steps of a tiny Llama, a ``save_state`` after step 5, then ``load_state`` and steps 6-10 again.

Default: W=2 (parity, resume, memory, no gather in the step), Muon's own error on every rank, the conversions of the
optimizer state (full dict = one process's Muon's; a SHARDED checkpoint saved at W=2 resumes at W=1).  ``ci``: W=4,
hybrid 2x2, FULL_STATE_DICT, a SHARDED resume at W=3, the Trainer's ``optimizers=``.
"""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

import models
from dist_helpers import spawn, trainer_args, trainer_run_and_resume

from accel_flatshard import ChainedOptimizer
from accel_flatshard.features.matrix_optim import balance_matrix_owners

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")

STEPS, SAVE_AFTER = 10, 5
LOSS_TOL = PARAM_TOL = 1e-4  # the bounds (params: or the difference DDP shows against one process)
RESUME_TOL = 1e-6


def _data():
    return models.batches(STEPS, batch=8, seq=8)  # 8 rows: 2 or 4 ranks get equal slices


def _split(model):
    """Muon's documented split: the 2-D matrices of the hidden layers; AdamW: embeddings, LM head, norms."""
    hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and not n.startswith(("model.embed", "lm_head"))]
    ids = {id(p) for p in hidden}
    return hidden, [p for p in model.parameters() if id(p) not in ids]


# Muon's two documented recipes.  "docs": its example's lr=0.02 (with the default "original" lr adjustment);
# "adamw_matched": adjust_lr_fn="match_rms_adamw" with an AdamW-sized lr.  With lr=0.02 a gradient perturbed by
# 1e-7 (relative, about one rounding) moves this tiny Llama's loss by up to 4e-4 within 10 steps (Newton-Schulz in
# bf16 amplifies it), by 1.4e-5 with the matched recipe.  At W=2 our reduced gradient equals DDP's bit for bit (two
# halves summed: one rounding either way), so the docs' recipe is compared; at W=4 and hybrid the sum's order
# differs from gloo's all-reduce, so the matched recipe is, where 1e-4 is above that rounding noise.
RECIPES = {"docs": dict(lr=0.02, weight_decay=0.1),
           "adamw_matched": dict(lr=1e-3, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")}


def _optimizers(model, recipe="docs"):
    hidden, rest = _split(model)
    return [torch.optim.Muon(hidden, **RECIPES[recipe]),
            torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.01)]


def _step(model, optimizers, x, rank, world, backward=None):
    local = x.chunk(world)[rank]
    loss = model(local, labels=local).loss
    (backward or torch.Tensor.backward)(loss)
    for o in optimizers:
        o.step()
    for o in optimizers:
        o.zero_grad()
    return models.global_mean(loss, world)


def _fsdp_env(state_dict_type="SHARDED_STATE_DICT", fsdp_group_size=None):
    """What ``accelerate launch`` exports for the README yaml (its FSDP keys), in this rank."""
    for k in [k for k in os.environ if k.startswith(("FSDP_", "FLATSHARD_", "ACCELERATE_"))]:
        del os.environ[k]
    os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_AUTO_WRAP_POLICY="TRANSFORMER_BASED_WRAP",
                      FSDP_TRANSFORMER_CLS_TO_WRAP="LlamaDecoderLayer", FSDP_SYNC_MODULE_STATES="true",
                      FSDP_STATE_DICT_TYPE=state_dict_type,
                      FSDP_SHARDING_STRATEGY="HYBRID_SHARD" if fsdp_group_size else "FULL_SHARD")
    if fsdp_group_size:
        os.environ["FLATSHARD_FSDP_GROUP_SIZE"] = str(fsdp_group_size)


def _references(rank, world, recipe):
    """(one process's losses and parameters on rank 0 or None, DDP's losses and parameters)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    single = None
    if rank == 0:
        model = models.llama(n_layer=2)
        opts = _optimizers(model, recipe)
        losses = [_step(model, opts, x, 0, 1) for x in _data()]
        single = (losses, {n: p.detach().clone() for n, p in model.named_parameters()})
    model = models.llama(n_layer=2)
    opts = _optimizers(model, recipe)
    ddp = DDP(model)
    losses = [_step(ddp, opts, x, rank, world) for x in _data()]
    return single, (losses, {n: p.detach().clone() for n, p in model.named_parameters()})


def _parity_and_resume(rank, world, root, state_dict_type="SHARDED_STATE_DICT", fsdp_group_size=None, recipe="docs"):
    """DDP / one process, then ours through ``accelerator.prepare``: losses, parameters, the held Muon state, the
    bytes gathered during the optimizer steps, and the losses of steps 6-10 again after ``load_state``."""
    single, ddp = _references(rank, world, recipe)
    _fsdp_env(state_dict_type, fsdp_group_size)
    from accel_flatshard.integrations.accelerate import Accelerator
    from accel_flatshard.features.matrix_optim import owner_computes_of

    acc = Accelerator()
    model = models.llama(n_layer=2)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    muon, adamw = _optimizers(model, recipe)
    model, muon, adamw = acc.prepare(model, muon, adamw)
    group = model.shard_group
    losses, gathered_in_steps = [], 0
    for i, x in enumerate(_data()):
        if i == SAVE_AFTER:
            acc.save_state(os.path.join(root, "state"))
        local = x.chunk(world)[rank]
        loss = model(local, labels=local).loss
        acc.backward(loss)
        before = group.bytes_gathered
        muon.step()
        adamw.step()
        gathered_in_steps += group.bytes_gathered - before
        muon.zero_grad()
        adamw.zero_grad()
        losses.append(models.global_mean(loss, world))
    owner = owner_computes_of(muon.optimizer)
    owned = sum(m.numel for m in owner.matrices if m.owner == group.shard_rank)
    held = {n: tuple(v.shape) for p, st in muon.optimizer.state.items() for k, v in st.items()
            for n in [next(m.fqn for m in owner.matrices if m.param is p)]}
    muon_state_numel = sum(v.numel() for st in muon.optimizer.state.values() for v in st.values())
    full = models.full_params(model)
    acc.load_state(os.path.join(root, "state"))
    resumed = [_step(model, [muon, adamw], x, rank, world, acc.backward) for x in _data()[SAVE_AFTER:]]
    return {"single": single, "ddp": ddp, "losses": losses, "params": full, "resumed": resumed,
            "held": held, "shapes": shapes, "owned": owned, "muon_state_numel": muon_state_numel,
            "gathered_in_steps": gathered_in_steps, "shard_rank": group.shard_rank,
            "owners": {m.fqn: m.owner for m in owner.matrices}}


def _check_parity(results, world):
    single_losses, single_params = results[0]["single"]
    ddp_losses, ddp_params = results[0]["ddp"]
    ours = results[0]
    dloss = max(abs(a - b) for a, b in zip(ours["losses"], ddp_losses))
    ddp_vs_single = max((ddp_params[k] - single_params[k]).abs().max().item() for k in ddp_params)
    dparam = max((ours["params"][k] - ddp_params[k]).abs().max().item() for k in ddp_params)
    assert dloss <= LOSS_TOL, (dloss, ours["losses"], ddp_losses)
    assert dparam <= max(ddp_vs_single, PARAM_TOL), (dparam, ddp_vs_single)
    assert max(abs(a - b) for a, b in zip(ours["losses"], single_losses)) <= max(  # (as far as DDP is from it)
        abs(a - b) for a, b in zip(ddp_losses, single_losses)) + LOSS_TOL
    resumed = max(abs(a - b) for a, b in zip(ours["resumed"], ours["losses"][SAVE_AFTER:]))
    assert resumed <= RESUME_TOL, (ours["resumed"], ours["losses"][SAVE_AFTER:])
    for r in results:  # every rank holds the momentum of the matrices it owns, whole, and nothing else
        owned = {n for n, o in r["owners"].items() if o == r["shard_rank"]}
        assert r["held"] == {n: r["shapes"][n] for n in owned}, (r["held"], owned)
        assert r["muon_state_numel"] == r["owned"]
        assert r["gathered_in_steps"] == 0  # no all-gather of the model in the optimizer step
    shard_size = len({r["shard_rank"] for r in results})
    loads = [sum(r["owned"] for r in results if r["shard_rank"] == s) / (len(results) // shard_size)
             for s in range(shard_size)]
    largest = max(int(torch.Size(s).numel()) for s in results[0]["shapes"].values() if len(s) == 2)
    assert max(loads) - min(loads) <= largest, loads
    return dloss, dparam, ddp_vs_single


# ---------------------------------------------------------------------- in-process
def test_owners_are_balanced_by_matrix_size():
    assert balance_matrix_owners([4, 4, 2, 2, 1], 2) == [0, 1, 0, 1, 0]
    sizes = [1024] * 8 + [2048] * 6
    owners = balance_matrix_owners(sizes, 4)
    loads = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(4)]
    assert max(loads) - min(loads) <= max(sizes) and sorted(set(owners)) == [0, 1, 2, 3]
    assert balance_matrix_owners([5, 7], 1) == [0, 0]


def test_chained_optimizer_steps_saves_and_loads_like_its_optimizers():
    """Muon + AdamW chained: the same updates as the two stepped apart; its state dict loads back exactly."""
    a, b = models.llama(n_layer=1), models.llama(n_layer=1)
    chained, apart = ChainedOptimizer(_optimizers(a)), _optimizers(b)
    for x in models.batches(3):
        _step(a, [chained], x, 0, 1)
        _step(b, apart, x, 0, 1)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    saved = chained.state_dict()
    assert len(saved["param_groups"]) == 2 and len(saved["state"]) == len(list(a.parameters()))
    again = ChainedOptimizer(_optimizers(a))
    again.load_state_dict(saved)
    for p in a.parameters():
        for key, value in chained.state[p].items():
            assert torch.equal(torch.as_tensor(again.state[p][key]), torch.as_tensor(value)), key
    again.param_groups[0]["lr"] = 0.5  # a scheduler's change reaches the optimizer of that group
    assert again.optimizers[0].param_groups[0]["lr"] == 0.5


def test_a_group_added_to_the_chained_optimizer_is_refused_naming_where_to_add_it():
    model = models.llama(n_layer=1)
    chained = ChainedOptimizer(_optimizers(model))
    with pytest.raises(NotImplementedError, match=r"add the group to one of the chained optimizers"):
        chained.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    assert len(chained.param_groups) == 2  # unchanged


# ---------------------------------------------------------------------- W=2 (default)
def test_muon_at_w2_through_prepare_equals_ddp_and_resumes(tmp_path):
    results = spawn(2, _parity_and_resume, str(tmp_path))
    dloss, dparam, ddp_vs_single = _check_parity(results, 2)
    print(f"W=2: max |dloss| vs DDP {dloss:.2e}, max |dparam| {dparam:.2e} (DDP vs one process {ddp_vs_single:.2e})")


def _own_error(rank, world):
    from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy

    model = models.llama(n_layer=1)
    muon = torch.optim.Muon(_split(model)[0], lr=0.02)
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model))
    muon.add_param_group({"params": [model.model.norm.weight]})  # (Muon checks 2-D only in its constructor)
    x = models.batches(1)[0].chunk(world)[rank]
    wrapped(x, labels=x).loss.backward()
    before = [p.detach().clone() for p in wrapped.parameters()]
    try:
        muon.step()
    except ValueError as e:
        error = str(e)
    else:
        error = None
    unchanged = all(torch.equal(a, b) for a, b in zip(before, wrapped.parameters()))
    return error, unchanged


def test_muons_own_error_is_raised_on_every_rank_as_muon_raises_it():
    model = models.llama(n_layer=1)
    muon = torch.optim.Muon(_split(model)[0], lr=0.02)
    muon.add_param_group({"params": [model.model.norm.weight]})
    x = models.batches(1)[0]
    model(x, labels=x).loss.backward()
    with pytest.raises(ValueError) as expected:
        muon.step()
    for error, unchanged in spawn(2, _own_error):
        assert error == str(expected.value), error  # "Param gradient must be a 2D matrix"
        assert unchanged  # raised before anything was exchanged or written


def _conversions(rank, world, root):
    """The full optimizer state dict is one process's Muon's (to torch's format and back); the SHARDED optimizer
    checkpoint saved here is resumed at W=1 by the test."""
    from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy
    from accel_flatshard.state import (full_optim_state_dict, load_full_optim_state_dict, save_sharded_model,
                                       save_sharded_optimizer)

    model = models.llama(n_layer=2)
    muon, adamw = _optimizers(model)
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model))
    data = _data()
    for x in data[:3]:
        _step(wrapped, [muon, adamw], x, rank, world)
    osd = full_optim_state_dict(wrapped, muon)
    save_sharded_model(wrapped, os.path.join(root, "model"))
    save_sharded_optimizer(wrapped, muon, os.path.join(root, "muon"))
    save_sharded_optimizer(wrapped, adamw, os.path.join(root, "adamw"))
    after = [_step(wrapped, [muon, adamw], x, rank, world) for x in data[3:5]]
    load_full_optim_state_dict(wrapped, muon, osd or None)  # rank 0's dict, broadcast: back to the owners
    return {"osd": osd, "after": after, "reloaded": full_optim_state_dict(wrapped, muon)}


def test_optimizer_state_dicts_convert_and_a_sharded_checkpoint_resumes_at_another_world_size(tmp_path, world_of_one):
    from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy
    from accel_flatshard.state import (load_sharded_model, load_sharded_optimizer, optim_state_dict_from_torch,
                                       optim_state_dict_to_torch)

    ours = spawn(2, _conversions, str(tmp_path))[0]
    plain = models.llama(n_layer=2)  # one process, the global batch
    muon, adamw = _optimizers(plain)
    data = _data()
    for x in data[:3]:
        _step(plain, [muon, adamw], x, 0, 1)
    reference = optim_state_dict_from_torch(muon.state_dict(), plain, muon)
    assert ours["osd"]["state"].keys() == reference["state"].keys()
    for name, entry in reference["state"].items():
        torch.testing.assert_close(ours["osd"]["state"][name]["momentum_buffer"], entry["momentum_buffer"],
                                   rtol=0, atol=1e-5)  # (gradients: a sum over 2 ranks vs one)
    other = torch.optim.Muon(_split(plain)[0], lr=0.02, weight_decay=0.1)
    other.load_state_dict(optim_state_dict_to_torch(ours["osd"], plain, other))  # a plain Muon takes it as is
    assert all(v["momentum_buffer"].shape == p.shape for p, v in other.state.items())

    # the W=2 SHARDED checkpoint at W=1: the next steps are those of the uninterrupted W=2 run
    model = models.llama(n_layer=2)
    muon, adamw = _optimizers(model)
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model))
    load_sharded_model(wrapped, str(tmp_path / "model"))
    load_sharded_optimizer(wrapped, muon, str(tmp_path / "muon"))
    load_sharded_optimizer(wrapped, adamw, str(tmp_path / "adamw"))
    resumed = [_step(wrapped, [muon, adamw], x, 0, 1) for x in data[3:5]]
    assert max(abs(a - b) for a, b in zip(resumed, ours["after"])) <= 1e-5, (resumed, ours["after"])
    for name, entry in ours["osd"]["state"].items():  # the full dict loaded back is what was saved
        assert torch.equal(ours["reloaded"]["state"][name]["momentum_buffer"], entry["momentum_buffer"]), name


# ---------------------------------------------------------------------- ci: W=4, hybrid 2x2, FULL, the Trainer
@pytest.mark.ci
@pytest.mark.parametrize("world,fsdp_group_size,state_dict_type", [(4, None, "SHARDED_STATE_DICT"),
                                                               (4, 2, "FULL_STATE_DICT"),
                                                               (2, None, "FULL_STATE_DICT")],
                         ids=["w4", "hybrid-2x2-full", "w2-full"])
def test_muon_equals_ddp_and_resumes(tmp_path, world, fsdp_group_size, state_dict_type):
    recipe = "docs" if world == 2 else "adamw_matched"
    results = spawn(world, _parity_and_resume, str(tmp_path), state_dict_type, fsdp_group_size, recipe, timeout_s=600)
    dloss, dparam, ddp_vs_single = _check_parity(results, world)
    print(f"W={world} G={fsdp_group_size}: max |dloss| vs DDP {dloss:.2e}, max |dparam| {dparam:.2e} "
          f"(DDP vs one process {ddp_vs_single:.2e})")


def _resume_at(rank, world, root, save):
    """W=2 saves after 3 steps (SHARDED), W=3 loads it; both return the next 2 losses."""
    from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy
    from accel_flatshard.state import (load_sharded_model,
                                       load_sharded_optimizer,
                                       save_sharded_model,
                                       save_sharded_optimizer)

    model = models.llama(n_layer=2)
    muon, adamw = _optimizers(model)
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model))
    data = models.batches(6, batch=12, seq=8)  # 12 rows: equal slices on 2 and 3 ranks
    names = ("model", "muon", "adamw")
    if save:
        for x in data[:3]:
            _step(wrapped, [muon, adamw], x, rank, world)
        for name, opt in zip(names, (None, muon, adamw)):
            path = os.path.join(root, name)
            save_sharded_model(wrapped, path) if opt is None else save_sharded_optimizer(wrapped, opt, path)
    else:
        load_sharded_model(wrapped, os.path.join(root, "model"))
        load_sharded_optimizer(wrapped, muon, os.path.join(root, "muon"))
        load_sharded_optimizer(wrapped, adamw, os.path.join(root, "adamw"))
    return [_step(wrapped, [muon, adamw], x, rank, world) for x in data[3:5]]


@pytest.mark.ci
def test_sharded_muon_checkpoint_saved_at_w2_resumes_at_w3(tmp_path):
    uninterrupted = spawn(2, _resume_at, str(tmp_path), True)[0]
    resumed = spawn(3, _resume_at, str(tmp_path), False)[0]
    assert max(abs(a - b) for a, b in zip(resumed, uninterrupted)) <= 1e-5, (resumed, uninterrupted)


def _trainer(rank, world, root, ddp):
    """The Trainer with ``optimizers=(ChainedOptimizer([muon, adamw]), None)``, under the README yaml's FSDP keys
    (or DDP); a checkpoint at step 4 and a resume from it."""
    import datasets
    import transformers

    if not ddp:
        _fsdp_env()
        from accel_flatshard import register

        register()
    datasets.disable_progress_bars()
    ids = torch.cat(_data())
    ds = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()}).with_format("torch")

    def make_trainer(out):
        model = models.llama(n_layer=2)
        return transformers.Trainer(model=model, args=trainer_args(out, world, learning_rate=1e-2), train_dataset=ds,
                                    optimizers=(ChainedOptimizer(_optimizers(model)), None))

    return trainer_run_and_resume(make_trainer, root)


@pytest.mark.ci
def test_trainer_optimizers_argument_takes_muon_chained_with_adamw(tmp_path):
    with tempfile.TemporaryDirectory() as ddp_dir:
        ddp = spawn(2, _trainer, ddp_dir, True)[0]
    ours = spawn(2, _trainer, str(tmp_path), False)[0]
    assert ours[2] and not ddp[2]
    assert max(abs(ours[0][s] - ddp[0][s]) for s in ddp[0]) <= LOSS_TOL, (ours[0], ddp[0])
    assert max(abs(ours[1][s] - ours[0][s]) for s in ours[1]) <= RESUME_TOL, (ours[1], ours[0])

