"""``accel-flatshard inspect`` / ``consolidate`` and ``read_full_tensors`` on small checkpoints written offline (no
processes)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from accel_flatshard.state import CheckpointError
from accel_flatshard.state.dcp import FlatRange
from accel_flatshard.state.offline import read_full_tensors
from accel_flatshard.state.sharded import save_entries
from accel_flatshard.tools.cli import main


def _write(directory, kind="model"):
    """A two-'rank' style checkpoint written in one process: a weight in two ranges, a bias, a buffer."""
    weight, bias, buf = torch.randn(40, 30), torch.randn(30), torch.arange(5.0)
    entries = {"layer.weight": FlatRange(weight.reshape(-1).clone(), 0, (40, 30)), "layer.bias": bias, "buf": buf}
    tensors = {"layer.weight": {"kind": "param", "shape": [40, 30], "dtype": "float32", "aliases": []},
               "layer.bias": {"kind": "param", "shape": [30], "dtype": "float32", "aliases": []},
               "buf": {"kind": "buffer", "shape": [5], "dtype": "float32"}}
    save_entries(None, str(directory), entries, {"kind": kind, "model_class": "Toy", "tensors": tensors})
    return {"layer.weight": weight, "layer.bias": bias, "buf": buf}


def test_inspect_prints_keys_shapes_and_world_size(tmp_path, capsys):
    _write(tmp_path / "ckpt")
    assert main(["inspect", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "saved at world size 1" in out and "Toy" in out
    assert "layer.weight" in out and "40x30" in out and "float32" in out
    assert "4.94 KB of tensor data" in out  # (1200 + 30 + 5) * 4 bytes
    assert main(["inspect", "--json", str(tmp_path / "ckpt")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["world_size"] == 1 and info["tensors"]["layer.bias"]["shape"] == [30]


def test_consolidate_single_and_sharded(tmp_path):
    original = _write(tmp_path / "ckpt")
    out = str(tmp_path / "hf")
    assert main(["consolidate", str(tmp_path / "ckpt"), out, "--max-shard-size", "3KB"]) == 0
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert set(index["weight_map"]) == set(original)
    assert index["metadata"]["total_size"] == 4 * (1200 + 30 + 5)
    loaded = {}
    for name in set(index["weight_map"].values()):
        loaded.update(load_file(os.path.join(out, name)))
    assert all(torch.equal(loaded[k], v) for k, v in original.items())
    # consolidating again into the same directory as one file removes the stale shards and index
    assert main(["consolidate", str(tmp_path / "ckpt"), out]) == 0
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    loaded = load_file(os.path.join(out, "model.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in original.items())


def test_consolidate_errors_exit_nonzero(tmp_path, capsys):
    _write(tmp_path / "optim", kind="optimizer")
    assert main(["consolidate", str(tmp_path / "optim"), str(tmp_path / "out")]) == 1
    assert "expected kind 'model'" in capsys.readouterr().err
    _write(tmp_path / "ckpt")
    with open(tmp_path / "ckpt" / "__0_0.distcp", "r+b") as f:
        f.truncate(100)
    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 1
    assert "__0_0.distcp: size is 100 bytes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["consolidate"])


@pytest.mark.parametrize("max_batch_bytes", [1 << 30, 100], ids=["one_batch", "a_batch_per_tensor"])
def test_read_full_tensors_yields_every_tensor_whole_in_checkpoint_order(tmp_path, max_batch_bytes):
    original = _write(tmp_path / "ckpt")
    read = list(read_full_tensors(str(tmp_path / "ckpt"), max_batch_bytes=max_batch_bytes))
    assert [name for name, _ in read] == ["layer.weight", "layer.bias", "buf"]
    assert all(torch.equal(tensor, original[name]) for name, tensor in read)


def test_read_full_tensors_reads_the_names_asked_in_their_order_and_refuses_an_unknown_one(tmp_path):
    original = _write(tmp_path / "ckpt")
    read = list(read_full_tensors(str(tmp_path / "ckpt"), names=["buf", "layer.weight"]))
    assert [name for name, _ in read] == ["buf", "layer.weight"]
    assert all(torch.equal(tensor, original[name]) for name, tensor in read)
    with pytest.raises(CheckpointError, match="'layer.scale' is not in the checkpoint"):
        list(read_full_tensors(str(tmp_path / "ckpt"), names=["layer.scale"]))
