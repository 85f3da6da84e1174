"""Checkpoint save/load time and memory: full (gathered to rank 0, safetensors) vs sharded (DCP).

Builds a GPT-2 of about 150M parameters (n_embd=1024, n_layer=12), wraps it on W gloo ranks (CPU),
runs one tiny training step so AdamW has state, then times on every rank:

* full model:   full_state_dict + safetensors save_file on rank 0 / load_file on rank 0 + load_full_state_dict
* sharded model: save_sharded_model / load_sharded_model
* full optim:   full_optim_state_dict + torch.save on rank 0 / torch.load(weights_only) + load_full_optim_state_dict
* sharded optim: save_sharded_optimizer / load_sharded_optimizer

Peak RSS is sampled every 2 ms by a thread during each operation and reported above the RSS just
before it (after ``malloc_trim`` so memory freed by earlier operations does not hide growth), plus
the process's lifetime maximum (ru_maxrss; sharded operations run first).  Prints a markdown table.

    python benchmarks/checkpoint_bench.py [--world-size 2] [--n-embd 1024] [--n-layer 12] [--dir /tmp/ckpt_bench]
"""
from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _trim() -> None:
    """Return freed heap memory to the OS (glibc), so an operation's RSS growth is not hidden by
    memory that an earlier operation freed."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _PeakRSS:
    def __enter__(self):
        self.base = _rss_mb()
        self.peak = self.base
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self.t0 = time.perf_counter()
        return self

    def _run(self):
        while not self._stop:
            self.peak = max(self.peak, _rss_mb())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        self._stop = True
        self._thread.join()
        self.peak = max(self.peak, _rss_mb())


def _dir_mb(path: str) -> float:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total / 2**20


def _worker(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from safetensors.torch import load_file, save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy
    from accel_flatshard.state import (full_optim_state_dict, full_state_dict, load_full_optim_state_dict,
                                       load_full_state_dict, load_sharded_model, load_sharded_optimizer,
                                       save_sharded_model, save_sharded_optimizer)

    torch.manual_seed(0)
    config = GPT2Config(n_embd=args.n_embd, n_layer=args.n_layer, n_head=16)
    model = GPT2LMHeadModel(config)
    n_params = sum(p.numel() for p in model.parameters())
    model = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, config.vocab_size, (1, 8))
    model(x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()
    rows = []
    d = args.dir

    def run(fmt, op, fn, path=None):
        gc.collect()
        _trim()
        dist.barrier()
        with _PeakRSS() as m:
            fn()
        dist.barrier()
        size = _dir_mb(path) if (path and rank == 0 and op == "save") else None
        rows.append((fmt, op, rank, m.seconds, m.peak - m.base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, size))

    def full_save():
        sd = full_state_dict(model)
        if rank == 0:
            os.makedirs(f"{d}/full", exist_ok=True)
            sd.pop("lm_head.weight")  # tied to transformer.wte.weight; safetensors stores it once
            save_file(sd, f"{d}/full/model.safetensors", metadata={"format": "pt"})

    def full_load():
        sd = load_file(f"{d}/full/model.safetensors") if rank == 0 else None
        load_full_state_dict(model, sd, strict=False)

    def full_optim_save():
        osd = full_optim_state_dict(model, opt)
        if rank == 0:
            os.makedirs(f"{d}/full_optim", exist_ok=True)
            torch.save(osd, f"{d}/full_optim/optim.pt")

    def full_optim_load():
        osd = torch.load(f"{d}/full_optim/optim.pt", weights_only=True) if rank == 0 else None
        load_full_optim_state_dict(model, opt, osd)

    run("sharded (DCP)", "save", lambda: save_sharded_model(model, f"{d}/sharded"), f"{d}/sharded")
    run("sharded (DCP)", "load", lambda: load_sharded_model(model, f"{d}/sharded"))
    run("sharded optim (DCP)", "save", lambda: save_sharded_optimizer(model, opt, f"{d}/sharded_optim"), f"{d}/sharded_optim")
    run("sharded optim (DCP)", "load", lambda: load_sharded_optimizer(model, opt, f"{d}/sharded_optim"))
    run("full (rank 0, safetensors)", "save", full_save, f"{d}/full")
    run("full (rank 0, safetensors)", "load", full_load)
    run("full optim (rank 0, torch.save)", "save", full_optim_save, f"{d}/full_optim")
    run("full optim (rank 0, torch.save)", "load", full_optim_load)
    queue.put((rank, n_params, rows))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=1024)
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--dir", default="/tmp/ckpt_bench")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.world_size, port, args, queue)) for r in range(args.world_size)]
    for p in procs:
        p.start()
    results = []
    while len(results) < len(procs):
        try:
            results.append(queue.get(timeout=5))
        except Exception:  # queue.Empty: check that nobody died
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise SystemExit(f"a rank failed (exit codes {[p.exitcode for p in procs]}); see its traceback above")
    for p in procs:
        p.join()
    results.sort()
    n_params = results[0][1]
    print(f"GPT-2 n_embd={args.n_embd} n_layer={args.n_layer}: {n_params / 1e6:.1f}M parameters, "
          f"world size {args.world_size} (gloo, CPU, 1 thread per rank), torch {torch.__version__}\n")
    print("| format | op | rank | time (s) | peak RSS above start (MB) | process max RSS (MB) | on disk (MB) |")
    print("|---|---|---|---|---|---|---|")
    rows = sorted((r for _, _, rs in results for r in rs), key=lambda r: (r[0], r[1] != "save", r[2]))
    for fmt, op, rank, secs, extra, maxrss, size in rows:
        print(f"| {fmt} | {op} | {rank} | {secs:.2f} | {extra:.0f} | {maxrss:.0f} | {'' if size is None else f'{size:.0f}'} |")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
