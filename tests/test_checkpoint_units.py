"""Checkpoint building blocks without processes: chunk arithmetic, resharding plans, safe metadata
unpickling, atomic directory commits, size parsing, the background writer's priority."""
from __future__ import annotations

import math
import os
import pickle
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

from accel_flatshard.state import CheckpointError, UnsafeCheckpointError
from torch.distributed.checkpoint.planner import SavePlan

from accel_flatshard.state.dcp import (FlatLoadPlanner,
                                       FlatRange,
                                       FlatSavePlanner,
                                       check_tiling,
                                       plan_reads,
                                       range_to_chunks)
from accel_flatshard.state.atomic import commit_dir, new_tmp_dir
from accel_flatshard.state.sharded import META_FILE, load_metadata_safely, resolve_checkpoint_dir
from accel_flatshard.core.sizes import parse_size
from accel_flatshard.core.flat_param import FlatParamLayout

shapes = st.lists(st.integers(1, 5), min_size=0, max_size=4).map(tuple)


def test_range_to_chunks_example():
    chunks = range_to_chunks(7, 18, (4, 5))
    assert [(c.offsets, c.sizes, c.flat_start) for c in chunks] == [
        ((1, 2), (1, 3), 7), ((2, 0), (1, 5), 10), ((3, 0), (1, 3), 15)]
    assert range_to_chunks(0, 20, (4, 5))[0].sizes == (4, 5)
    assert range_to_chunks(3, 3, (4, 5)) == []
    assert [(c.offsets, c.sizes) for c in range_to_chunks(0, 1, ())] == [((), ())]
    with pytest.raises(ValueError, match="outside"):
        range_to_chunks(0, 21, (4, 5))


@settings(max_examples=200, deadline=None)
@given(shape=shapes, data=st.data())
def test_range_to_chunks_tiles_the_range(shape, data):
    numel = math.prod(shape)
    start = data.draw(st.integers(0, numel))
    end = data.draw(st.integers(start, numel))
    chunks = range_to_chunks(start, end, shape)
    assert len(chunks) <= max(2 * len(shape) - 1, 1)
    full = torch.arange(numel).view(shape) if shape else torch.tensor(0)
    got = [full[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))].reshape(-1) for c in chunks]
    got = torch.cat(got) if got else torch.empty(0, dtype=torch.long)
    assert torch.equal(got, torch.arange(start, end))  # in order, disjoint, contiguous, exact


def test_check_tiling_reports_gaps_and_overlaps():
    assert check_tiling((4, 5), [((0, 0), (2, 5)), ((2, 0), (2, 5))]) is None
    assert "cover" in check_tiling((4, 5), [((0, 0), (2, 5))])
    assert "overlap" in check_tiling((4, 5), [((0, 0), (2, 5)), ((1, 0), (1, 5)), ((3, 0), (1, 5))])
    assert "exceeds" in check_tiling((4, 5), [((3, 0), (2, 5))])


def _simulate_save(shapes_, world, replicas=1, alignment=4):
    """Per (replica, shard rank) FlatRange entries of one flat parameter, plus the full values."""
    layout = FlatParamLayout([f"p{i}" for i in range(len(shapes_))], shapes_, world, alignment)
    values = {s.fqn: torch.randn(s.shape) for s in layout.slots}
    plans, planners = [], []
    for replica in range(replicas):
        for rank in range(world):
            entries = {}
            if replica == 0:  # only the first replica writes
                for piece in layout.shard_pieces(rank):
                    slot = layout.slots[piece.slot_index]
                    local = values[slot.fqn].reshape(-1)[piece.param_start: piece.param_start + piece.length].clone()
                    entries[slot.fqn] = FlatRange(local, piece.param_start, tuple(slot.shape))
            planner = FlatSavePlanner()
            planner.set_up_planner(entries, is_coordinator=rank == 0 and replica == 0)
            plans.append(planner.create_local_plan())
            planners.append(planner)
    final, metadata = planners[0].create_global_plan(plans)
    storage = {}  # what the writer would store, by storage index
    for planner, plan in zip(planners, final):
        for item in planner.finish_plan(plan).items:
            storage[item.index] = planner.resolve_data(item).clone()
    return layout, values, metadata, storage


