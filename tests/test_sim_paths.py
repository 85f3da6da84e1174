"""Every public path of a wrapped model on the simulated CUDA schedule (tests/sim_cuda.py; issues 21 and 22).

Each test runs one path twice: on the simulated GPU (the engine's real CUDA code path, every op observed;
``sim.violations`` must stay empty) and without the simulator (the CPU schedule); the results must be equal.
Variants of the schedule:

* ``plain``: sharded, one process;
* ``offload``: CPU offload (pinned host shards and gradients, the optimizer on the host);
* ``hybrid``: hybrid sharding over two identical replicas (``sim_cuda.IdenticalReplicas``): the replica
  all-reduce on its own stream, chained to the reduce-scatter's event.

A value read on the host (``.item()``) makes the host wait for the GPU and would hide a missing wait, so
results are compared only after the simulated run.  The same paths at W=2 over real gloo collectives are
in tests/test_sim_w2.py; tests/test_sim_table.py breaks every ordering call of the package in turn and
requires one of the simulated tests to fail.
"""
import contextlib

import pytest
import torch
import torch.nn.functional as F

from accel_flatshard import CPUOffload, FullyShardedDataParallel, transformer_auto_wrap_policy
from accel_flatshard.checkpoint import (full_optim_state_dict, full_state_dict, load_full_optim_state_dict,
                                        load_full_state_dict, load_sharded_model, load_sharded_optimizer,
                                        save_sharded_model, save_sharded_optimizer)
from accel_flatshard.generation import (peak_held_bytes, set_generation_options, trl_generation_context,
                                        trl_summon_full_params)
from models import batches, llama, llama_layer_class
from sim_cuda import IdenticalReplicas, SimulatedCuda, simulate_cuda

pytestmark = pytest.mark.usefixtures("world_of_one")

VARIANTS = ["plain", "offload", "hybrid"]
GENERATE = dict(max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0)


# ---------------------------------------------------------------------- harness
def _wrap(variant, make=None, policy=None, **kwargs):
    module = (make or (lambda: llama(n_layer=2)))()
    policy = policy(module) if policy else transformer_auto_wrap_policy([llama_layer_class()])
    return FullyShardedDataParallel(module, auto_wrap_policy=policy,
                                    cpu_offload=CPUOffload(offload_params=variant == "offload"), **kwargs)


def _simulated(variant, sim=None, **kwargs):
    model = _wrap(variant, **kwargs)
    group = IdenticalReplicas(model.shard_group) if variant == "hybrid" else None
    return model, simulate_cuda(model, group=group, sim=sim)


class _Run:
    """What a scenario knows of its run: ``name`` ("reference" or "simulated") and ``host(tree)``, which
    declares the tensors of ``tree`` (a state dict: CPU tensors on a GPU machine too) host memory."""

    def __init__(self, name, sim=None):
        self.name, self.sim = name, sim

    def host(self, tree):
        if self.sim is not None:
            for t in tree.values() if isinstance(tree, dict) else tree:
                if isinstance(t, torch.Tensor):
                    self.sim.place(t, "host")
        return tree


def _both(variant, scenario, **kwargs):
    """``scenario(model, run)`` on an unsimulated and a simulated model built alike; the results must be
    equal and the simulated schedule free of violations."""
    expected = scenario(_wrap(variant, **kwargs), _Run("reference"))
    model, sim = _simulated(variant, **kwargs)
    with sim:
        got = scenario(model, _Run("simulated", sim))
    assert sim.violations == [], "\n".join(sim.violations[:8])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    return got


def _sgd(model):
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)


def _adamw(model):
    # foreach=False: the same for-loop kernel with and without the simulator (offload would pick fused)
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=False)


def _loss(model, x):
    return model(input_ids=x, labels=x).loss


def _step(model, opt, x):
    loss = _loss(model, x)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


# ---------------------------------------------------------------------- generation
def _partial_budget(model):
    """A budget that keeps the root gathered but not every layer (3 layers, forward prefetch)."""
    return peak_held_bytes(model.units, [], True)


