"""A rank SIGKILLed under ``accelerate launch --max_restarts 1``: the job comes back by itself.

``examples/resume_on_fault.py`` (async checkpoints every 2 steps, ``load_state()`` of the newest complete one at
start) runs under ``tests/scripts/fault_on_rank.py``, which kills rank 1 on the first attempt at one of three
points.  Spec, at each point: the job exits 0, its final weights equal an uninterrupted run's exactly, and the steps
run twice are exactly those after the checkpoint it resumed from, which is the newest one that was complete.

The same for the Trainer (``tests/scripts/trainer_resume.py``, ``resume_from_checkpoint=True``).  The launch is the
one a user types: the shipped yaml (its static rendezvous) plus ``--max_restarts 1``, no other flag, no variable.
The c10d rendezvous (with the agent's shared store, and without it: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) and
``torchrun --max-restarts 1`` resume too.  Before accel_flatshard gave each attempt's process groups a store prefix
of their own (elastic.scoping_store_per_attempt), the restarted ranks of the static and shared-store launches could
read a dead peer's address left in the agent's store and hang in init_process_group.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

import pytest
import torch

from launch_helpers import CPU_FSDP_YAML, REPO, _free_port, _run_or_dump_stacks, fsdp_config, launch

pytest.importorskip("accelerate")
safetensors = pytest.importorskip("safetensors.torch")

SCRIPT = REPO / "tests" / "scripts" / "fault_on_rank.py"
STEPS = 8
RESTARTS = ["--max_restarts", "1"]  # added to the plain launch command, as a user adds it
TIMEOUT_S = 300  # a resumed run takes 25-60 s here; a restarted attempt that hangs is dumped and failed
STDOUT: dict = {}  # each run's output directory -> its stdout


def _parse(out: Path, stdout: str) -> Tuple[dict, List[int], Optional[int], List[int]]:
    """The final weights, the steps of the first attempt, the step resumed from (None: no restart) and the steps
    after the restart."""
    first, resumed_at, after = [], None, []
    STDOUT[out] = stdout
    for line in stdout.splitlines():
        if m := re.match(r"resumed from .* at step (\d+)$", line):
            resumed_at = int(m.group(1))
        elif m := re.match(r"step (\d+) loss", line):
            (after if resumed_at is not None else first).append(int(m.group(1)))
    return safetensors.load_file(out / "final" / "model.safetensors"), first, resumed_at, after


def _run(out: Path, fault: Optional[str] = None, config: Path = CPU_FSDP_YAML, flags: Sequence[str] = (),
         **env: str) -> Tuple[dict, List[int], Optional[int], List[int]]:
    """``accelerate launch --config_file config --max_restarts 1 [flags] fault_on_rank.py ...``, see :func:`_parse`."""
    env.update(**({"FAULT": fault} if fault else {}))
    launcher_flags = [*RESTARTS, *flags]
    # the launcher's own flags go before the script: launch() puts ``script`` right after its own
    proc = launch(config, launcher_flags[0], [*launcher_flags[1:], str(SCRIPT), "--output_dir", str(out),
                                              "--steps", str(STEPS)], env=env, timeout=TIMEOUT_S)
    return _parse(out, proc.stdout)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    weights, steps, resumed_at, _ = _run(tmp_path_factory.mktemp("uninterrupted"))
    assert steps == list(range(1, STEPS + 1)) and resumed_at is None
    return weights


def _check(uninterrupted, out: Path, fault: str, expected_resume: Tuple[int, ...], run=_run, **kwargs: Any) -> None:
    weights, first, resumed_at, after = run(out, fault, **kwargs)
    assert resumed_at in expected_resume, (resumed_at, first)
    assert after == list(range(resumed_at + 1, STEPS + 1))  # repeated: only the steps after that checkpoint
    assert weights.keys() == uninterrupted.keys()
    assert all(torch.equal(weights[k], uninterrupted[k]) for k in weights)


@pytest.mark.ci
def test_rank_killed_mid_step_resumes_from_the_newest_complete_checkpoint(uninterrupted, tmp_path):
    # killed in step 5: the step-4 checkpoint is complete, or still being written (then step 2's is the newest)
    _check(uninterrupted, tmp_path, "mid_step:5", (2, 4))


@pytest.mark.ci
def test_rank_killed_during_a_background_write_resumes_from_the_checkpoint_before(uninterrupted, tmp_path):
    _check(uninterrupted, tmp_path, "during_write:2", (2,))  # the step-4 save never committed
    left = sorted(os.listdir(tmp_path / "checkpoints"))
    assert left == ["checkpoint_2", "checkpoint_3"], left  # total_limit=2 (checkpoint_1 was rewritten, then pruned)


@pytest.mark.ci
def test_rank_killed_right_after_a_commit_resumes_from_that_checkpoint(uninterrupted, tmp_path):
    _check(uninterrupted, tmp_path, "after_commit:2", (4,))


@pytest.mark.ci
@pytest.mark.parametrize("shared_store", ["shared", "not shared"])
def test_rank_killed_under_the_c10d_rendezvous_resumes(uninterrupted, tmp_path, shared_store):
    # the agent's store shared with the workers (c10d's default), or TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 0
    # of each attempt hosts a store of its own
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if shared_store == "not shared" else {}
    _check(uninterrupted, tmp_path, "mid_step:5", (2, 4), flags=["--rdzv_backend", "c10d"], **env)


# ---------------------------------------------------------------------- the Trainer
TRAINER = dict(FAULT_SCRIPT=str(REPO / "tests" / "scripts" / "trainer_resume.py"))


@pytest.fixture(scope="module")
def trainer_uninterrupted(tmp_path_factory):
    """The Trainer with asynchronous checkpoints; its final weights equal synchronous checkpoints' exactly."""
    weights, steps, resumed_at, _ = _run(tmp_path_factory.mktemp("trainer_async"), FLATSHARD_ASYNC_SAVE="1", **TRAINER)
    assert steps == list(range(1, STEPS + 1)) and resumed_at is None
    sync, _, _, _ = _run(tmp_path_factory.mktemp("trainer_sync"), **TRAINER)
    assert sync.keys() == weights.keys() and all(torch.equal(sync[k], weights[k]) for k in sync)
    return weights


