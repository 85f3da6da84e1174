"""bitsandbytes' 8-bit AdamW over sharded parameters (issue 44; ``accel_flatshard/blockwise_optim.py``).

``bnb.optim.AdamW8bit`` over a prepared tiny Llama (hidden 64: its matrices of 4096 elements or more get 8-bit state,
the norms 32-bit; shard boundaries cut some of them) against the same optimizer on DDP:
20 steps, the optimizer state per rank, an exact resume (SHARDED) at the world size of the save and a clear error at
another one.  ``ci``: the FULL_STATE_DICT resume; the Trainer with ``optim="adamw_bnb_8bit"`` launched with the
README yaml, against accelerate's DDP.  Skipped without bitsandbytes (an optional extra: ``pip install accel_flatshard[bnb]``).
"""
from __future__ import annotations

import math
import os

import pytest
import torch

import models
from dist_helpers import spawn

pytest.importorskip("bitsandbytes", reason="bitsandbytes is an optional extra: pip install 'accel_flatshard[bnb]'")

STEPS = 20
LOSS_TOL = 1e-3  # the bound; the measured difference is printed
TABLES = 2 * 256 * 4  # bitsandbytes' two 256-entry fp32 lookup tables (qmap1, qmap2), shared by every parameter
BLOCK = 256


def _model():
    return models.llama(n_layer=2, hidden=64)


def _state_bytes(optimizer) -> int:
    """Unique storages of the optimizer state (the lookup tables, shared by every parameter, once)."""
    seen = {}
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
    return sum(seen.values())


def _precision(optimizer, model) -> dict:
    return {n: str(optimizer.state[p]["state1"].dtype) for n, p in model.named_parameters()}


def _run(rank, world, kind, root=None):
    import bitsandbytes as bnb
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy

    model = _model()
    wrapped = DDP(model) if kind == "ddp" else FullyShardedDataParallel(
        model, auto_wrap_policy=transformer_auto_wrap_policy(model))
    opt = bnb.optim.AdamW8bit(wrapped.parameters(), lr=1e-3)
    losses = models.train(wrapped, models.batches(STEPS, batch=8, seq=8), rank, world, optimizer=opt)
    out = {"losses": losses, "bytes": _state_bytes(opt), "precision": _precision(opt, model)}
    if kind != "ddp":  # blocks of each piece: one process has ceil(numel / 256) per parameter
        layout = {slot.fqn: [flat.layout.shard_pieces(r)[i].length for r in range(world)]
                  for flat in wrapped.flat_params for i, slot in enumerate(flat.layout.slots)}
        out["extra_blocks"] = {fqn: sum(math.ceil(n / BLOCK) for n in lengths) - math.ceil(sum(lengths) / BLOCK)
                               for fqn, lengths in layout.items()}
    return out


def test_adamw8bit_at_w2_equals_ddp_with_each_rank_holding_its_share_of_the_state():
    ddp = spawn(2, _run, "ddp")
    ours = spawn(2, _run, "ours")
    dloss = max(abs(a - b) for a, b in zip(ours[0]["losses"], ddp[0]["losses"]))
    assert dloss <= LOSS_TOL, (ours[0]["losses"], ddp[0]["losses"])
    for r in ours:  # 8-bit state exactly where one process keeps it (bitsandbytes decides by the piece's size)
        assert r["precision"] == ddp[0]["precision"], r["precision"]
    eight_bit = [n for n, d in ddp[0]["precision"].items() if d == "torch.uint8"]
    assert eight_bit == [n for n, p in _model().named_parameters() if p.numel() >= 4096]  # (min_8bit_size)
    # every byte accounted for: DDP's state, plus one more copy of the lookup tables per rank, plus the block
    # scales (8 bytes) of the blocks a shard boundary cuts in two
    extra = sum(n for fqn, n in ours[0]["extra_blocks"].items() if fqn in eight_bit)
    assert sum(r["bytes"] for r in ours) == ddp[0]["bytes"] + TABLES + 8 * extra
    ratios = [r["bytes"] / ddp[0]["bytes"] for r in ours]
    assert max(ratios) <= 0.5 + (TABLES + 8 * extra + 4096) / ddp[0]["bytes"], ratios
    print(f"AdamW8bit W=2: max |dloss| vs DDP {dloss:.2e}; state bytes per rank {[r['bytes'] for r in ours]} vs "
          f"DDP {ddp[0]['bytes']} (ratios {[f'{x:.4f}' for x in ratios]})")


