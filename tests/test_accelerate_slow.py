"""Slow Accelerate-backend launches: each configuration on its own, Llama, bf16, and the example script.

The default run covers every feature at least once (test_accelerate_launch.py, combined launches);
these isolate them, so a failure points at one option.  Run with ``pytest -m slow``.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from launch_helpers import CPU_FSDP_YAML, PLAIN_SCRIPT, REPO, ddp_config, fsdp_config, launch, max_abs_diff, read_json

pytestmark = pytest.mark.slow
TOL = 1e-6


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("accelerate_slow")


def _ddp(work: Path, model: str) -> dict:
    out = work / f"ddp_{model}.json"
    if not out.exists():
        launch(ddp_config(work), PLAIN_SCRIPT, ["--output_json", str(out), "--model", model], ddp=True)
    return read_json(out)


VARIANTS = {
    "shard_grad_op": (dict(fsdp_sharding_strategy="SHARD_GRAD_OP"), {}, []),
    "hybrid_group_1": (dict(fsdp_sharding_strategy="HYBRID_SHARD"), {"FLATSHARD_FSDP_GROUP_SIZE": "1"}, []),
    "no_shard": (dict(fsdp_sharding_strategy="NO_SHARD"), {}, []),
    "size_based": (dict(fsdp_auto_wrap_policy="SIZE_BASED_WRAP", fsdp_min_num_params=2000), {}, []),
    "no_wrap_prefetch": (dict(fsdp_auto_wrap_policy="NO_WRAP", fsdp_forward_prefetch=True,
                              fsdp_backward_prefetch="BACKWARD_POST"), {}, ["--prepare_style", "reversed"]),
    "activation_checkpointing": (dict(fsdp_activation_checkpointing=True), {}, ["--prepare_style", "optimizer_after"]),
    "sync_each_batch": ({}, {}, ["--sync_each_batch"]),
    "limit_and_reduce_env": ({}, {"FLATSHARD_LIMIT_ALL_GATHERS": "1", "FLATSHARD_REDUCE_SCATTER_VIA_ALL_REDUCE": "0"}, []),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_matches_ddp(work, name):
    ref = _ddp(work, "gpt2")
    overrides, env, extra = VARIANTS[name]
    out = work / f"{name}.json"
    launch(fsdp_config(work, f"{name}.yaml", **overrides), PLAIN_SCRIPT, ["--output_json", str(out), *extra],
           via_run=True, env=env)
    result = read_json(out)
    assert result["distributed_type"] == "DistributedType.FSDP"
    assert max_abs_diff(result["losses"], ref["losses"]) < TOL
    assert max_abs_diff(result["grad_norms"], ref["grad_norms"]) < TOL
    assert result["eval"]["samples"] == 10


def test_llama_matches_ddp_and_resumes(work):
    """Llama (untied embeddings, rotary buffers): DDP parity, then SHARDED save/resume in a new launch."""
    ref = _ddp(work, "llama")
    out = work / "llama.json"
    launch(CPU_FSDP_YAML, PLAIN_SCRIPT, ["--output_json", str(out), "--model", "llama", "--save_at", "4",
                                         "--save", f"SHARDED_STATE_DICT={work / 'llama_ckpt'}"], via_run=True)
    result = read_json(out)
    assert max_abs_diff(result["losses"], ref["losses"]) < TOL
    out2 = work / "llama_resume.json"
    launch(CPU_FSDP_YAML, PLAIN_SCRIPT, ["--output_json", str(out2), "--model", "llama", "--save_at", "4",
                                         "--resume_from", str(work / "llama_ckpt")], via_run=True)
    assert max_abs_diff(read_json(out2)["resumed"][0]["losses"], result["losses"][4:]) < TOL


def test_bf16_trains_close_to_fp32(work):
    ref = _ddp(work, "gpt2")
    out = work / "bf16.json"
    launch(fsdp_config(work, "bf16.yaml", mixed_precision="bf16"), PLAIN_SCRIPT, ["--output_json", str(out)], via_run=True)
    result = read_json(out)
    assert all(l == l for l in result["losses"])
    assert max_abs_diff(result["losses"], ref["losses"]) < 5e-2  # bf16 compute, fp32 master shards


def test_example_trains_checkpoints_resumes_and_saves(work):
    """examples/train_causal_lm.py: loss falls, --resume_from_checkpoint reproduces the steps after the
    checkpoint, the final directory loads with from_pretrained (model and tokenizer)."""
    import transformers

    out = work / "example"
    args = ["--max_train_steps", "8", "--logging_steps", "1", "--checkpointing_steps", "4", "--block_size", "64",
            "--per_device_train_batch_size", "4", "--max_eval_samples", "16", "--gradient_accumulation_steps", "2",
            "--output_dir", str(out), "--model_name_or_path", "llama-tiny"]
    example = REPO / "examples" / "train_causal_lm.py"
    launch(CPU_FSDP_YAML, example, args)
    first = json.loads((out / "all_results.json").read_text())
    losses = [h["loss"] for h in first["train_history"]]
    assert losses[-1] < losses[0] - 0.2, losses
    launch(CPU_FSDP_YAML, example, args + ["--resume_from_checkpoint", str(out / "step_4")])
    second = json.loads((out / "all_results.json").read_text())
    assert [h["step"] for h in second["train_history"]] == [5, 6, 7, 8]
    assert max_abs_diff([h["loss"] for h in second["train_history"]], losses[4:]) < TOL
    assert abs(second["eval_loss"] - first["eval_loss"]) < TOL
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "final")
    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "final")
    ids = tokenizer("def f(x):", return_tensors="pt").input_ids
    assert tokenizer.decode(ids[0]) == "def f(x):"
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()
