"""One-GPU check of Muon owner-computes (issue 44, ``accel_flatshard/matrix_optim.py``) on the real CUDA path.

A tiny Llama, Muon over its hidden matrices and AdamW over the rest (as torch's docs split them), 10 steps: the
plain model on the GPU against the wrapped one (NCCL, one rank: both exchanges are copies issued on the
"matrix_exchange" side stream, ordered by events).  Twice: as is, and in gpu_check_slow's slow-GPU mode (a spin
queued on the compute stream before every optimizer step and on every side stream before every collective,
ours included), where a missing wait would read a buffer before it is written.  Prints a JSON line per mode
(max |dloss| and max |dparameter| against the plain model, which should be 0) and writes them to ``--out``.

    python benchmarks/gpu_check_muon.py --out muon_gpu.json
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
from accel_flatshard.matrix_optim import hidden_matrices, owner_computes_of  # noqa: E402


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
    p.add_argument("--out", default=None)
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    results = []
    for slow in (False, True):
        plain = models.llama(n_layer=2, hidden=64).to(device)
        expected = train(plain, optimizers(plain), device)
        model = models.llama(n_layer=2, hidden=64).to(device)
        opts = optimizers(model)
        wrapped = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model))
        with slow_gpu(device, enabled=slow):
            got = train(wrapped, opts, device)
        torch.cuda.synchronize()
        owner = owner_computes_of(opts[0])
        with wrapped.summon_full_params():
            ours = {n: p.detach().clone() for n, p in wrapped.module.named_parameters()}
        row = {"slow_gpu": slow, "steps": len(got),
               "max_dloss": max(abs(a - b) for a, b in zip(got, expected)),
               "max_dparam": max((ours[n] - p.detach()).abs().max().item() for n, p in plain.named_parameters()),
               "side_stream": type(owner.streams).__name__, "matrices": len(owner.matrices)}
        print(json.dumps(row), flush=True)
        results.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()
    return 0 if all(r["max_dloss"] == 0 and r["max_dparam"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
