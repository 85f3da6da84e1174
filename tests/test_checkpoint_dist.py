"""Checkpoints end to end: tiny GPT-2 (tied) and Llama, full and sharded, model and optimizer.

Default run (about 2 minutes on 2 cores): one 2-rank run that trains, saves every form, checks the
full-dict round trips and a crash mid-save, and keeps training (the uninterrupted reference); one
3-rank run that resumes from those checkpoints (2 -> 3, GPT-2 with AdamW, Llama saved with hybrid
sharding with SGD+momentum); the rest in this process (2 -> 1 resume, plain HF models, consolidation,
damaged and mismatched checkpoints).  ``-m slow`` adds 4 -> 2 and hybrid 4 (G=2) -> 2 / 3 / 1.
"""
from __future__ import annotations

import glob
import json
import os
import pickle
import shutil
import zlib

import pytest
import torch
import torch.distributed as dist

import models
from dist_helpers import spawn

from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy
from accel_flatshard.state import (full_optim_state_dict, full_state_dict, load_full_optim_state_dict,
                                   load_full_state_dict, load_sharded_model, load_sharded_optimizer,
                                   optim_state_dict_from_torch, optim_state_dict_to_torch, save_sharded_model,
                                   save_sharded_optimizer, CheckpointError, UnsafeCheckpointError)

STEPS = 5
TOL = 1e-6  # resumed vs uninterrupted losses, also across world sizes


def _data():
    return models.batches(2 * STEPS, batch=12, seq=8)  # 12 splits evenly over 1, 2, 3 and 4 ranks


def _wrap(model, **kw):
    return FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model), **kw)


def _adamw(model):
    return torch.optim.AdamW(models.param_groups(model), lr=1e-3)


def _sgd(model):
    groups = models.param_groups(model)
    groups[1]["lr"] = 0.05
    return torch.optim.SGD(groups, lr=0.1, momentum=0.9)


def _train(model, opt, data, rank, ws):
    losses = []
    for x in data:
        local = x.chunk(ws)[rank]
        loss = model(local, labels=local).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(models.global_mean(loss, ws))
    return losses


def _assert_same_state(m1, o1, m2, o2):
    for (n, p), (_, q) in zip(m1.named_parameters(), m2.named_parameters()):
        assert torch.equal(p, q), n
        s1, s2 = o1.state[p], o2.state[q]
        assert s1.keys() == s2.keys(), n
        for k in s1:
            assert torch.equal(s1[k], s2[k]), (n, k)
    for g1, g2 in zip(o1.param_groups, o2.param_groups):
        assert {k: v for k, v in g1.items() if k != "params"} == {k: v for k, v in g2.items() if k != "params"}


def _crash_mid_save(rank, model, path):
    """Rank 1 fails after writing 2 items: every rank raises, the old checkpoint survives intact."""
    from accel_flatshard.state import dcp as _planner

    original = _planner.FlatSavePlanner.resolve_data
    calls = [0]

    def flaky(self, item):
        calls[0] += 1
        if rank == 1 and calls[0] > 2:
            raise OSError("No space left on device (simulated)")
        return original(self, item)

    _planner.FlatSavePlanner.resolve_data = flaky
    try:
        with pytest.raises(CheckpointError, match="No space left on device"):
            save_sharded_model(model, path)
    finally:
        _planner.FlatSavePlanner.resolve_data = original
    dist.barrier()
    assert glob.glob(path + ".tmp-*") == []


