"""A rank SIGKILLed under ``accelerate launch --max_restarts 1``: the job comes back by itself.

``examples/resume_on_fault.py`` (async checkpoints every 2 steps, ``load_state()`` of the newest complete one at
start) runs under ``tests/scripts/fault_on_rank.py``, which kills rank 1 on the first attempt at one of three
points.  Spec, at each point: the job exits 0, its final weights equal an uninterrupted run's exactly, and the steps
run twice are exactly those after the checkpoint it resumed from, which is the newest one that was complete.

The same for the Trainer (``tests/scripts/trainer_resume.py``, ``resume_from_checkpoint=True``).  The launch uses the c10d rendezvous with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (README "Checkpoints"): with
the agent's shared store, a restarted rank can read a dead peer's address left in it by the first attempt.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, List, Optional, Tuple

import pytest
import torch

from launch_helpers import CPU_FSDP_YAML, REPO, fsdp_config, launch

pytest.importorskip("accelerate")
safetensors = pytest.importorskip("safetensors.torch")

SCRIPT = REPO / "tests" / "scripts" / "fault_on_rank.py"
STEPS = 8
RESTARTS = ["--max_restarts", "1", "--rdzv_backend", "c10d"]
STDOUT: dict = {}  # each run's output directory -> its stdout


def _run(out: Path, fault: Optional[str] = None, config: Path = CPU_FSDP_YAML,
         **env: str) -> Tuple[dict, List[int], Optional[int], List[int]]:
    """Launch; returns the final weights, the steps of the first attempt, the step resumed from (None: no
    restart) and the steps after the restart."""
    env.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **({"FAULT": fault} if fault else {}))
    # the launcher's own flags go before the script: launch() puts ``script`` right after its own
    proc = launch(config, RESTARTS[0], [*RESTARTS[1:], str(SCRIPT), "--output_dir", str(out),
                                                 "--steps", str(STEPS)], env=env, timeout=600)
    first, resumed_at, after = [], None, []
    STDOUT[out] = proc.stdout
    for line in proc.stdout.splitlines():
        if m := re.match(r"resumed from .* at step (\d+)$", line):
            resumed_at = int(m.group(1))
        elif m := re.match(r"step (\d+) loss", line):
            (after if resumed_at is not None else first).append(int(m.group(1)))
    return safetensors.load_file(out / "final" / "model.safetensors"), first, resumed_at, after


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    weights, steps, resumed_at, _ = _run(tmp_path_factory.mktemp("uninterrupted"))
    assert steps == list(range(1, STEPS + 1)) and resumed_at is None
    return weights


def _check(uninterrupted, out: Path, fault: str, expected_resume: Tuple[int, ...], **env: Any) -> None:
    weights, first, resumed_at, after = _run(out, fault, **env)
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
