"""Micro-benchmark: a LoRA unit's all-gather on gloo, as one point-to-point message per flat parameter and peer
(what the engine sends) against one packed message per peer (the rank's shards copied into one send buffer,
received rank-major and copied out into each flat parameter, as NCCL's packed path does).

    .venv/bin/python benchmarks/packed_gather_bench.py            # llama-40M-lora's block: 3,162,112 + 16,384

Issue 42 asked the LoRA row to be faster than two gathers.  On gloo the engine already posts both flat parameters
in one point-to-point batch, so the one thing packing could still save is a message per peer; this measures what
that single message costs in copies (docs/communication.md has the numbers).
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _exchange(pairs, rank, world):
    """One point-to-point batch: each (send, slots) pair sends ``send`` to every peer and receives into its slot."""
    ops = []
    for send, slots in pairs:
        slots[rank].copy_(send)
        for peer in range(world):
            if peer != rank:
                ops += [dist.P2POp(dist.isend, send, peer=peer, tag=1),
                        dist.P2POp(dist.irecv, slots[peer], peer=peer, tag=1)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _gather_per_flat(outputs, shards, rank, world):
    _exchange([(shard, out.chunk(world)) for out, shard in zip(outputs, shards)], rank, world)


def _gather_packed(outputs, shards, rank, world, gathered):
    _exchange([(torch.cat(shards), gathered)], rank, world)
    start = 0
    for out, shard in zip(outputs, shards):
        out.view(world, -1).copy_(gathered[:, start:start + shard.numel()])
        start += shard.numel()


def _worker(rank, world, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sizes = [args.frozen, args.adapters]
    shards = [torch.randn(n // world) for n in sizes]
    outputs = [torch.empty(n) for n in sizes]
    gathered = torch.empty(world, sum(sizes) // world)
    ways = {"one message per flat parameter and peer (the engine)": lambda: _gather_per_flat(outputs, shards, rank,
                                                                                             world),
            "one packed message per peer, copied out": lambda: _gather_packed(outputs, shards, rank, world, gathered)}
    best = {}
    for _ in range(args.rounds):  # (alternated, the best round of each: the least disturbed by the host)
        for name, gather in ways.items():
            for _ in range(5):
                gather()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.iters):
                gather()
            dist.barrier()
            best[name] = min(best.get(name, float("inf")), (time.perf_counter() - start) / args.iters * 1e3)
    if rank == 0:
        base = next(iter(best.values()))
        print(f"W={world}, flat parameters of {args.frozen:,} and {args.adapters:,} fp32 elements")
        print(f"{'way':<56} {'ms / gather':>12} {'vs engine':>10}")
        for name, ms in best.items():
            print(f"{name:<56} {ms:>12.2f} {ms / base:>9.2f}x")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--frozen", type=int, default=3_162_112, help="frozen flat parameter's elements (a multiple of W)")
    p.add_argument("--adapters", type=int, default=16_384, help="trainable flat parameter's elements")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--port", type=int, default=29617)
    args = p.parse_args()
    mp.spawn(_worker, args=(args.world_size, args), nprocs=args.world_size)


if __name__ == "__main__":
    main()