@pytest.mark.parametrize("mode", ["full", "budget", "budget-partial", "per_unit"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_generate_right_after_an_optimizer_step(variant, mode):
    """The gathers of generate() must see the optimizer's in-place update (no forward in between)."""
    def scenario(model, run):
        if mode == "budget-partial":
            set_generation_options(model, mode="budget", budget_bytes=_partial_budget(model))
        else:
            set_generation_options(model, mode=mode)  # budget: the tiny model fits: gathered once
        opt, x = _sgd(model), batches(2)
        losses = [_step(model, opt, x[0])]
        tokens = model.module.generate(x[0][:, :4], **GENERATE)
        losses.append(_step(model, opt, x[1]))
        return [tokens, losses]

    with pytest.warns(UserWarning) if mode in ("budget-partial", "per_unit") else contextlib.nullcontext():
        _both(variant, scenario, make=lambda: llama(n_layer=3 if mode == "budget-partial" else 2))


@pytest.mark.parametrize("mode", ["full", "budget-partial", "per_unit"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_trl_summon_seam_generates_like_the_unsimulated_run(variant, mode):
    """TRL's ``DistributedBackend.summon_full_params(model_wrapped, recurse=False)`` as patched
    (``generation.trl_summon_full_params``): a summon without writeback (full), or the generation session."""
    def original(self, module, **kwargs):  # TRL's own: never reached for our models
        raise AssertionError("the seam called TRL's summon_full_params for an accel_flatshard model")

    seam = trl_summon_full_params(original)

    def scenario(model, run):
        if mode == "budget-partial":
            set_generation_options(model, mode="budget", budget_bytes=_partial_budget(model))
        else:
            set_generation_options(model, mode=mode)
        opt, x = _sgd(model), batches(2)
        losses = [_step(model, opt, x[0])]
        with seam(None, model, recurse=False):
            tokens = model.module.generate(x[0][:, :4], **GENERATE)
        with trl_generation_context(model):  # the context itself (what the seam calls)
            again = model.module.generate(x[1][:, :4], **GENERATE)
        losses.append(_step(model, opt, x[1]))
        return [tokens, again, losses]

    with pytest.warns(UserWarning) if mode in ("budget-partial", "per_unit") else contextlib.nullcontext():
        _both(variant, scenario, make=lambda: llama(n_layer=3))


# ---------------------------------------------------------------------- summon_full_params
@pytest.mark.parametrize("how", ["writeback", "no-writeback", "bf16-inside"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_summon_full_params(variant, how):
    def scenario(model, run):
        opt, x = _sgd(model), batches(2)
        losses = [_step(model, opt, x[0])]
        with model.summon_full_params(writeback=how != "no-writeback"):
            if how == "bf16-inside":
                model.module.to(torch.bfloat16)  # TRL's GRPO with bf16=True; undone on exit
            logits = model.module(input_ids=x[1]).logits.float()
            inside = {k: v.clone() for k, v in model.state_dict().items()}  # the module's own, full
            with torch.no_grad():
                model.module.model.norm.weight.mul_(0.5)  # kept with writeback (not after a dtype cast)
        losses.append(_step(model, opt, x[1]))
        return [logits, inside, losses]

    _both(variant, scenario)


# ---------------------------------------------------------------------- state dicts and checkpoints
@pytest.mark.parametrize("variant", VARIANTS)
def test_state_dict_and_load_state_dict_of_the_prepared_model(variant):
    def scenario(model, run):
        opt, x = _sgd(model), batches(3)
        losses = [_step(model, opt, x[0])]
        wrapper_sd, module_sd = run.host(model.state_dict()), run.host(model.module.state_dict())  # full
        losses.append(_step(model, opt, x[1]))
        model.load_state_dict(wrapper_sd)  # back to after the first step
        losses.append(_step(model, opt, x[1]))  # equals the second loss
        local = run.host({k: v.clone() for k, v in model.local_state_dict().items()})  # (views of shards)
        losses.append(_step(model, opt, x[2]))
        model.load_local_state_dict(local)
        losses.append(_step(model, opt, x[2]))
        return [wrapper_sd, module_sd, losses]

    got = _both(variant, scenario)
    assert torch.equal(got[2][1], got[2][2]) and torch.equal(got[2][3], got[2][4])


@pytest.mark.parametrize("kind", ["full", "sharded"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_checkpoint_save_and_load_of_model_and_optimizer(variant, kind, tmp_path):
    def scenario(model, run):
        opt, x = _adamw(model), batches(2)
        losses = [_step(model, opt, x[0])]
        where = tmp_path / run.name
        if kind == "full":
            saved = run.host(full_state_dict(model)), full_optim_state_dict(model, opt)
            run.host([v for state in saved[1]["state"].values() for v in state.values()])
        else:
            save_sharded_model(model, str(where / "model"))
            save_sharded_optimizer(model, opt, str(where / "optim"))
        losses.append(_step(model, opt, x[1]))
        if kind == "full":
            load_full_state_dict(model, saved[0])
            load_full_optim_state_dict(model, opt, saved[1])
        else:
            load_sharded_model(model, str(where / "model"))
            load_sharded_optimizer(model, opt, str(where / "optim"))
        losses.append(_step(model, opt, x[1]))  # equals the second loss
        return losses

    losses = _both(variant, scenario)
    assert torch.equal(losses[1], losses[2])


# ---------------------------------------------------------------------- training features
@pytest.mark.parametrize("variant", VARIANTS)
def test_clip_grad_norm(variant):
    def scenario(model, run):
        opt, norms, losses = _sgd(model), [], []
        for x in batches(2):
            loss = _loss(model, x)
            loss.backward()
            norms.append(model.clip_grad_norm_(0.05))  # small: the gradients are scaled
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return [norms, losses]

    _both(variant, scenario)


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_sync_accumulation(variant):
    def scenario(model, run):
        opt, losses = _sgd(model), []
        for x in batches(2):
            first, second = x.chunk(2)
            with model.no_sync():  # the full gradients stay on the device, unreduced
                loss = _loss(model, first)
                loss.backward()
            losses.append(loss.detach())
            loss = _loss(model, second)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return losses

    _both(variant, scenario)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_activation_checkpointing(variant, reentrant):
    def scenario(model, run):
        model.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        opt = _sgd(model)
        return [_step(model, opt, x) for x in batches(2)]

    _both(variant, scenario)


def _fused_head_llama():
    """TRL's fused LM head: the root's forward reads ``lm_head.weight`` (a unit of its own) directly."""
    model = llama(n_layer=2)

    def forward(input_ids, labels=None):
        hidden = model.model(input_ids).last_hidden_state[:, :-1]
        logits = hidden @ model.lm_head.weight.t()  # read outside lm_head's forward
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), input_ids[:, 1:].reshape(-1))

    model.forward = forward
    return model


@pytest.mark.parametrize("nograd_between", [False, True], ids=["read", "read-then-no-grad-forward"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_read_from_outside_a_unit(variant, nograd_between):
    """With a no-grad forward between forward and backward (DPO's reference pass on the same model) the
    head's unit is freed in between and gathered again when backward starts."""
    def scenario(model, run):
        opt, losses = _sgd(model), []
        for x in batches(2):
            loss = model(x)
            if nograd_between:
                with torch.no_grad():
                    losses.append(model(x))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return losses

    _both(variant, scenario, make=_fused_head_llama, policy=transformer_auto_wrap_policy)


# ---------------------------------------------------------------------- a frozen reference model kept gathered
def _frozen_llama():
    return llama(n_layer=2).requires_grad_(False)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_frozen_reference_kept_gathered_next_to_a_trained_policy(variant):
    """DPO/GRPO's reference model: no-grad forwards keep its units gathered (keep_frozen_gathered) until the
    policy's optimizer step; then TRL's ``sync_ref_model`` mixes the policy into it (a write of its shards:
    on the host with offload) and the next reference forward gathers again."""
    def run_pair(policy, reference, run):
        set_generation_options(reference, keep_frozen_gathered=True)
        opt, out = _sgd(policy), []
        for x in batches(2):
            with torch.no_grad():
                out.append(reference(input_ids=x).logits)
                out.append(reference(input_ids=x).logits)  # kept gathered: no gather
            out.append(_step(policy, opt, x))
            with torch.no_grad():  # sync_ref_model
                for ref_p, p in zip(reference.parameters(), policy.parameters()):
                    ref_p.mul_(0.5).add_(p, alpha=0.5)
        return out

    expected = run_pair(_wrap(variant), _wrap(variant, make=_frozen_llama), _Run("reference"))
    policy, sim = _simulated(variant)
    reference, _ = _simulated(variant, sim=sim, make=_frozen_llama)
    with sim:
        got = run_pair(policy, reference, _Run("simulated", sim))
    assert sim.violations == [], "\n".join(sim.violations[:8])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


# ---------------------------------------------------------------------- issue 22: defects 3, 4, 6
@pytest.mark.parametrize("write", ["load_state_dict", "load_full_state_dict", "summon-writeback"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_shards_written_between_forward_and_backward_are_seen_by_the_backward_gathers(variant, write):
    """Defect 4: a load or a summon with writeback while units await backward writes the shards (on the
    compute stream); the backward's gathers on the all-gather stream must wait for that write."""
    def scenario(model, run):
        opt, x = _sgd(model), batches(2)
        losses = [_step(model, opt, x[0])]
        # left where the simulated device has it: a dict on the GPU (rank 0's broadcast at W>1 is too), so
        # loading it is a device copy, which does not make the host wait as a copy from CPU memory does
        saved = model.state_dict()
        losses.append(_step(model, opt, x[1]))
        loss = _loss(model, x[0])  # units await backward
        if write == "load_state_dict":
            model.load_state_dict(saved)
        elif write == "load_full_state_dict":
            load_full_state_dict(model, saved)
        else:
            with model.summon_full_params(writeback=True), torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        losses.append(_step(model, opt, x[1]))
        return losses

    _both(variant, scenario)


@pytest.mark.parametrize("then", ["optimizer-step", "load_state_dict", "summon-writeback"])
@pytest.mark.parametrize("before", ["eval-forward", "no_sync-micro-step"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_host_writes_after_a_forward_without_a_reducing_backward(variant, before, then):
    """Defect 6: with offload the host writes the pinned shards (optimizer step, a load, a summon's
    writeback) after an evaluation forward or a ``no_sync`` micro-step: the host-to-device copies of those
    forwards may still read them."""
    def scenario(model, run):
        opt, x = _sgd(model), batches(2)
        losses = [_loss(model, x[0])]
        losses[0].backward()  # a reducing backward: gradients on the host
        saved = run.host(model.state_dict())
        if before == "eval-forward":
            with torch.no_grad():
                losses.append(_loss(model, x[1]))
        else:
            with model.no_sync():
                loss = _loss(model, x[1])
                loss.backward()
            losses.append(loss.detach())
        if then == "optimizer-step":
            opt.step()
        elif then == "load_state_dict":
            model.load_state_dict(saved)
        else:
            with model.summon_full_params(writeback=True), torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
        opt.zero_grad()
        losses.append(_step(model, opt, x[0]))
        return [loss.detach() for loss in losses]

    _both(variant, scenario)


@pytest.mark.parametrize("variant", ["hybrid", "hybrid-offload"])
def test_a_backward_that_raised_is_drained_without_freeing_shards_the_replica_stream_writes(variant):
    """Defect 3: after a backward that raised, the next forward drains the reductions it started.  Under
    hybrid sharding a reduction's replica all-reduce is already issued on the replica stream; its shard
    may not be freed (reused) before that all-reduce is done."""
    def scenario(model, run):
        opt, x = _sgd(model), batches(2)

        def fail(grad):
            raise RuntimeError("backward failed")

        def hook_input(module, args):  # raises once layer 0's gradients are done (layers' reductions issued)
            if torch.is_grad_enabled() and args[0].requires_grad:
                args[0].register_hook(fail)

        handle = model.module.model.layers[0].register_forward_pre_hook(hook_input)
        with pytest.raises(RuntimeError, match="backward failed"):
            _loss(model, x[0]).backward()
        handle.remove()
        with pytest.warns(UserWarning, match="did not complete"):
            losses = [_step(model, opt, x[1])]  # drains the aborted backward's reductions first
        losses.append(_step(model, opt, x[0]))
        return losses

    offload = variant == "hybrid-offload"
    expected = scenario(_wrap("offload" if offload else "plain"), _Run("reference"))
    model = _wrap("offload" if offload else "plain")
    sim = simulate_cuda(model, group=IdenticalReplicas(model.shard_group))
    with sim:
        got = scenario(model, _Run("simulated", sim))
    assert sim.violations == [], "\n".join(sim.violations[:8])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_offload_with_hybrid_sharding_trains_like_the_unsimulated_run():
    """Offload and hybrid together: the reduced shard is copied to the host on the replica stream."""
    def scenario(model, run):
        opt = _adamw(model)
        return [_step(model, opt, x) for x in batches(2)]

    expected = scenario(_wrap("offload"), _Run("reference"))
    model = _wrap("offload")
    sim = simulate_cuda(model, group=IdenticalReplicas(model.shard_group))
    with sim:
        got = scenario(model, _Run("simulated", sim))
    assert sim.violations == [], "\n".join(sim.violations[:8])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_the_simulator_names_the_tensor_the_stream_and_the_op_of_an_unordered_host_write():
    """The host is a stream: a host write of a pinned shard that a host-to-device copy may still read is
    reported with the shard's name, the copy's stream and the op."""
    model, sim = _simulated("offload")
    x = batches(1)[0]
    with sim:
        with torch.no_grad():
            model(input_ids=x)  # gathers copy the host shards to the device (all-gather stream)
        unit = model._root.recorded_order[-1]  # gathered last
        unit.flat_params[0].local_shard.add_(1.0)  # on the host, without waiting for those copies
    engine = model._root.engine
    assert any(v.startswith(f"local_shard of {unit.name}[") and f"while {engine.all_gather_stream.name} may still"
               in v and "aten::add_" in v for v in sim.violations), sim.violations
    assert isinstance(sim, SimulatedCuda)