def first_run(rank, ws, root, which=("gpt2", "llama"), llama_group=1):
    """Train 5 steps, save everything, check in-run round trips, train 5 more (the reference)."""
    data, out = _data(), {}
    if "gpt2" in which:
        m = _wrap(models.gpt2())
        opt = _adamw(m)
        out["gpt2_l1"] = _train(m, opt, data[:STEPS], rank, ws)
        summoned = models.full_params(m)
        sd = full_state_dict(m)
        if rank == 0:
            assert list(sd) == list(summoned)  # keys and order of the plain model, tied names included
            assert all(torch.equal(sd[k], summoned[k]) for k in sd)
            assert sd["lm_head.weight"] is sd["transformer.wte.weight"]
        else:
            assert sd == {}
        out["sd"], out["osd"] = sd, full_optim_state_dict(m, opt)
        save_sharded_model(m, f"{root}/gpt2/model")
        save_sharded_optimizer(m, opt, f"{root}/gpt2/optim")
        # full dict into a fresh sharded model: broadcast from rank 0, and every rank passing it
        every_rank = full_state_dict(m, rank0_only=False)
        for mode in ("rank0", "every"):
            fresh = _wrap(models.gpt2(seed=3))
            load_full_state_dict(fresh, (sd if rank == 0 else None) if mode == "rank0" else every_rank)
            got = models.full_params(fresh)
            assert all(torch.equal(got[k], summoned[k]) for k in summoned), mode
        # sharded reload at the same world size gives identical model and optimizer state
        fresh = _wrap(models.gpt2(seed=3))
        fresh_opt = _adamw(fresh)
        for g in fresh_opt.param_groups:
            g["lr"] = 123.0  # restored from the checkpoint
        load_sharded_model(fresh, f"{root}/gpt2/model")
        load_sharded_optimizer(fresh, fresh_opt, f"{root}/gpt2/optim")
        _assert_same_state(m, opt, fresh, fresh_opt)
        # loading again into an optimizer that has state fills its tensors in place
        before = {id(p): fresh_opt.state[p]["exp_avg"] for p in fresh.parameters()}
        for st in fresh_opt.state.values():
            st["exp_avg"].mul_(2.0)
        load_sharded_optimizer(fresh, fresh_opt, f"{root}/gpt2/optim")
        assert all(fresh_opt.state[p]["exp_avg"] is before[id(p)] for p in fresh.parameters())
        _assert_same_state(m, opt, fresh, fresh_opt)
        # a failed save of changed weights leaves the previous checkpoint as it was
        with fresh.summon_full_params():
            for p in fresh.parameters():
                p.data.add_(1.0)
        _crash_mid_save(rank, fresh, f"{root}/gpt2/model")
        load_sharded_model(fresh, f"{root}/gpt2/model")
        got = models.full_params(fresh)
        assert all(torch.equal(got[k], summoned[k]) for k in summoned)
        with torch.no_grad():
            logits = m(data[0][:2]).logits
        out["logits"] = logits if rank == 0 else None
        out["gpt2_l2"] = _train(m, opt, data[STEPS:], rank, ws)
    if "llama" in which:
        m = _wrap(models.llama(), fsdp_group_size=llama_group)  # hybrid: llama_group ranks per shard group
        opt = _sgd(m)
        out["llama_l1"] = _train(m, opt, data[:STEPS], rank, ws)
        summoned, sd, osd = models.full_params(m), full_state_dict(m), full_optim_state_dict(m, opt)
        if rank == 0:  # with hybrid sharding only rank 0's shard group gathers
            assert list(sd) == list(summoned) and all(torch.equal(sd[k], summoned[k]) for k in sd)
            assert all(st["momentum_buffer"].shape == sd[k].shape for k, st in osd["state"].items())
            assert [g["lr"] for g in osd["param_groups"]] == [0.1, 0.05]
        save_sharded_model(m, f"{root}/llama/model")
        save_sharded_optimizer(m, opt, f"{root}/llama/optim")
        out["llama_l2"] = _train(m, opt, data[STEPS:], rank, ws)
    return out


def resume(rank, ws, root, sd=None, osd=None, which=("gpt2", "llama"), llama_group=None):
    """Fresh models at this world size, loaded from the first run's checkpoints, train 5 more steps."""
    data, out = _data()[STEPS:], {}
    if "gpt2" in which:
        m = _wrap(models.gpt2(seed=5))
        opt = _adamw(m)
        load_sharded_model(m, f"{root}/gpt2/model")
        load_sharded_optimizer(m, opt, f"{root}/gpt2/optim")
        out["gpt2_sharded"] = _train(m, opt, data, rank, ws)
        if sd is not None:
            m = _wrap(models.gpt2(seed=5))
            opt = _adamw(m)
            load_full_state_dict(m, sd if rank == 0 else None)
            load_full_optim_state_dict(m, opt, osd if rank == 0 else None)
            out["gpt2_full"] = _train(m, opt, data, rank, ws)
    if "llama" in which:
        m = _wrap(models.llama(seed=5), fsdp_group_size=llama_group)
        opt = _sgd(m)
        load_sharded_model(m, f"{root}/llama/model")
        load_sharded_optimizer(m, opt, f"{root}/llama/optim")
        out["llama_sharded"] = _train(m, opt, data, rank, ws)
    return out


def _close(a, b, tol=TOL):
    assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= tol, (a, b)


