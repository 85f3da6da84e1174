"""One-GPU check of Muon owner-computes (issue 44, ``accel_flatshard/features/matrix_optim.py``) on the real CUDA path.

A tiny Llama, Muon over its hidden matrices and AdamW over the rest (as torch's docs split them), 10 steps: the
plain model on the GPU against the wrapped one (NCCL, one rank: both exchanges are copies issued on the
"matrix_exchange" side stream, ordered by events).  Twice: as is, and in gpu_check_slow's slow-GPU mode (a spin
queued on the compute stream before every optimizer step and on every side stream before every collective,
ours included), where a missing wait would read a buffer before it is written.  Prints one indented check line per
mode (max |dloss| and max |dparameter| against the plain model, which should be 0; gpu_check_report.py keeps the
indented lines for the summary) and the verdict, and writes the rows to ``muon.json`` in ``--out`` (a folder, as
benchmarks/gpu_check.sh passes it; the ``muon`` part there).  ``--device cpu``: the same code on gloo and the host
adapter (the CPU smoke of gpu_check.sh, tests/test_gpu_check_smoke.py).

    python benchmarks/gpu_check_muon.py --out OUT_DIR [--device cpu]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, HERE)

import models  # noqa: E402  (tests/models.py)
from gpu_check_slow import lag, slow_gpu  # noqa: E402

from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy  # noqa: E402
from accel_flatshard.features.matrix_optim import hidden_matrices, owner_computes_of  # noqa: E402


def optimizers(model: torch.nn.Module) -> list:
    matrices, rest = hidden_matrices(model)
    return [torch.optim.Muon(matrices, lr=0.02, weight_decay=0.1), torch.optim.AdamW(rest, lr=1e-2)]


def train(model: torch.nn.Module, opts: list, device: torch.device) -> list:
    losses = []
    for x in models.batches(10, batch=8, seq=16):
        x = x.to(device)
        loss = model(x, labels=x).loss
        loss.backward()
        lag()
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad()
        losses.append(loss.detach())
    return [v.item() for v in losses]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None, help="a folder: muon.json goes there")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    if args.device == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=0, world_size=1)
    results = []
    for slow in (False, True):
        plain = models.llama(n_layer=2, hidden=64).to(device)
        expected = train(plain, optimizers(plain), device)
        model = models.llama(n_layer=2, hidden=64).to(device)
        opts = optimizers(model)
        wrapped = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model))
        with slow_gpu(device, enabled=slow):
            got = train(wrapped, opts, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        owner = owner_computes_of(opts[0])
        with wrapped.summon_full_params():
            ours = {n: p.detach().clone() for n, p in wrapped.module.named_parameters()}
        row = {"slow_gpu": slow, "steps": len(got),
               "max_dloss": max(abs(a - b) for a, b in zip(got, expected)),
               "max_dparam": max((ours[n] - p.detach()).abs().max().item() for n, p in plain.named_parameters()),
               "side_stream": type(owner.streams).__name__, "matrices": len(owner.matrices)}
        print(f"  muon {'slow-GPU mode' if slow else 'as is'}: {row['steps']} steps, {row['matrices']} matrices on "
              f"{row['side_stream']}: max|dloss| {row['max_dloss']:.1e}, max|dparam| {row['max_dparam']:.1e} "
              f"(vs the plain model; 0 expected)", flush=True)
        results.append(row)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "muon.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()
    ok = all(r["max_dloss"] == 0 and r["max_dparam"] == 0 for r in results)
    print(f"gpu_check muon: {'PASS' if ok else 'FAIL'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
