"""QLoRA under sharding (issue 44; ``accel_flatshard/integrations/bitsandbytes_shards.py``): a 4-bit base (nf4, ``bnb_4bit_quant_storage``
bf16, so the packed weights shard as bf16 with the other frozen parameters) with PEFT LoRA adapters on every linear
layer of a tiny Llama, loaded with ``from_pretrained`` from a directory this file writes (no hub).

Default: W=2 through ``accelerator.prepare`` (bf16 mixed precision) against one process on the global batch (in the
same rank, the same threads: accelerate sets its own): 10 steps, max |dloss| <= 5e-4; a ``save_state`` after step 5
and ``load_state`` give the same steps 6-10; the adapter saved from the sharded model (``save_pretrained`` with
``accelerator.get_state_dict``) loads into a fresh 4-bit base and gives the sharded model's logits, and merges into a
bf16 base.  ``ci``: the Trainer (``bf16=True``) under the README yaml's FSDP keys, with a checkpoint and a resume.
Skipped without bitsandbytes (``pip install accel_flatshard[bnb]``).
"""
from __future__ import annotations

import os

import pytest
import torch

import models
from dist_helpers import spawn, trainer_args, trainer_run_and_resume

pytest.importorskip("bitsandbytes", reason="bitsandbytes is an optional extra: pip install 'accel_flatshard[bnb]'")
pytest.importorskip("peft")

STEPS, SAVE_AFTER = 10, 5
LOSS_TOL = 5e-4  # the bound in bf16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny Llama's weights on disk (hidden 64: its 4096-element matrices quantize in 64-element blocks)."""
    path = tmp_path_factory.mktemp("qlora_base")
    models.llama(n_layer=2, hidden=64).save_pretrained(path)
    return str(path)


def load_qlora(base: str, adapter: str = None):
    """The 4-bit base with fresh LoRA adapters (seeded), or the adapter saved in ``adapter``; in training mode."""
    import transformers
    from peft import LoraConfig, PeftModel, get_peft_model

    transformers.logging.set_verbosity_error()
    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                            bnb_4bit_compute_dtype=torch.bfloat16,
                                            bnb_4bit_quant_storage=torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, quantization_config=quant, dtype=torch.bfloat16)
    torch.manual_seed(0)
    if adapter is not None:
        return PeftModel.from_pretrained(model, adapter)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0))
    model.train()
    return model


def _fsdp_env(mixed_precision="bf16"):
    for k in [k for k in os.environ if k.startswith(("FSDP_", "FLATSHARD_", "ACCELERATE_"))]:
        del os.environ[k]
    os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_AUTO_WRAP_POLICY="TRANSFORMER_BASED_WRAP",
                      FSDP_TRANSFORMER_CLS_TO_WRAP="LlamaDecoderLayer", FSDP_SYNC_MODULE_STATES="true",
                      FSDP_STATE_DICT_TYPE="SHARDED_STATE_DICT", ACCELERATE_MIXED_PRECISION=mixed_precision)


def _data():
    return models.batches(STEPS, batch=8, seq=8)


