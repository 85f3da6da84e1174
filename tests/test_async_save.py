"""Asynchronous ``save_state`` and crash-consistent checkpoints (``checkpoint/commit.py``), on 2 spawned gloo ranks.

Spec: with a save every 2 steps, async saves (the files written while training goes on) give exactly the losses
and final weights of synchronous saves; every checkpoint holds exactly the step it was taken at (resuming from it
reproduces the uninterrupted run bit for bit); a directory without its commit marker is refused by ``load_state``
naming what is missing and skipped by "newest complete", whose predecessor loads.  FULL and SHARDED.
"""
from __future__ import annotations

import os
import shutil
import threading

import pytest
import torch

from dist_helpers import spawn
from toy import D, Toy

pytest.importorskip("accelerate")

STEPS, SAVE_EVERY, MICRO, LR = 6, 2, 4, 1e-2
_PREFIXES = ("FSDP_", "FLATSHARD_", "ACCELERATE_", "PARALLELISM_CONFIG_")
ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
       "FSDP_TRANSFORMER_CLS_TO_WRAP": "Block"}


def _accelerator(state_dict_type: str, **kwargs):
    from accelerate.state import AcceleratorState, GradientState

    from accel_flatshard.integrations.accelerate import Accelerator

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    for key in [k for k in os.environ if k.startswith(_PREFIXES)]:
        del os.environ[key]
    os.environ.update(ENV, FSDP_STATE_DICT_TYPE=state_dict_type)
    return Accelerator(**kwargs)


def _prepared(accelerator, seed: int = 0):
    from torch.utils.data import DataLoader, TensorDataset

    model = Toy(seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    data = torch.randn(STEPS * MICRO * 2, D, generator=torch.Generator().manual_seed(3))
    loader = DataLoader(TensorDataset(data), batch_size=MICRO)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    return accelerator.prepare(model, optimizer, loader, scheduler)


def _train(accelerator, model, optimizer, loader, scheduler, first_step=0, save=None, after_step=lambda: None):
    """One optimizer step per batch; ``save(step)`` after every SAVE_EVERY-th; exact global losses."""
    losses = []
    for step, (x,) in enumerate(loader, start=first_step + 1):
        loss = model(x)
        accelerator.backward(loss)
        optimizer.step()
        after_step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach()).tolist())
        if save is not None and step % SAVE_EVERY == 0:
            save(step)
    return losses


def _full(accelerator, model):
    return {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}


def _holding_writes(commit, gates):
    """``commit.start_save`` whose background writer starts only once its gate is set (after the next optimizer
    step): a snapshot that were not a copy would then hold a later step."""
    start_save = commit.start_save

    def held(directory, parts, group, ready, commit_marker, background):
        gate = threading.Event()
        gates.append(gate)
        return start_save(directory, parts, group, lambda: (gate.wait(), ready()), commit_marker, background)

    return held


def _async_vs_sync_worker(rank: int, world: int, root: str, state_dict_type: str) -> dict:
    from accel_flatshard.state import commit

    out, gates, start_save = {}, [], commit.start_save
    commit.start_save = _holding_writes(commit, gates)
    release = lambda: [gate.set() for gate in gates]
    for mode in ("sync", "async"):
        accelerator = _accelerator(state_dict_type)
        model, optimizer, loader, scheduler = _prepared(accelerator)
        save = lambda step: accelerator.save_state(os.path.join(root, mode, f"step_{step}"), async_save=mode == "async")
        out[mode] = {"losses": _train(accelerator, model, optimizer, loader, scheduler, save=save, after_step=release)}
        release()
        commit.wait_for_saves()  # (not end_training: the next mode needs the process group)
        out[mode]["final"] = _full(accelerator, model)
    commit.start_save = start_save
    out["held_writes"] = len(gates)
    out["resumed"] = {}
    for step in range(SAVE_EVERY, STEPS, SAVE_EVERY):  # resume from each async checkpoint, seed differs
        accelerator = _accelerator(state_dict_type)
        model, optimizer, loader, scheduler = _prepared(accelerator, seed=7)
        accelerator.load_state(os.path.join(root, "async", f"step_{step}"))
        rest = accelerator.skip_first_batches(loader, step)
        losses = _train(accelerator, model, optimizer, loader=rest, scheduler=scheduler, first_step=step)
        out["resumed"][step] = {"losses": losses, "final": _full(accelerator, model)}
    return out


