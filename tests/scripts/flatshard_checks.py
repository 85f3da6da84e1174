"""Error cases and fp16 loss scaling of accel_flatshard's Accelerator, in one launch.

Launched by tests/test_accelerate_errors.py with a yaml that asks for ``fsdp_version: 2`` (FSDP2 keys),
``mixed_precision: fp16`` and a layer class list naming a class GPT-2 does not have.  Each check
records the error message it got; the main process writes them to ``--output_json``.
"""
import argparse
import dataclasses
import json
import os

import torch
import torch.distributed as dist
import transformers

from accel_flatshard import FullyShardedDataParallel
from accel_flatshard.integrations.accelerate import Accelerator


def gpt2(seed=0):
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))


def expect_error(results, name, fn, exc=Exception):
    try:
        fn()
    except exc as e:  # noqa: BLE001 - recording the message is the point
        results[name] = f"{type(e).__name__}: {e}"
        return
    raise AssertionError(f"{name}: no error raised")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--output_json", required=True)
    args = p.parse_args()
    results = {}

    # 1. the yaml says fsdp_version: 2 (accepted, mapped to accel_flatshard); an unknown version is refused
    assert os.environ.get("FSDP_VERSION") == "2", os.environ.get("FSDP_VERSION")
    os.environ["FSDP_VERSION"] = "3"
    expect_error(results, "fsdp_version_3", Accelerator, ValueError)
    os.environ["FSDP_VERSION"] = "2"

    # 2. a misspelt FLATSHARD_* variable
    os.environ["FLATSHARD_GROUPSIZE"] = "2"
    expect_error(results, "unknown_env", Accelerator, ValueError)
    del os.environ["FLATSHARD_GROUPSIZE"]

    accelerator = Accelerator()
    results["distributed_type"] = str(accelerator.distributed_type)
    results["mixed_precision"] = accelerator.mixed_precision
    results["scaler"] = type(accelerator.scaler).__name__

    # 3. the yaml names a layer class the model does not have (GPT2Block,NoSuchBlock)
    expect_error(results, "unknown_layer_class", lambda: accelerator.prepare(gpt2()), ValueError)
    accelerator.flatshard_options = dataclasses.replace(accelerator.flatshard_options, layer_cls_names=["GPT2Block"])

    # 4. models wrapped by torch DDP / torch fully_shard (torch FSDP1 refuses to build on CPU; its
    #    isinstance check is covered by test_accelerate_config.py)
    expect_error(results, "torch_ddp", lambda: accelerator.prepare(torch.nn.parallel.DistributedDataParallel(gpt2())),
                 ValueError)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fsdp2_model = gpt2()
    fully_shard(fsdp2_model, mesh=init_device_mesh("cpu", (accelerator.num_processes,)))
    expect_error(results, "torch_fsdp2", lambda: accelerator.prepare(fsdp2_model), ValueError)

    # 5. a model whose ranks > 0 hold meta tensors (what cpu_ram_efficient_loading gives): rank 0's
    #    values must arrive everywhere; the optimizer made before prepare keeps working
    rank = accelerator.process_index
    if rank == 0:
        model = gpt2()
        initial = {k: v.clone() for k, v in model.state_dict().items()}
    else:
        with torch.device("meta"):
            model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert isinstance(model, FullyShardedDataParallel)
    full = accelerator.get_state_dict(model)
    if rank == 0:
        results["meta_rank1_synced"] = all(torch.equal(full[k], initial[k]) for k in initial)
    else:
        assert full == {}
    assert not any(p.is_meta for p in model.parameters())

    # 6. a second model is sharded too (its own wrapper)
    second = accelerator.prepare(gpt2(1))
    results["two_models"] = isinstance(second, FullyShardedDataParallel) and second is not model

    # 7. fp16: scaled backward, then an inf in rank 1's gradient shard only must skip the step on both ranks
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 128, (4, 16), generator=g) for _ in range(4)]
    skipped, scales, losses = [], [], []
    for step, x in enumerate(batches):
        x = x.chunk(accelerator.num_processes)[rank]
        loss = model(input_ids=x, labels=x).loss
        accelerator.backward(loss)
        if step == 1 and rank == 1:
            p_ = next(p for p in model.parameters() if p.grad is not None and p.grad.numel() > 0)
            p_.grad.view(-1)[0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        changed = any(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
        skipped.append(bool(accelerator.optimizer_step_was_skipped))
        results.setdefault(f"changed_rank{rank}", []).append(changed)
        scales.append(float(accelerator.scaler.get_scale()))
        losses.append(float(loss.detach()))
    flags = [None] * accelerator.num_processes
    dist.all_gather_object(flags, (skipped, results[f"changed_rank{rank}"], scales))
    results["fp16"] = {"per_rank": flags, "losses_rank0": losses}

    # 8. unwrap_model gives the user's class; clip_grad_value_ works on shards
    results["unwrapped_class"] = type(accelerator.unwrap_model(model)).__name__
    x = batches[0].chunk(accelerator.num_processes)[rank]
    accelerator.backward(model(input_ids=x, labels=x).loss)
    accelerator.clip_grad_value_(model.parameters(), 1e-4)
    results[f"max_grad_after_clip_value_rank{rank}"] = max(
        float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None and p.grad.numel())

    if accelerator.is_main_process:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroy the process group before exit


if __name__ == "__main__":
    main()
