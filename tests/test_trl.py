"""TRL trainers, unmodified, through ``accelerate launch -m accel_flatshard.run`` vs accelerate DDP.

Tiny untied Llama (its ``lm_head`` is a unit of its own and TRL's fused LM head reads ``lm_head.weight``
from the model's forward), 2 CPU processes, 4 optimizer steps; the logged loss of every step is the mean
over both processes.
"""
import pytest

from launch_helpers import CPU_FSDP_YAML, SCRIPTS, ddp_config, ddp_reference, fsdp_config, launch, max_abs_diff, read_json

LOSS_TOL = 1e-5
WEIGHT_TOL = 1e-4


def _run_both(tmp, script, *args):
    launch(ddp_config(tmp), script, [*args, "--output_dir", str(tmp / "ddp"), "--output_json", str(tmp / "ddp.json")],
           ddp=True)
    launch(CPU_FSDP_YAML, script, [*args, "--output_dir", str(tmp / "fs"), "--output_json", str(tmp / "fs.json")],
           via_run=True)
    return read_json(tmp / "ddp.json"), read_json(tmp / "fs.json")


SFT_ARGS = ("--model", "llama", "--save_final")
sft_ddp = ddp_reference("sft_ddp", SCRIPTS / "trl_sft.py",
                        lambda out: [*SFT_ARGS, "--output_dir", out / "ddp", "--output_json", out / "ddp.json"])


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory, sft_ddp):
    """``({"ddp": dir, "fs": dir}, ddp results, our results)``."""
    tmp = tmp_path_factory.mktemp("sft")
    launch(CPU_FSDP_YAML, SCRIPTS / "trl_sft.py",
           [*SFT_ARGS, "--output_dir", str(tmp / "fs"), "--output_json", str(tmp / "fs.json")], via_run=True)
    return {"ddp": sft_ddp / "ddp", "fs": tmp / "fs"}, read_json(sft_ddp / "ddp.json"), read_json(tmp / "fs.json")


def _load_final(directory):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(directory)).state_dict()


def test_sft_trainer_on_untied_llama_follows_ddp(sft_runs):
    _, ddp, ours = sft_runs
    assert ours["distributed_type"] == "DistributedType.FSDP" and ours["num_processes"] == 2
    assert len(ours["losses"]) == 4
    assert max_abs_diff(ours["losses"], ddp["losses"]) < LOSS_TOL


def test_sft_trainer_model_is_sharded(sft_runs):
    _, ddp, ours = sft_runs
    assert ours["model_info"]["trainable"] == ddp["model_info"]["trainable"] // 2


def test_sft_final_save_loads_with_from_pretrained_and_equals_ddps(sft_runs):
    dirs, _, _ = sft_runs
    ddp_state, our_state = _load_final(dirs["ddp"] / "final"), _load_final(dirs["fs"] / "final")
    assert sorted(our_state) == sorted(ddp_state)
    assert all(our_state[k].shape == ddp_state[k].shape for k in ddp_state)
    assert max((our_state[k] - ddp_state[k]).abs().max().item() for k in ddp_state) < WEIGHT_TOL


