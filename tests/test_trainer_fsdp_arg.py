"""The Trainer's own ``TrainingArguments(fsdp=..., fsdp_config=...)``, no accelerate yaml: ``torchrun
--nproc_per_node 2 -m accel_flatshard.run train.py`` (issue 30).

transformers asks for FSDP with a ``FullyShardedDataParallelPlugin`` its Trainer builds, after
``TrainingArguments`` has set up accelerate's state; nothing sets ``ACCELERATE_USE_FSDP``.  Under the runner the
state must be gloo over both processes from the start: ``TrainingArguments.world_size`` is 2 before the Trainer
exists, ``main_process_first`` holds rank 1 until rank 0 is done, no warning tells the user to use the runner they
used, and the run is sharded and matches accelerate's DDP on the same script (tests/test_trainer.py's reference).

Default run: FULL_SHARD with transformers' default FSDP version (2), checkpoint at step 4.  ``ci``: resume from
that checkpoint in a new launch.  ``slow``: SHARD_GRAD_OP and FSDP version 1 (the same code path).
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from launch_helpers import REPO, _free_port, _run_or_dump_stacks, read_json
from test_trainer import LOSS_TOL, SAVE_AT, STEPS, TRAINER_SCRIPT, _assert_sharded, _max_loss_diff, ddp_run  # noqa: F401
from test_trainer import trainer_ddp  # noqa: F401  (the shared DDP reference fixture)

WARNING = "was set up before this Accelerator without a backend"


def torchrun(script: Path, args, timeout: float = 300):
    """``python -m torch.distributed.run --nproc_per_node 2 -m accel_flatshard.run script args`` (no accelerate
    launcher: no ACCELERATE_* / FSDP_* variables)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           "-m", "accel_flatshard.run", str(script), *map(str, args)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLATSHARD_", "ACCELERATE_", "FSDP_"))}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = _run_or_dump_stacks(cmd, env, timeout)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}): {' '.join(cmd)}\n--- stdout\n{proc.stdout[-6000:]}"
                             f"\n--- stderr\n{proc.stderr[-8000:]}")
    return proc


def _train(out: Path, fsdp: str, version, *extra: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    args = ["--output_dir", out / "run", "--output_json", out / "result.json", "--steps", STEPS, "--fsdp", fsdp,
            *(["--fsdp_version", version] if version else []), *extra]
    proc = torchrun(TRAINER_SCRIPT, args)
    result = read_json(out / "result.json")
    result["dir"], result["output"] = out, proc.stdout + proc.stderr
    return result


def _assert_state_right_from_the_start(run: dict) -> None:
    assert run["world_size_before_trainer"] == 2  # TrainingArguments saw both processes before the Trainer
    assert run["main_was_first"] == [True, True]  # rank 1 waited for rank 0 in main_process_first
    assert WARNING not in run["output"], run["output"][-3000:]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("trainer_fsdp_arg")


@pytest.fixture(scope="module")
def full_shard_run(work) -> dict:
    return _train(work / "full_shard", "full_shard auto_wrap", None, "--save_steps", SAVE_AT)


@pytest.mark.ci  # two launches (~50 s): make test stays under 10 min
def test_fsdp_argument_sets_up_the_state_before_the_trainer(full_shard_run):
    _assert_state_right_from_the_start(full_shard_run)


@pytest.mark.ci  # two launches (~50 s): make test stays under 10 min
def test_fsdp_argument_trains_sharded_like_ddp(full_shard_run, ddp_run):
    _assert_sharded(full_shard_run)
    assert full_shard_run["reshard_after_forward"] is True  # full_shard
    assert full_shard_run["global_step"] == STEPS
    assert _max_loss_diff(full_shard_run, ddp_run) <= LOSS_TOL


@pytest.mark.ci
def test_fsdp_argument_resumes_from_its_checkpoint(full_shard_run, ddp_run, work):
    out = work / "resume"
    shutil.copytree(full_shard_run["dir"] / "run", out / "run")
    resumed = _train(out, "full_shard auto_wrap", None, "--resume_from", out / "run" / f"checkpoint-{SAVE_AT}")
    _assert_sharded(resumed)
    _assert_state_right_from_the_start(resumed)
    after = range(SAVE_AT + 1, STEPS + 1)
    assert _max_loss_diff(resumed, full_shard_run, after) <= LOSS_TOL
    assert _max_loss_diff(resumed, ddp_run, after) <= LOSS_TOL


@pytest.mark.parametrize("fsdp, version", [pytest.param("shard_grad_op auto_wrap", 2, marks=pytest.mark.slow),
                                           pytest.param("full_shard auto_wrap", 1, marks=pytest.mark.slow),
                                           pytest.param("shard_grad_op auto_wrap", 1, marks=pytest.mark.ci)])
def test_fsdp_argument_strategies_and_versions_train_sharded_like_ddp(work, ddp_run, fsdp, version):
    run = _train(work / f"{fsdp.split()[0]}_v{version}", fsdp, version)
    _assert_state_right_from_the_start(run)
    _assert_sharded(run)
    assert run["reshard_after_forward"] is (fsdp.split()[0] == "full_shard")  # the strategy asked for
    assert _max_loss_diff(run, ddp_run) <= LOSS_TOL
