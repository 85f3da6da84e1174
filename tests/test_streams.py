"""The CUDA schedule, checked on CPU by simulation (tests/sim_cuda.py).

The wrapper runs its real CUDA code path (``CudaStreams``) against a simulated ``torch.cuda`` on a GPU
that is infinitely slow relative to the host: nothing is known finished until a stream or the host
waited on it.  Single process (gloo, world size 1): fast, and the results must equal the plain model's.
"""
import contextlib

import pytest
import torch
import torch.nn as nn

from accel_flatshard import BackwardPrefetch, CPUOffload, FullyShardedDataParallel, transformer_auto_wrap_policy
from accel_flatshard.core import engine as engine_module
from accel_flatshard.core.engine import Engine
from accel_flatshard.core.options import FlatShardOptions
from accel_flatshard.core.flat_param import FlatParameter
from accel_flatshard.core.device import HIGH_PRIORITY, CudaStreams, HostAdapter
from models import batches, llama, llama_layer_class
from sim_cuda import SimulatedCuda, one_thread, sim_adapter, simulate_cuda  # noqa: F401 - one_thread: a fixture

LAYERS = 6


pytestmark = pytest.mark.usefixtures("world_of_one", "one_thread")


def _simulated(device_index=0, current_device=0, **kwargs):
    model = FullyShardedDataParallel(llama(n_layer=LAYERS), auto_wrap_policy=transformer_auto_wrap_policy([llama_layer_class()]),
                                     **kwargs)
    return model, simulate_cuda(model, device_index, current_device)


