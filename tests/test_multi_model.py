"""Several wrapped models in one process: each has its own root state and engine; they do not interfere.

Engine level (spawned gloo ranks vs one process): two models stepped in an interleaved order, a
backward of one that fails while the other trains on, one gradient norm over both.  Accelerate level
(``accelerate launch``, unmodified script vs accelerate DDP): a trained policy and a frozen reference
model, both prepared, both sharded, the frozen one without gradient memory.
"""
import pytest
import torch

from accel_flatshard import FullyShardedDataParallel, clip_grad_norm_, transformer_auto_wrap_policy
from dist_helpers import spawn
from launch_helpers import CPU_FSDP_YAML, SCRIPTS, ddp_reference, launch, max_abs_diff, read_json
from models import batches, global_mean, llama

TOL = 1e-6


def _wrap(model):
    return FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model))


def _interleaved_steps(a, b, rank, world_size, clip=None):
    """forward a, forward b, backward b, backward a, then (optionally one clip over both) step both."""
    opt = torch.optim.AdamW(list(a.parameters()) + list(b.parameters()), lr=1e-2)
    losses, norms = [], []
    for x in batches(3, batch=4, seq=16):
        local = x.chunk(world_size)[rank]
        loss_a = a(local, labels=local).loss
        loss_b = b(local.flip(1), labels=local.flip(1)).loss
        loss_b.backward()
        loss_a.backward()
        if clip is not None:
            norms.append(float(clip(list(a.parameters()) + list(b.parameters()), 0.5)))
        opt.step()
        opt.zero_grad()
        losses.append((global_mean(loss_a, world_size), global_mean(loss_b, world_size)))
    return losses, norms


def _interleaved_worker(rank, world_size):
    a, b = _wrap(llama(seed=0)), _wrap(llama(seed=1))
    return _interleaved_steps(a, b, rank, world_size, clip=clip_grad_norm_)


def test_two_models_interleaved_with_one_clip_over_both_match_single_process():
    losses, norms = spawn(2, _interleaved_worker)[0]
    ref_losses, ref_norms = _interleaved_steps(llama(seed=0), llama(seed=1), 0, 1, clip=torch.nn.utils.clip_grad_norm_)
    assert max(abs(x - y) for pair, ref in zip(losses, ref_losses) for x, y in zip(pair, ref)) < TOL
    assert max(abs(x - y) / y for x, y in zip(norms, ref_norms)) < 1e-5


def _failed_backward_worker(rank, world_size):
    a, b = _wrap(llama(seed=0)), _wrap(llama(seed=1))
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    x = batches(1, batch=4, seq=16)[0].chunk(world_size)[rank]

    def fail(grad):
        raise RuntimeError("injected failure in a's backward")

    def hook_output(module, args, output):  # the first block's output fails when its gradient arrives
        (output[0] if isinstance(output, tuple) else output).register_hook(fail)

    a.module.model.layers[0].register_forward_hook(hook_output)
    loss = a(x, labels=x).loss
    try:
        loss.backward()
    except RuntimeError:
        pass
    losses_b = []
    for _ in range(2):  # b trains on while a's backward is left unfinished
        out = b(x, labels=x).loss
        out.backward()
        opt_b.step()
        opt_b.zero_grad()
        losses_b.append(global_mean(out, world_size))
    try:
        opt_a.step()
        a_step = "allowed"
    except RuntimeError as e:
        a_step = str(e)
    return losses_b, a_step


def test_a_failed_backward_of_one_model_blocks_only_its_own_optimizer():
    losses_b, a_step = spawn(2, _failed_backward_worker)[0]
    reference = llama(seed=1)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x = batches(1, batch=4, seq=16)[0]
    ref_losses = []
    for _ in range(2):
        out = reference(x, labels=x).loss
        out.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(out.item())
    assert max(abs(a - b) for a, b in zip(losses_b, ref_losses)) < TOL
    assert "did not complete" in a_step


# DDP refuses a model without trainable parameters: its reference is prepared with evaluation_mode
two_model_ddp = ddp_reference("two_model_ddp", SCRIPTS / "two_model_train.py", lambda out: [
    "--prepare_reference", "evaluation_mode", "--output_dir", out / "ddp", "--output_json", out / "ddp.json"])


@pytest.fixture(scope="module")
def two_model_runs(tmp_path_factory, two_model_ddp):
    tmp = tmp_path_factory.mktemp("two_models")
    script = SCRIPTS / "two_model_train.py"
    launch(CPU_FSDP_YAML, script, ["--prepare_reference", "together", "--output_dir", str(tmp / "fs"),
                                   "--output_json", str(tmp / "fs.json")], via_run=True)
    return read_json(two_model_ddp / "ddp.json"), read_json(tmp / "fs.json")


def test_policy_and_frozen_reference_prepared_together_train_like_ddp(two_model_runs):
    ddp, ours = two_model_runs
    assert ours["distributed_type"] == "DistributedType.FSDP"
    assert max_abs_diff(ours["losses"], ddp["losses"]) < 1e-5
    assert max_abs_diff(ours["grad_norms"], ddp["grad_norms"]) < 1e-5


def test_both_models_are_sharded_and_the_frozen_one_holds_no_gradients(two_model_runs):
    ddp, ours = two_model_runs
    assert ours["policy"]["trainable"] == ddp["policy"]["trainable"] // 2
    assert ours["reference"]["frozen"] == ddp["reference"]["frozen"] // 2
    assert ours["reference"]["trainable"] == 0 and ours["reference_grad_bytes"] == 0
    assert ours["policy_grad_bytes"] > 0


def test_get_state_dict_gives_each_models_full_state(two_model_runs):
    ddp, ours = two_model_runs
    for name in ("policy", "reference"):
        assert ours[f"{name}_state_keys"] == ddp[f"{name}_state_keys"]
        assert abs(ours[f"{name}_state_sum"] - ddp[f"{name}_state_sum"]) < 1e-3
