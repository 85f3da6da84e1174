"""The prepared model's ``state_dict()`` is the full state dict (torch FSDP's default), its
``load_state_dict`` takes a full dict and reshards; this rank's slices are ``local_state_dict()``.

One DDP (in the session's shared reference launch) and one accel_flatshard launch of the same plain
accelerate script (``scripts/prepared_state_dict.py``, cpu_2proc.yaml through ``-m accel_flatshard.run``).  DDP's prepared model prefixes its keys
with ``module.``; torch FSDP's full state dict (and ours) has the plain model's keys.
"""
from __future__ import annotations

import json

import pytest
import torch

from dist_helpers import spawn
from launch_helpers import CPU_FSDP_YAML, SCRIPTS, ddp_reference, launch
from models import gpt2

SCRIPT = SCRIPTS / "prepared_state_dict.py"
TOL = 1e-5


prepared_state_dict_ddp = ddp_reference("prepared_state_dict_ddp", SCRIPT, lambda out: ["--output_dir", out])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, prepared_state_dict_ddp):
    ddp, ours = prepared_state_dict_ddp, tmp_path_factory.mktemp("prepared_state_dict")
    launch(CPU_FSDP_YAML, SCRIPT, ["--output_dir", str(ours)], via_run=True)
    return {name: (d, json.loads((d / "results.json").read_text())) for name, d in (("ddp", ddp), ("flatshard", ours))}


def test_accelerator_save_of_prepared_state_dict_writes_ddps_full_model(runs):
    ours = torch.load(runs["flatshard"][0] / "prepared_state_dict.pt", weights_only=True)
    ddp = torch.load(runs["ddp"][0] / "prepared_state_dict.pt", weights_only=True)
    ddp = {k.removeprefix("module."): v for k, v in ddp.items()}
    plain = gpt2(seed=5).state_dict()
    assert list(ours) == list(plain)  # the plain model's keys, in its order, no wrapper prefix
    assert all(ours[k].shape == plain[k].shape for k in plain)  # full shapes, not 1-D slices
    assert sorted(ours) == sorted(ddp)
    assert max((ours[k].float() - ddp[k].float()).abs().max().item() for k in ours) <= TOL
    assert max((ours[k].float() - plain[k].float()).abs().max().item() for k in ours) > 1e-3  # trained, not initial


def test_prepared_state_dict_on_main_process_only_fails_fast(runs):
    record = runs["flatshard"][1]["main_only"]
    assert record["error"] is not None and record["seconds"] < 10, record
    assert "on every rank" in record["error"]
    assert runs["ddp"][1]["main_only"]["error"] is None  # fine under DDP (nothing is sharded)


def test_full_dict_into_prepared_load_state_dict_reshards(runs):
    ours, ddp = runs["flatshard"][1], runs["ddp"][1]
    assert max(abs(a - b) for a, b in zip(ours["losses"], ddp["losses"])) < 1e-6
    assert abs(ours["probe_trained"] - ours["probe_saved"]) > 1e-4  # the extra steps changed the model
    for key in ("probe_loaded_every_rank", "probe_loaded_rank0"):
        assert abs(ours[key] - ours["probe_saved"]) < 1e-6, key
        assert abs(ours[key] - ddp[key]) < 1e-6, key
    for key in ("step_after_load", "step_after_rank0_load"):
        assert abs(ours[key] - ddp[key]) < 1e-6, key


def _local_worker(rank, world_size):
    from accel_flatshard import FullyShardedDataParallel

    wrapped = FullyShardedDataParallel(gpt2(seed=5))
    local = {k: v.clone() for k, v in wrapped.local_state_dict().items()}  # no collective
    error = None
    try:
        wrapped.load_state_dict(local)  # slices are not a full dict: refused, on every rank
    except RuntimeError as e:
        error = str(e)
    for p in wrapped.parameters():
        p.data.zero_()
    wrapped.load_local_state_dict(local)
    back = wrapped.local_state_dict()
    return ({k: tuple(v.shape) for k, v in local.items()}, error,
            all(torch.equal(back[k], local[k]) for k in local))


def test_local_state_dict_is_this_ranks_slices():
    plain = gpt2(seed=5).state_dict()
    for shapes, error, restored in spawn(2, _local_worker):
        assert list(shapes) == list(plain) and all(len(s) == 1 for s in shapes.values())
        assert error is not None and "size mismatch" in error
        assert restored
