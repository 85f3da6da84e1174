"""CPU offload's CUDA schedule, checked by simulation (tests/sim_cuda.py; issue 17).

The offloaded model runs the engine's real CUDA code path on the simulated GPU: host shards and host
gradients are pinned host memory, the copies are ops of the side streams, and the optimizer (AdamW, on
the host) is observed op by op.  Checked:

* placement: nothing persistent on the device (shards, gradients, optimizer state are host memory;
  between steps the device holds only module buffers and inputs), and the device peak stays within the
  bound gathered units + unreduced full gradients + shard copies + activations (the same model without
  offload does not);
* ordering / read after write across streams: every host -> device copy is waited for by the gather
  that reads it, every device -> host copy by the host before it reads the gradient, no host write of
  a shard while a copy may still read it (``sim.violations``);
* buffer reuse: pinned buffers are allocated in the first step and reused, none leaked.

Each check is shown to fail on a deliberately broken schedule or placement: by a broken adapter here,
and by the mutation tables (tests/sim_table.py: every ordering call of the package; tests/
test_sim_mutations.py: the placement and buffer-reuse rows).
"""
import contextlib

import pytest
import torch

from accel_flatshard import CPUOffload, FullyShardedDataParallel, transformer_auto_wrap_policy
from accel_flatshard.core.engine import MAX_PENDING_REDUCTIONS
from models import batches, llama, llama_layer_class
from sim_cuda import SimCudaStreams, one_thread, simulate_cuda  # noqa: F401 - one_thread: a fixture

LAYERS = 4

pytestmark = pytest.mark.usefixtures("world_of_one", "one_thread")


def _offloaded(offload=True, **kwargs):
    model = FullyShardedDataParallel(llama(n_layer=LAYERS), auto_wrap_policy=transformer_auto_wrap_policy([llama_layer_class()]),
                                     cpu_offload=CPUOffload(offload_params=offload), **kwargs)
    return model, simulate_cuda(model)