# FULL_STATE_DICT: ci (make test runs SHARDED; the FULL snapshot is the gathered copy the synchronous save makes too)
@pytest.fixture(scope="module", params=["SHARDED_STATE_DICT", pytest.param("FULL_STATE_DICT", marks=pytest.mark.ci)])
def async_vs_sync(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param.lower())
    return root, spawn(2, _async_vs_sync_worker, str(root), request.param, timeout_s=300)[0]


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_async_saves_every_2_steps_give_the_losses_and_weights_of_sync_saves(async_vs_sync):
    _, out = async_vs_sync
    assert out["held_writes"] == STEPS // SAVE_EVERY  # every async save went through the (held) writer
    assert out["async"]["losses"] == out["sync"]["losses"]
    assert out["async"]["final"] and _equal(out["async"]["final"], out["sync"]["final"])


def test_resume_from_each_async_checkpoint_equals_the_uninterrupted_run(async_vs_sync):
    _, out = async_vs_sync
    for step, resumed in out["resumed"].items():
        assert resumed["losses"] == out["async"]["losses"][step:], step
        assert _equal(resumed["final"], out["async"]["final"]), step


def test_every_async_checkpoint_is_committed_with_its_marker(async_vs_sync):
    from accel_flatshard.state import commit

    root, _ = async_vs_sync
    for mode in ("sync", "async"):
        for step in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY):
            directory = root / mode / f"step_{step}"
            assert (directory / commit.COMPLETE_FILE).is_file() and not (directory / commit.PENDING_FILE).exists()
            assert commit.missing_parts(str(directory)) is None


# ---------------------------------------------------------------------- incomplete checkpoints
def _interrupted_worker(rank: int, world: int, root: str) -> dict:
    """Automatic naming, total_limit=2: three saves; the last one is then made incomplete as a rank killed
    mid-write leaves it (a part and the commit marker missing)."""
    from accelerate.utils import ProjectConfiguration

    from accel_flatshard.state import CheckpointError, commit, newest_complete_checkpoint

    config = ProjectConfiguration(project_dir=root, automatic_checkpoint_naming=True, total_limit=2)
    accelerator = _accelerator("SHARDED_STATE_DICT", project_config=config)
    model, optimizer, loader, scheduler = _prepared(accelerator)
    states = {}

    def save(step):
        accelerator.save_state(async_save=True)
        states[step] = _full(accelerator, model)

    _train(accelerator, model, optimizer, loader, scheduler, save=save)
    commit.wait_for_saves()
    checkpoints = os.path.join(root, "checkpoints")
    out = {"kept": sorted(os.listdir(checkpoints))}
    accelerator.wait_for_everyone()
    last = os.path.join(checkpoints, "checkpoint_2")
    if rank == 0:  # what a kill during the write leaves: no marker, a part still in its temporary directory
        manifest = os.path.join(last, commit.COMPLETE_FILE)
        os.replace(manifest, os.path.join(last, commit.PENDING_FILE))
        shutil.rmtree(os.path.join(last, "optimizer_0"))
    accelerator.wait_for_everyone()
    try:
        accelerator.load_state(last)
    except CheckpointError as exc:
        out["refused"] = str(exc)
    out["newest"] = newest_complete_checkpoint(checkpoints)
    accelerator.load_state()  # automatic naming: the newest complete one
    out["loaded_equals_step_4"] = _equal(_full(accelerator, model), states[4])
    out["next_iteration"] = accelerator.project_configuration.iteration

    # a background write that fails on rank 1 (a full disk): save_state returns, the next waiting call raises
    from accel_flatshard.state import dcp

    write_data = dcp.RecordingWriter.write_data

    def full_disk(self, plan, planner):
        if rank == 1:
            raise OSError(28, "No space left on device", os.path.join(self.path, "__1_0.distcp"))
        return write_data(self, plan, planner)

    dcp.RecordingWriter.write_data = full_disk
    accelerator.save_state(async_save=True)
    try:
        accelerator.save_state(async_save=True)
    except CheckpointError as exc:
        out["failed_write"] = str(exc)
    finally:
        dcp.RecordingWriter.write_data = write_data
    return out


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    return spawn(2, _interrupted_worker, str(tmp_path_factory.mktemp("interrupted")), timeout_s=300)


def test_an_interrupted_checkpoint_is_refused_naming_what_is_missing_and_skipped_by_newest(interrupted):
    out = interrupted[0]
    assert out["kept"] == ["checkpoint_1", "checkpoint_2"]  # total_limit=2
    assert "checkpoint_2 is an incomplete checkpoint" in out["refused"]
    assert "optimizer_0/" in out["refused"] and "flatshard_complete.json" in out["refused"]
    assert out["newest"].endswith("checkpoint_1")
    assert out["loaded_equals_step_4"] and out["next_iteration"] == 2


