"""Training stall of a checkpoint: ``save_state`` synchronous vs asynchronous, and torch DCP's ``async_save``.

On W gloo ranks (CPU), for each model row (``benchmarks/bench.py``'s sizes), two engines side by side:

* ours: accel_flatshard's ``Accelerator`` (SHARDED_STATE_DICT), ``save_state(dir, async_save=False|True)``;
* torch: ``fully_shard`` (FSDP2) per decoder layer, ``dcp.save`` vs ``dcp.async_save`` of
  ``get_state_dict(model, optimizer)`` (DCP's default staging: a CPU copy, then a background thread).

Per engine: the median step time without a save; a first asynchronous save, waited for (it makes the writer's
process group and DCP's caches once per run: its time is in the last column); then the stall of a synchronous save (time until the call returns,
slowest rank) and of an asynchronous one; the median step time of the steps that run while the background write
is in flight, how many did, and when the write finished (from the call); the snapshot's host memory per rank
(ours: what ``checkpoint/commit.py`` copies; torch: the staged state dict's tensors).  Prints a markdown table.

    .venv/bin/python benchmarks/async_save_bench.py [--rows llama-40M,llama-150M] [--world-size 2] [--seq 128]
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
       "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT", "FSDP_BACKWARD_PREFETCH": "BACKWARD_PRE",
       "FSDP_FORWARD_PREFETCH": "true", "FSDP_SYNC_MODULE_STATES": "false"}


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _on_any_rank(flag: bool) -> bool:
    """``flag`` or'ed over the ranks.  Each rank's writer thread ends at its own time (rank 0 commits last), and the
    ranks must take the same number of steps, or their collectives would mismatch and hang."""
    t = torch.tensor([int(flag)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t)


def _timed_steps(step: Callable[[], None], n: int) -> List[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def _measure(step: Callable[[], None], save: Callable[[str, bool], Any], in_flight: Callable[[Any], bool],
             finish: Callable[[Any], None], root: str, steps: int, snapshot_bytes: Callable[[], int]) -> Dict[str, Any]:
    _timed_steps(step, 2)  # warm-up (allocations, optimizer state)
    base = statistics.median(_timed_steps(step, steps))
    dist.barrier()
    t0 = time.perf_counter()
    finish(save(os.path.join(root, "first"), True))  # once per run: groups, DCP's caches (not in the table's stall)
    first = _slowest(time.perf_counter() - t0)
    dist.barrier()
    t0 = time.perf_counter()
    save(os.path.join(root, "sync"), False)
    sync_stall = _slowest(time.perf_counter() - t0)
    dist.barrier()
    t0 = time.perf_counter()
    handle = save(os.path.join(root, "async"), True)
    async_stall = _slowest(time.perf_counter() - t0)
    during: List[float] = []
    while len(during) < 4 * steps and _on_any_rank(in_flight(handle)):
        during += _timed_steps(step, 1)
    t1 = time.perf_counter()
    finish(handle)
    done = _slowest(time.perf_counter() - t0)
    n = torch.tensor([len(during)], dtype=torch.int64)
    dist.all_reduce(n, op=dist.ReduceOp.MIN)
    return {"first": first, "base": base, "sync": sync_stall, "async": async_stall, "during": statistics.median(during) if during else
            float("nan"), "steps_during": int(n), "write_done": done, "finish_wait": _slowest(time.perf_counter() - t1),
            "snapshot": snapshot_bytes()}


def _ours(row: str, args, root: str) -> Dict[str, Any]:
    from accelerate.state import AcceleratorState, GradientState

    from accel_flatshard.state import commit
    from accel_flatshard.integrations.accelerate import Accelerator
    from bench import build_model

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    os.environ.update(ENV)
    accelerator = Accelerator()
    model = build_model(row, args.seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    x = torch.randint(0, model.module.config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    snap = {"bytes": 0}
    snapshot_entries = commit.snapshot_entries

    def counting(entries):
        out, ready = snapshot_entries(entries)
        snap["bytes"] += commit.snapshot_bytes(out)
        return out, ready

    commit.snapshot_entries = counting

    def step() -> None:
        loss = model(input_ids=x, labels=x).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def save(directory: str, background: bool) -> Any:
        snap["bytes"] = 0 if background else snap["bytes"]  # the last asynchronous save's
        accelerator.save_state(directory, async_save=background)
        return commit.SAVES.in_flight

    try:
        return _measure(step, save, lambda h: h is not None and h.thread.is_alive(), lambda h: commit.wait_for_saves(),
                        root, args.steps, lambda: snap["bytes"])
    finally:
        commit.snapshot_entries = snapshot_entries


def _torch(row: str, args, root: str) -> Dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from bench import block_classes, build_model

    model = build_model(row, args.seq)
    blocks = tuple(block_classes(model))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for m in model.modules():
        if isinstance(m, blocks):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    x = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    group = dist.new_group(backend="gloo")  # DCP's async_save wants a group of its own for the background thread
    staged = {"bytes": 0}

    def step() -> None:
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def save(directory: str, background: bool) -> Any:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        if not background:
            dcp.save(state, checkpoint_id=directory)
            return None
        staged["bytes"] = sum(getattr(t, "_local_tensor", t).numel() * t.element_size() for t in _tensors(state))
        return dcp.async_save(state, checkpoint_id=directory, process_group=group)

    return _measure(step, save, lambda f: f is not None and not f.done(), lambda f: f.result(), root, args.steps,
                    lambda: staged["bytes"])


def _tensors(obj: Any) -> List[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _worker(rank: int, world: int, port: int, args, root: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {}
    for row in args.rows.split(","):
        for engine, run in (("accel_flatshard save_state", _ours), ("torch FSDP2 + DCP", _torch)):
            directory = os.path.join(root, row, engine.split()[0])
            out[(row, engine)] = run(row, args, directory)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(directory, ignore_errors=True)
    if rank == 0:
        results.put(out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="llama-40M,llama-150M")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    args = p.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="async_save_bench_")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.world_size, port, args, root, results))
             for r in range(args.world_size)]
    for proc in procs:
        proc.start()
    out = results.get()
    for proc in procs:
        proc.join()
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    print(f"W={args.world_size}, CPU/gloo, batch {args.batch} x seq {args.seq} per rank, load average "
          f"{os.getloadavg()[0]:.2f} at the end\n")
    print("| model | engine | step s | sync save stall s | async stall s | async / sync | step s during write "
          "(steps) | write done after s | snapshot MiB/rank | first async save, waited s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (row, engine), r in out.items():
        print(f"| {row} | {engine} | {r['base']:.3f} | {r['sync']:.2f} | {r['async']:.3f} | "
              f"{r['async'] / r['sync']:.0%} | {r['during']:.3f} ({r['steps_during']}) | {r['write_done']:.2f} | "
              f"{r['snapshot'] / 2**20:.0f} | {r['first']:.2f} |")


if __name__ == "__main__":
    main()
