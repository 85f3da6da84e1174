"""Every public path of a wrapped model on the simulated CUDA schedule (tests/sim_cuda.py; issues 21 and 22).

Each test runs one path (a *scenario*) twice: on the simulated GPU (the engine's real CUDA code path, every
op observed; ``sim.violations`` must stay empty) and without the simulator (the CPU schedule); the results
must be equal.  Variants of the schedule:

* ``plain``: sharded, one process;
* ``offload``: CPU offload (pinned host shards and gradients, the optimizer on the host);
* ``hybrid``: hybrid sharding over two identical replicas (:class:`IdenticalReplicas`): the replica
  all-reduce on its own stream, chained to the reduce-scatter's event.

A value read on the host (``.item()``) makes the host wait for the GPU and would hide a missing wait, so
results are compared only after the simulated run.  One combination per path runs by default, all of them
with ``-m slow`` and in the mutation table (tests/sim_table.py: every ordering call of the package broken
in turn must fail one of these).  The same scenarios at W=2 over real gloo collectives: tests/test_sim_w2.py.
"""
import contextlib
import functools
import itertools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from accel_flatshard import CPUOffload, FullyShardedDataParallel, transformer_auto_wrap_policy
from accel_flatshard.state import (full_optim_state_dict, full_state_dict, load_full_optim_state_dict,
                                   load_full_state_dict, load_sharded_model, load_sharded_optimizer, save_sharded_model,
                                   save_sharded_optimizer)
from accel_flatshard.features.generation import (control_of,
                                                 peak_held_bytes,
                                                 set_generation_options,
                                                 trl_generation_context,
                                                 trl_summon_full_params)
from models import batches, llama, llama_layer_class
from sim_cuda import one_thread, simulate_cuda  # noqa: F401 - one_thread: a fixture

pytestmark = pytest.mark.usefixtures("world_of_one", "one_thread")

GENERATE = dict(max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0)


# ---------------------------------------------------------------------- harness
class IdenticalReplicas:
    """The engine's view of hybrid sharding over ``replicas`` identical copies of a one-process shard group.

    Every replica holds the same gradient, so the all-reduce across replicas multiplies by ``replicas``
    (in place, as NCCL writes its buffer) and the averaged gradients equal the single process's: a whole
    wrapped model runs the hybrid schedule (replica stream, chained events) in one process and must train
    exactly like the plain model.  Everything else is the real group's."""

    def __init__(self, group, replicas=2):
        self._group, self.replicas = group, replicas
        self.world_size = group.world_size * replicas
        self.is_hybrid = True

    def __getattr__(self, name):
        return getattr(self._group, name)

    def all_reduce_replicas(self, tensor, async_op=True):
        tensor.mul_(self.replicas)
        return _Done()


class _Done:
    def wait(self):
        return True


class NodeLocalGathers:
    """The engine's view of hpZ in one process: a node group of one rank (ranks_per_node=1), so each unit keeps its
    whole gathered buffer as its secondary slice after forward, and its backward gather copies it back inside the
    "machine" (on the all-gather stream, after the copy made on the compute stream).  Everything else is the real
    group's."""

    def __init__(self, group):
        from accel_flatshard.core.comm import Members

        self._group, self.node = group, Members(None, 1, 0, 0)

    def __getattr__(self, name):
        return getattr(self._group, name)

    def all_gather(self, outputs, shards, async_op=True, kind="", in_node=False):
        if not in_node:
            return self._group.all_gather(outputs, shards, async_op=async_op, kind=kind)
        for output, shard in zip(outputs, shards):
            output.copy_(shard)
        return _Done()


class Run:
    """What a scenario knows of its run: ``name`` ("reference" or "simulated"), a directory ``tmp`` of its
    own (the same on every rank), and ``host(tree)``, which declares the tensors of ``tree`` host memory
    (a state dict: CPU tensors on a GPU machine too)."""

    def __init__(self, name, tmp, sim=None):
        self.name, self.tmp, self.sim = name, Path(tmp) / name, sim

    def host(self, tree):
        if self.sim is not None:
            for t in tree.values() if isinstance(tree, dict) else tree:
                if isinstance(t, torch.Tensor):
                    self.sim.place(t, "host")
        return tree