def _train(model, sim=None, steps=2, accumulate=1, after_step=None):
    """AdamW steps (on the host when offloaded); losses read only at the end (no host sync per step).
    ``foreach=False``: the plain model's for-loop step, so the results can be compared exactly."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses = []
    with sim if sim is not None else contextlib.nullcontext():
        for x in batches(steps):
            for m in x.chunk(accumulate):
                loss = model(input_ids=m, labels=m).loss
                loss.backward()
                losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
            if after_step is not None:
                after_step(model, opt)
        return [loss.item() for loss in losses]


def _persistent(model, opt):
    """name -> tensor of everything that must live in host memory."""
    out = {}
    for i, flat in enumerate(model.flat_params):
        out[f"flat{i}.local_shard"] = flat.local_shard
        if flat.sharded_grad is not None:
            out[f"flat{i}.sharded_grad"] = flat.sharded_grad
    for j, state in enumerate(opt.state.values()):
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.numel() > 1:
                out[f"adam{j}.{k}"] = v
    return out


def test_offload_schedule_trains_exactly_like_the_plain_model_with_nothing_persistent_on_the_device():
    model, sim = _offloaded()
    residents = []

    def check(model, opt):
        sim.assert_on_host(_persistent(model, opt))
        residents.append(sum(b.nbytes for b in sim.device_storages()))

    losses = _train(model, sim, steps=3, after_step=check)
    assert losses == _train(llama(n_layer=LAYERS), steps=3)
    assert sim.violations == []
    # between steps the device holds the module buffers (rotary tables), the inputs and the kept losses
    small = sum(b.numel() * b.element_size() for b in model.buffers()) + sum(x.numel() * 8 for x in batches(3)) + 4096
    assert max(residents) <= small, (residents, small)


def _device_bound(model, activations):
    """gathered units in flight + unreduced full gradients + shard copies + activations."""
    inflight, pending = model.options.limit_all_gathers, MAX_PENDING_REDUCTIONS
    unit = [sum(f.layout.padded_numel * f.unsharded.element_size() for f in u.flat_params) for u in model.units]
    shard = [sum(f.layout.shard_numel * 4 * 2 for f in u.flat_params) for u in model.units]
    root = unit[[u.is_root for u in model.units].index(True)]
    layer = max(b for b, u in zip(unit, model.units) if not u.is_root)
    return (root + (inflight + 1) * layer + (pending + 1) * max(unit) + (inflight + pending + 2) * max(shard)
            + activations)


@pytest.mark.parametrize("offload", [True, False], ids=["offload", "broken-placement-no-offload"])
def test_device_peak_is_within_the_offload_bound(offload):
    """The bound holds with offload; the same schedule keeping shards, gradients and AdamW state on the
    device (no offload) exceeds it, so the check sees persistent device state."""
    from sim_cuda import SimulatedCuda

    plain, plain_sim = llama(n_layer=LAYERS), SimulatedCuda()
    x = batches(1)[0]
    with plain_sim:
        plain(input_ids=x, labels=x).loss.backward()
    param_bytes = sum(p.numel() * 4 for p in plain.parameters())
    activations = max(plain_sim.peak_bytes["device"] - 2 * param_bytes, 0)  # minus parameters and gradients
    model, sim = _offloaded(offload)
    _train(model, sim, steps=2)
    assert sim.violations == []
    bound = _device_bound(model, activations) + sum(b.numel() * b.element_size() for b in model.buffers())
    if offload:
        assert sim.peak_bytes["device"] <= bound, (sim.peak_bytes, bound)
    else:
        assert sim.peak_bytes["device"] > bound, (sim.peak_bytes, bound)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_pinned_buffers_are_reused_not_leaked(accumulate):
    """Shards, gradients and (when gradients accumulate) staging: pinned once in the first step; later
    steps (zero_grad to None, accumulation over micro-steps) reuse them, and no pinned buffer piles up."""
    model, sim = _offloaded()
    offload = model.schedule.engine.offload
    counts = []

    def count(model, opt):
        alive = [b for b in list(sim._buffers.values()) if b.placement == "host" and b.pinned]
        counts.append((len(offload.host_buffers), len(alive)))

    _train(model, sim, steps=4, accumulate=accumulate, after_step=count)
    assert sim.violations == []
    trainable = sum(f.requires_grad for f in model.flat_params)
    expected = len(model.flat_params) + trainable * (2 if accumulate > 1 else 1)
    assert counts == [(expected, expected)] * 4, counts


class _CopiesOnTheComputeStream(SimCudaStreams):
    """A broken adapter: the host -> device copy runs on the device's default (compute) stream, which the
    all-gather stream does not wait for."""

    def to_device(self, host):
        with self.on(self.api.default_stream(self.device.index)):
            return super().to_device(host)


@pytest.mark.parametrize("broken", [False, True], ids=["adapter", "broken-adapter"])
def test_every_host_to_device_copy_is_ordered_before_the_gather_that_reads_it(broken):
    model, sim = _offloaded()
    if broken:
        engine = model.schedule.engine
        adapter = _CopiesOnTheComputeStream(engine.streams.device, sim)
        adapter._side = engine.streams._side  # the same simulated side streams
        engine.attach(adapter)
    _train(model, sim, steps=1)
    hazards = [v for v in sim.violations if "before its write on compute" in v]
    assert bool(hazards) == broken, sim.violations


@pytest.mark.parametrize("chosen", [None, False], ids=["default", "user-chose-foreach-False"])
def test_the_host_adamw_step_uses_the_fused_kernel_unless_the_user_chose(chosen):
    """Offload onto a GPU moves AdamW to the host, where torch's default is the slowest variant
    (benchmarks/offload_adamw.py): the step uses fused=True instead, within ulps of the for-loop."""
    model, sim = _offloaded()
    reference = _offloaded(offload=False)[0]
    losses = {}
    for name, m in (("ours", model), ("reference", reference)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=chosen if name == "ours" else False)
        context = sim if name == "ours" else contextlib.nullcontext()
        with context, pytest.warns(UserWarning, match="fused=True") if (name, chosen) == ("ours", None) else \
                contextlib.nullcontext():
            for x in batches(2):
                m(input_ids=x, labels=x).loss.backward()
                opt.step()
                opt.zero_grad()
        losses[name] = [p.detach().clone() for p in m.parameters()]
        if name == "ours":
            assert opt.param_groups[0]["fused"] is (True if chosen is None else None)
    assert sim.violations == []
    for a, b in zip(losses["ours"], losses["reference"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("world, shard", [(4, 4), (4, 2)], ids=["sharded-W4", "hybrid-2x2"])
def test_offload_under_hybrid_copies_the_gradient_after_the_replica_all_reduce(world, shard):
    """The reduced shard is copied to its host buffer on the stream that wrote it last (the replica
    stream under hybrid sharding), post-divided; the device copy is dropped at once, kept alive for the
    other stream by record_stream; the host reads the gradient only after the copy's event."""
    from accel_flatshard.core.engine import Engine
    from accel_flatshard.core.options import FlatShardOptions
    from sim_cuda import SimulatedCuda, sim_adapter
    from test_streams import _flat_with_grad, _IdenticalRanksGroup

    sim = SimulatedCuda()
    group = _IdenticalRanksGroup(world, shard, sim, torch.device("cuda", 0))
    engine = Engine(group, torch.device("cpu"), FlatShardOptions(offload_params=True), streams=sim_adapter(sim))
    flat, p, grad = _flat_with_grad(shard, 3.0, torch.float32)
    with sim:
        engine.reduce_grad(flat, grad, "w")
        engine.finish_reduces()
    assert torch.equal(p.grad, torch.full_like(p.grad, 3.0))  # (W ranks * 3.0) / W
    sim.assert_on_host({"sharded_grad": flat.sharded_grad})
    assert sim.violations == []  # (tests/sim_table.py shows this fails without the record_stream)


@pytest.mark.parametrize("world", [1, 2])
def test_two_reductions_of_one_flat_parameter_in_one_backward_are_summed(world):
    """A flat parameter reduced twice before the end of backward (the engine allows it; e.g. a unit whose
    gradient hook fires once per inner backward): each copy lands in its own host buffer, concurrently,
    and the host adds them (not the second one written over the first and then added to itself)."""
    from accel_flatshard.core.engine import Engine
    from accel_flatshard.core.options import FlatShardOptions
    from sim_cuda import SimulatedCuda, sim_adapter
    from test_streams import _flat_with_grad, _IdenticalRanksGroup

    sim = SimulatedCuda()
    engine = Engine(_IdenticalRanksGroup(world, world), torch.device("cpu"), FlatShardOptions(offload_params=True),
                    streams=sim_adapter(sim))
    flat, p, grad = _flat_with_grad(world, 3.0, torch.float32)
    with sim:
        for expected in (8.0, 16.0):  # two backwards (accumulating): the second reuses the first's buffers
            engine.reduce_grad(flat, torch.full_like(grad, 3.0), "w")  # (the engine divides it in place)
            engine.reduce_grad(flat, torch.full_like(grad, 5.0), "w")
            engine.finish_reduces()
            assert torch.equal(p.grad, torch.full_like(p.grad, expected)), p.grad  # 3 + 5 (+ 3 + 5)
    assert sim.violations == []
    assert len(engine.offload.host_buffers) == 3  # sharded_grad + two staging buffers, allocated once
