"""torch's own state-dict API (``torch.distributed.checkpoint.state_dict``) on a prepared model (state/torch_api.py).

Default options give, per parameter, this rank's pieces as a ``ShardedTensor`` of the original key and global shape
(no gather); ``full_state_dict=True`` full tensors; ``set_*`` take both; ``dcp.save(get_state_dict(model, opt))``
then ``dcp.load`` + ``set_state_dict`` resume with DCP's default planners at the same world size (exactly), at
another (2 -> 4 -> 1) and into a plain model.  Tiny GPT-2 (tied embeddings) and Llama, gloo ranks.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     get_state_dict, set_model_state_dict, set_optimizer_state_dict,
                                                     set_state_dict)

import models
from dist_helpers import spawn

STEPS = 3
TOL = 1e-6  # across world sizes (the reduction order differs); the same world size resumes exactly
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
FULL_EVERY_RANK = StateDictOptions(full_state_dict=True)

warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)


def _data():
    return models.batches(2 * STEPS, batch=8, seq=8)  # splits evenly over 1, 2 and 4 ranks


def _wrap(model, **kw):
    from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy

    return FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model), **kw)


def _adamw(model):
    return torch.optim.AdamW(models.param_groups(model), lr=1e-2)


def _train(model, opt, data, rank, ws):
    return models.train(model, data, rank, ws, optimizer=opt)


def _local_bytes(sd):
    seen, total = set(), 0
    for value in sd.values():
        if isinstance(value, ShardedTensor) and id(value) not in seen:
            seen.add(id(value))
            total += sum(s.tensor.nbytes for s in value.local_shards())
    return total


def _shape_worker(rank, ws, which, group):
    plain = models.MODELS[which](seed=5)
    reference = {k: v.clone() for k, v in plain.state_dict().items()}
    model_bytes = sum(p.nbytes for p in plain.parameters())  # (each tied parameter once)
    model = _wrap(plain, fsdp_group_size=group)
    sd = get_model_state_dict(model)
    full = get_model_state_dict(model, options=FULL_EVERY_RANK)  # full tensors on every rank
    params = {k for k, _ in model.named_parameters(remove_duplicate=False)}
    checks = {"keys": list(sd) == list(reference),
              "shapes": all(tuple(sd[k].shape) == tuple(reference[k].shape) for k in reference),
              "params_sharded": all(isinstance(sd[k], ShardedTensor) for k in params),
              "buffers_whole": all(not isinstance(sd[k], ShardedTensor) for k in set(sd) - params)}
    # the local shards are the right parts of the full tensor
    checks["values"] = all(torch.equal(s.tensor, full[k][tuple(slice(o, o + n) for o, n in zip(
        s.metadata.shard_offsets, s.metadata.shard_sizes))]) for k in params for s in sd[k].local_shards())
    checks["full_equals_plain"] = all(torch.equal(full[k], reference[k]) for k in reference)
    rank0_only = get_model_state_dict(model, options=FULL)
    return checks, _local_bytes(sd), model_bytes, model.shard_group.shard_size, len(rank0_only)


@pytest.mark.parametrize("ws, which, group", [(2, "gpt2", None), (4, "llama", None), (4, "llama", 2)],
                         ids=["w2-gpt2", "w4-llama", "hybrid-2x2-llama"])
def test_default_options_give_this_ranks_pieces_as_sharded_tensors(ws, which, group):
    results = spawn(ws, _shape_worker, which, group, timeout_s=300)
    for rank, (checks, local, total, shard_size, n_full) in enumerate(results):
        assert all(checks.values()), (rank, checks)
        assert local <= total / shard_size + 4096, (rank, local, total)  # 1/G of the model, no gather
        assert (n_full > 0) == (rank == 0), (rank, n_full)  # full_state_dict + cpu_offload: rank 0 only


def _set_worker(rank, ws):
    data = _data()
    a = _wrap(models.gpt2(seed=5))
    opt_a = _adamw(a)
    _train(a, opt_a, data[:STEPS], rank, ws)
    sharded_osd = get_optimizer_state_dict(a, opt_a)
    entry = sharded_osd["state"]["transformer.wte.weight"]
    kinds = {k: type(v).__name__ for k, v in entry.items()}
    step_is_scalar = entry["step"].dim() == 0 and entry["step"].item() == STEPS
    forms = {
        "sharded": (get_model_state_dict(a), sharded_osd, None),
        "full": (get_model_state_dict(a, options=FULL_EVERY_RANK),
                 get_optimizer_state_dict(a, opt_a, options=FULL_EVERY_RANK), FULL_EVERY_RANK),
        "full_rank0": (get_model_state_dict(a, options=FULL), get_optimizer_state_dict(a, opt_a, options=FULL),
                       StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)),
        "flattened": (get_model_state_dict(a), get_optimizer_state_dict(
            a, opt_a, options=StateDictOptions(flatten_optimizer_state_dict=True)),
            StateDictOptions(flatten_optimizer_state_dict=True)),
    }
    losses = {}
    for name, (msd, osd, options) in forms.items():
        b = _wrap(models.gpt2(seed=7))
        opt_b = _adamw(b)
        set_model_state_dict(b, msd, options=options)
        set_optimizer_state_dict(b, opt_b, osd, options=options)
        losses[name] = _train(b, opt_b, data[STEPS:], rank, ws)
    reference = _train(a, opt_a, data[STEPS:], rank, ws)
    return kinds, step_is_scalar, losses, reference


def test_set_accepts_sharded_full_and_flattened_forms():
    kinds, step_is_scalar, losses, reference = spawn(2, _set_worker, timeout_s=300)[0]
    assert kinds == {"step": "Tensor", "exp_avg": "ShardedTensor", "exp_avg_sq": "ShardedTensor"}
    assert step_is_scalar
    for name, got in losses.items():
        assert got == reference, name  # the same world size: exactly


# ---------------------------------------------------------------------- dcp.save / dcp.load round trips
def _first_run(rank, ws, root):
    data = _data()
    model = _wrap(models.gpt2(seed=5))
    opt = _adamw(model)
    losses = _train(model, opt, data[:STEPS], rank, ws)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/w{ws}")
    return losses + _train(model, opt, data[STEPS:], rank, ws)


def _resume(rank, ws, root, source, resave):
    model = _wrap(models.gpt2(seed=11))
    opt = _adamw(model)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=f"{root}/{source}")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if resave:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/w{ws}")
    return _train(model, opt, _data()[STEPS:], rank, ws)


@pytest.fixture(scope="module")
def run2(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("torch_dcp"))
    return root, spawn(2, _first_run, root, timeout_s=300)[0]


def test_dcp_round_trip_at_the_same_world_size_resumes_exactly(run2):
    root, losses = run2
    assert spawn(2, _resume, root, "w2", False, timeout_s=300)[0] == losses[STEPS:]


def test_dcp_round_trip_2_to_4_to_1(run2):
    root, losses = run2
    at4 = spawn(4, _resume, root, "w2", True, timeout_s=300)[0]  # resaved at W=4: another cut of every tensor
    at1 = spawn(1, _resume, root, "w4", False, timeout_s=300)[0]
    for got in (at4, at1):
        assert max(abs(a - b) for a, b in zip(got, losses[STEPS:])) < TOL, (got, losses)


def test_dcp_checkpoint_loads_into_a_plain_model(run2):
    root, losses = run2
    plain = models.gpt2(seed=11)
    opt = _adamw(plain)
    msd, osd = get_state_dict(plain, opt)
    state = {"model": msd, "optim": osd}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no process group: DCP says so)
        dcp.load(state, checkpoint_id=f"{root}/w2")
    set_state_dict(plain, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = models.train(plain, _data()[STEPS:], optimizer=opt)
    assert max(abs(a - b) for a, b in zip(got, losses[STEPS:])) < TOL, (got, losses)


# ---------------------------------------------------------------------- the torchtitan-style example
def _losses(stdout):
    return [line for line in stdout.splitlines() if line.startswith("step ")]


@pytest.mark.ci  # (two accelerate launches, ~30 s: CI runs it, make test stays under 9 minutes)
def test_torchtitan_style_example_resumes_from_its_async_dcp_checkpoint(tmp_path):
    from launch_helpers import CPU_FSDP_YAML, REPO, launch

    script = REPO / "examples" / "torch_dcp_loop.py"
    first = launch(CPU_FSDP_YAML, script, ["--output_dir", str(tmp_path / "a"), "--steps", "6",
                                           "--checkpointing_steps", "3", "--async_save"])
    resumed = launch(CPU_FSDP_YAML, script, ["--output_dir", str(tmp_path / "b"), "--steps", "6",
                                             "--resume_from", str(tmp_path / "a" / "step-3")])
    assert f"resumed from {tmp_path / 'a' / 'step-3'} at step 3" in resumed.stdout
    assert len(_losses(first.stdout)) == 6
    assert _losses(resumed.stdout) == _losses(first.stdout)[3:]  # the same world size: exactly
    assert (tmp_path / "b" / "step-6" / ".metadata").exists()  # dcp.save (synchronous) of the resumed run
