"""``Accelerator.save_state`` / ``load_state`` with several sharded models: one real launch.

Every accel_flatshard-wrapped model in ``accelerator._models`` is saved under accelerate's index names
(``pytorch_model_fsdp_0/``, ``pytorch_model_fsdp_1/`` or ``pytorch_model_fsdp.bin``,
``pytorch_model_fsdp_1.bin``) and each optimizer with the model whose parameters it updates; loading
restores both, so the steps after the checkpoint repeat exactly for both models.
"""
from __future__ import annotations

import pytest

from launch_helpers import CPU_FSDP_YAML, SCRIPTS, launch, read_json


@pytest.fixture(scope="module")
def two_models(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("two_model_state")
    launch(CPU_FSDP_YAML, SCRIPTS / "trainer_multi_model_state.py",
           ["--work_dir", str(work), "--output_json", str(work / "result.json")])
    return read_json(work / "result.json")


def test_save_state_writes_every_model_and_optimizer_with_accelerates_index_names(two_models):
    files = two_models["files"]
    assert {"pytorch_model_fsdp_0", "pytorch_model_fsdp_1", "optimizer_0", "optimizer_1"} <= set(files["SHARDED_STATE_DICT"])
    assert {"pytorch_model_fsdp.bin", "pytorch_model_fsdp_1.bin", "optimizer.bin", "optimizer_1.bin"} <= set(
        files["FULL_STATE_DICT"])


@pytest.mark.parametrize("kind", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_load_state_restores_both_models(two_models, kind):
    reference, resumed = two_models["reference"], two_models["resumed"][kind]
    assert len(reference) == len(resumed) == 2
    for ref_step, res_step in zip(reference, resumed):
        assert res_step == pytest.approx(ref_step, abs=1e-6)  # [gpt2 loss, llama loss] per step
