"""Single-process micro-benchmark of the int8 math (core/int8.py) on one core: what one rank's quantize /
dequantize / sum costs per step at a realistic shard size.  Seconds to run; no collectives.  The "step" rows add
them up for a unit resharded after forward (float32 compute): two gathers and one reduction.

    PYTHONPATH=. python benchmarks/int8_micro.py [--numel 13500000] [--block 256] [--world 2] [--repeats 5]
"""
from __future__ import annotations

import argparse
import time

import torch

from accel_flatshard.core.int8 import (dequantize_blocks, quantize_blocks, quantize_for_reduction, shard_blocks,
                                       sum_dequantized)


def best_ms(fn, repeats: int) -> float:
    fn()  # (warm-up: first-touch page faults of new buffers)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=13_500_000, help="elements of one rank's shard")
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--world", type=int, default=2, help="W: gathered rows / reduction sources")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    n, block, world = args.numel, args.block, args.world
    shard = torch.randn(n)
    full_grad = torch.randn(world * n)
    q, scales = quantize_blocks(shard, block, "bench")
    gathered_q, gathered_scales = q.repeat(world).view(world, n), scales.repeat(world).view(world, -1)
    out_fp32 = torch.empty(world * n)
    out_bf16 = torch.empty(world * n, dtype=torch.bfloat16)
    sum_out = torch.empty(n)
    rows = {
        "quantize shard (fp32)": lambda: quantize_blocks(shard, block, "bench"),
        f"dequantize W={world} shards -> fp32": lambda: dequantize_blocks(gathered_q, gathered_scales, block,
                                                                          out=out_fp32),
        f"dequantize W={world} shards -> bf16": lambda: dequantize_blocks(gathered_q, gathered_scales, block,
                                                                          out=out_bf16),
        f"quantize_for_reduction W={world}": lambda: quantize_for_reduction(full_grad, world, block, "bench"),
        f"sum_dequantized W={world}": lambda: sum_dequantized(gathered_q, gathered_scales, block, sum_out),
    }
    timings = {name: best_ms(fn, args.repeats) for name, fn in rows.items()}
    quantize, dequantize = timings["quantize shard (fp32)"], timings[f"dequantize W={world} shards -> fp32"]
    reduction = timings[f"quantize_for_reduction W={world}"] + timings[f"sum_dequantized W={world}"]
    # one step of a unit resharded after forward: a forward and a backward gather, one reduction
    timings["step: quantizing again in backward"] = 2 * (quantize + dequantize) + reduction
    timings["step: backward reuses forward codes"] = quantize + 2 * dequantize + reduction
    print(f"shard {n} elements, block {block} ({shard_blocks(n, block)} blocks), W={world}, 1 thread, "
          f"best of {args.repeats}")
    for name, ms in timings.items():
        print(f"  {name:38s} {ms:8.1f} ms")


if __name__ == "__main__":
    main()