@settings(max_examples=40, deadline=None)
@given(shapes_=st.lists(shapes.filter(lambda s: math.prod(s) > 0), min_size=1, max_size=4),
       w_save=st.integers(1, 4), w_load=st.integers(1, 4), replicas=st.integers(1, 2))
def test_reshard_plans_give_each_rank_exactly_its_slice(shapes_, w_save, w_load, replicas):
    _, values, metadata, storage = _simulate_save(shapes_, w_save, replicas)
    for key, md in metadata.state_dict_metadata.items():  # metadata carries true shapes
        assert tuple(md.size) == tuple(values[key].shape)
    layout = FlatParamLayout([f"p{i}" for i in range(len(shapes_))], shapes_, w_load, 4)
    for rank in range(w_load):
        entries = {}
        for piece in layout.shard_pieces(rank):
            slot = layout.slots[piece.slot_index]
            if piece.length:
                entries[slot.fqn] = FlatRange(torch.full((piece.length,), float("nan")), piece.param_start, tuple(slot.shape))
        planner = FlatLoadPlanner()
        planner.set_up_planner(entries, metadata)
        for item in planner.create_local_plan().items:  # what DCP's reader does with each read item
            src = storage[item.storage_index]
            for d, (o, n) in enumerate(zip(item.storage_offsets, item.lengths)):
                src = src.narrow(d, o, n)
            planner.resolve_tensor(item).copy_(src)
        for key, entry in entries.items():
            expected = values[key].reshape(-1)[entry.start: entry.start + entry.local.numel()]
            assert torch.equal(entry.local, expected)


def test_plan_reads_reports_missing_data():
    _, _, metadata, _ = _simulate_save([(4, 5)], 2)
    metadata.state_dict_metadata["p0"].chunks.pop()
    with pytest.raises(CheckpointError, match="p0: the checkpoint holds"):
        plan_reads({"p0": torch.empty(4, 5)}, metadata)
    with pytest.raises(CheckpointError, match="p1: not found"):
        plan_reads({"p1": torch.empty(3)}, metadata)


def test_save_planner_rejects_incomplete_shards():
    planner = FlatSavePlanner()
    planner.set_up_planner({"w": FlatRange(torch.zeros(3), 0, (2, 3))})
    with pytest.raises(CheckpointError, match="w: the ranks' shards do not form the whole tensor"):
        planner.create_global_plan([planner.create_local_plan(), SavePlan([])])


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/_flatshard_pwned",))


def test_metadata_unpickler_refuses_disallowed_globals(tmp_path):
    from torch.distributed.checkpoint.metadata import Metadata

    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(Metadata(state_dict_metadata={"x": _Evil()})))
    if os.path.exists("/tmp/_flatshard_pwned"):
        os.remove("/tmp/_flatshard_pwned")
    with pytest.raises(UnsafeCheckpointError, match=r"refusing to load global '(posix|os)\.system'"):
        load_metadata_safely(str(path))
    assert not os.path.exists("/tmp/_flatshard_pwned")
    path.write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(CheckpointError, match="expected a DCP Metadata"):
        load_metadata_safely(str(path))
    path.write_bytes(pickle.dumps(Metadata(state_dict_metadata={}))[:-5])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_metadata_safely(str(path))


def test_real_dcp_metadata_passes_the_allow_list(tmp_path):
    from accel_flatshard.state.dcp import dcp_save

    entries = {"w": FlatRange(torch.randn(20), 0, (4, 5)), "step": torch.tensor(3.0),
               "h": FlatRange(torch.randn(3).bfloat16(), 0, (3,))}
    dcp_save(entries, str(tmp_path / "c"), FlatSavePlanner(), None)
    md = load_metadata_safely(str(tmp_path / "c" / ".metadata"))
    assert tuple(md.state_dict_metadata["w"].size) == (4, 5)
    assert md.state_dict_metadata["h"].properties.dtype == torch.bfloat16


