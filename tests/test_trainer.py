"""Hugging Face ``Trainer`` on accel_flatshard: real ``accelerate launch`` runs, 2 CPU processes, gloo.

The script (tests/scripts/trainer_causal_lm.py) is a plain Trainer script: no accel_flatshard import.
It runs under accelerate's DDP (the reference) and through ``-m accel_flatshard.run`` with the yamls
users have: the README's accelerate_configs/cpu_2proc.yaml (SHARDED_STATE_DICT) and the two that
``accelerate config`` writes on a CPU-only host (cpu_2proc_fsdp1.yaml: FULL_STATE_DICT;
cpu_2proc_fsdp2.yaml: ``fsdp_version: 2``).  Model: tiny Llama with an untied LM head, 8 steps of
AdamW with weight decay, clipping and a linear schedule, checkpoint every 4 steps.

Default suite: the DDP reference and one sharded launch with the README yaml (parity, sharding, the final
``save_model`` as the yaml configures it (SHARDED: written in full), checkpoint layout, ``accelerate merge-weights``).  The rest is ``slow``.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from launch_helpers import ACCELERATE, CPU_FSDP_YAML, REPO, SCRIPTS, ddp_config, ddp_reference, launch, read_json

TRAINER_SCRIPT = SCRIPTS / "trainer_causal_lm.py"
FSDP1_YAML = REPO / "accelerate_configs" / "cpu_2proc_fsdp1.yaml"  # what `accelerate config` writes (FULL)
FSDP2_YAML = REPO / "accelerate_configs" / "cpu_2proc_fsdp2.yaml"  # ... with its default fsdp_version 2
LOSS_TOL = 1e-5
WEIGHT_TOL = 1e-4
STEPS, SAVE_AT = 8, 4


def _train(config: Path, out: Path, *extra: str, ddp: bool = False) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    args = ["--output_dir", str(out / "run"), "--output_json", str(out / "result.json"), "--steps", str(STEPS), *extra]
    launch(config, TRAINER_SCRIPT, args, via_run=not ddp, ddp=ddp)
    result = read_json(out / "result.json")
    result["dir"] = out
    return result


def _losses(result: dict, steps) -> list:
    return [result["losses"][str(s)] for s in steps]


def _max_loss_diff(a: dict, b: dict, steps=range(1, STEPS + 1)) -> float:
    return max(abs(x - y) for x, y in zip(_losses(a, steps), _losses(b, steps)))


def _weights(directory: Path) -> dict:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory).state_dict()


def _max_weight_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _assert_sharded(result: dict) -> None:
    """Fails if the Trainer trained unsharded: W=2 seen everywhere, each rank holds about half the model."""
    assert result["accelerator_class"] == "accel_flatshard.integrations.accelerate.Accelerator"
    assert result["world_size"] == 2 and result["parallel_mode"] == "ParallelMode.DISTRIBUTED"
    assert result["distributed_type"] == "DistributedType.FSDP"
    total, local = result["total_trainable_numel"], result["local_trainable_numel"]
    assert len(local) == 2 and sum(local) == total, (local, total)  # 1-D shards, nothing held twice
    assert all(abs(n - total / 2) <= 0.01 * total for n in local), (local, total)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("trainer")


trainer_ddp = ddp_reference("trainer_ddp", TRAINER_SCRIPT, lambda out: [
    "--output_dir", out / "run", "--output_json", out / "result.json", "--steps", STEPS, "--save_steps", SAVE_AT,
    "--final_dir", out / "final"])


@pytest.fixture(scope="module")
def ddp_run(trainer_ddp) -> dict:
    """accelerate's DDP on CPU: the same script, checkpoint at step 4 (model.safetensors), final save (in the
    session's shared reference launch)."""
    result = read_json(trainer_ddp / "result.json")
    result["dir"] = trainer_ddp
    return result


@pytest.fixture(scope="module")
def readme_run(work) -> dict:
    """The README yaml (SHARDED_STATE_DICT), unmodified script, -m accel_flatshard.run; the final
    ``trainer.save_model(dir)`` as the yaml configures it (no switch to FULL_STATE_DICT first)."""
    out = work / "readme"
    return _train(CPU_FSDP_YAML, out, "--save_steps", str(SAVE_AT), "--final_dir", str(out / "final"),
                  "--final_save_as_configured")


