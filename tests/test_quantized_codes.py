"""qwZ's backward gather sends the int8 codes its forward gather quantized (core/unit.py ``forward_codes``): the
masters do not change between a unit's forward and its backward, so quantizing them again would give the same
codes.  In-process (one gloo rank: the int8 path runs, its collective is a local copy) and fast:

* one quantization per unit per step instead of one per gather, and the same bits as quantizing again;
* codes are dropped whenever the shards may change between a forward and its backward (an optimizer step, a
  state-dict load, a summon's writeback): the backward then gathers the new weights, bitwise as without the reuse.
  Each test would fail with the stale codes (checked: the gradients differ when the drop is removed).
"""
from __future__ import annotations

import pytest
import torch

from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy
from accel_flatshard.core import engine as engine_module
from accel_flatshard.core.engine import Engine
from models import batches, llama

pytestmark = pytest.mark.usefixtures("world_of_one")


def _wrap():
    model = llama(n_layer=3)
    return FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model),
                                    quantized_all_gather=True)


@pytest.fixture
def no_reuse(monkeypatch):
    """Every gather quantizes (the behaviour before the reuse): the reference for bitwise comparisons."""
    def off():
        monkeypatch.setattr(Engine, "reuses_forward_codes", property(lambda self: False))
    return off


@pytest.fixture
def quantizations(monkeypatch):
    """The labels of the shards quantized for gathers, in call order."""
    calls = []

    def counted(x, block, what, *args, **kwargs):
        calls.append(what)
        return quantize(x, block, what, *args, **kwargs)

    quantize = engine_module.quantize_blocks
    monkeypatch.setattr(engine_module, "quantize_blocks", counted)
    return calls


def _shards(model):
    return [f.local_shard.clone() for unit in model.units for f in unit.flat_params]


def _train(steps=3):
    model = _wrap()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x in batches(steps):
        loss = model(x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, _shards(model)


def test_the_backward_gather_sends_the_forward_codes_one_quantization_a_unit_a_step(quantizations, no_reuse):
    model = _wrap()
    units = sum(1 for unit in model.units if unit.flat_params)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = batches(1)[0]
    for reuse in (True, False):
        if not reuse:
            no_reuse()
        for _ in range(2):  # (the first step records the order; the second keeps the last unit for backward)
            quantizations.clear()
            loss = model(x, labels=x).loss
            in_forward = len(quantizations)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert in_forward == units  # every unit gathered once in forward
        if reuse:
            assert len(quantizations) == units  # backward gathers quantized nothing
            assert all(unit.forward_codes is None for unit in model.units)  # none held past the backward
        else:
            assert len(quantizations) > units  # (resharded units are gathered again, quantized again)


def test_the_reused_codes_train_bitwise_as_quantizing_again(no_reuse):
    reused = _train()
    no_reuse()
    again = _train()
    assert reused[0] == again[0]
    assert all(torch.equal(a, b) for a, b in zip(reused[1], again[1]))


def _step_between_forward_and_backward(model, optimizer):
    optimizer.step()


def _load_between_forward_and_backward(model, optimizer):
    state = {name: value * 1.5 for name, value in model.state_dict().items()}
    model.load_state_dict(state)


def _summon_between_forward_and_backward(model, optimizer):
    with model.summon_full_params(writeback=True), torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)


@pytest.mark.parametrize("write", [_step_between_forward_and_backward, _load_between_forward_and_backward,
                                   _summon_between_forward_and_backward], ids=["step", "load_state_dict", "summon"])
def test_codes_kept_from_a_forward_are_dropped_when_the_shards_change_before_its_backward(write, no_reuse):
    def gradients(reuse):
        model = _wrap()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        first, second = batches(2)
        model(first, labels=first).loss.backward()  # (gradients, so that the step in between changes the weights)
        loss = model(second, labels=second).loss
        assert any(unit.forward_codes is not None for unit in model.units) == reuse
        before = _shards(model)
        write(model, optimizer)
        assert all(unit.forward_codes is None for unit in model.units)
        assert not all(torch.equal(a, b) for a, b in zip(before, _shards(model)))  # the weights did change
        optimizer.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    reused = gradients(True)
    no_reuse()
    again = gradients(False)
    assert all(torch.equal(a, b) for a, b in zip(reused, again))
