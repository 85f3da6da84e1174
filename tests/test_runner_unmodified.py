"""Unmodified accelerate code under ``accelerate launch --config_file accelerate_configs/cpu_2proc.yaml -m
accel_flatshard.run`` (the README yaml, 2 CPU processes, gloo):

* accelerate's own FSDP test script ``test_utils/scripts/test_merge_weights.py`` (builds a
  ``FullyShardedDataParallelPlugin(...)`` in code, saves with ``save_fsdp_model``, merges with
  ``merge_fsdp_weights`` / ``accelerate merge-weights``, compares with the prepared model's state_dict);
* a user's ``nn.Module`` without ``_no_split_modules`` (blocks in an ``nn.ModuleList``) under
  TRANSFORMER_BASED_WRAP with no class list: the repeated blocks become units (logged), losses equal DDP's,
  each rank holds about 1/W of the parameters.

The merge-weights launch is marked ``ci`` (CI runs it, ``make test`` does not): the save and merge paths it
takes are the ones tests/test_trainer.py's ``accelerate merge-weights`` check and tests/test_accelerate_launch.py
reach in the default run.
"""
from __future__ import annotations

from pathlib import Path

import accelerate
import pytest

from launch_helpers import CPU_FSDP_YAML, SCRIPTS, ddp_reference, launch, max_abs_diff, read_json

MERGE_WEIGHTS_SCRIPT = Path(accelerate.__file__).parent / "test_utils" / "scripts" / "test_merge_weights.py"


@pytest.fixture(scope="module")
def merge_weights_run(tmp_path_factory):
    assert MERGE_WEIGHTS_SCRIPT.exists(), MERGE_WEIGHTS_SCRIPT
    proc = launch(CPU_FSDP_YAML, MERGE_WEIGHTS_SCRIPT, via_run=True, check=False, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.ci
def test_merge_weights_script_builds_its_plugin_trains_saves_and_merges(merge_weights_run):
    _, output = merge_weights_run
    # (a) FullyShardedDataParallelPlugin(...) in user code no longer raises on a CPU host
    assert "no available devices" not in output, output[-4000:]
    # the script's own `save_fsdp_model` import reaches accel_flatshard's, and accelerate merges what it wrote
    assert "accel_flatshard.integrations.state_io:Saving model to test_merge_weights_fsdp_weights" in output
    assert "Successfully merged FSDP weights and saved to test_merge_weights_fsdp_weights/model.safetensors" in output


@pytest.mark.ci
def test_accelerates_own_merge_weights_script_passes_unmodified(merge_weights_run):
    returncode, output = merge_weights_run
    assert returncode == 0, output[-6000:]


custom_blocks_ddp = ddp_reference("custom_blocks_ddp", SCRIPTS / "custom_blocks_train.py",
                                  lambda out: ["--output_json", out / "ddp.json"])


@pytest.fixture(scope="module")
def custom_runs(tmp_path_factory, custom_blocks_ddp):
    work = tmp_path_factory.mktemp("custom_blocks")
    proc = launch(CPU_FSDP_YAML, SCRIPTS / "custom_blocks_train.py", ["--output_json", str(work / "fsdp.json")],
                  via_run=True)
    return read_json(custom_blocks_ddp / "ddp.json"), read_json(work / "fsdp.json"), proc.stdout + proc.stderr


def test_custom_module_without_no_split_modules_trains_like_ddp(custom_runs):
    ddp, fsdp, _ = custom_runs
    assert fsdp["model_class"] == "FullyShardedDataParallel" and ddp["model_class"] != fsdp["model_class"]
    assert len(fsdp["losses"]) == len(ddp["losses"]) == 6
    assert max_abs_diff(fsdp["losses"], ddp["losses"]) < 1e-5


def test_custom_module_is_sharded_about_one_over_w(custom_runs):
    _, fsdp, _ = custom_runs
    total, held = fsdp["total_numel"], fsdp["local_numel"]
    assert len(held) == 2
    for local in held:  # 1/W plus per-unit padding
        assert total / 2 <= local <= total / 2 * 1.05, (local, total)


def test_custom_module_chosen_units_are_logged(custom_runs):
    _, _, output = custom_runs
    assert "wrapping its repeated blocks ['Block'] as units" in output, output[-4000:]
    assert "fsdp_transformer_layer_cls_to_wrap: Block" in output
    # once per process (2 processes), not once per unit or per call
    assert output.count("wrapping its repeated blocks") == 2
