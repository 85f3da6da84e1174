"""The memory planner against the GPU (issue 25): ``accel_flatshard.plan``'s per-rank peak vs ``max_memory_allocated``.

    python benchmarks/gpu_check_plan.py [--out DIR]     # one GPU, ~1 min: emulated W=8 (torch's fake process group)
    python benchmarks/gpu_check_plan.py --device cpu    # CPU smoke of the same code: W=1 gloo, MemTracker, tiny

Each row wraps a model (a Llama with untied head, a GPT-2 with tied head) on the device for its settings,
runs two AdamW steps and measures the second: ``torch.cuda.max_memory_allocated()`` from a peak reset
before it (it counts the shards, optimizer state and inputs allocated earlier, as the planner does); on
CPU torch's dispatch-level MemTracker.  The planner predicts the same step with ``device="cuda"`` (the
host running ahead of the GPU, as the CUDA simulator models it).  Not in the planner: cuBLAS workspaces
and CUDA kernels that save other tensors than the CPU kernels its fake run uses (flash attention, autocast
lists).  PASS when every row is within --tol (default 10%).  Exit status 1 on FAIL.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from accel_flatshard import FullyShardedDataParallel, MixedPrecision  # noqa: E402
from accel_flatshard.core.options import FlatShardOptions  # noqa: E402
from accel_flatshard.plan import Config, Planner  # noqa: E402
from accel_flatshard.core.wrap import checkpoint_units, policy_of  # noqa: E402

BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
ROWS = [("llama", "FULL_SHARD", {}), ("llama", "FULL_SHARD + AC", {"activation_checkpointing": True}),
        ("llama", "bf16", {"mixed_precision": BF16}), ("llama", "SHARD_GRAD_OP", {"reshard_after_forward": False}),
        ("llama", "offload + bf16", {"offload_params": True, "mixed_precision": BF16}), ("gpt2", "FULL_SHARD", {})]


def model(family: str, small: bool):
    import transformers

    transformers.logging.set_verbosity_error()
    layers, hidden, vocab = (2, 64, 256) if small else (8, 1024, 32000)
    if family == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=layers, n_embd=hidden, n_head=max(1, hidden // 64), vocab_size=vocab, n_positions=2048,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=hidden, intermediate_size=hidden * 11 // 4, vocab_size=vocab,
        num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64), tie_word_embeddings=False))


def measured_peak(family: str, opts: FlatShardOptions, device: torch.device, batch: dict, small: bool) -> int:
    # the previous row's wrapped model and optimizer hold reference cycles (hooks, the engine): only a
    # collection frees their device memory, which would otherwise count in this row's peak
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    host = model(family, small)
    wrapped = FullyShardedDataParallel(host, auto_wrap_policy=policy_of(opts, host), device_id=device, options=opts)
    if opts.activation_checkpointing:
        checkpoint_units(wrapped.module, [u.module for u in wrapped.units if not u.is_root])
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-5, foreach=device.type == "cuda")  # (as the planner)
    batch = {k: v.to(device) for k, v in batch.items()}
    tracker = None
    for step in range(2):
        if step == 1 and device.type == "cuda":
            gc.collect()  # (step 0's garbage in cycles, if any)
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        elif step == 1:
            from torch.distributed._tools.mem_tracker import MemTracker

            tracker = MemTracker()
            offload = wrapped.schedule.engine.offload
            tracker.track_external(wrapped, optimizer, *[f.unsharded for f in wrapped.flat_params], *batch.values(),
                                   *(offload.host_buffers if offload else []))
        with tracker if tracker is not None else torch.enable_grad():
            wrapped(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    if tracker is not None:
        peak = max(s["Total"] for s in tracker.get_tracker_snapshot("peak").values())
    else:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    del wrapped, optimizer, host, tracker, batch
    gc.collect()  # freed here, before the next row resets the peak counter
    return peak


def run(device: torch.device, world: int, batch_size: int, seq: int, tol: float) -> bool:
    small, ok = device.type != "cuda", True
    print(f"planner vs measured step peak, W={world}{' (fake process group)' if world > 1 else ''}, "
          f"batch {batch_size} x {seq} per rank, AdamW")
    make_batch = lambda n: {"input_ids": torch.zeros(n, seq, dtype=torch.long),  # noqa: E731
                            "labels": torch.zeros(n, seq, dtype=torch.long)}
    for family, label, knobs in ROWS:
        opts = FlatShardOptions(auto_wrap="transformer", **knobs)

        def build(family=family):
            with torch.device("meta"):
                return model(family, small)
        planner = Planner(build, opts, world, batch_size, make_batch, device.type)  # (AdamW)
        predicted = planner.predict(Config(opts, batch_size))
        real = measured_peak(family, opts, device, make_batch(batch_size), small)
        err = (predicted.peak_bytes - real) / real
        ok &= abs(err) <= tol
        print(f"  {family:5} {label:18} planner {predicted.peak_bytes / 2**20:9.1f} MiB  measured {real / 2**20:9.1f}"
              f" MiB  {err:+.1%}  ({predicted.where})  {'PASS' if abs(err) <= tol else 'FAIL'}", flush=True)
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--part", choices=["plan"], default="plan", help="(the one part: tests/test_gpu_check_smoke.py's form)")
    p.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))  # (for gpu_check.sh; nothing written)
    p.add_argument("--world", type=int, default=8, help="emulated ranks on the GPU (fake process group)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--tol", type=float, default=0.10)
    args = p.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("CUDA is not available", file=sys.stderr)
        return 2
    if cuda:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ok = run(device, args.world if cuda else 1, args.batch if cuda else 2, args.seq if cuda else 16, args.tol)
    finally:
        dist.destroy_process_group()
    print("gpu_check plan:", "PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
