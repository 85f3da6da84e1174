"""LoRA (PEFT), unmodified scripts through ``accelerate launch -m accel_flatshard.run`` vs accelerate DDP:
a plain accelerate loop and ``transformers.Trainer``.  The saved adapter loads with
``PeftModel.from_pretrained`` and equals DDP's."""
import pytest
import torch

from launch_helpers import CPU_FSDP_YAML, SCRIPTS, ddp_config, ddp_reference, fsdp_config, launch, max_abs_diff, read_json

LOSS_TOL = 1e-5


def _run_both(tmp, script, fsdp_yaml):
    launch(ddp_config(tmp), script, ["--output_dir", str(tmp / "ddp"), "--output_json", str(tmp / "ddp.json")], ddp=True)
    launch(fsdp_yaml, script, ["--output_dir", str(tmp / "fs"), "--output_json", str(tmp / "fs.json")], via_run=True)
    return read_json(tmp / "ddp.json"), read_json(tmp / "fs.json")


def _load_adapter(directory):
    import sys

    from peft import PeftModel

    sys.path.insert(0, str(SCRIPTS))
    from trl_common import tiny_model

    return PeftModel.from_pretrained(tiny_model("llama"), str(directory))


def _assert_adapters_equal(ddp_dir, ours_dir):
    ddp_model, our_model = _load_adapter(ddp_dir), _load_adapter(ours_dir)
    ddp_state, our_state = ddp_model.state_dict(), our_model.state_dict()
    assert sorted(ddp_state) == sorted(our_state)
    lora = [k for k in ddp_state if "lora_" in k]
    assert lora and all(our_state[k].shape == ddp_state[k].shape for k in lora)
    assert max((our_state[k] - ddp_state[k]).abs().max().item() for k in lora) < 1e-4
    x = torch.arange(16).unsqueeze(0) + 3
    with torch.no_grad():
        assert (our_model(x).logits - ddp_model(x).logits).abs().max().item() < 1e-4


peft_plain_ddp = ddp_reference("peft_plain_ddp", SCRIPTS / "peft_plain.py",
                               lambda out: ["--output_dir", out / "ddp", "--output_json", out / "ddp.json"])


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory, peft_plain_ddp):
    """``({"ddp": dir, "fs": dir}, ddp results, our results)``."""
    tmp = tmp_path_factory.mktemp("peft_plain")
    launch(CPU_FSDP_YAML, SCRIPTS / "peft_plain.py", ["--output_dir", str(tmp / "fs"), "--output_json", str(tmp / "fs.json")],
           via_run=True)
    dirs = {"ddp": peft_plain_ddp / "ddp", "fs": tmp / "fs"}
    return dirs, read_json(peft_plain_ddp / "ddp.json"), read_json(tmp / "fs.json")


def test_lora_plain_loop_follows_ddp_and_is_sharded(plain_runs):
    _, ddp, ours = plain_runs
    assert ours["distributed_type"] == "DistributedType.FSDP" and ours["unwrapped_class"] == "PeftModelForCausalLM"
    assert max_abs_diff(ours["losses"], ddp["losses"]) < LOSS_TOL
    assert ours["model_info"]["trainable"] == ddp["model_info"]["trainable"] // 2
    assert ours["model_info"]["frozen"] == ddp["model_info"]["frozen"] // 2


def test_lora_plain_loop_saved_adapter_loads_and_equals_ddps(plain_runs):
    dirs, _, _ = plain_runs
    _assert_adapters_equal(dirs["ddp"], dirs["fs"])


def test_lora_adapter_saved_without_state_dict_on_every_rank_equals_ddps(plain_runs):
    """``unwrap_model(model).save_pretrained(dir, is_main_process=...)`` (no ``state_dict=``): PEFT asks the
    unwrapped model for its state dict, which is gathered collectively, so the adapter is complete."""
    dirs, _, _ = plain_runs
    _assert_adapters_equal(dirs["ddp"] / "no_state_dict", dirs["fs"] / "no_state_dict")


@pytest.mark.slow
def test_lora_with_trainer_follows_ddp_and_saves_a_loadable_adapter(tmp_path):
    """Trainer.save_model under FSDP writes the model for FULL_STATE_DICT (as with torch FSDP)."""
    ddp, ours = _run_both(tmp_path, SCRIPTS / "peft_trainer.py", fsdp_config(tmp_path, fsdp_state_dict_type="FULL_STATE_DICT"))
    assert max_abs_diff(ours["losses"], ddp["losses"]) < LOSS_TOL
    assert ours["model_info"]["trainable"] == ddp["model_info"]["trainable"] // 2
    _assert_adapters_equal(tmp_path / "ddp" / "final", tmp_path / "fs" / "final")
