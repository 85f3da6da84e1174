"""Every way users save a model writes the full model (equal to accelerate DDP's), or fails fast.

Reference: the same unmodified script (``tests/scripts/run_clm_no_trainer.py``, a copy of Hugging Face's
``run_clm_no_trainer.py`` with its save tail) under accelerate's DDP.  One DDP and one accel_flatshard
launch (``-m accel_flatshard.run``, cpu_2proc.yaml, SHARDED_STATE_DICT; the DDP one in the session's shared
reference launch) are shared by the launch tests below; each also writes ``accelerator.save_model``, ``torch.save(unwrap_model(model)
.state_dict())`` and ``save_pretrained(state_dict=accelerator.get_state_dict(model))`` output, and
times a ``save_pretrained`` called on the main process only.  The spawn tests check the state-dict
contract directly and the ``push_to_hub`` path (upload mocked: no network).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dist_helpers import spawn
from accel_flatshard.tools.cli import main as cli_main
from launch_helpers import CPU_FSDP_YAML, SCRIPTS, ddp_reference, launch
from models import gpt2, llama

HF_SCRIPT = SCRIPTS / "run_clm_no_trainer.py"
STEPS = 6
TOL = 1e-5


def _script_args(out: Path) -> list:
    return ["--output_dir", str(out / "final"), "--max_train_steps", str(STEPS), "--checkpointing_steps", str(STEPS // 2),
            "--save_model_dir", str(out / "save_model"), "--torch_save_path", str(out / "state_dict.pt"),
            "--get_state_dict_dir", str(out / "get_state_dict"), "--main_only_dir", str(out / "main_only"),
            "--results_json", str(out / "results.json")]


hf_script_ddp = ddp_reference("hf_script_ddp", HF_SCRIPT, _script_args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, hf_script_ddp):
    """``{"ddp": dir, "flatshard": dir}``: the two runs of the HF-style script."""
    ours = tmp_path_factory.mktemp("save_model") / "flatshard"
    ours.mkdir()
    launch(CPU_FSDP_YAML, HF_SCRIPT, _script_args(ours), via_run=True)
    return {"ddp": hf_script_ddp, "flatshard": ours}


def _results(run: Path) -> dict:
    return json.loads((run / "results.json").read_text())


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _from_pretrained(directory: Path) -> dict:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory).state_dict()


def test_example_save_tail_writes_ddps_model(runs):
    """unwrap_model(model).save_pretrained(dir, is_main_process=..., save_function=accelerator.save) on
    every rank, no state_dict=: the same files as DDP's, loadable by from_pretrained, equal values."""
    ours, ddp = runs["flatshard"] / "final", runs["ddp"] / "final"
    assert sorted(os.listdir(ours)) == sorted(os.listdir(ddp)) == sorted(
        ["all_results.json", "config.json", "generation_config.json", "model.safetensors", f"step_{STEPS // 2}",
         f"step_{STEPS}"])
    assert (ours / "config.json").read_text() == (ddp / "config.json").read_text()
    weights = load_file(ours / "model.safetensors")
    assert _max_diff(weights, load_file(ddp / "model.safetensors")) <= TOL
    assert _max_diff(_from_pretrained(ours), _from_pretrained(ddp)) <= TOL
    # training and evaluation were the same too (the saved model is the trained one, not the initial one)
    r_ours, r_ddp = _results(runs["flatshard"]), _results(runs["ddp"])
    assert max(abs(a - b) for a, b in zip(r_ours["losses"], r_ddp["losses"])) < 1e-6
    assert abs(r_ours["perplexity"] - r_ddp["perplexity"]) < 1e-4 * r_ddp["perplexity"]


@pytest.mark.parametrize("path", ["save_model/model.safetensors", "get_state_dict/model.safetensors",
                                  "state_dict.pt"])
def test_other_save_paths_write_ddps_model(runs, path):
    """accelerator.save_model, save_pretrained(state_dict=get_state_dict(model)), torch.save of the
    unwrapped model's state_dict() taken on every rank: full tensors equal to DDP's."""
    load = load_file if path.endswith(".safetensors") else torch.load
    ours, ddp = load(runs["flatshard"] / path), load(runs["ddp"] / path)
    assert _max_diff(ours, ddp) <= TOL
    if path.endswith(".pt"):  # the plain state dict: tied weights under both names, one tensor
        assert ours["lm_head.weight"].data_ptr() == ours["transformer.wte.weight"].data_ptr()