def _qlora_run(rank, world, base, root):
    _fsdp_env()
    from accel_flatshard.integrations.accelerate import Accelerator

    acc = Accelerator()
    torch.set_num_threads(1)  # (accelerate set its own count; the reference runs with the same)
    single = None
    if rank == 0:  # one process, the global batch, bf16 autocast as accelerate's mixed precision
        model = load_qlora(base)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        single = []
        for x in _data():
            with torch.autocast("cpu", torch.bfloat16):
                loss = model(x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            single.append(loss.item())
    model = load_qlora(base)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    storage = {str(p.dtype) for n, p in model.named_parameters() if not p.requires_grad}
    model, opt = acc.prepare(model, opt)

    def step(x):
        local = x.chunk(world)[rank]
        loss = model(local, labels=local).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        return acc.reduce(loss.detach().float(), "mean").item()

    losses = []
    for i, x in enumerate(_data()):
        if i == SAVE_AFTER:
            acc.save_state(os.path.join(root, "state"))
        losses.append(step(x))
    probe = torch.arange(16).unsqueeze(0) + 3
    model.eval()
    with torch.no_grad():
        logits = model(probe).logits.float()
    model.train()
    unwrapped = acc.unwrap_model(model)
    unwrapped.save_pretrained(os.path.join(root, "adapter"), is_main_process=acc.is_main_process,
                              save_function=acc.save, state_dict=acc.get_state_dict(model))
    acc.wait_for_everyone()
    acc.load_state(os.path.join(root, "state"))
    resumed = [step(x) for x in _data()[SAVE_AFTER:]]
    sharded = type(model).__name__ == "FullyShardedDataParallel" and sum(
        p.numel() for p in model.parameters()) < sum(p.numel() for p in load_qlora(base).parameters())
    return {"single": single, "losses": losses, "resumed": resumed, "logits": logits, "storage": storage,
            "sharded": sharded, "registered": sorted({type(p).__name__ for p in unwrapped.parameters()})}


def test_qlora_at_w2_equals_one_process_resumes_and_saves_a_mergeable_adapter(base_dir, tmp_path):
    results = spawn(2, _qlora_run, base_dir, str(tmp_path))
    ours = results[0]
    assert all(r["sharded"] for r in results)
    assert ours["storage"] == {"torch.bfloat16"}  # the 4-bit weights are sharded as their storage dtype
    assert "Params4bit" in ours["registered"]  # the sharded parameters stay registered after forwards
    dloss = max(abs(a - b) for a, b in zip(ours["losses"], ours["single"]))
    assert dloss <= LOSS_TOL, (ours["losses"], ours["single"])
    assert ours["resumed"] == ours["losses"][SAVE_AFTER:], (ours["resumed"], ours["losses"][SAVE_AFTER:])
    # the adapter, in one process: into a fresh 4-bit base it gives the sharded model's logits; it merges into bf16
    adapted = load_qlora(base_dir, str(tmp_path / "adapter")).eval()
    probe = torch.arange(16).unsqueeze(0) + 3
    for module in adapted.modules():  # (bitsandbytes' CPU packing path in evaluation: the sharded model has it off)
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    with torch.no_grad():
        logits = adapted(probe).logits.float()
    torch.testing.assert_close(logits, ours["logits"], rtol=0, atol=2e-2)
    import transformers
    from peft import PeftModel

    bf16 = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16)
    merged = PeftModel.from_pretrained(bf16, str(tmp_path / "adapter")).merge_and_unload()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        merged_logits = merged(probe).logits.float()
    assert (merged_logits - logits).abs().max().item() < 0.5  # (bf16 base vs its 4-bit quantization)
    print(f"QLoRA W=2: max |dloss| vs one process {dloss:.2e}; sharded vs one-process adapter logits "
          f"{(logits - ours['logits']).abs().max().item():.2e}")


def _trainer(rank, world, base, root):
    """The Trainer (bf16) on the QLoRA model, a checkpoint at step 4, a resume from it."""
    import datasets
    import transformers

    _fsdp_env("no")
    from accel_flatshard import register

    register()
    datasets.disable_progress_bars()
    ids = torch.cat(_data())
    ds = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()}).with_format("torch")

    def make_trainer(out):
        torch.set_num_threads(1)  # (the Trainer's Accelerator of the run before set its own count)
        args = trainer_args(out, world, learning_rate=1e-3, bf16=True)
        return transformers.Trainer(model=load_qlora(base), args=args, train_dataset=ds)

    return trainer_run_and_resume(make_trainer, root)


@pytest.mark.ci
def test_qlora_trainer_path_trains_sharded_and_resumes(base_dir, tmp_path):
    losses, resumed, sharded = spawn(2, _trainer, base_dir, str(tmp_path))[0]
    assert sharded
    assert all(abs(resumed[s] - losses[s]) <= 1e-4 for s in resumed), (resumed, losses)