def wrap(variant, make=None, policy=None, **kwargs):
    """``variant``: plain / offload / hybrid / hybrid-offload / hpz / int8 / int8-offload.  Hybrid: ``fsdp_group_size=1``
    at W>1; in one process :func:`simulated` gives the engine two identical replicas; hpz: a node group of one rank;
    int8-offload: the master shards are host memory, copied to the device on the all-gather stream, then quantized."""
    module = (make or (lambda: llama(n_layer=2)))()
    policy = policy(module) if policy else transformer_auto_wrap_policy([llama_layer_class()])
    world = torch.distributed.get_world_size()
    if "int8" in variant:  # the quantized all-gather and reduction (run in one process: the int8 math on the streams)
        kwargs.update(quantized_all_gather=True, quantized_reduce=True, quant_block=64)
    return FullyShardedDataParallel(module, auto_wrap_policy=policy, cpu_offload=CPUOffload("offload" in variant),
                                    fsdp_group_size=1 if "hybrid" in variant and world > 1 else None, **kwargs)


def simulated(variant, sim=None, **kwargs):
    model = wrap(variant, **kwargs)
    one_process_hybrid = "hybrid" in variant and not model.shard_group.is_hybrid
    group = IdenticalReplicas(model.shard_group) if one_process_hybrid else None
    if variant == "hpz":  # (unsimulated, the world of one keeps no secondary: the reference is the plain schedule)
        group = NodeLocalGathers(model.shard_group)
    return model, simulate_cuda(model, group=group, sim=sim)


def run_both(variant, scenario, tmp, **kwargs):
    """``scenario(model, run)`` on an unsimulated and a simulated model built alike; returns (simulated
    result, unsimulated result, violations)."""
    expected = scenario(wrap(variant, **kwargs), Run("reference", tmp))
    model, sim = simulated(variant, **kwargs)
    with sim:
        got = scenario(model, Run("simulated", tmp, sim))
    return got, expected, sim.violations


def _both(variant, scenario, tmp, **kwargs):
    got, expected, violations = run_both(variant, scenario, tmp, **kwargs)
    assert violations == [], "\n".join(violations[:8])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    return got


def _grid(argnames, combos, default):
    """Parametrize with every combination; those not in ``default`` are ``slow``."""
    combos = [c if isinstance(c, tuple) else (c,) for c in combos]
    default = {c if isinstance(c, tuple) else (c,) for c in default}
    return pytest.mark.parametrize(argnames, [
        pytest.param(*c, id="-".join(map(str, c)), marks=() if c in default else pytest.mark.slow) for c in combos])


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


def _set_mode(model, mode):
    if mode == "budget-partial":  # keeps the root gathered, not every layer (3 layers, forward prefetch)
        set_generation_options(model, generation_mode="budget",
                               generation_budget_mb=peak_held_bytes(model.units, [], True) / 2**20)
    else:
        set_generation_options(model, generation_mode=mode)  # budget: the tiny model fits: gathered once


def _warns_if(slow_mode):
    return pytest.warns(UserWarning) if slow_mode else contextlib.nullcontext()


# ---------------------------------------------------------------------- scenarios (also run at W=2)
def generate_after_step(model, run, mode):
    """The gathers of generate() must see the optimizer's in-place update (no forward in between)."""
    _set_mode(model, mode)
    opt, x = _sgd(model), batches(2)
    losses = [_step(model, opt, x[0])]
    with _warns_if(mode in ("budget-partial", "per_unit")):
        tokens = model.module.generate(x[0][:, :4], **GENERATE)
    losses.append(_step(model, opt, x[1]))
    return [tokens, losses]


def _not_trls_own(self, module, **kwargs):
    raise AssertionError("the seam called TRL's own summon_full_params for an accel_flatshard model")


def trl_seam(model, run, mode):
    """TRL's ``DistributedBackend.summon_full_params(model_wrapped, recurse=False)`` as patched
    (``generation.trl_summon_full_params``): a summon without writeback (full), or the generation session."""
    _set_mode(model, mode)
    opt, x = _sgd(model), batches(2)
    losses = [_step(model, opt, x[0])]
    with _warns_if(mode in ("budget-partial", "per_unit")):
        with trl_summon_full_params(_not_trls_own)(None, model, recurse=False):
            tokens = model.module.generate(x[0][:, :4], **GENERATE)
        with trl_generation_context(model):  # what the seam calls
            again = model.module.generate(x[1][:, :4], **GENERATE)
    losses.append(_step(model, opt, x[1]))
    return [tokens, again, losses]


def summon(model, run, how):
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