def test_readme_yaml_trains_sharded_like_ddp(readme_run, ddp_run):
    _assert_sharded(readme_run)
    assert not readme_run["is_fsdp2"]
    assert readme_run["global_step"] == ddp_run["global_step"] == STEPS
    assert _max_loss_diff(readme_run, ddp_run) <= LOSS_TOL


def test_final_save_under_sharded_state_dict_writes_the_full_model(readme_run, ddp_run):
    """Under SHARDED_STATE_DICT transformers' save_model writes nothing for torch FSDP (exit 0, no word): here the
    user's final save writes weights and config, loadable with from_pretrained and equal to DDP's; the yaml's
    state dict type stays SHARDED for the checkpoints."""
    final = readme_run["dir"] / "final"
    assert (final / "config.json").is_file() and (final / "model.safetensors").is_file(), sorted(os.listdir(final))
    assert _max_weight_diff(_weights(final), _weights(ddp_run["dir"] / "final")) <= WEIGHT_TOL
    assert readme_run["state_dict_type"] == readme_run["state_dict_type_after_final_save"] == "StateDictType.SHARDED_STATE_DICT"


def test_sharded_checkpoint_is_accelerates_layout(readme_run, ddp_run, tmp_path):
    """checkpoint-4 holds pytorch_model_fsdp_0/ (DCP) + optimizer_0/; `accelerate merge-weights` turns the
    model directory into safetensors equal to DDP's step-4 weights."""
    ckpt = readme_run["dir"] / "run" / f"checkpoint-{SAVE_AT}"
    assert (ckpt / "pytorch_model_fsdp_0" / ".metadata").is_file()
    assert (ckpt / "optimizer_0" / ".metadata").is_file()
    assert not (ckpt / "pytorch_model_fsdp.bin").exists()
    assert not (ckpt / "model.safetensors").exists()  # the Trainer's checkpoints keep the sharded layout only
    merged = tmp_path / "merged"
    subprocess.run([str(ACCELERATE), "merge-weights", str(ckpt / "pytorch_model_fsdp_0"), str(merged)],
                   check=True, capture_output=True, text=True, timeout=300)
    from safetensors.torch import load_file

    ours = load_file(merged / "model.safetensors")
    ddp = load_file(ddp_run["dir"] / "run" / f"checkpoint-{SAVE_AT}" / "model.safetensors")
    ddp = {k: v for k, v in ddp.items()}
    assert _max_weight_diff(ours, ddp) <= WEIGHT_TOL


@pytest.mark.ci  # a third launch (~30 s); offload is exact in process in tests/test_offload.py
def test_trainer_with_offload_is_sharded_and_exact(readme_run, ddp_run, work, tmp_path):
    """The README yaml with fsdp_offload_params: true (issue 17): on a CPU host the shards already live in
    host memory, so the run must be sharded and bit for bit the run without offload (and DDP's losses)."""
    config = tmp_path / "offload.yaml"
    config.write_text(CPU_FSDP_YAML.read_text().replace("fsdp_offload_params: false", "fsdp_offload_params: true"))
    assert "fsdp_offload_params: true" in config.read_text()
    run = _train(config, work / "offload", "--final_dir", str(work / "offload" / "final"))
    _assert_sharded(run)
    assert _losses(run, range(1, STEPS + 1)) == _losses(readme_run, range(1, STEPS + 1))
    assert _max_loss_diff(run, ddp_run) <= LOSS_TOL
    assert _max_weight_diff(_weights(run["dir"] / "final"), _weights(ddp_run["dir"] / "final")) <= WEIGHT_TOL


@pytest.mark.slow
def test_resume_sharded_checkpoint_in_new_launch(readme_run, ddp_run, work):
    out = work / "readme_resume"
    shutil.copytree(readme_run["dir"] / "run", out / "run")
    resumed = _train(CPU_FSDP_YAML, out, "--resume_from", str(out / "run" / f"checkpoint-{SAVE_AT}"))
    _assert_sharded(resumed)
    after = range(SAVE_AT + 1, STEPS + 1)
    assert _max_loss_diff(resumed, readme_run, after) <= LOSS_TOL
    assert _max_loss_diff(resumed, ddp_run, after) <= LOSS_TOL


@pytest.fixture(scope="module")
def full_run(work) -> dict:
    """`accelerate config`'s FSDP1 yaml (FULL_STATE_DICT)."""
    out = work / "full"
    return _train(FSDP1_YAML, out, "--save_steps", str(SAVE_AT), "--final_dir", str(out / "final"))