@pytest.mark.slow
@pytest.mark.parametrize("state_dict_type", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_sft_resume_from_step_4_in_a_new_launch_reproduces_steps_5_to_8(tmp_path, state_dict_type):
    yaml = fsdp_config(tmp_path, fsdp_state_dict_type=state_dict_type)
    common = ["--model", "llama", "--steps", "8", "--save_steps", "4"]
    launch(ddp_config(tmp_path), SCRIPTS / "trl_sft.py",
           [*common, "--output_dir", str(tmp_path / "ddp"), "--output_json", str(tmp_path / "ddp.json")], ddp=True)
    launch(yaml, SCRIPTS / "trl_sft.py",
           [*common, "--output_dir", str(tmp_path / "fs"), "--output_json", str(tmp_path / "fs.json")], via_run=True)
    launch(yaml, SCRIPTS / "trl_sft.py",
           [*common, "--output_dir", str(tmp_path / "fs"), "--output_json", str(tmp_path / "resumed.json"),
            "--resume_from", str(tmp_path / "fs" / "checkpoint-4")], via_run=True)
    ddp, ours, resumed = (read_json(tmp_path / f"{n}.json") for n in ("ddp", "fs", "resumed"))
    assert len(ours["losses"]) == 8 and len(resumed["losses"]) == 4
    assert max_abs_diff(ours["losses"], ddp["losses"]) < LOSS_TOL
    assert max_abs_diff(resumed["losses"], ours["losses"][4:]) < LOSS_TOL


@pytest.fixture(scope="module")
def dpo_ref_runs(tmp_path_factory):
    return _run_both(tmp_path_factory.mktemp("dpo_ref"), SCRIPTS / "trl_dpo.py", "--mode", "ref")


@pytest.mark.slow
def test_dpo_trainer_with_reference_model_follows_ddp(dpo_ref_runs):
    ddp, ours = dpo_ref_runs
    assert ours["distributed_type"] == "DistributedType.FSDP"
    assert max_abs_diff(ours["losses"], ddp["losses"]) < LOSS_TOL
    # the reference model matters: its log-probs enter the loss (rewards are relative to it)
    assert max_abs_diff([log["rewards/margins"] for log in ours["logs"]],
                        [log["rewards/margins"] for log in ddp["logs"]]) < LOSS_TOL


@pytest.mark.slow
def test_dpo_reference_model_is_sharded_without_gradients(dpo_ref_runs):
    ddp, ours = dpo_ref_runs
    assert ours["model_info"]["trainable"] == ddp["model_info"]["trainable"] // 2
    assert ours["ref_class"] == "FullyShardedDataParallel"
    ref_total = ddp["ref_info"]["trainable"] + ddp["ref_info"]["frozen"]
    assert ours["ref_info"]["trainable"] + ours["ref_info"]["frozen"] == ref_total // 2
    assert ours["ref_info"]["grads"] == 0


@pytest.mark.slow
def test_dpo_trainer_with_lora_follows_ddp(tmp_path):
    """No reference model: TRL disables the adapter for the reference pass (is_peft_model must see the
    PeftModel inside the wrapper); the frozen head is read with grad, then by a no-grad pass."""
    ddp, ours = _run_both(tmp_path, SCRIPTS / "trl_dpo.py", "--mode", "lora")
    assert max_abs_diff(ours["losses"], ddp["losses"]) < LOSS_TOL
    assert ours["model_info"]["trainable"] == ddp["model_info"]["trainable"] // 2
    assert ours["model_info"]["frozen"] == ddp["model_info"]["frozen"] // 2


@pytest.mark.slow
def test_kto_trainer_with_reference_model_follows_ddp_and_shards_the_reference(tmp_path):
    ddp, ours = _run_both(tmp_path, SCRIPTS / "trl_kto.py")
    assert max_abs_diff(ours["losses"], ddp["losses"]) < LOSS_TOL
    assert ours["ref_class"] == "FullyShardedDataParallel"
    assert ours["ref_info"]["trainable"] == ddp["ref_info"]["trainable"] // 2 and ours["ref_info"]["grads"] == 0


@pytest.mark.slow
def test_grpo_trainer_with_reference_model_follows_ddp_and_shards_the_reference(tmp_path):
    """Generation runs through the sharded policy (units gathered per forward step)."""
    ddp, ours = _run_both(tmp_path, SCRIPTS / "trl_grpo.py")
    assert ours["seam_patched"]  # generation goes through our summon (generation.py), not per-token gathers
    assert max_abs_diff(ours["losses"], ddp["losses"]) < LOSS_TOL
    assert max_abs_diff(ours["rewards"], ddp["rewards"]) < LOSS_TOL  # same generations
    assert ours["ref_class"] == "FullyShardedDataParallel"
    assert ours["ref_info"]["trainable"] == ddp["ref_info"]["trainable"] // 2 and ours["ref_info"]["grads"] == 0