def state_dicts(model, run):
    """The prepared model's state_dict() and load_state_dict (full, collective), its local ones."""
    opt, x = _sgd(model), batches(3)
    losses = [_step(model, opt, x[0])]
    wrapper_sd, module_sd = run.host(model.state_dict()), run.host(model.module.state_dict())
    losses.append(_step(model, opt, x[1]))
    model.load_state_dict(wrapper_sd)  # back to after the first step
    losses.append(_step(model, opt, x[1]))  # equals the second loss
    local = run.host({k: v.clone() for k, v in model.local_state_dict().items()})  # (views of the shards)
    losses.append(_step(model, opt, x[2]))
    model.load_local_state_dict(local)
    losses.append(_step(model, opt, x[2]))
    assert torch.equal(losses[1], losses[2]) and torch.equal(losses[3], losses[4])
    return [wrapper_sd, module_sd, losses]


def checkpoint(model, run, kind):
    """FULL and SHARDED saves and loads of the model and its optimizer (accel_flatshard.state)."""
    opt, x = _adamw(model), batches(2)
    losses = [_step(model, opt, x[0])]
    if kind == "full":
        saved = run.host(full_state_dict(model)), full_optim_state_dict(model, opt)
        run.host([v for state in saved[1].get("state", {}).values() for v in state.values()])
    else:
        save_sharded_model(model, str(run.tmp / "model"))
        save_sharded_optimizer(model, opt, str(run.tmp / "optim"))
    losses.append(_step(model, opt, x[1]))
    if kind == "full":
        load_full_state_dict(model, saved[0] or None)  # (rank 0 has the dicts at W>1)
        load_full_optim_state_dict(model, opt, saved[1] or None)
    else:
        load_sharded_model(model, str(run.tmp / "model"))
        load_sharded_optimizer(model, opt, str(run.tmp / "optim"))
    losses.append(_step(model, opt, x[1]))
    assert torch.equal(losses[1], losses[2])
    return losses


def clip(model, run):
    opt, norms, losses = _sgd(model), [], []
    for x in batches(2):
        loss = _loss(model, x)
        loss.backward()
        norms.append(model.clip_grad_norm_(0.05))  # small: the gradients are scaled
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return [norms, losses]


def save_pretrained(model, run, how):
    """``accelerator.get_state_dict`` (``full_state_dict(rank0_only, cpu_offload)``: copies to the host) then
    ``save_pretrained(state_dict=...)``, or ``save_pretrained`` of the unwrapped module (its ``state_dict()``
    gathers): safetensors reads every tensor on the host, which must be a completed copy."""
    from safetensors.torch import load_file

    opt, x = _sgd(model), batches(1)
    losses = [_step(model, opt, x[0])]
    out = run.tmp / "hf"
    if how == "get_state_dict":
        model.module.save_pretrained(out, state_dict=full_state_dict(model, rank0_only=True, cpu_offload=True))
    else:
        model.module.save_pretrained(out)
    return [load_file(out / "model.safetensors"), losses]


def no_sync_deferring_the_replica_all_reduce(model, run):
    """FSDP2's ``set_requires_all_reduce(False)`` on the micro-step before the last (hybrid sharding: the reduction
    inside the shard group runs, its result is carried, the replica all-reduce runs once on the last micro-step); a
    model with nothing to defer (the unsimulated one process) reduces as plain ``no_sync``."""
    return no_sync(model, run, defer=True)


def no_sync(model, run, defer=False):
    opt, losses = _sgd(model), []
    for x in batches(2):
        first, second = x.chunk(2)
        if defer:
            model.set_requires_all_reduce(False)
        with model.no_sync():  # the full gradients stay on the device, unreduced (defer: reduced inside the group)
            loss = _loss(model, first)
            loss.backward()
        if defer:
            model.set_requires_all_reduce(True)
        losses.append(loss.detach())
        loss = _loss(model, second)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def activation_checkpointing(model, run, how):
    """transformers' gradient checkpointing (reentrant or not), or torch's checkpoint wrapper around the
    whole decoder stack: its recomputation in backward runs every unit's forward before their backward
    starts, so each is gathered there (``Unit._pre_forward_hook`` during backward)."""
    if how == "whole-stack":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        stack = model.module.model
        apply_activation_checkpointing(model.module, check_fn=lambda m: m is stack)
    else:
        model.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": how == "reentrant"})
    opt = _sgd(model)
    return [_step(model, opt, x) for x in batches(2)]