@pytest.mark.slow
def test_full_state_dict_checkpoint_resume_and_final_save(full_run, ddp_run, work):
    _assert_sharded(full_run)
    assert _max_loss_diff(full_run, ddp_run) <= LOSS_TOL
    ckpt = full_run["dir"] / "run" / f"checkpoint-{SAVE_AT}"
    # accelerate's FULL names: rank 0's torch.save of the full model and the name-keyed optimizer state
    assert (ckpt / "pytorch_model_fsdp.bin").is_file() and (ckpt / "optimizer.bin").is_file()
    saved = torch.load(ckpt / "pytorch_model_fsdp.bin", weights_only=True)
    ddp_step4 = _weights(ddp_run["dir"] / "run" / f"checkpoint-{SAVE_AT}")
    assert _max_weight_diff(saved, ddp_step4) <= WEIGHT_TOL
    assert _max_weight_diff(_weights(full_run["dir"] / "final"), _weights(ddp_run["dir"] / "final")) <= WEIGHT_TOL

    out = work / "full_resume"
    shutil.copytree(full_run["dir"] / "run", out / "run")
    resumed = _train(FSDP1_YAML, out, "--resume_from", str(out / "run" / f"checkpoint-{SAVE_AT}"))
    assert _max_loss_diff(resumed, ddp_run, range(SAVE_AT + 1, STEPS + 1)) <= LOSS_TOL


@pytest.mark.slow
def test_fsdp2_yaml_from_accelerate_config_trains_sharded_like_ddp(ddp_run, work):
    run = _train(FSDP2_YAML, work / "fsdp2", "--save_steps", str(SAVE_AT))
    _assert_sharded(run)
    assert not run["is_fsdp2"]  # no torch-FSDP2-only code path in accelerate or the Trainer
    assert _max_loss_diff(run, ddp_run) <= LOSS_TOL
    ckpt = run["dir"] / "run" / f"checkpoint-{SAVE_AT}"  # FSDP2's default state dict type: SHARDED
    assert (ckpt / "pytorch_model_fsdp_0" / ".metadata").is_file() and (ckpt / "optimizer_0").is_dir()


@pytest.mark.slow
def test_save_only_model_checkpoint_equals_ddp(ddp_run, work):
    run = _train(FSDP1_YAML, work / "save_only_model", "--save_steps", str(SAVE_AT), "--save_only_model")
    ckpt = run["dir"] / "run" / f"checkpoint-{SAVE_AT}"
    assert not (ckpt / "optimizer.bin").exists() and not (ckpt / "pytorch_model_fsdp.bin").exists()
    ours = _weights(ckpt)
    assert _max_weight_diff(ours, _weights(ddp_run["dir"] / "run" / f"checkpoint-{SAVE_AT}")) <= WEIGHT_TOL


@pytest.mark.slow
def test_load_best_model_at_end_restores_the_best_checkpoint(work):
    """Evaluate every 2 steps; the loss goes up with this lr, so the best checkpoint is an early one and the
    model after training must be that checkpoint's (its eval loss, not step 8's)."""
    run = _train(CPU_FSDP_YAML, work / "best", "--save_steps", "2", "--load_best_model_at_end")
    _assert_sharded(run)
    history = {int(k): v for k, v in run["eval_history"].items()}
    during = {s: v for s, v in history.items() if s <= STEPS and s % 2 == 0}
    best_step = min(during, key=during.get)
    assert run["best_model_checkpoint"].endswith(f"checkpoint-{best_step}")
    assert best_step != STEPS, during  # otherwise loading the best model could not be told apart
    assert abs(run["eval_loss_after"] - during[best_step]) <= LOSS_TOL
    assert abs(run["eval_loss_after"] - during[STEPS]) > 10 * LOSS_TOL


@pytest.mark.slow
def test_gradient_accumulation_matches_ddp(work):
    """gradient_accumulation_steps=2: the Trainer's accelerator.no_sync path on the sharded model."""
    ddp = _train(ddp_config(work), work / "ga_ddp", "--gradient_accumulation_steps", "2", ddp=True)
    ours = _train(CPU_FSDP_YAML, work / "ga_readme", "--gradient_accumulation_steps", "2")
    _assert_sharded(ours)
    assert _max_loss_diff(ours, ddp) <= LOSS_TOL