@pytest.fixture(scope="module")
def run2(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt2"))
    return root, spawn(2, first_run, root, timeout_s=300)[0]


@pytest.fixture
def single_rank(tmp_path):
    """A one-rank gloo group in this process (to load checkpoints at world size 1)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg_store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_resume_2_to_3_gpt2_and_hybrid_llama(run2):
    root, ref = run2
    got = spawn(3, resume, root, timeout_s=300)[0]  # (full dicts at another world size: the 2 -> 1 test)
    _close(got["gpt2_sharded"], ref["gpt2_l2"])
    _close(got["llama_sharded"], ref["llama_l2"])


def test_resume_2_to_1_in_process(run2, single_rank):
    root, ref = run2
    got = resume(0, 1, root, ref["sd"], ref["osd"])
    _close(got["gpt2_sharded"], ref["gpt2_l2"])
    _close(got["gpt2_full"], ref["gpt2_l2"])
    _close(got["llama_sharded"], ref["llama_l2"])


def test_hybrid_save_written_by_one_replica(run2):
    root, _ = run2
    meta = json.load(open(f"{root}/llama/model/flatshard.json"))
    assert meta["world_size"] == 2 and meta["shard_size"] == 1
    assert sorted(meta["files"]) == ["__0_0.distcp"]  # replica 1 wrote no tensor data
    data_files = [f for f in os.listdir(f"{root}/llama/model") if f.endswith(".distcp")]
    assert data_files == ["__0_0.distcp"]  # and left no empty file that flatshard.json does not list


def test_full_dicts_work_with_plain_hf_model_and_optimizer(run2, tmp_path):
    from transformers import GPT2LMHeadModel

    _, ref = run2
    plain = models.gpt2(seed=9)
    plain.load_state_dict(ref["sd"], strict=True)
    x = _data()[0][:2]
    with torch.no_grad():
        logits = plain(x).logits
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=1e-5)
    plain.save_pretrained(str(tmp_path / "hf"), state_dict=ref["sd"])
    reloaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"))
    with torch.no_grad():
        assert torch.equal(reloaded(x).logits, logits)
    opt = _adamw(plain)
    opt.load_state_dict(optim_state_dict_to_torch(ref["osd"], plain, opt))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    back = optim_state_dict_from_torch(opt.state_dict(), plain, opt)  # and back to names
    assert list(back["state"]) == list(ref["osd"]["state"])
    assert all(torch.equal(back["state"][n][k], v) for n, st in ref["osd"]["state"].items() for k, v in st.items())
    assert [g["params"] for g in back["param_groups"]] == [g["params"] for g in ref["osd"]["param_groups"]]
    _close(_train(plain, opt, _data()[STEPS:], 0, 1), ref["gpt2_l2"], tol=1e-5)


def test_consolidate_and_inspect_cli(run2, tmp_path, capsys):
    from transformers import GPT2LMHeadModel

    from accel_flatshard.tools.cli import main

    root, ref = run2
    x = _data()[0][:2]
    for max_size, expected in (("5GB", ["model.safetensors"]), ("20KB", None)):
        out = str(tmp_path / f"hf_{max_size}")
        assert main(["consolidate", f"{root}/gpt2/model", out, "--max-shard-size", max_size]) == 0
        files = sorted(f for f in os.listdir(out) if f.startswith("model"))
        if expected:
            assert files == expected
        else:
            assert "model.safetensors.index.json" in files and len(files) > 3
        models.gpt2().config.save_pretrained(out)
        hf = GPT2LMHeadModel.from_pretrained(out)
        with torch.no_grad():
            torch.testing.assert_close(hf(x).logits, ref["logits"], rtol=0, atol=1e-5)
    capsys.readouterr()
    assert main(["inspect", f"{root}/gpt2/model"]) == 0
    text = capsys.readouterr().out
    assert "saved at world size 2" in text and "GPT2LMHeadModel" in text
    assert "transformer.h.0.attn.c_attn.weight" in text and "32x96" in text
    assert main(["inspect", f"{root}/gpt2/optim"]) == 0
    assert "param_groups[1]" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "missing")]) == 1
    assert "does not exist" in capsys.readouterr().err


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_damaged_and_mismatched_checkpoints_raise_clear_errors(run2, single_rank, tmp_path):
    root, _ = run2
    model_dir = f"{root}/gpt2/model"
    m = _wrap(models.gpt2())

    bad = _copy(model_dir, tmp_path / "truncated")
    with open(f"{bad}/__1_0.distcp", "r+b") as f:
        f.truncate(os.path.getsize(f"{bad}/__1_0.distcp") - 100)
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp: size is \d+ bytes, expected \d+ \(truncated"):
        load_sharded_model(m, bad)

    bad = _copy(model_dir, tmp_path / "flipped")
    _flip_byte(f"{bad}/__0_0.distcp", os.path.getsize(f"{bad}/__0_0.distcp") // 2)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: checksum mismatch in bytes"):
        load_sharded_model(m, bad)

    bad = _copy(model_dir, tmp_path / "missing_rank_file")
    os.remove(f"{bad}/__1_0.distcp")
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp: missing"):
        load_sharded_model(m, bad)

    bad = _copy(model_dir, tmp_path / "metadata")
    _flip_byte(f"{bad}/.metadata", 40)
    with pytest.raises(CheckpointError, match=r"\.metadata: checksum mismatch"):
        load_sharded_model(m, bad)

    bad = _copy(model_dir, tmp_path / "no_json")
    os.remove(f"{bad}/flatshard.json")
    with pytest.raises(CheckpointError, match="not a complete accel_flatshard checkpoint"):
        load_sharded_model(m, bad)

    # a crafted .metadata whose checksum was updated too: refused by the allow-list, nothing runs
    bad = _copy(model_dir, tmp_path / "crafted")
    payload = pickle.dumps(_Evil())
    with open(f"{bad}/.metadata", "wb") as f:
        f.write(payload)
    meta = json.load(open(f"{bad}/flatshard.json"))
    meta["dcp_metadata"].update(size=len(payload), crc32=zlib.crc32(payload))
    json.dump(meta, open(f"{bad}/flatshard.json", "w"))
    with pytest.raises(UnsafeCheckpointError, match=r"refusing to load global '(posix|os)\.system'"):
        load_sharded_model(m, bad)
    assert not os.path.exists(_PWNED)

    with pytest.raises(CheckpointError, match="checkpoint of kind 'optimizer', expected kind 'model'"):
        load_sharded_model(m, f"{root}/gpt2/optim")
    llama = _wrap(models.llama())
    with pytest.raises(CheckpointError, match=r"saved from GPT2LMHeadModel, loading into LlamaForCausalLM.*\n.*missing in the checkpoint: \[.*'model\.embed_tokens\.weight'"):
        load_sharded_model(llama, model_dir)
    wide = _wrap(models.gpt2(n_embd=64))
    with pytest.raises(CheckpointError, match=r"transformer\.wte\.weight: checkpoint has shape \(128, 32\) dtype float32, the model expects shape \(128, 64\)"):
        load_sharded_model(wide, model_dir)
    half = _wrap(models.gpt2().to(torch.bfloat16))
    with pytest.raises(CheckpointError, match=r"transformer\.wte\.weight: checkpoint has shape \(128, 32\) dtype float32, the model expects shape \(128, 32\) dtype bfloat16"):
        load_sharded_model(half, model_dir)
    # the optimizer must have the same groups by name
    one_group = torch.optim.AdamW(m.parameters(), lr=1e-3)
    with pytest.raises(CheckpointError, match="checkpoint has 2 optimizer param groups, the optimizer has 1"):
        load_sharded_optimizer(m, one_group, f"{root}/gpt2/optim")
    # full state dicts are validated too
    sd = full_state_dict(m)
    sd.pop("transformer.h.0.ln_1.bias")
    sd["transformer.h.1.mlp.c_fc.weight"] = torch.zeros(3, 3)
    sd["extra.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match=r"(?s)unexpected keys: \['extra\.weight'\].*missing keys: \['transformer\.h\.0\.ln_1\.bias'\].*size mismatch for transformer\.h\.1\.mlp\.c_fc\.weight: checkpoint has shape \(3, 3\), the model expects \(32, 128\)"):
        load_full_state_dict(m, sd)


_PWNED = "/tmp/_flatshard_ckpt_pwned"


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {_PWNED}",))


@pytest.mark.slow
def test_resume_4_to_2_gpt2(tmp_path):
    root = str(tmp_path)
    ref = spawn(4, first_run, root, ("gpt2",), timeout_s=400)[0]
    got = spawn(2, resume, root, ref["sd"], ref["osd"], ("gpt2",), timeout_s=300)[0]
    _close(got["gpt2_sharded"], ref["gpt2_l2"])
    _close(got["gpt2_full"], ref["gpt2_l2"])


@pytest.mark.slow
def test_resume_hybrid_4x2_llama_to_2_3_1(tmp_path):
    root = str(tmp_path)
    ref = spawn(4, first_run, root, ("llama",), 2, timeout_s=400)[0]
    assert sorted(json.load(open(f"{root}/llama/model/flatshard.json"))["files"]) == ["__0_0.distcp", "__1_0.distcp"]
    for ws, group in ((2, None), (3, None), (1, None), (4, 2)):
        got = spawn(ws, resume, root, None, None, ("llama",), group, timeout_s=300)[0]
        _close(got["llama_sharded"], ref["llama_l2"])
