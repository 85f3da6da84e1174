"""Peak host memory per rank while wrapping a ~150M-parameter GPT-2: eager (full model on every rank)
versus meta-device construction materialised unit by unit.  Prints a markdown table.

    .venv/bin/python benchmarks/init_memory.py [--layers 12 --hidden 1024 --world-size 2]
"""
from __future__ import annotations

import argparse
import os
import resource
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _build(args, meta: bool):
    from transformers import GPT2Config, GPT2LMHeadModel
    import transformers

    transformers.logging.set_verbosity_error()
    config = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=16, vocab_size=50257, n_positions=1024)
    if meta:
        with torch.device("meta"):
            return GPT2LMHeadModel(config)
    return GPT2LMHeadModel(config)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _worker(rank, world_size, port, args, mode, queue):
    from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    base = _rss_mib()
    start = time.perf_counter()
    model = _build(args, meta=(mode == "meta"))
    n_params = sum(p.numel() for p in model.parameters())
    init_fn = None
    if mode == "meta":
        def init_fn(module):
            module.to_empty(device="cpu", recurse=False)
            model._init_weights(module)
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model),
                                       param_init_fn=init_fn, sync_module_states=(mode != "meta"))
    elapsed = time.perf_counter() - start
    queue.put((mode, rank, n_params, _rss_mib() - base, base, elapsed, wrapped.sharded_bytes() / 2**20))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    for mode in ("eager", "meta"):
        queue = ctx.Queue()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [ctx.Process(target=_worker, args=(r, args.world_size, port, args, mode, queue))
                 for r in range(args.world_size)]
        for p in procs:
            p.start()
        rows += [queue.get() for _ in procs]
        for p in procs:
            p.join()
    rows.sort()
    eager_peak = max(r[3] for r in rows if r[0] == "eager")
    print(f"GPT-2 {rows[0][2] / 1e6:.0f}M params, W={args.world_size}, fp32 model = {rows[0][2] * 4 / 2**20:.0f} MiB\n")
    print("| init | rank | peak RSS growth while building+wrapping (MiB) | vs eager | shard+grad bytes (MiB) | time (s) |")
    print("|---|---|---|---|---|---|")
    for mode, rank, _, peak, _, elapsed, shard in rows:
        print(f"| {mode} | {rank} | {peak:.0f} | {peak / eager_peak:.2f}x | {shard:.0f} | {elapsed:.1f} |")


if __name__ == "__main__":
    main()