class SkippableStack(torch.nn.Module):
    """Three blocks (tests/toy.py); ``forward(x, depth)`` runs only the first ``depth`` of them (a layer
    drop, an early exit)."""

    def __init__(self):
        super().__init__()
        from toy import Block, D

        torch.manual_seed(0)
        self.embed = torch.nn.Linear(D, D)
        self.blocks = torch.nn.ModuleList([Block() for _ in range(3)])
        self.head = torch.nn.Linear(D, 1)

    def forward(self, x, depth=3):
        x = self.embed(x)
        for block in self.blocks[:depth]:
            x = block(x)
        return self.head(x).pow(2).mean()


def _block_policy(module):
    from toy import Block

    return transformer_auto_wrap_policy([Block])


SKIPPABLE_MODEL = dict(make=SkippableStack, policy=_block_policy)


def skipped_unit(model, run, then):
    """A forward that skips the last unit leaves the gather its predecessor prefetched for it in flight
    (forward prefetch follows the recorded order); a load (``ensure_idle``) or the end of a no-grad forward
    must wait for that gather before it writes the shard the gather reads or frees its buffer."""
    from toy import toy_batches

    opt, x = _sgd(model), toy_batches(3)
    losses = [_step_toy(model, opt, x[0])]  # records the order: every block
    saved = model.state_dict()  # (a dict on the simulated device: its load is a device copy)
    if then == "load_state_dict":
        loss = model(x[1], depth=2)  # units await backward; the last block's gather is in flight
        model.load_state_dict(saved)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    else:
        with torch.no_grad():
            losses.append(model(x[1], depth=2))  # every unit is freed at the end
    losses.append(_step_toy(model, opt, x[2]))
    return losses


def _step_toy(model, opt, x):
    loss = model(x)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def fused_head_llama():
    """TRL's fused LM head: the root's forward reads ``lm_head.weight`` (a unit of its own) directly."""
    model = llama(n_layer=2)

    def forward(input_ids, labels=None):
        hidden = model.model(input_ids).last_hidden_state[:, :-1]
        logits = hidden @ model.lm_head.weight.t()  # read outside lm_head's forward
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), input_ids[:, 1:].reshape(-1))

    model.forward = forward
    return model


OUTSIDE_READ_MODEL = dict(make=fused_head_llama, policy=transformer_auto_wrap_policy)


def outside_read(model, run, nograd_between, keep_root=False):
    """With a no-grad forward between forward and backward (DPO's reference pass on the same model) the
    head's unit is freed in between and gathered again when backward starts.  ``keep_root``: frozen-model
    keeping (FLATSHARD_KEEP_FROZEN_GATHERED) with a budget for the root only: the root stays gathered, so
    nothing but the head's own wait orders its gather before the backward reads it."""
    if keep_root:
        root = next(u for u in model.units if u.is_root)
        set_generation_options(model, keep_frozen_gathered=True,
                               generation_budget_mb=peak_held_bytes(model.units, [root], True) / 2**20)
        assert control_of(model).plan() == [root]
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


def write_between_forward_and_backward(model, run, write):
    """Issue 22 defect 4: a load or a summon with writeback while units await backward writes the shards
    (on the compute stream); the backward's gathers on the all-gather stream must wait for that write."""
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
        load_full_state_dict(model, saved or None)
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


def host_write_after_forward(model, run, before, then):
    """Issue 22 defect 6: with offload the host writes the pinned shards (an optimizer step, a load, a
    summon's writeback) after an evaluation forward or a ``no_sync`` micro-step: the host-to-device copies
    of those forwards may still read them."""
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


def raised_backward(model, run):
    """Issue 22 defect 3: after a backward that raised, the next forward drains the gathers and reductions it
    started.  Under hybrid sharding a reduction's replica all-reduce is already issued on the replica
    stream; its shard may not be freed (reused) before that all-reduce is done."""
    opt, x = _sgd(model), batches(2)

    def fail(grad):
        raise RuntimeError("backward failed")

    def hook_input(module, args):  # raises once the last layer's gradients are done: its reductions are
        if torch.is_grad_enabled() and args[0].requires_grad:  # issued, the layer below is being gathered
            args[0].register_hook(fail)

    handle = model.module.model.layers[-1].register_forward_pre_hook(hook_input)
    with pytest.raises(RuntimeError, match="backward failed"):
        _loss(model, x[0]).backward()
    handle.remove()
    with pytest.warns(UserWarning, match="did not complete"):
        losses = [_step(model, opt, x[1])]  # drains the aborted backward's reductions first
    losses.append(_step(model, opt, x[0]))
    return losses


