"""``accel-flatshard inspect`` / ``consolidate`` on a FULL_STATE_DICT ``save_state`` directory (offline).

The SHARDED layout, written by a real launch, is covered in test_save_model.py.  Here the directory is
built as accelerate's FSDP ``save_state`` writes it under FULL_STATE_DICT: ``pytorch_model_fsdp.bin``
(``torch.save`` of the plain model's state dict: tied weights share a tensor), ``optimizer.bin`` and
accelerate's own files.
"""
from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from accel_flatshard.tools.cli import main
from models import gpt2


def _full_save_state_dir(directory):
    model = gpt2(seed=1)
    directory.mkdir()
    torch.save(model.state_dict(), directory / "pytorch_model_fsdp.bin")
    torch.save({"state": {}, "param_groups": [{"lr": 0.1}]}, directory / "optimizer.bin")
    torch.save({"last_epoch": 3}, directory / "scheduler.bin")
    (directory / "random_states_0.pkl").write_bytes(b"rng")
    return model


def test_inspect_full_save_state_dir_lists_model_optimizer_and_files(tmp_path, capsys):
    _full_save_state_dir(tmp_path / "step_4")
    assert main(["inspect", str(tmp_path / "step_4")]) == 0
    out = capsys.readouterr().out
    assert "model pytorch_model_fsdp.bin: full file" in out and "transformer.h.1.mlp.c_fc.weight" in out
    assert "lm_head.weight" in out and "128x32" in out
    assert "optimizer optimizer.bin: full file" in out
    assert "scheduler.bin" in out and "random_states_0.pkl" in out
    assert main(["inspect", "--json", str(tmp_path / "step_4")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["models"][0]["tensors"]["transformer.wte.weight"]["shape"] == [128, 32]


def test_consolidate_full_save_state_dir_writes_tied_weights_once(tmp_path):
    model = _full_save_state_dir(tmp_path / "step_4")
    assert main(["consolidate", str(tmp_path / "step_4"), str(tmp_path / "hf")]) == 0
    written = load_file(tmp_path / "hf" / "model.safetensors")
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # as save_pretrained
    assert sorted(written) == sorted(expected)
    assert all(torch.equal(written[k], v) for k, v in expected.items())


def test_cli_on_a_save_pretrained_dir_says_what_it_is(tmp_path, capsys):
    gpt2().save_pretrained(tmp_path / "hf")
    assert main(["inspect", str(tmp_path / "hf")]) == 1
    assert "a Hugging Face model directory: load it with from_pretrained" in capsys.readouterr().err
