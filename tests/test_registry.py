"""The registry of prepared models (core/registry.py): every feature finds its model there, two process-wide
optimizer hooks dispatch to the models an optimizer steps, and a dropped model leaves nothing behind."""
from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch.optim import optimizer as torch_optimizer

from accel_flatshard import FullyShardedDataParallel
from accel_flatshard.core import registry


def ours():
    """torch's process-wide optimizer hooks that this package registered."""
    hooks = [*torch_optimizer._global_optimizer_pre_hooks.values(),
             *torch_optimizer._global_optimizer_post_hooks.values()]
    return [h for h in hooks if h.__module__.startswith("accel_flatshard")]


@pytest.fixture
def handler():
    """A step handler added for one test: the (optimizer, records) it was called with."""
    calls = []

    def record_call(optimizer, records):
        calls.append((optimizer, records))

    registry.on_step(pre=record_call)
    yield calls
    registry._PRE.remove(record_call)


def test_wrapping_registers_two_process_wide_optimizer_hooks_and_no_more(world_of_one):
    FullyShardedDataParallel(torch.nn.Linear(4, 4))
    FullyShardedDataParallel(torch.nn.Linear(4, 4), cpu_offload=True)
    assert len(ours()) == 2


def test_every_lookup_finds_the_models_record(world_of_one):
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    wrapped = FullyShardedDataParallel(module)
    record = registry.record_of(wrapped)
    assert record is registry.record_of(module) and record.wrapper is wrapped and record.module is module
    assert all(registry.record_of_param(p) is record for p in module.parameters())
    assert registry.unit_of(module) is wrapped.units[0] and record.units == wrapped.units
    assert record.shard_group is wrapped.shard_group and record.offload is None
    assert registry.record_of_param(torch.nn.Parameter(torch.zeros(2))) is None


def test_every_step_reaches_the_handlers_with_the_models_its_optimizer_steps(world_of_one, handler):
    wrapped = FullyShardedDataParallel(torch.nn.Linear(4, 4))
    plain = torch.nn.Linear(4, 4)
    alone = torch.optim.SGD(plain.parameters(), lr=0.1)
    alone.step()  # (a plain optimizer's step may concern a prepared model too: TRL's sync_ref_model)
    optimizer = torch.optim.SGD([*plain.parameters(), *wrapped.parameters()], lr=0.1)
    optimizer.step()
    assert handler == [(alone, []), (optimizer, [registry.record_of(wrapped)])]


def test_a_dropped_model_leaves_no_record(world_of_one):
    module = torch.nn.Linear(4, 4)
    wrapped = FullyShardedDataParallel(module)
    param = next(module.parameters())
    gone = weakref.ref(wrapped)
    del wrapped, module
    gc.collect()
    assert gone() is None and registry.record_of_param(param) is None


class _StandIn(SimpleNamespace):
    """A record stand-in (weak-referenceable, as the registry's cache holds records weakly)."""

    __slots__ = ("__weakref__",)


def test_an_offloaded_adamw_steps_fused_on_the_host(monkeypatch):
    """Offload onto a GPU: a stock AdamW's host step uses torch's fused kernel (a stand-in record: no GPU here)."""
    monkeypatch.setattr("accel_flatshard.core.offload._FAST_HOST_STEP_WARNED", False)
    param = torch.nn.Parameter(torch.zeros(4))
    param.grad = torch.ones(4)
    offload = SimpleNamespace(streams=SimpleNamespace(stream_ordered=True), wait_for_host_to_device_copies=lambda: 0)
    stand_in = _StandIn(offload=offload, schedule=SimpleNamespace(in_backward=False, units=[]))
    monkeypatch.setattr(registry, "record_of_param", lambda p: stand_in if p is param else None)
    optimizer = torch.optim.AdamW([param])
    with pytest.warns(UserWarning, match="fused=True"):
        registry._dispatch(registry._PRE)(optimizer, (), {})
    assert optimizer.param_groups[0]["fused"] is True and optimizer._step_supports_amp_scaling


def test_the_models_of_an_optimizer_follow_its_param_groups(world_of_one):
    first, second = FullyShardedDataParallel(torch.nn.Linear(4, 4)), FullyShardedDataParallel(torch.nn.Linear(4, 4))
    optimizer = torch.optim.SGD(first.parameters(), lr=0.1)
    assert registry.records_of_optimizer(optimizer) == [registry.record_of(first)]
    optimizer.add_param_group({"params": list(second.parameters())})
    assert registry.records_of_optimizer(optimizer) == [registry.record_of(first), registry.record_of(second)]
