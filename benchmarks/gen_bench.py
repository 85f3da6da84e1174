"""Generation benchmark: greedy decoding through a sharded model, per generation mode, vs DDP.

    .venv/bin/python benchmarks/gen_bench.py                 # (make bench-gen) W=2, CPU/gloo, ~2-4 min idle
    .venv/bin/python benchmarks/gen_bench.py --repeats 5 --new-tokens 32 --layers 8

Model (issue 16): Llama, 8 layers, hidden 512, intermediate 1408, 8 heads, vocab 4000, untied head; greedy
``--new-tokens`` (32) for a batch of 2 prompts of 16 tokens per rank.  Every rank builds the same weights;
the rows run INTERLEAVED (repeat r of every row, a barrier before each), so ratios come from one run
under the same machine load.  Rows:

* ``ddp``: torch DDP, ``ddp.module.generate`` (no collective during generation);
* ``full`` / ``budget50`` / ``per_unit``: ``unwrap_model``-style ``wrapped.module.generate`` in that
  generation mode (``budget50``: a budget of half the gathered model);
* ``summon``: ``generate`` inside ``summon_full_params(writeback=False)`` (TRL's seam; master dtype).

Reported: median generation time (slowest rank) and its paired ratio to DDP; all-gathers per generate;
the most gathered bytes held at once (measured at every unit's forward; DDP: the whole model, always
held) plus this rank's shards; and a GRPO-like step (generate, then forward+backward of prompt+completion,
AdamW step) time vs DDP's.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROWS = ("ddp", "full", "budget50", "per_unit", "summon")


def build_model(layers: int):
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=512, intermediate_size=1408,
                                      num_attention_heads=8, num_key_value_heads=8, vocab_size=4000,
                                      max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(config)


def worker(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy
    from accel_flatshard.features.generation import set_generation_options, unit_bytes

    ddp = torch.nn.parallel.DistributedDataParallel(build_model(args.layers))
    model = build_model(args.layers)
    ours = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model))
    total = sum(unit_bytes(u) for u in ours.units)
    counter = {"n": 0}
    group_all_gather = ours.shard_group.all_gather

    def counting(*a, **k):
        counter["n"] += 1
        return group_all_gather(*a, **k)

    ours.shard_group.all_gather = counting
    held = {"peak": 0}

    def note(*_):
        held["peak"] = max(held["peak"], sum(f.unsharded.untyped_storage().nbytes() for f in ours.flat_params))

    for unit in ours.units:
        unit.module.register_forward_pre_hook(note)
        unit.module.register_forward_hook(note)
    g = torch.Generator().manual_seed(rank)
    prompts = torch.randint(3, 4000, (2, 16), generator=g)
    kw = dict(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    options = {"full": dict(generation_mode="full"), "budget50": dict(generation_mode="budget", generation_budget_mb=total // 2 / 2**20),
               "per_unit": dict(generation_mode="per_unit"), "summon": dict(generation_mode="budget", generation_budget_mb=None)}
    opt_ddp = torch.optim.AdamW(ddp.parameters(), lr=1e-5)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-5)

    def generate(row: str) -> torch.Tensor:
        if row == "ddp":
            return ddp.module.generate(prompts, **kw)
        set_generation_options(ours, **options[row])
        if row == "summon":
            with ours.summon_full_params(writeback=False):
                return ours.module.generate(prompts, **kw)
        return ours.module.generate(prompts, **kw)

    times: Dict[str, List[float]] = {r: [] for r in ROWS}
    grpo: Dict[str, List[float]] = {"ddp": [], "full": []}
    gathers, peaks, tokens = {}, {}, {}
    import warnings

    warnings.simplefilter("ignore")
    for rep in range(args.repeats + 1):  # the first repeat warms up
        order = ROWS[rep % len(ROWS):] + ROWS[: rep % len(ROWS)]
        for row in order:
            dist.barrier()
            counter["n"], held["peak"] = 0, 0
            t0 = time.perf_counter()
            with torch.no_grad():
                out = generate(row)
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if rep:
                times[row].append(dt.item())
            gathers[row], peaks[row], tokens[row] = counter["n"], held["peak"], out
        for row in ("ddp", "full"):  # a GRPO-like step: generate, then train on prompt + completion
            dist.barrier()
            model_, opt = (ddp, opt_ddp) if row == "ddp" else (ours, opt_ours)
            t0 = time.perf_counter()
            with torch.no_grad():
                seq = generate(row)
            loss = model_(input_ids=seq, labels=seq).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if rep:
                grpo[row].append(dt.item())
    same = all(torch.equal(tokens[r], tokens["ddp"]) for r in ROWS)
    if rank == 0:
        shard = sum(f.local_shard.numel() * f.local_shard.element_size() for f in ours.flat_params)
        ddp_t = statistics.median(times["ddp"])
        print(f"\ngen_bench: W={world}, {args.layers}-layer Llama h512 v4000 untied, batch 2 x 16 prompt tokens, "
              f"{args.new_tokens} new tokens greedy, {args.repeats} repeats; load avg at end "
              f"{os.getloadavg()[0]:.2f}; gathered model {total / 2**20:.1f} MiB; tokens equal DDP in every row: {same}")
        print(f"{'row':10} {'gen s (median)':>15} {'vs DDP':>8} {'gathers/gen':>12} {'peak gathered MiB':>18} "
              f"{'+ shards MiB':>13}")
        for row in ROWS:
            t = statistics.median(times[row])
            ratio = statistics.median(a / b for a, b in zip(times[row], times["ddp"]))
            # DDP holds the whole model always; a summon holds it in master dtype (its forwards run no unit hook)
            peak = total if row == "ddp" else sum(unit_bytes(u, master=True) for u in ours.units) if row == "summon" else peaks[row]
            print(f"{row:10} {t:15.3f} {ratio:7.2f}x {gathers[row] if row != 'ddp' else 0:12d} "
                  f"{peak / 2**20:18.1f} {0 if row == 'ddp' else shard / 2**20:13.1f}")
        g_ratio = statistics.median(a / b for a, b in zip(grpo["full"], grpo["ddp"]))
        print(f"GRPO-like step (generate + fwd/bwd + AdamW): DDP {statistics.median(grpo['ddp']):.3f} s, "
              f"ours (gather-once) {statistics.median(grpo['full']):.3f} s: {g_ratio:.2f}x  (DDP time {ddp_t:.3f} s/gen)")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(args.world_size, port, args), nprocs=args.world_size, start_method="spawn")


if __name__ == "__main__":
    main()