def test_save_pretrained_on_main_process_only_fails_fast(runs):
    """Under `if accelerator.is_main_process:` the gather cannot happen: an error within 10 s that says
    to call it on every rank, and no weights file."""
    record = _results(runs["flatshard"])["main_only"]
    assert record["error"] is not None and record["seconds"] < 10, record
    assert "on every rank" in record["error"] and "get_state_dict" in record["error"]
    left = os.listdir(runs["flatshard"] / "main_only")
    assert not [f for f in left if f.endswith((".safetensors", ".bin", ".pt"))], left
    assert _results(runs["ddp"])["main_only"]["error"] is None  # fine under DDP (nothing is sharded)


def test_cli_inspect_and_consolidate_a_save_state_dir(runs, tmp_path, capsys):
    """`accel-flatshard inspect/consolidate` on the directory save_state wrote (pytorch_model_fsdp_0/,
    optimizer_0/, accelerate's files); the checkpoint is of the last step, so it equals the final model."""
    ckpt = runs["flatshard"] / "final" / f"step_{STEPS}"
    assert cli_main(["inspect", str(ckpt)]) == 0
    shown = capsys.readouterr().out
    for expected in ["model pytorch_model_fsdp_0: sharded", "saved at world size 2", "GPT2LMHeadModel",
                     "transformer.h.1.mlp.c_fc.weight", "32x128", "optimizer optimizer_0: sharded", "AdamW",
                     "scheduler.bin", "random_states_0.pkl", "random_states_1.pkl"]:
        assert expected in shown, (expected, shown)
    assert cli_main(["inspect", "--json", str(ckpt)]) == 0
    as_json = json.loads(capsys.readouterr().out)
    assert [m["name"] for m in as_json["models"]] == ["pytorch_model_fsdp_0"]
    assert [o["name"] for o in as_json["optimizers"]] == ["optimizer_0"]
    assert cli_main(["consolidate", str(ckpt), str(tmp_path / "hf")]) == 0
    final = load_file(runs["flatshard"] / "final" / "model.safetensors")
    assert _max_diff(load_file(tmp_path / "hf" / "model.safetensors"), final) == 0

def test_get_state_dict_on_main_process_only_fails_fast(spawned):
    """accelerator.get_state_dict / save_model gather through full_state_dict: one rank alone raises
    within 10 s with the same advice."""
    error, seconds = spawned[1][0]["get_state_dict_main_only"]
    assert error is not None and "on every rank" in error and seconds < 10


def _hybrid_worker(rank, world_size):
    from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy

    model = llama(seed=4)
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model),  # noqa: F841
                                       fsdp_group_size=2)
    full = model.state_dict()
    return full if rank == 0 else len(full)


@pytest.mark.slow
def test_unwrapped_state_dict_with_hybrid_sharding():
    """HYBRID (W=4, shard groups of 2): rank 0 still gets the plain model's state dict, the others {}."""
    results = spawn(4, _hybrid_worker)
    assert _max_diff(results[0], llama(seed=4).state_dict()) == 0
    assert results[1:] == [0, 0, 0]


@pytest.mark.slow
def test_resume_from_checkpoint_then_save_equals_ddp(runs, tmp_path):
    """--resume_from_checkpoint step_3 (SHARDED save_state of the accel_flatshard run), train steps 4-6,
    save as the example does: the same model and perplexity as DDP's uninterrupted run."""
    args = ["--output_dir", str(tmp_path / "final"), "--max_train_steps", str(STEPS),
            "--resume_from_checkpoint", str(runs["flatshard"] / "final" / f"step_{STEPS // 2}"),
            "--results_json", str(tmp_path / "results.json")]
    launch(CPU_FSDP_YAML, HF_SCRIPT, args, via_run=True)
    ddp = runs["ddp"]
    resumed = json.loads((tmp_path / "results.json").read_text())
    assert _max_diff(load_file(tmp_path / "final" / "model.safetensors"),
                     load_file(ddp / "final" / "model.safetensors")) <= TOL
    micro_steps_done = (STEPS // 2) * 2  # --gradient_accumulation_steps 2: one loss per micro-batch
    assert max(abs(a - b) for a, b in zip(resumed["losses"], _results(ddp)["losses"][micro_steps_done:])) < 1e-6
    assert abs(resumed["perplexity"] - _results(ddp)["perplexity"]) < 1e-4 * _results(ddp)["perplexity"]


# ---------------------------------------------------------------------- state-dict contract (spawned ranks)
def _contract_worker(rank, world_size, out_dir):
    from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy

    results = {}
    for name, build in (("gpt2", gpt2), ("llama", llama)):
        model = build(seed=3)
        wrapped = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model))
        results[f"{name}_wrapper_shapes"] = {k: tuple(v.shape) for k, v in wrapped.local_state_dict().items()}
        full = model.state_dict()  # collective: every rank
        results[f"{name}_full"] = full if rank == 0 else len(full)
        model.save_pretrained(os.path.join(out_dir, name), is_main_process=rank == 0)
        with wrapped.summon_full_params():
            if rank == 1:  # inside summon the parameters are full already: no gather, one rank may call it
                results[f"{name}_summoned_rank1"] = {k: v.clone() for k, v in model.state_dict().items()}
    results["push"] = _push(rank, os.path.join(out_dir, "uploads"))
    results["get_state_dict_main_only"] = _main_only_full_state_dict(rank, wrapped)
    return results