def _resume(rank, world, root, state_dict_type):
    """Through accelerate's save_state / load_state (the README yaml's FSDP keys): the steps after the load are the
    steps after the save."""
    import bitsandbytes as bnb

    for k in [k for k in os.environ if k.startswith(("FSDP_", "FLATSHARD_", "ACCELERATE_"))]:
        del os.environ[k]
    os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_AUTO_WRAP_POLICY="TRANSFORMER_BASED_WRAP",
                      FSDP_TRANSFORMER_CLS_TO_WRAP="LlamaDecoderLayer", FSDP_SYNC_MODULE_STATES="true",
                      FSDP_STATE_DICT_TYPE=state_dict_type)
    from accel_flatshard.integrations.accelerate import Accelerator

    acc = Accelerator()
    model = _model()
    opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    data = models.batches(6, batch=8, seq=8)
    models.train(model, data[:3], rank, world, optimizer=opt)
    acc.save_state(os.path.join(root, state_dict_type))
    after = models.train(model, data[3:], rank, world, optimizer=opt)
    acc.load_state(os.path.join(root, state_dict_type))
    return after, models.train(model, data[3:], rank, world, optimizer=opt)


@pytest.fixture(scope="module")
def sharded_resume(tmp_path_factory):
    root = tmp_path_factory.mktemp("bnb_resume")
    return root, spawn(2, _resume, str(root), "SHARDED_STATE_DICT")


def test_adamw8bit_resume_is_exact_sharded(sharded_resume):
    for after, resumed in sharded_resume[1]:
        assert resumed == after, (resumed, after)


@pytest.mark.ci
def test_adamw8bit_resume_is_exact_full(tmp_path):
    for after, resumed in spawn(2, _resume, str(tmp_path), "FULL_STATE_DICT"):
        assert resumed == after, (resumed, after)


def test_adamw8bit_state_of_a_rank_s_piece_refuses_another_shard_size(sharded_resume, world_of_one):
    """The block scales are state of each rank's piece: a W=2 checkpoint does not load at W=1 (it says why)."""
    import bitsandbytes as bnb

    from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy
    from accel_flatshard.state import CheckpointError, load_sharded_optimizer

    tmp_path = sharded_resume[0]
    model = _model()
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model))
    opt = bnb.optim.AdamW8bit(wrapped.parameters(), lr=1e-3)
    models.train(wrapped, models.batches(1, batch=8, seq=8), optimizer=opt)
    with pytest.raises(CheckpointError, match="absmax1.shard0: state of each rank's piece .* saved with a shard "
                                              "group of 2 ranks: it loads only at that size, not 1"):
        load_sharded_optimizer(wrapped, opt, str(tmp_path / "SHARDED_STATE_DICT" / "optimizer_0"))


@pytest.mark.ci
def test_trainer_adamw_bnb_8bit_under_the_readme_yaml(tmp_path):
    """``TrainingArguments(optim="adamw_bnb_8bit")`` (the Trainer keeps the embeddings' state in 32 bits through
    bitsandbytes' override), launched with accelerate_configs/cpu_2proc.yaml, against accelerate's DDP."""
    from launch_helpers import CPU_FSDP_YAML, SCRIPTS, ddp_config, launch, read_json

    script = SCRIPTS / "trainer_causal_lm.py"
    runs = {}
    for name, config, ddp in (("ddp", ddp_config(tmp_path), True), ("ours", CPU_FSDP_YAML, False)):
        out = tmp_path / name
        launch(config, script, ["--output_dir", str(out / "run"), "--output_json", str(out / "result.json"),
                                "--steps", "8", "--optim", "adamw_bnb_8bit", "--save_steps", "4"],
               via_run=not ddp, ddp=ddp)
        runs[name] = read_json(out / "result.json")
    assert runs["ours"]["local_trainable_numel"][0] < runs["ours"]["total_trainable_numel"]  # sharded
    dloss = max(abs(runs["ours"]["losses"][s] - runs["ddp"]["losses"][s]) for s in runs["ddp"]["losses"])
    assert dloss <= LOSS_TOL, (runs["ours"]["losses"], runs["ddp"]["losses"])
    assert runs["ours"]["checkpoints"] == ["checkpoint-4", "checkpoint-8"]
