"""The Accelerate backend end to end: real ``accelerate launch`` runs, 2 CPU processes, gloo.

Reference: the same plain script under accelerate's own DDP.  Each launch costs ~15 s of imports, so
one launch checks several things; the launches are module fixtures shared by the tests below.

* ``fsdp_run``: the plain script through ``-m accel_flatshard.run`` with the repo's cpu_2proc.yaml
  (FULL_SHARD, transformer blocks, BACKWARD_PRE): 8 steps, accumulation 2, clipping; ``save_state`` at
  step 4 as FULL_STATE_DICT and SHARDED_STATE_DICT; ``get_state_dict`` + ``save_pretrained`` and
  ``save_model`` at the end.
* ``resume_run``: a new launch, accel_flatshard's Accelerator imported directly, optimizer built after
  ``prepare``, a different layout (SHARD_GRAD_OP, size-based units): ``load_state`` of each step-4
  checkpoint, then steps 5-8.
* ``combo_run``: HYBRID_SHARD (FLATSHARD_FSDP_GROUP_SIZE=1), activation checkpointing, forward prefetch,
  BACKWARD_POST, cpu_ram_efficient_loading from a local ``save_pretrained`` dir, ``prepare`` in reversed
  order, ``sync_each_batch``, automatic checkpoint naming with ``total_limit``.
* ``offload_run`` (marked ``ci``: CI runs it, ``make test`` does not; tests/test_trainer.py launches the
  offload yaml in the default run): the README yaml with ``fsdp_offload_params: true``, then a new launch that
  resumes from its checkpoints.

The accelerate-DDP reference runs in the session's shared reference launch (launch_helpers.ddp_reference).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from launch_helpers import (CPU_FSDP_YAML, PLAIN_SCRIPT, SCRIPTS, ddp_reference, fsdp_config, launch, max_abs_diff,
                            read_json)

TOL = 1e-6  # loss / grad-norm agreement with DDP (fp32, same data, same reduction order up to fp rounding)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("accelerate_launch")


plain_ddp = ddp_reference("plain_ddp", PLAIN_SCRIPT, lambda out: ["--output_json", out / "ddp.json"])


@pytest.fixture(scope="module")
def ddp_ref(plain_ddp):
    return read_json(plain_ddp / "ddp.json")


@pytest.fixture(scope="module")
def fsdp_run(work):
    out = work / "fsdp.json"
    args = ["--output_json", str(out), "--save_at", "4",
            "--save", f"FULL_STATE_DICT={work / 'ckpt_full'}", f"SHARDED_STATE_DICT={work / 'ckpt_sharded'}",
            "--save_pretrained_dir", str(work / "pretrained"), "--save_model_dir", str(work / "save_model")]
    launch(CPU_FSDP_YAML, PLAIN_SCRIPT, args, via_run=True)
    return read_json(out)


def test_plain_script_via_run_matches_ddp(ddp_ref, fsdp_run):
    """An unmodified accelerate script under `-m accel_flatshard.run`: really sharded, same losses as DDP."""
    assert ddp_ref["distributed_type"] == "DistributedType.MULTI_CPU" and ddp_ref["num_processes"] == 2
    assert fsdp_run["accelerator_class"] == "accel_flatshard.integrations.accelerate.Accelerator"
    assert fsdp_run["distributed_type"] == "DistributedType.FSDP"
    assert fsdp_run["num_processes"] == 2
    assert fsdp_run["model_class"] == "GPT2LMHeadModel"  # unwrap_model gives the user's class
    assert fsdp_run["links"] == ddp_ref["links"]
    assert fsdp_run["links"]["optimizer_is_original"] and fsdp_run["links"]["optimizer_params_in_model"]
    assert len(fsdp_run["losses"]) == 8
    assert max_abs_diff(fsdp_run["losses"], ddp_ref["losses"]) < TOL
    # clip_grad_norm_: the global norm over both ranks' shards (clipping is active: norms > 0.5)
    assert min(ddp_ref["grad_norms"]) > 0.5
    assert max_abs_diff(fsdp_run["grad_norms"], ddp_ref["grad_norms"]) < TOL
    # gather_for_metrics: 10 eval samples over 2 ranks x batch 4, padding dropped
    assert fsdp_run["eval"]["samples"] == ddp_ref["eval"]["samples"] == 10
    assert abs(fsdp_run["eval"]["loss"] - ddp_ref["eval"]["loss"]) < 1e-3


def test_save_state_layouts(work, fsdp_run):
    """accelerate's FSDP layout; the save pre-hook ran once per save_state."""
    full = sorted(p.name for p in (work / "ckpt_full").iterdir())
    sharded = sorted(p.name for p in (work / "ckpt_sharded").iterdir())
    assert {"pytorch_model_fsdp.bin", "optimizer.bin", "scheduler.bin", "custom_checkpoint_0.pkl",
            "random_states_0.pkl", "random_states_1.pkl"} <= set(full), full
    assert {"pytorch_model_fsdp_0", "optimizer_0", "scheduler.bin", "custom_checkpoint_0.pkl",
            "random_states_0.pkl", "random_states_1.pkl"} <= set(sharded), sharded
    assert not any(n.endswith(".bin") and n.startswith("pytorch_model") for n in sharded)
    # the full model file is the plain model's state dict (loadable without accel_flatshard)
    sd = torch.load(work / "ckpt_full" / "pytorch_model_fsdp.bin", weights_only=True)
    assert sd["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)
    assert fsdp_run["hook_calls"]["save"] == 2


def test_get_state_dict_save_pretrained_roundtrip(work, fsdp_run):
    """save_pretrained(state_dict=accelerator.get_state_dict(model)) -> from_pretrained gives the same logits."""
    import transformers

    assert fsdp_run["saved_class"] == "GPT2LMHeadModel"
    model = transformers.AutoModelForCausalLM.from_pretrained(work / "pretrained").eval()
    assert type(model).__name__ == "GPT2LMHeadModel"
    with torch.no_grad():
        logits = model(input_ids=torch.arange(16).unsqueeze(0)).logits
    assert torch.allclose(logits[0, :4, :8], torch.tensor(fsdp_run["logits"]), atol=1e-5, rtol=0)
    assert abs(logits.double().sum().item() - fsdp_run["logits_full_sum"]) < 1e-3
    # accelerator.save_model: the same weights as one safetensors file (tied lm_head stored once)
    from safetensors.torch import load_file

    saved = load_file(work / "save_model" / "model.safetensors")
    reference = model.state_dict()
    assert saved and all(torch.equal(saved[k], reference[k]) for k in saved)
    assert set(reference) - set(saved) <= {"lm_head.weight"}


def test_load_state_resumes_exactly(work, fsdp_run):
    """A new launch loads the step-4 FULL and SHARDED checkpoints and reproduces steps 5-8.

    It imports accel_flatshard's Accelerator directly, builds the optimizer after prepare(model), and
    uses another unit layout (SHARD_GRAD_OP, size-based units): checkpoints are keyed by parameter
    name, not by the wrapping.
    """
    out = work / "resume.json"
    config = fsdp_config(work, "resume.yaml", fsdp_sharding_strategy="SHARD_GRAD_OP",
                         fsdp_auto_wrap_policy="SIZE_BASED_WRAP", fsdp_min_num_params=2000)
    launch(config, SCRIPTS / "flatshard_direct.py",
           ["--output_json", str(out), "--save_at", "4", "--prepare_style", "optimizer_after",
            "--resume_from", str(work / "ckpt_full"), str(work / "ckpt_sharded")])
    result = read_json(out)
    assert result["accelerator_class"] == "accel_flatshard.integrations.accelerate.Accelerator"
    assert result["links"] == fsdp_run["links"]  # optimizer built from the prepared model: same groups
    assert [r["dir"] for r in result["resumed"]] == [str(work / "ckpt_full"), str(work / "ckpt_sharded")]
    for resumed in result["resumed"]:
        assert resumed["counter_after_load"] == 4  # register_for_checkpointing object restored
        assert max_abs_diff(resumed["losses"], fsdp_run["losses"][4:]) < TOL, resumed
        assert max_abs_diff(resumed["grad_norms"], fsdp_run["grad_norms"][4:]) < TOL
    assert result["hook_calls"]["load"] == 2


@pytest.mark.ci  # (make test under 9 minutes: CI runs it)
def test_feature_combo_matches_ddp(work, ddp_ref):
    """Hybrid sharding, activation checkpointing, prefetch options, cpu_ram_efficient_loading, reversed
    prepare order and sync_each_batch at once: still DDP's losses; automatic checkpoint naming keeps
    total_limit=2 folders and load_state() picks the latest."""
    sys.path.insert(0, str(SCRIPTS))
    import plain_accelerate_train as plain

    model_dir = work / "init_model"
    plain.build_model(plain.parse_args(["--output_json", "unused"])).save_pretrained(model_dir)
    out = work / "combo.json"
    config = fsdp_config(work, "combo.yaml", fsdp_sharding_strategy="HYBRID_SHARD",
                         fsdp_activation_checkpointing=True, fsdp_forward_prefetch=True,
                         fsdp_backward_prefetch="BACKWARD_POST", fsdp_cpu_ram_efficient_loading=True,
                         fsdp_sync_module_states=True, fsdp_transformer_layer_cls_to_wrap="GPT2Block")
    launch(config, PLAIN_SCRIPT,
           ["--output_json", str(out), "--model_dir", str(model_dir), "--prepare_style", "reversed",
            "--sync_each_batch", "--auto_ckpt_dir", str(work / "auto")],
           via_run=True, env={"FLATSHARD_FSDP_GROUP_SIZE": "1"})
    result = read_json(out)
    assert result["distributed_type"] == "DistributedType.FSDP"
    assert result["links"] == ddp_ref["links"]  # prepare(scheduler, eval_dl, train_dl, optimizer, model)
    # transformers 5.x loads real weights on every rank even with FSDP_CPU_RAM_EFFICIENT_LOADING (older
    # versions leave ranks > 0 on meta): either way rank 0 has real weights.  The meta path itself is
    # checked in test_accelerate_errors.py.
    assert result["meta_params_per_rank"][0] == 0
    assert max_abs_diff(result["losses"], ddp_ref["losses"]) < TOL
    assert max_abs_diff(result["grad_norms"], ddp_ref["grad_norms"]) < TOL
    assert result["eval"]["samples"] == 10
    assert result["auto_checkpoints"] == ["checkpoint_1", "checkpoint_2"]  # saved at 2, 4, 6; total_limit 2
    assert result["auto_counter_after_load"] == 6


@pytest.fixture(scope="module")
def offload_run(work):
    """The README yaml with ``fsdp_offload_params: true`` (issue 17): shards on the host (here the device)."""
    out = work / "offload.json"
    config = fsdp_config(work, "offload.yaml", fsdp_offload_params=True)
    args = ["--output_json", str(out), "--save_at", "4", "--save", f"FULL_STATE_DICT={work / 'off_full'}",
            f"SHARDED_STATE_DICT={work / 'off_sharded'}"]
    launch(config, PLAIN_SCRIPT, args, via_run=True)
    return read_json(out)


@pytest.mark.ci
def test_offload_yaml_trains_like_ddp_and_resumes_exactly(work, ddp_ref, offload_run):
    """fsdp_offload_params: true is accepted on a CPU-only host (not refused), shards, and trains like DDP;
    a new launch with the same yaml loads its step-4 FULL and SHARDED checkpoints and reproduces steps 5-8."""
    assert offload_run["accelerator_class"] == "accel_flatshard.integrations.accelerate.Accelerator"
    assert offload_run["distributed_type"] == "DistributedType.FSDP" and offload_run["num_processes"] == 2
    assert max_abs_diff(offload_run["losses"], ddp_ref["losses"]) < 1e-5
    assert max_abs_diff(offload_run["grad_norms"], ddp_ref["grad_norms"]) < 1e-5
    out = work / "offload_resume.json"
    config = fsdp_config(work, "offload_resume.yaml", fsdp_offload_params=True)
    launch(config, SCRIPTS / "flatshard_direct.py",
           ["--output_json", str(out), "--save_at", "4", "--prepare_style", "optimizer_after",
            "--resume_from", str(work / "off_full"), str(work / "off_sharded")])
    result = read_json(out)
    for resumed in result["resumed"]:
        assert resumed["losses"] == offload_run["losses"][4:], resumed
        assert resumed["grad_norms"] == offload_run["grad_norms"][4:]
    assert len(result["resumed"]) == 2
