"""Clear errors, meta-device loading and fp16 loss scaling of the Accelerate backend: one real launch.

The yaml asks for ``fsdp_version: 2``, ``mixed_precision: fp16`` and a layer class GPT-2 lacks;
tests/scripts/flatshard_checks.py walks through the cases and records what happened.
"""
from __future__ import annotations

import pytest

from launch_helpers import SCRIPTS, fsdp_config, launch, read_json


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    work = tmp_path_factory.mktemp("accelerate_checks")
    config = fsdp_config(work, "checks.yaml", mixed_precision="fp16", fsdp_version=2,
                         fsdp_transformer_layer_cls_to_wrap="GPT2Block,NoSuchBlock")
    launch(config, SCRIPTS / "flatshard_checks.py", ["--output_json", str(work / "checks.json")])
    return read_json(work / "checks.json")


def test_clear_errors(checks):
    assert "fsdp_version 3" in checks["fsdp_version_3"] and "1 and 2" in checks["fsdp_version_3"]
    # a misspelt FLATSHARD_* variable lists the known names
    assert "FLATSHARD_GROUPSIZE" in checks["unknown_env"] and "FLATSHARD_FSDP_GROUP_SIZE" in checks["unknown_env"]
    # a layer class from the yaml that the model lacks: named, with the classes that exist
    assert "NoSuchBlock" in checks["unknown_layer_class"] and "GPT2Block" in checks["unknown_layer_class"]
    assert "DistributedDataParallel" in checks["torch_ddp"] and "plain model" in checks["torch_ddp"]
    assert "fully_shard" in checks["torch_fsdp2"]
    assert checks["two_models"] is True  # a second model is sharded, not refused (test_multi_model.py)


def test_meta_rank_gets_rank0_weights(checks):
    """Ranks > 0 on the meta device (cpu_ram_efficient_loading): prepare fills them from rank 0 and the
    optimizer built before prepare still updates them."""
    assert checks["meta_rank1_synced"] is True
    changed_rank1 = checks["fp16"]["per_rank"][1][1]
    assert changed_rank1[0] and changed_rank1[2], changed_rank1


def test_fp16_sharded_grad_scaler(checks):
    """An inf in rank 1's gradient shard only: both ranks skip that step and halve the scale."""
    assert checks["distributed_type"] == "DistributedType.FSDP"
    assert checks["mixed_precision"] == "fp16" and checks["scaler"] == "ShardedGradScaler"
    for skipped, changed, scales in checks["fp16"]["per_rank"]:
        assert skipped == [False, True, False, False]
        assert changed == [True, False, True, True]  # parameters untouched on the skipped step
        assert scales[0] == 2 * scales[1] == 65536.0
    losses = checks["fp16"]["losses_rank0"]
    assert all(l == l and 4.0 < l < 6.0 for l in losses), losses  # finite, sensible
    assert checks["unwrapped_class"] == "GPT2LMHeadModel"
    assert checks["max_grad_after_clip_value_rank0"] <= 1e-4 + 1e-9  # clip_grad_value_ on shards
