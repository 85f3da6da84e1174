"""Micro-benchmark of gloo collectives on this host (W ranks, one process each).

    .venv/bin/python benchmarks/comm_bench.py --mib 152 --world-size 2

Times each way of doing the all-gather / reduce-scatter that a flat-parameter engine needs, alone and
concurrently with a matmul loop on the compute thread (to see how much of it overlaps on this CPU).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def ag_into_tensor(out, shard, rank, ws):
    return dist.all_gather_into_tensor(out, shard, async_op=True)


def ag_list(out, shard, rank, ws):
    return dist.all_gather(list(out.chunk(ws)), shard, async_op=True)


def ag_via_all_reduce(out, shard, rank, ws):
    out.zero_()
    out.chunk(ws)[rank].copy_(shard)
    return dist.all_reduce(out, async_op=True)


def ag_via_broadcast(out, shard, rank, ws):
    chunks = out.chunk(ws)
    chunks[rank].copy_(shard)
    works = [dist.broadcast(chunks[r], src=r, async_op=True) for r in range(ws)]
    return _Multi(works)


def ag_via_p2p(out, shard, rank, ws):
    """Ring: W-1 steps of send-to-next / receive-from-previous straight into the output's slots."""
    chunks = out.chunk(ws)
    chunks[rank].copy_(shard)
    works = []
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    for s in range(ws - 1):
        send_idx, recv_idx = (rank - s) % ws, (rank - s - 1) % ws
        ops = [dist.P2POp(dist.isend, chunks[send_idx], nxt), dist.P2POp(dist.irecv, chunks[recv_idx], prv)]
        reqs = dist.batch_isend_irecv(ops)
        if s < ws - 2:  # the next send needs this receive
            for r in reqs:
                r.wait()
        else:
            works.extend(reqs)
    return _Multi(works)


def ag_via_p2p_direct(out, shard, rank, ws):
    """Send the shard to every peer, receive every peer's shard straight into its slot (no waits between)."""
    chunks = out.chunk(ws)
    chunks[rank].copy_(shard)
    ops = []
    for peer in range(ws):
        if peer != rank:
            ops.append(dist.P2POp(dist.isend, shard, peer, tag=1))
            ops.append(dist.P2POp(dist.irecv, chunks[peer], peer, tag=1))
    return _Multi(dist.batch_isend_irecv(ops))


def rs_via_p2p_direct(full, out, rank, ws):
    """Send chunk j to rank j, receive every peer's copy of our chunk into a temporary, sum at wait()."""
    chunks = full.chunk(ws)
    tmp = torch.empty(ws - 1, out.numel(), dtype=full.dtype)
    ops, i = [], 0
    for peer in range(ws):
        if peer != rank:
            ops.append(dist.P2POp(dist.isend, chunks[peer], peer, tag=2))
            ops.append(dist.P2POp(dist.irecv, tmp[i], peer, tag=2))
            i += 1
    works = dist.batch_isend_irecv(ops)

    class _W:
        def wait(self_):
            for w in works:
                w.wait()
            torch.add(chunks[rank], tmp[0], out=out)
            for j in range(1, ws - 1):
                out.add_(tmp[j])
    return _W()


def rs_via_all_to_all(full, out, rank, ws):
    tmp = torch.empty(ws, out.numel(), dtype=full.dtype)
    work = dist.all_to_all_single(tmp, full, async_op=True)

    class _W:
        def wait(self_):
            work.wait()
            torch.sum(tmp, dim=0, out=out)
    return _W()


def rs_tensor(full, out, rank, ws):
    return dist.reduce_scatter_tensor(out, full, async_op=True)


def rs_via_all_reduce(full, out, rank, ws):
    return dist.all_reduce(full, async_op=True)


class _Multi:
    def __init__(self, works):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()


AG = {"all_gather_into_tensor": ag_into_tensor, "all_gather(list)": ag_list, "all_reduce-based": ag_via_all_reduce,
      "broadcast-based": ag_via_broadcast, "p2p ring": ag_via_p2p, "p2p direct": ag_via_p2p_direct}
RS = {"reduce_scatter_tensor": rs_tensor, "all_reduce (+slice)": rs_via_all_reduce,
      "p2p direct (+sum)": rs_via_p2p_direct, "all_to_all_single (+sum)": rs_via_all_to_all}


def _compute(n_iter, a):
    for _ in range(n_iter):
        a @ a


def worker(rank, ws, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=ws, timeout=datetime.timedelta(seconds=300))
    numel = args.mib * 2**20 // 4 // ws * ws
    shard = torch.randn(numel // ws)
    out = torch.empty(numel)
    full = torch.randn(numel)
    rs_out = torch.empty(numel // ws)
    a = torch.randn(512, 512)
    # compute-alone time of the matmul loop used for the overlap column
    n_iter = args.overlap_iters
    _compute(2, a)
    t = time.perf_counter(); _compute(n_iter, a); comp = time.perf_counter() - t
    rows = []
    for kind, table in (("all-gather", AG), ("reduce-scatter", RS)):
        for name, fn in table.items():
            if args.only and name not in args.only.split(","):
                continue
            alone, both, comp_alone = [], [], []
            for it in range(args.iters + 1):
                dist.barrier()
                t = time.perf_counter()
                _compute(n_iter, a)
                comp_alone.append(time.perf_counter() - t)
                dist.barrier()
                t = time.perf_counter()
                w = fn(out, shard, rank, ws) if kind == "all-gather" else fn(full, rs_out, rank, ws)
                w.wait()
                dt = time.perf_counter() - t
                dist.barrier()
                t = time.perf_counter()
                w = fn(out, shard, rank, ws) if kind == "all-gather" else fn(full, rs_out, rank, ws)
                _compute(n_iter, a)
                w.wait()
                dt2 = time.perf_counter() - t
                if it:
                    alone.append(dt); both.append(dt2)
            exposed = [b - c for b, c in zip(both, comp_alone[1:])]
            t_alone = torch.tensor([statistics.median(alone), statistics.median(both), statistics.median(exposed)])
            dist.all_reduce(t_alone, op=dist.ReduceOp.MAX)
            rows.append((kind, name, *t_alone.tolist()))
    if rank == 0:
        print(f"W={ws}, {args.mib} MiB full tensor, torch threads={args.threads}, compute loop alone ~{comp*1e3:.0f} ms "
              f"(medians of {args.iters}; 'exposed' = paired (comm + compute) - compute alone)")
        print("| collective | implementation | alone (ms) | with compute (ms) | exposed (ms) |")
        print("|---|---|---:|---:|---:|")
        for kind, name, t1, t2, t3 in rows:
            print(f"| {kind} | {name} | {t1*1e3:.0f} | {t2*1e3:.0f} | {t3*1e3:.0f} |")
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=152)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--overlap-iters", type=int, default=100)
    p.add_argument("--only", default=None, help="comma list of implementation names to run")
    args = p.parse_args()
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    mp.start_processes(worker, args=(args.world_size, port, args), nprocs=args.world_size, start_method="spawn")


if __name__ == "__main__":
    sys.exit(main())