def test_a_failed_background_write_raises_on_every_rank_at_the_next_save_naming_the_file(interrupted):
    for out in interrupted:
        assert "saving " in out["failed_write"] and "checkpoint_2 failed" in out["failed_write"]
        assert "No space left on device" in out["failed_write"] and "__1_0.distcp" in out["failed_write"]


def _peer_dies_mid_save(rank: int, world: int, directory: str) -> str:
    """Rank 1 dies (as SIGKILLed) while the background writer writes; rank 0's next wait says the save failed."""
    import time

    import torch.distributed as dist

    from accel_flatshard.state import CheckpointError, commit

    def write(group):
        if rank == 1:
            os._exit(1)
        time.sleep(0.5)

    commit.start_save(directory, [("part", write)], commit.writer_group(dist.group.WORLD, world), lambda: None,
                      lambda: open(os.path.join(directory, commit.COMPLETE_FILE), "w").close(), True)
    try:
        commit.wait_for_saves()
    except CheckpointError as exc:
        return str(exc)
    return "wait_for_saves() returned: the save looked complete"


def test_a_rank_dying_during_a_background_write_fails_the_save_on_the_survivors(tmp_path):
    # (before: the survivors' writer thread died in the outcome gather, and the save looked complete to them)
    with pytest.raises(RuntimeError, match="rank 1: exited") as failure:
        spawn(2, _peer_dies_mid_save, str(tmp_path), timeout_s=60)
    assert "the checkpoint is incomplete" in failure.value.results[0], failure.value.results
    assert "a rank died?" in failure.value.results[0]
    assert not (tmp_path / "flatshard_complete.json").exists()


# ---------------------------------------------------------------------- the CUDA snapshot, simulated
def _simulated_snapshot(drop: str = ""):
    """A shard updated on the compute stream, snapshotted, then updated again (the next optimizer step);
    ``drop``: the adapter's ordering call the mutation leaves out."""
    from sim_cuda import SimulatedCuda, sim_adapter

    from accel_flatshard.state import commit
    from accel_flatshard.state.dcp import FlatRange

    sim = SimulatedCuda()
    adapter = sim_adapter(sim)
    if drop:
        setattr(adapter, drop, lambda waiter, other: None)
    with sim:
        shard = torch.ones(16)
        shard.mul_(2.0)
        snapshot, ready = commit.snapshot_entries({"w": FlatRange(shard, 0, (4, 4))}, adapter)
        shard.add_(1.0)
        ready()
        copied = snapshot["w"].local.clone()
    return sim, copied


def test_cuda_snapshot_copies_on_a_side_stream_that_the_next_update_waits_for():
    sim, copied = _simulated_snapshot()
    assert sim.violations == []
    assert torch.equal(copied, torch.full((16,), 2.0))


@pytest.mark.parametrize("drop, racing_op", [("wait_event", "aten::add_"), ("wait_stream", "aten::copy_")])
def test_cuda_snapshot_without_either_wait_is_a_race_the_simulator_names(drop, racing_op):
    # wait_event: the next update may run before the copy; wait_stream: the copy may run before the last update
    sim, _ = _simulated_snapshot(drop)
    assert any(racing_op in str(v) for v in sim.violations), sim.violations


@pytest.mark.parametrize("how", ["keyword", "FLATSHARD_ASYNC_SAVE"])
def test_async_save_on_an_accelerator_that_is_not_sharding_saves_synchronously_and_says_so_once(tmp_path, how):
    """No FSDP config, one process: accelerate's own save_state runs (it has no async_save); the request for a
    background write is not dropped silently."""
    import warnings

    from accelerate.state import AcceleratorState, GradientState

    from accel_flatshard.integrations.accelerate import Accelerator

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    saved = {k: os.environ.pop(k) for k in [k for k in os.environ if k.startswith(_PREFIXES)]}
    os.environ.update({"FLATSHARD_ASYNC_SAVE": "1"} if how != "keyword" else {})
    try:
        accelerator = Accelerator(cpu=True)
        assert accelerator.flatshard_options is None
        model = Toy()
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
        kwargs = {"async_save": True} if how == "keyword" else {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for name in ("a", "b"):
                accelerator.save_state(str(tmp_path / name), **kwargs)
        said = [w for w in caught if "save_state writes synchronously" in str(w.message)]
        assert len(said) == 1, [str(w.message) for w in caught]
        assert {"model.safetensors", "optimizer.bin"} <= set(os.listdir(tmp_path / "b"))
    finally:
        os.environ.pop("FLATSHARD_ASYNC_SAVE", None)
        os.environ.update(saved)
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
