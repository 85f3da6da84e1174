"""CPU offload (issue 17, ``offload.py``) on a CPU host: the same engine path with host copies.

On CPU the host is the device, so offload must train bit for bit like the run without it while still
going through the offload bookkeeping (host gradient targets, staging for accumulation, reused host
buffers).  Single process (gloo, world size 1); the GPU schedule is checked by simulation in
``test_offload_sim.py`` and on a real GPU by ``benchmarks/gpu_check.sh``.
"""
import pytest
import torch

from accel_flatshard import CPUOffload, FullyShardedDataParallel, MixedPrecision, transformer_auto_wrap_policy
from models import batches, llama, llama_layer_class

pytestmark = pytest.mark.usefixtures("world_of_one")


def _model(offload, mp=None, freeze=True):
    model = llama(n_layer=3)
    if freeze:
        model.model.layers[1].requires_grad_(False)  # a frozen unit: no gradient, no reduction
    return FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy([llama_layer_class()]),
                                    mixed_precision=mp, cpu_offload=CPUOffload(offload_params=offload))


def _train(model, accumulation, steps=3, clip=None):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for x in batches(steps):
        micro = x.chunk(2) if accumulation != "none" else [x]
        for i, m in enumerate(micro):
            no_sync = accumulation == "no_sync" and i < len(micro) - 1
            ctx = model.no_sync() if no_sync else torch.enable_grad()
            with ctx:
                loss = model(input_ids=m, labels=m).loss / len(micro)
                loss.backward()
            losses.append(loss.item())
        if clip is not None:
            losses.append(model.clip_grad_norm_(clip).item())
        opt.step()
        opt.zero_grad()
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("accumulation", ["none", "no_sync", "per_micro_step"])
@pytest.mark.parametrize("mp", [None, MixedPrecision(param_dtype=torch.bfloat16)], ids=["fp32", "bf16"])
def test_offload_on_cpu_trains_bit_for_bit_like_without(accumulation, mp):
    with_offload = _train(_model(True, mp), accumulation)
    without = _train(_model(False, mp), accumulation)
    assert with_offload[0] == without[0]
    assert all(torch.equal(a, b) for a, b in zip(with_offload[1], without[1]))


def test_offload_on_cpu_matches_the_plain_model_with_clipping():
    """Gradients clipped on the host by their global norm, then AdamW on the host shards."""
    plain = llama(n_layer=3)
    plain.model.layers[1].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-2)
    ref = []
    for x in batches(3):
        loss = plain(input_ids=x, labels=x).loss
        loss.backward()
        ref += [loss.item(), torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5).item()]
        opt.step()
        opt.zero_grad()
    losses, _ = _train(_model(True), "none", clip=0.5)
    assert losses == pytest.approx(ref, abs=1e-5)


def test_offloaded_host_buffers_are_allocated_once_and_reused():
    """Shards, gradients and (with accumulation) staging buffers: allocated in the first step, reused by
    every later step, also across zero_grad() (set to None)."""
    model = _model(True)
    offload = model.schedule.engine.offload
    _train(model, "per_micro_step", steps=1)
    after_first = len(offload.host_buffers)
    trainable = sum(f.requires_grad for f in model.flat_params)
    assert after_first == len(model.flat_params) + 2 * trainable  # shard each; grad + staging per trainable
    _train(model, "per_micro_step", steps=3)
    assert len(offload.host_buffers) == after_first
    assert all(f.sharded_grad is not None for f in model.flat_params if f.requires_grad)  # kept, not freed


def test_cpu_offload_accepts_torch_forms():
    from torch.distributed.fsdp import CPUOffload as TorchCPUOffload, CPUOffloadPolicy, OffloadPolicy

    from accel_flatshard.core.fully_sharded import wants_offload

    assert wants_offload(TorchCPUOffload(offload_params=True)) and wants_offload(CPUOffloadPolicy())
    assert not wants_offload(TorchCPUOffload()) and not wants_offload(OffloadPolicy()) and not wants_offload(None)
    with pytest.raises(TypeError, match="cpu_offload"):
        wants_offload("yes")


# ---------------------------------------------------------------------- a unit applied twice in one forward
def _trained_state(module, model, data, is_ddp: bool) -> dict:
    """SGD over ``data``; the full state dict after (DDP: the module's own)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in data:
        model(x).backward()
        opt.step()
        opt.zero_grad()
    state = module.state_dict() if is_ddp else model.state_dict()
    return {k: v.detach().clone() for k, v in state.items()}


def _applied_twice_vs_ddp(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from toy import Block, Toy, toy_batches

    data = [x.chunk(world_size)[rank] for x in toy_batches(3)]
    results = []
    for wrapper in ("ddp", "offload"):
        module = Toy(tie_blocks=False)  # blocks[1] is applied twice in one forward
        model = DDP(module) if wrapper == "ddp" else FullyShardedDataParallel(
            module, auto_wrap_policy=transformer_auto_wrap_policy([Block]), cpu_offload=CPUOffload(True))
        results.append(_trained_state(module, model, data, wrapper == "ddp"))
    return results


def test_a_unit_applied_twice_under_offload_trains_like_ddp():
    """Both uses' gradients reach the host shard gradient (one reduction per backward: autograd sums the
    two uses before the unit's gradient hook fires).  Two reductions of one flat parameter in one backward:
    test_offload_sim.py::test_two_reductions_of_one_flat_parameter_in_one_backward_are_summed."""
    from dist_helpers import spawn

    ddp, offloaded = spawn(2, _applied_twice_vs_ddp)[0]
    assert ddp.keys() == offloaded.keys()
    for name in ddp:
        torch.testing.assert_close(offloaded[name], ddp[name], rtol=1e-5, atol=1e-6, msg=name)


def _applied_twice_under_reentrant_checkpointing(rank, world_size):
    import functools

    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.checkpoint import checkpoint

    from toy import Block, Toy, toy_batches

    class CheckpointedToy(Toy):
        """Every block under reentrant checkpointing: blocks[1], called twice, runs two inner backwards."""

        def forward(self, x):
            run = functools.partial(checkpoint, use_reentrant=True)
            x = self.scale(run(self.blocks[0], self.embed(x)))
            x = run(self.blocks[2], run(self.blocks[1], run(self.blocks[1], x)))
            return self.head(x).pow(2).mean()

    data = [x.chunk(world_size)[rank] for x in toy_batches(3)]
    results = {}
    for wrapper in ("ddp", "sharded", "offload"):
        module = CheckpointedToy(tie_blocks=False)
        # (DDP needs static_graph for a parameter made ready twice in one backward)
        model = DDP(module, static_graph=True) if wrapper == "ddp" else FullyShardedDataParallel(
            module, auto_wrap_policy=transformer_auto_wrap_policy([Block]),
            cpu_offload=CPUOffload(wrapper == "offload"))
        results[wrapper] = _trained_state(module, model, data, wrapper == "ddp")
    return results


def test_a_unit_applied_twice_under_reentrant_checkpointing_trains_like_ddp():
    """Reentrant checkpointing runs one inner backward per call of a unit, so the unit's gradients arrive (and
    are reduced) once per call, the second time after its backward was done: both reductions are summed, with
    and without offload."""
    from dist_helpers import spawn

    results = spawn(2, _applied_twice_under_reentrant_checkpointing)[0]
    ddp = results.pop("ddp")
    for wrapper, state in results.items():
        assert state.keys() == ddp.keys()
        for name in ddp:
            torch.testing.assert_close(state[name], ddp[name], rtol=1e-5, atol=1e-6, msg=f"{wrapper} {name}")
