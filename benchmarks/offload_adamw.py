"""Host AdamW step time for CPU offload (issue 17): torch's for-loop, foreach and fused variants on CPU.

With ``fsdp_offload_params: true`` the optimizer steps on the host shards.  This measures the three
implementations torch offers on CPU tensors on one flat shard split into parameter views (the shapes of
Llama blocks), checks that each gives the for-loop's result (max difference in ulps after ``--steps``
steps), and prints a table.  Optionally (``--device cuda``) the same step on the GPU without offload.

    python benchmarks/offload_adamw.py --numel 40_000_000 --steps 5
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Dict, List

import torch


def _params(numel: int, device: str, seed: int = 0) -> List[torch.nn.Parameter]:
    """``numel`` elements as views of one flat buffer, cut like a Llama block (4 square, 3 MLP, 2 norms)."""
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(numel, generator=g).to(device)
    h = int((numel / 13) ** 0.5)  # 4 h*h + 3 h*(2.25h) ~ 13 h^2
    sizes = [h * h] * 4 + [h * (9 * h // 4)] * 3 + [h, h]
    sizes.append(numel - sum(sizes))
    return [torch.nn.Parameter(v) for v in torch.split(flat, sizes)]


def _grads(params: List[torch.nn.Parameter], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.device) * 1e-2


def run(variant: str, numel: int, steps: int, device: str) -> Dict[str, object]:
    params = _params(numel, device)
    kwargs = {"for-loop": dict(foreach=False, fused=False), "foreach": dict(foreach=True, fused=False),
              "fused": dict(fused=True)}[variant]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, **kwargs)
    times = []
    for step in range(steps):
        _grads(params, step)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    result = torch.cat([p.detach().reshape(-1).cpu() for p in params])
    return {"variant": variant, "device": device, "step_ms": 1000 * min(times[1:] or times), "result": result}


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between a and b in fp32 units in the last place."""
    ia, ib = a.view(torch.int32).long(), b.view(torch.int32).long()
    # map the sign-magnitude bit patterns onto a monotone integer line
    ia = torch.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int((ia - ib).abs().max())


def main(argv=None) -> List[Dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=40_000_000)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="also time the step on this device without offload")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [run(v, args.numel, args.steps, "cpu") for v in ("for-loop", "foreach", "fused")]
    reference = rows[0]["result"]
    for row in rows:
        row["max_ulps_vs_for_loop"] = ulps(row["result"], reference)
        # ulps explode for values next to zero: also the absolute difference and the ulps where |p| >= 1e-3
        big = reference.abs() >= 1e-3
        row["max_ulps_where_abs_ge_1e-3"] = ulps(row["result"][big], reference[big])
        row["max_abs_diff"] = float((row["result"] - reference).abs().max())
        row["differing"] = int((row["result"] != reference).sum())
    if args.device != "cpu":
        rows.append(run("fused", args.numel, args.steps, args.device))
        rows[-1]["max_ulps_vs_for_loop"] = ulps(rows[-1]["result"], reference)
        rows[-1].update(max_abs_diff=float((rows[-1]["result"] - reference).abs().max()),
                        differing=int((rows[-1]["result"] != reference).sum()), **{"max_ulps_where_abs_ge_1e-3": -1})
    for row in rows:
        del row["result"]
    print(f"AdamW step, {args.numel / 1e6:.0f}M parameters, {torch.get_num_threads()} threads")
    print("| variant | device | step (ms) | max ulps vs for-loop | ulps where abs >= 1e-3 | max abs diff | elements differing |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['variant']} | {row['device']} | {row['step_ms']:.1f} | {row['max_ulps_vs_for_loop']} | "
              f"{row['max_ulps_where_abs_ge_1e-3']} | {row['max_abs_diff']:.1e} | {row['differing']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
