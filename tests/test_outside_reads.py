"""A unit's parameter read by its parent's forward, outside the unit's own forward (TRL's fused LM head).

The untied Llama head is a unit of its own under ``transformer_auto_wrap_policy(model)``; a "fused head"
forward reads ``lm_head.weight`` from the root's forward.  Reference: the same steps in one process.
"""
import pytest
import torch
import torch.nn.functional as F

from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy
from dist_helpers import spawn
from models import batches, full_params, global_mean, llama

TOL = 1e-6


def _fused_forward(model, x, also_call_head=False):
    """What TRL's ``add_fused_lm_head`` does: run the backbone, multiply by ``lm_head.weight`` directly."""
    hidden = model.model(x).last_hidden_state[:, :-1]
    weight = model.lm_head.weight  # read outside lm_head's forward
    logits = hidden @ weight.t()
    if also_call_head:  # the head's own forward runs too (and reshards after it)
        logits = logits + model.lm_head(hidden)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))


def _install_fused_forward(model, also_call_head):
    model.forward = lambda x: _fused_forward(model, x, also_call_head)  # instance attribute, as TRL does


def _steps(model, data, rank, world_size, nograd_between=False):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses, evals = [], []
    for x in data:
        local = x.chunk(world_size)[rank]
        loss = model(local)
        if nograd_between:  # DPO with LoRA: the reference pass (no grad) runs between forward and backward
            with torch.no_grad():
                model(local)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss, world_size))
        with torch.no_grad():
            evals.append(global_mean(model(local), world_size))
    return losses, evals


def _model(also_call_head, frozen_head):
    model = llama(n_layer=2)
    _install_fused_forward(model, also_call_head)
    model.lm_head.weight.requires_grad_(not frozen_head)
    return model


def _worker(rank, world_size, also_call_head, reshard_after_forward, frozen_head=False):
    model = _model(also_call_head, frozen_head)
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model),
                                       reshard_after_forward=reshard_after_forward)
    head_unit = next(u for u in wrapped.units if u.module is model.lm_head)
    losses, evals = _steps(wrapped, batches(4, batch=4, seq=16), rank, world_size, nograd_between=frozen_head)
    return {
        "losses": losses, "evals": evals, "params": full_params(wrapped),
        "head_is_unit": head_unit is not None,
        "head_weight_shape_between_steps": tuple(model.lm_head.weight.shape),
        "head_gathered_after_steps": head_unit.sharded_state.name != "SHARDED",
        "head_class_name": type(model.lm_head).__name__,
        "head_is_linear": isinstance(model.lm_head, torch.nn.Linear),
    }


def _reference(also_call_head, frozen_head=False):
    model = _model(also_call_head, frozen_head)
    losses, evals = _steps(model, batches(4, batch=4, seq=16), 0, 1, nograd_between=frozen_head)
    return losses, evals, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def read_only_run():
    return spawn(2, _worker, False, True), _reference(False)


def test_head_read_by_parent_forward_trains_like_single_process(read_only_run):
    (result, _), (ref_losses, _, ref_params) = read_only_run
    assert max(abs(a - b) for a, b in zip(result["losses"], ref_losses)) < TOL
    assert max((result["params"][k] - v).abs().max().item() for k, v in ref_params.items()) < 1e-5


def test_head_read_under_no_grad_matches_single_process(read_only_run):
    (result, _), (_, ref_evals, _) = read_only_run
    assert max(abs(a - b) for a, b in zip(result["evals"], ref_evals)) < TOL


def test_outside_the_forward_the_head_weight_stays_a_shard_and_is_freed(read_only_run):
    (result, _), _ = read_only_run
    numel = 128 * 32  # vocab x hidden, split over 2 ranks
    assert result["head_weight_shape_between_steps"] == (numel // 2,)
    assert not result["head_gathered_after_steps"]


def test_the_read_hook_keeps_the_module_class_name_and_type(read_only_run):
    (result, _), _ = read_only_run
    assert result["head_class_name"] == "Linear" and result["head_is_linear"]


def test_frozen_head_read_survives_a_no_grad_forward_before_backward():
    """DPO + LoRA: frozen head read with grad (autograd saves it for the input gradient), then a no-grad
    reference pass reshards every unit; backward must find the head gathered again."""
    result = spawn(2, _worker, False, True, True)[0]
    ref_losses, _, ref_params = _reference(False, frozen_head=True)
    assert max(abs(a - b) for a, b in zip(result["losses"], ref_losses)) < TOL
    assert max((result["params"][k] - v).abs().max().item() for k, v in ref_params.items()) < 1e-5


@pytest.mark.parametrize("reshard_after_forward", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_head_read_and_called_in_one_forward_trains_like_single_process(reshard_after_forward):
    """The head's own forward runs after the direct read (and would reshard what autograd saved)."""
    result = spawn(2, _worker, True, reshard_after_forward)[0]
    ref_losses, ref_evals, ref_params = _reference(True)
    assert max(abs(a - b) for a, b in zip(result["losses"], ref_losses)) < TOL
    assert max(abs(a - b) for a, b in zip(result["evals"], ref_evals)) < TOL
    assert max((result["params"][k] - v).abs().max().item() for k, v in ref_params.items()) < 1e-5