def train(model, run):
    opt = _adamw(model)
    return [_step(model, opt, x) for x in batches(2)]


def frozen_llama():
    return llama(n_layer=2).requires_grad_(False)


def frozen_reference(policy, reference):
    """DPO/GRPO's reference model: no-grad forwards keep its units gathered (keep_frozen_gathered) until the
    policy's optimizer step; then TRL's ``sync_ref_model`` mixes the policy into it (a write of its shards:
    on the host with offload) and the next reference forward gathers again."""
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


def run_frozen_reference(variant):
    """:func:`frozen_reference` unsimulated and simulated (both models on one simulated GPU)."""
    expected = frozen_reference(wrap(variant), wrap(variant, make=frozen_llama))
    policy, sim = simulated(variant)
    reference, _ = simulated(variant, sim=sim, make=frozen_llama)
    with sim:
        got = frozen_reference(policy, reference)
    return got, expected, sim.violations


# ---------------------------------------------------------------------- tests
def _product(*axes):
    return list(itertools.product(*axes))


TWO = ["plain", "offload"]
THREE = ["plain", "offload", "hybrid"]
FOUR = THREE + ["hpz", "int8", "int8-offload"]


@_grid("variant,mode", _product(TWO, ["full", "budget", "budget-partial", "per_unit"]),
       default=[("plain", "full"), ("plain", "per_unit"), ("offload", "budget-partial")])
def test_generate_right_after_an_optimizer_step(variant, mode, tmp_path):
    _both(variant, functools.partial(generate_after_step, mode=mode), tmp_path,
          make=lambda: llama(n_layer=3 if mode == "budget-partial" else 2))


@_grid("variant,mode", _product(TWO, ["full", "budget-partial", "per_unit"]),
       default=[("plain", "full"), ("offload", "per_unit")])
def test_trl_summon_seam(variant, mode, tmp_path):
    _both(variant, functools.partial(trl_seam, mode=mode), tmp_path, make=lambda: llama(n_layer=3))


@_grid("variant,how", _product(TWO, ["writeback", "no-writeback", "bf16-inside"]),
       default=[("plain", "writeback"), ("offload", "bf16-inside")])
def test_summon_full_params(variant, how, tmp_path):
    _both(variant, functools.partial(summon, how=how), tmp_path)


@_grid("variant", TWO, default=TWO)
def test_state_dict_and_load_state_dict_of_the_prepared_model(variant, tmp_path):
    _both(variant, state_dicts, tmp_path)


@_grid("variant,kind", _product(TWO, ["full", "sharded"]), default=[("plain", "full"), ("offload", "sharded")])
def test_checkpoint_save_and_load_of_model_and_optimizer(variant, kind, tmp_path):
    _both(variant, functools.partial(checkpoint, kind=kind), tmp_path)


@_grid("variant,how", _product(TWO, ["get_state_dict", "save_pretrained"]),
       default=[("offload", "get_state_dict"), ("plain", "save_pretrained")])
def test_save_pretrained_reads_completed_host_copies(variant, how, tmp_path):
    _both(variant, functools.partial(save_pretrained, how=how), tmp_path)


@_grid("variant", THREE, default=["hybrid", "offload"])
def test_clip_grad_norm(variant, tmp_path):
    _both(variant, clip, tmp_path)


def test_clip_grad_norm_under_offload_syncs_the_host_twice_not_per_parameter():
    """The host norms go to the device for the all-reduce (one blocking copy) and the clip coefficient comes
    back once per (device, dtype) of the gradients, not once per gradient (each is a blocking copy)."""
    model, sim = simulated("offload")
    x = batches(1)[0]
    with sim:
        _loss(model, x).backward()
        before = sim.host_syncs
        model.clip_grad_norm_(0.05)
    assert sim.violations == []
    assert sim.host_syncs - before == 2, f"{sim.host_syncs - before} host syncs for {len(model.flat_params)} flat parameters"


@_grid("variant", FOUR, default=["offload", "hpz", "int8"])
def test_no_sync_accumulation(variant, tmp_path):
    _both(variant, no_sync, tmp_path)


@_grid("variant", ["hybrid", "hybrid-offload"], default=["hybrid"])
def test_no_sync_accumulation_deferring_the_replica_all_reduce(variant, tmp_path):
    _both(variant, no_sync_deferring_the_replica_all_reduce, tmp_path)