@pytest.mark.ci
def test_trainer_rank_killed_during_a_background_write_resumes_with_resume_from_checkpoint_true(
        trainer_uninterrupted, tmp_path):
    _check(trainer_uninterrupted, tmp_path, "during_write:2", (2,), FLATSHARD_ASYNC_SAVE="1", **TRAINER)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-6", "checkpoint-8", "final"]  # save_total_limit=2


@pytest.mark.ci
def test_trainer_rank_killed_mid_step_resumes_from_the_newest_complete_checkpoint(trainer_uninterrupted, tmp_path):
    _check(trainer_uninterrupted, tmp_path, "mid_step:5", (2, 4), FLATSHARD_ASYNC_SAVE="1", **TRAINER)


@pytest.mark.ci
def test_trainer_rank_killed_right_after_a_commit_resumes_from_that_checkpoint(trainer_uninterrupted, tmp_path):
    _check(trainer_uninterrupted, tmp_path, "after_commit:2", (4,), FLATSHARD_ASYNC_SAVE="1", **TRAINER)


@pytest.mark.ci
def test_trainer_under_full_state_dict_killed_during_a_background_write_resumes(trainer_uninterrupted, tmp_path):
    # FULL: rank 0's gathered model and optimizer state are the snapshot; the Trainer's model write is deferred
    config = fsdp_config(tmp_path, fsdp_state_dict_type="FULL_STATE_DICT")
    _check(trainer_uninterrupted, tmp_path / "run", "during_write:2", (2,), config=config, FLATSHARD_ASYNC_SAVE="1",
           **TRAINER)
    assert "save 1 writes in the background: ['the model (Trainer._save)'," in STDOUT[tmp_path / "run"]


# ---------------------------------------------------------------------- torchrun, the Trainer's own fsdp argument
def _torchrun(out: Path, fault: Optional[str] = None) -> Tuple[dict, List[int], Optional[int], List[int]]:
    """``torchrun --nproc_per_node 2 --max-restarts 1 -m accel_flatshard.run`` of the Trainer with
    ``TrainingArguments(fsdp="full_shard auto_wrap")`` (no accelerate launcher, no yaml), see :func:`_parse`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", "1",
           "--master_port", str(_free_port()), "-m", "accel_flatshard.run", str(SCRIPT), "--output_dir", str(out),
           "--steps", str(STEPS), "--fsdp", "full_shard auto_wrap"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLATSHARD_", "ACCELERATE_", "FSDP_"))}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])), **TRAINER,
               **({"FAULT": fault} if fault else {}))
    proc = _run_or_dump_stacks(cmd, env, TIMEOUT_S)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode})\n{proc.stdout[-6000:]}\n{proc.stderr[-8000:]}"
    return _parse(out, proc.stdout)


@pytest.mark.ci
def test_trainer_under_torchrun_max_restarts_resumes(tmp_path):
    reference, steps, resumed_at, _ = _torchrun(tmp_path / "uninterrupted")
    assert steps == list(range(1, STEPS + 1)) and resumed_at is None
    _check(reference, tmp_path / "killed", "mid_step:5", (2, 4), run=_torchrun)