def _train(model, steps=2, sim=None):
    """``steps`` SGD steps; with ``sim``, every op is observed.  The losses are read (``.item()``, a host
    synchronisation) only after the last step, so the host does not order one step after the previous
    optimizer update: the engine's own waits must."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with sim if sim is not None else contextlib.nullcontext():
        for x in batches(steps):
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return [loss.item() for loss in losses]


def test_simulated_cuda_schedule_trains_exactly_like_the_plain_model():
    model, sim = _simulated()
    assert isinstance(model.schedule.engine.streams, CudaStreams)
    assert _train(model, sim=sim) == _train(llama(n_layer=LAYERS))
    assert sim.violations == []


@pytest.mark.parametrize("offload", [False, True], ids=["plain", "offload"])
def test_the_host_synchronises_only_on_blocking_events(offload):
    """The host waits on events in the gather rate limit and for the offload copies: created with
    ``blocking=True`` so that the waiting thread sleeps instead of spinning a core (README, "CUDA events")."""
    model, sim = _simulated(cpu_offload=CPUOffload(offload_params=offload))
    _train(model, steps=2, sim=sim)
    assert sim.event_syncs["blocking"] > 0 and sim.event_syncs["spinning"] == 0, dict(sim.event_syncs)


def test_at_most_n_full_gradients_are_alive_during_backward():
    """Defect 1: full gradients were kept until the end of backward on CUDA (DDP's peak)."""
    model, sim = _simulated()
    _train(model, steps=1, sim=sim)
    n_flats = len(model.flat_params)
    assert n_flats > 3
    assert sim.peak["full_grad"] <= engine_module.MAX_PENDING_REDUCTIONS
    assert sim.violations == []  # each was dropped only after the compute stream waited for its reduction


def test_the_simulator_sees_unbounded_full_gradients(monkeypatch):
    """The check above can fail: with the bound lifted (the old CUDA path) every flat gradient stays alive."""
    model, sim = _simulated()
    monkeypatch.setattr(engine_module, "MAX_PENDING_REDUCTIONS", 10**6)
    _train(model, steps=1, sim=sim)
    assert sim.peak["full_grad"] == len(model.flat_params)


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("limit", [1, 2])
def test_limit_all_gathers_bounds_gathered_buffers_when_the_host_runs_ahead(limit, prefetch):
    """Defect 3: freed buffers stay reserved until the GPU is past their readers; the host must wait on
    free events instead of running through the whole forward."""
    model, sim = _simulated(limit_all_gathers=limit, forward_prefetch=prefetch,
                            backward_prefetch=BackwardPrefetch.BACKWARD_PRE if prefetch else None)
    _train(model, steps=1, sim=sim)
    # the root stays gathered for the whole step, plus at most `limit` units in flight or awaiting free;
    # a prefetch gathers the next unit while the current one (the +1) still computes (README Offload's bound)
    assert sim.peak["unsharded"] <= limit + 1 + int(prefetch)
    assert sim.host_syncs > 0
    assert sim.violations == []


def test_the_simulator_sees_gathers_piling_up_without_the_rate_limit(monkeypatch):
    monkeypatch.setattr(CudaStreams, "wait_for_freed", lambda self, limit: None)
    model, sim = _simulated(limit_all_gathers=1)
    _train(model, steps=1, sim=sim)
    assert sim.peak["unsharded"] >= LAYERS


def test_streams_of_the_models_device_are_used_not_the_current_devices():
    """Defect 4: model on cuda:1, current device 0 (no torch.cuda.set_device)."""
    model, sim = _simulated(device_index=1, current_device=0)
    _train(model, steps=1, sim=sim)
    assert sim.streams_used == {1}
    assert {name for op, name, kind in sim.log if op == "read" and kind == "unsharded"} == {"compute1"}
    assert sim.violations == []


def test_the_simulator_catches_waits_on_the_current_devices_stream(monkeypatch):
    """The check above can fail: ``current_stream()`` without a device (the old code) waits on cuda:0's
    stream, so cuda:1's compute stream reads gathers it never waited for."""
    monkeypatch.setattr(CudaStreams, "compute_stream", lambda self: self.api.current_stream())
    model, sim = _simulated(device_index=1, current_device=0)
    _train(model, steps=1, sim=sim)
    assert 0 in sim.streams_used
    assert any("read on compute1 before its write" in v for v in sim.violations)


def test_inputs_are_moved_to_the_models_device_at_the_root():
    """Defect 8: a plain-torch loop passing CPU tensors to a CUDA model."""
    model, sim = _simulated(device_index=1)
    x = batches(1)[0]
    with sim:
        model(input_ids=x, labels=x)
    assert any(t is x for t in sim.moved_inputs)


def test_side_streams_have_high_priority():
    """Defect 9 (first half): FSDP2 gives its communication streams high priority."""
    model, sim = _simulated()
    _train(model, steps=1, sim=sim)
    assert sim.side_streams and all(s.priority == HIGH_PRIORITY for s in sim.side_streams)


class _IdenticalRanksGroup:
    """A shard group of ``world`` ranks that all hold the same gradient (hybrid: ``shard`` ranks per
    shard group).  Sums like NCCL does, in the gradient's dtype; notes the replica all-reduce's stream."""

    def __init__(self, world, shard, sim=None, device=None):
        self.world_size, self.shard_size, self.world_rank, self.shard_rank = world, shard, 0, 0
        self.is_hybrid = shard != world
        self.sim, self.device, self.replica_streams = sim, device, []

    def all_gather(self, outputs, shards, async_op=True, kind="", in_node=False):
        for output, shard in zip(outputs, shards):
            output.copy_(shard.repeat(self.shard_size))
        return _Done()

    def reduce_scatter(self, output, full, async_op=True):
        mine = full[: output.numel()]
        output.copy_(mine)
        for _ in range(self.shard_size - 1):
            output.add_(mine)
        return _Done()

    def all_reduce_replicas(self, tensor, async_op=True):
        if self.sim is not None:
            self.replica_streams.append(self.sim.current_stream(self.device))
        tensor.mul_(self.world_size // self.shard_size)
        return _Done()


class _Done:
    def wait(self):
        return True


def _flat_with_grad(world, value, dtype):
    p = nn.Parameter(torch.zeros(8 * world, dtype=dtype))
    flat = FlatParameter([p], ["w"], [[(nn.Module(), "w")]], rank=0, world_size=world)
    flat.set_local_shard_from_full(torch.zeros(flat.layout.padded_numel, dtype=dtype))
    flat.point_params_at_shard()
    return flat, p, torch.full((flat.layout.padded_numel,), value, dtype=dtype)


@pytest.mark.parametrize("adapter", ["cuda", "host"])
@pytest.mark.parametrize("world,value", [(4, 30000.0), (8, 30720.0)])
def test_fp16_gradients_are_divided_before_and_after_the_sum(adapter, world, value):
    """Defect 5: W ranks each with a loss-scaled fp16 gradient: at W=4, 4 * 30000 overflows fp16 (max 65504);
    divided by 2 before and 2 after, the average 30000 comes out.  At W=8 the factors differ (4 before, 2
    after): 8 * 30720 / 4 = 61440 fits, while swapped (2 before) 122880 would be inf."""
    sim = SimulatedCuda()
    streams = sim_adapter(sim) if adapter == "cuda" else HostAdapter(torch.device("cpu"))
    engine = Engine(_IdenticalRanksGroup(world, world), torch.device("cpu"), FlatShardOptions(), streams=streams)
    flat, p, grad = _flat_with_grad(world, value, torch.float16)
    with sim:
        engine.reduce_grad(flat, grad, "w")
        engine.finish_reduces()
    assert torch.isfinite(p.grad).all()
    assert torch.equal(p.grad, torch.full_like(p.grad, value))
    assert sim.violations == []
    assert (engine.predivide, engine.postdivide) == ((2.0, 2.0) if world == 4 else (4.0, 2.0))


def test_replica_all_reduce_runs_on_its_own_stream_after_the_reduce_scatter():
    """Defect 9 (second half): hybrid sharding's all-reduce across replicas must not queue behind the
    next reduce-scatter on one stream; it waits only for its own reduce-scatter's event."""
    sim = SimulatedCuda()
    device = torch.device("cuda", 0)
    group = _IdenticalRanksGroup(4, 2, sim, device)
    engine = Engine(group, torch.device("cpu"), FlatShardOptions(), streams=sim_adapter(sim))
    flat, p, grad = _flat_with_grad(2, 1.0, torch.float32)
    with sim:
        engine.reduce_grad(flat, grad, "w")
        engine.finish_reduces()
    assert torch.equal(p.grad, torch.ones_like(p.grad))  # (4 ranks * 1.0) / 4
    (replica_stream,) = group.replica_streams
    assert replica_stream is engine.replica_stream
    assert replica_stream is not engine.reduce_scatter_stream
    assert replica_stream.priority == HIGH_PRIORITY
    assert ("wait_event", replica_stream.name, engine.reduce_scatter_stream.name) in sim.log