def partly_frozen_llama():
    """Each block a frozen attention and a trainable MLP: two flat parameters per unit, in one gathered storage."""
    model = llama(n_layer=2)
    for layer in model.model.layers:
        layer.self_attn.requires_grad_(False)
    return model


@_grid("variant", FOUR, default=["plain", "offload", "hpz", "int8", "int8-offload"])
def test_units_of_several_flat_parameters_gather_once(variant, tmp_path):
    _both(variant, clip, tmp_path, make=partly_frozen_llama)


@_grid("variant,how", _product(FOUR, ["non-reentrant", "reentrant", "whole-stack"]),
       default=[("plain", "reentrant"), ("hybrid", "non-reentrant"), ("plain", "whole-stack"), ("hpz", "reentrant")])
def test_activation_checkpointing(variant, how, tmp_path):
    _both(variant, functools.partial(activation_checkpointing, how=how), tmp_path)


@_grid("variant,then", _product(TWO, ["load_state_dict", "no-grad-forward"]),
       default=[("plain", "load_state_dict"), ("offload", "no-grad-forward")])
def test_a_forward_that_skips_a_unit_leaves_no_gather_behind(variant, then, tmp_path):
    _both(variant, functools.partial(skipped_unit, then=then), tmp_path, **SKIPPABLE_MODEL)


@_grid("variant,how", _product(THREE, ["read", "read-then-no-grad-forward", "root-kept"]),
       default=[("plain", "read-then-no-grad-forward"), ("offload", "root-kept")])
def test_a_read_from_outside_a_unit(variant, how, tmp_path):
    scenario = functools.partial(outside_read, nograd_between=how != "read", keep_root=how == "root-kept")
    _both(variant, scenario, tmp_path, **OUTSIDE_READ_MODEL)


@_grid("variant", TWO, default=["offload"])
def test_a_frozen_reference_kept_gathered_next_to_a_trained_policy(variant):
    got, expected, violations = run_frozen_reference(variant)
    assert violations == [], "\n".join(violations[:8])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@_grid("variant,write", _product(TWO, ["load_state_dict", "load_full_state_dict", "summon-writeback"]),
       default=[("plain", "load_state_dict"), ("plain", "summon-writeback"), ("offload", "load_full_state_dict")])
def test_shards_written_between_forward_and_backward_are_seen_by_the_backward_gathers(variant, write, tmp_path):
    _both(variant, functools.partial(write_between_forward_and_backward, write=write), tmp_path)


@_grid("variant,before,then",
       _product(TWO, ["eval-forward", "no_sync-micro-step"], ["optimizer-step", "load_state_dict", "summon-writeback"]),
       default=[("offload", "eval-forward", "optimizer-step"), ("offload", "eval-forward", "load_state_dict"),
                ("offload", "no_sync-micro-step", "optimizer-step")])
def test_host_writes_after_a_forward_without_a_reducing_backward(variant, before, then, tmp_path):
    _both(variant, functools.partial(host_write_after_forward, before=before, then=then), tmp_path)


@_grid("variant", ["plain", "hybrid", "hybrid-offload"], default=["plain", "hybrid"])
def test_a_backward_that_raised_is_drained_without_freeing_shards_the_replica_stream_writes(variant, tmp_path):
    _both(variant, raised_backward, tmp_path, make=lambda: llama(n_layer=3))  # (a layer is being gathered)


def test_offload_with_hybrid_sharding_trains_like_the_unsimulated_run(tmp_path):
    """Offload and hybrid together: the reduced shard is copied to the host on the replica stream."""
    _both("hybrid-offload", train, tmp_path)


def test_the_simulator_names_the_tensor_the_stream_and_the_op_of_an_unordered_host_write():
    """The host is a stream: a host write of a pinned shard that a host-to-device copy may still read is
    reported with the shard's name, the copy's stream and the op."""
    model, sim = simulated("offload")
    x = batches(1)[0]
    with sim:
        with torch.no_grad():
            model(input_ids=x)  # gathers copy the host shards to the device (all-gather stream)
        unit = model.schedule.recorded_order[-1]  # gathered last
        unit.flat_params[0].local_shard.add_(1.0)  # on the host, without waiting for those copies
    stream = model.schedule.engine.all_gather_stream.name
    assert any(v.startswith(f"local_shard of {unit.name}[0] written on host while {stream} may still read it")
               and "aten::add_" in v for v in sim.violations), sim.violations