def _main_only_full_state_dict(rank, wrapped):
    """What accelerator.get_state_dict / save_model run, called under `if is_main_process:`."""
    from accel_flatshard.state import full_state_dict

    error, seconds = None, 0.0
    if rank == 0:
        start = time.time()
        try:
            full_state_dict(wrapped)
        except RuntimeError as e:
            error = str(e)
        seconds = time.time() - start
    torch.distributed.barrier()  # the world group still works afterwards
    return error, seconds


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """2 gloo ranks: the state-dict contract on GPT-2 and Llama, then push_to_hub (upload mocked)."""
    out = tmp_path_factory.mktemp("save_contract")
    return out, spawn(2, _contract_worker, str(out))


def test_unwrapped_state_dict_is_the_full_one_collectively(spawned):
    """unwrapped.state_dict(): the plain model's dict on rank 0, {} elsewhere; the wrapper's local_state_dict():
    this rank's 1-D slices; inside summon_full_params: full on any rank; save_pretrained on every rank
    writes what the plain model's save_pretrained writes (tied GPT-2 and untied Llama)."""
    tmp_path, results = spawned
    for name, build in (("gpt2", gpt2), ("llama", llama)):
        plain = build(seed=3)
        expected = plain.state_dict()
        plain.save_pretrained(tmp_path / f"{name}_plain")
        assert list(results[0][f"{name}_full"]) == list(expected)  # same keys, same order
        assert _max_diff(results[0][f"{name}_full"], expected) == 0
        assert results[1][f"{name}_full"] == 0
        assert _max_diff(results[1][f"{name}_summoned_rank1"], expected) == 0
        assert all(len(shape) == 1 for r in results for shape in r[f"{name}_wrapper_shapes"].values())
        assert sorted(os.listdir(tmp_path / name)) == sorted(os.listdir(tmp_path / f"{name}_plain"))
        assert _max_diff(load_file(tmp_path / name / "model.safetensors"),
                         load_file(tmp_path / f"{name}_plain" / "model.safetensors")) == 0


def _push(rank, upload_dir):
    import shutil
    import types
    from unittest import mock

    import transformers.utils.hub as hub
    from transformers import PreTrainedModel

    from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy

    model = gpt2(seed=5)
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model))  # noqa: F841

    def upload(self, working_dir, repo_id, *args, **kwargs):  # what would go to the Hub
        shutil.copytree(working_dir, os.path.join(upload_dir, f"{repo_id}_rank{rank}"))

    fake_api = types.SimpleNamespace(create_repo=lambda repo_id, **kw: types.SimpleNamespace(repo_id=repo_id))
    card = types.SimpleNamespace(save=lambda path: None)
    with mock.patch.object(hub, "hf_api", lambda: fake_api), \
            mock.patch.object(hub, "create_and_tag_model_card", lambda *a, **k: card), \
            mock.patch.object(PreTrainedModel, "_upload_modified_files", upload):
        model.push_to_hub("all_ranks")  # every rank calls it
        error, seconds = None, 0.0
        if rank == 0:  # the usual `if accelerator.is_main_process: model.push_to_hub(...)`
            start = time.time()
            try:
                model.push_to_hub("main_only")
            except RuntimeError as e:
                error = str(e)
            seconds = time.time() - start
    torch.distributed.barrier()
    return error, seconds


def test_push_to_hub_uploads_the_full_model_or_fails_fast(spawned):
    """push_to_hub goes through save_pretrained: called on every rank, rank 0 uploads the full model;
    called on the main process only, it raises within 10 s and uploads nothing."""
    out, results = spawned
    error, seconds = results[0]["push"]
    tmp_path = out / "uploads"
    plain = gpt2(seed=5)
    uploaded = load_file(tmp_path / "all_ranks_rank0" / "model.safetensors")
    assert _max_diff(uploaded, {k: v for k, v in plain.state_dict().items() if k != "lm_head.weight"}) == 0
    assert error is not None and "on every rank" in error and seconds < 10
    assert not (tmp_path / "main_only_rank0").exists()