def test_commit_dir_replaces_and_recovers(tmp_path):
    final = str(tmp_path / "ckpt")
    for version in ("one", "two"):
        tmp = new_tmp_dir(final)
        os.makedirs(tmp)
        with open(os.path.join(tmp, META_FILE), "w") as f:
            f.write(version)
        commit_dir(tmp, final)
        assert open(os.path.join(final, META_FILE)).read() == version
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    # a crash after "rename old away" and before "rename new in": the old one is still found
    os.rename(final, final + ".old-deadbeef")
    os.makedirs(final + ".tmp-cafecafe")  # and an unfinished save
    with pytest.warns(UserWarning, match="complete previous checkpoint"):
        assert resolve_checkpoint_dir(final) == final + ".old-deadbeef"
    os.makedirs(final)
    with pytest.raises(CheckpointError, match="not a complete accel_flatshard checkpoint"):
        resolve_checkpoint_dir(final)
    os.rmdir(final)
    os.rename(final + ".old-deadbeef", str(tmp_path / "moved"))
    with pytest.raises(CheckpointError, match="does not exist; incomplete saves found"):
        resolve_checkpoint_dir(final)


def test_parse_size():
    assert parse_size("5GB") == 5_000_000_000
    assert parse_size("2MiB") == 2 * 1024 * 1024
    assert parse_size("300kb") == 300_000
    assert parse_size(123) == 123
    with pytest.raises(ValueError, match="cannot parse size"):
        parse_size("lots")


@pytest.mark.parametrize("direction", ["to_torch", "from_torch"])
def test_torch_optimizer_conversion_names_a_parameter_outside_the_model(direction):
    """An optimizer holding a parameter the model does not own: the conversion names the group and the shape."""
    from accel_flatshard.state.optim import optim_state_dict_from_torch, optim_state_dict_to_torch

    model, stray = torch.nn.Linear(2, 3), torch.nn.Parameter(torch.zeros(5, 7))
    optimizer = torch.optim.SGD([*model.parameters(), stray], lr=0.1)
    convert = optim_state_dict_to_torch if direction == "to_torch" else optim_state_dict_from_torch
    with pytest.raises(CheckpointError, match=r"param_groups\[0\] holds a parameter \(shape \(5, 7\)\)"):
        convert({"param_groups": [], "state": {}}, model, optimizer)


def test_a_deletion_cut_short_leaves_no_half_emptied_checkpoint_that_reads_complete(tmp_path, monkeypatch):
    # prune_checkpoints deletes an incomplete folder and the process is killed inside the deletion, after the
    # manifest went (before: the rest read as a complete checkpoint written before commit markers, and loaded)
    from accel_flatshard.state import atomic, commit

    root = tmp_path / "checkpoints"
    for n, manifest in ((1, commit.COMPLETE_FILE), (2, commit.PENDING_FILE)):
        (root / f"checkpoint_{n}").mkdir(parents=True)
        (root / f"checkpoint_{n}" / "model.bin").write_text("x")
        (root / f"checkpoint_{n}" / manifest).write_text('{"parts": ["model.bin"]}')

    def killed_while_deleting(path, ignore_errors=False):
        os.remove(os.path.join(path, commit.PENDING_FILE))
        raise KeyboardInterrupt

    monkeypatch.setattr(atomic.shutil, "rmtree", killed_while_deleting)
    with pytest.raises(KeyboardInterrupt):
        commit.prune_checkpoints(str(root), total_limit=1)
    assert commit.newest_complete_checkpoint(str(root)) == str(root / "checkpoint_1")
    monkeypatch.undo()
    atomic.remove_dir(str(root / "checkpoint_2"))  # a later deletion of that name clears what the cut one left
    assert os.listdir(root) == ["checkpoint_1"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_the_background_writer_thread_alone_gets_the_lower_priority():
    import threading

    from accel_flatshard.state import commit

    seen = {}

    def writer():
        commit._lower_priority()
        seen["writer"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    thread = threading.Thread(target=writer)
    thread.start()
    thread.join()
    assert seen["writer"] == max(before, commit.WRITER_NICE)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # the training thread keeps its own
