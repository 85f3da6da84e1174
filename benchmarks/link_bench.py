"""The engines across two emulated machines joined by a shaped link (``make bench-link``; needs root).

    sudo .venv/bin/python benchmarks/link_bench.py    # 2 x 1 and 2 x 2 ranks, unshaped, 1 and 10 Gbit/s
    .venv/bin/python benchmarks/link_bench.py --topologies 2x2 --rates 1 --accumulate 4 --engines ddp,ours+hybrid
    .venv/bin/python benchmarks/link_bench.py --tiny --topologies 2x1 --rates 1   # seconds: the test's size

Each machine is a network namespace (``netlink.py``); its ranks talk over its own loopback, machine-to-machine
traffic crosses one veth pair shaped with ``tc`` on both ends, and gloo binds the veth (``GLOO_SOCKET_IFNAME``).
One run per topology and accumulation: every rank builds each engine once (same initial weights), then for each
link phase (first unshaped, then each rate; local rank 0 of each machine reshapes its own end between phases, all
ranks waiting) runs the engines' steps INTERLEAVED (order rotated each step, a barrier before each), as
``bench.py`` does, so the ratios of one phase come from the same minutes.  Per engine and phase:

* median step (the slowest rank's), and the medians of paired per-step ratios to DDP and to our exact engine;
* bytes that crossed machines per step, per direction (the larger): the veth's own ``tx_bytes`` counter read by each
  machine's local rank 0 between barriers around the step, so every engine is counted the same way (DDP's and
  torch FSDP's traffic included);
* the bound: the larger of compute alone (the engine's median step with the link unshaped) and bytes / rate.

Rows: 2 x 1 runs DDP, DDP + fp16_compress_hook, torch FSDP1 and FSDP2, ours exact, SHARD_GRAD_OP and int8; 2 x 2
adds HYBRID (a shard group per machine), hpZ and their int8 forms.  ``--accumulate K`` steps K micro-batches per
optimizer step, every engine under its own ``no_sync`` (FSDP2: ``set_requires_gradient_sync``) on all but the last,
as accelerate's ``accumulate`` does.  ``--json`` writes every row (``bench_plot.py --link`` draws the crossover).
The namespaces are removed on any exit; without root, ``ip``/``tc`` or namespaces it stops with what to do.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import netlink  # noqa: E402  (benchmarks/netlink.py)

MODELS = {  # name -> (bench.py family, config); llama-27M: the model (6 x 512, vocab 8192)
    "llama-27M": ("llama", dict(num_hidden_layers=6, hidden_size=512, intermediate_size=1376, num_attention_heads=8,
                                vocab_size=8192)),
    "tiny": ("llama", dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                           vocab_size=256)),
}
ENGINES = {
    "2x1": "ddp,ddp+fp16,fsdp1,fsdp2,ours,ours+noreshard,ours+int8",
    "2x2": "ddp,ddp+fp16,fsdp2,ours,ours+noreshard,ours+hybrid,ours+hpz,ours+int8,ours+hpz+int8,ours+hybrid+int8",
}
# with --accumulate K > 1 (every engine under its no_sync on all but the last micro-batch)
ACCUMULATE_ENGINES = {
    "2x1": "ddp,fsdp2,ours,ours+keep",
    "2x2": "ddp,fsdp2,ours,ours+keep,ours+hybrid,ours+hybrid+keep,ours+hybrid+defer,ours+hpz+keep",
}


# ---------------------------------------------------------------------- inside one machine (a rank)
def shape_own_end(rate_gbit: float) -> None:
    """Local rank 0 of a machine: shape this namespace's veth end (its egress) to ``rate_gbit`` (0: unshaped)."""
    dev = os.environ["GLOO_SOCKET_IFNAME"]
    subprocess.run(["tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
    if rate_gbit:
        burst = max(65536, int(rate_gbit * 1e9 / 8 / 1000))
        subprocess.run(["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate_gbit * 1000:g}mbit", "burst",
                        str(burst), "latency", "100ms"], check=True, capture_output=True)


def tx_bytes() -> int:
    with open(f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/tx_bytes") as f:
        return int(f.read())


def no_sync_of(model):
    """The engine's own "do not reduce this micro-batch" switch, as accelerate's ``accumulate`` uses it."""
    if hasattr(model, "no_sync"):  # DDP, torch FSDP1, ours
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # torch FSDP2
        @contextlib.contextmanager
        def fsdp2():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
        return fsdp2()
    raise TypeError(f"no no_sync for {type(model).__name__}")


def step(runner, micro_batches) -> float:
    """One optimizer step over ``micro_batches``: each but the last under the engine's no_sync; the mean loss."""
    import torch

    total = 0.0
    span = torch.profiler.record_function(f"bench::step[{runner.name}]")  # (--profile: one span kind per engine)
    span.__enter__()
    for i, x in enumerate(micro_batches):
        quiet = no_sync_of(runner.model) if i < len(micro_batches) - 1 else contextlib.nullcontext()
        with quiet:
            loss = runner.model(input_ids=x, labels=x).loss / len(micro_batches)
            loss.backward()
        total += loss.item()
    for opt in runner.opts:
        opt.step()
    for opt in runner.opts:
        opt.zero_grad(set_to_none=True)
    span.__exit__(None, None, None)
    return total


def run_phases(rank: int, world: int, local: int, args) -> Optional[List[dict]]:
    import torch
    import torch.distributed as dist

    import bench  # benchmarks/bench.py: the models and the engines, built as `make bench` builds them

    bench.SIZES.update(MODELS)
    device = torch.device("cpu")
    base = bench.build_model(args.model, args.seq)
    runners = [bench.make_runner(e, base, device, args, world) for e in args.engines]
    vocab = MODELS[args.model][1]["vocab_size"]
    g = torch.Generator().manual_seed(1234)
    total = args.warmup + args.steps
    batches = [[torch.randint(0, vocab, (args.batch * world, args.seq), generator=g) for _ in range(args.accumulate)]
               for _ in range(total)]
    rows = []
    for rate in [0.0] + args.rates:
        dist.barrier()
        if local == 0:
            shape_own_end(rate)
        dist.barrier()
        times = {e: [] for e in args.engines}
        sent = {e: [] for e in args.engines}
        losses = {e: [] for e in args.engines}
        prof = bench.row_profiler(device) if args.profile and rank == 0 else None
        for s in range(total):
            micro = [x[rank * args.batch:(rank + 1) * args.batch] for x in batches[s]]
            k = s % len(runners)
            for r in runners[k:] + runners[:k]:
                dist.barrier()
                before = tx_bytes() if local == 0 else 0
                t0 = time.perf_counter()
                loss = step(r, micro)
                dt = time.perf_counter() - t0
                dist.barrier()  # (outside the timing: every rank's traffic of this step is on the counter)
                after = tx_bytes() if local == 0 else 0
                if s >= args.warmup:
                    times[r.name].append(dt)
                    sent[r.name].append(after - before)
                    losses[r.name].append(loss)
            if rank == 0 and args.verbose:
                print(f"  [{rate or 'unshaped'} Gbit/s] step {s}", flush=True)
        if prof is not None:  # our engines' phase tables at this rate (rank 0; the profiler slows every engine)
            for name, text in bench.profile_tables(prof, runners, f"{rate}gbit", rank, args).items():
                print(f"[{rate or 'unshaped'} Gbit/s / {name}]\n{text}\n", flush=True)
        t = torch.tensor([times[e] for e in args.engines], dtype=torch.float64)
        b = torch.tensor([sent[e] for e in args.engines], dtype=torch.float64)
        lo = torch.tensor([losses[e] for e in args.engines], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's step
        dist.all_reduce(b, op=dist.ReduceOp.MAX)  # the busier direction (each machine's local rank 0 counts its own)
        dist.all_reduce(lo)
        rows.append({"rate_gbit": rate, "engines": args.engines, "times": t.tolist(), "cross_bytes": b.tolist(),
                     "losses": (lo / world).tolist()})
    if local == 0:
        shape_own_end(0.0)
    return rows if rank == 0 else None


def rank_main(local_rank: int, args) -> None:
    import torch
    import torch.distributed as dist

    rank, world = args.machine * args.ranks_per_machine + local_rank, 2 * args.ranks_per_machine
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(args.ranks_per_machine), MASTER_PORT=str(args.port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=args.timeout))
    try:
        rows = run_phases(rank, world, local_rank, args)
        if rows is not None:
            with open(args.out, "w") as f:
                json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def machine_main(args) -> int:
    """One machine (run inside its namespace): its ranks, spawned."""
    import torch.multiprocessing as mp

    mp.start_processes(rank_main, args=(args,), nprocs=args.ranks_per_machine, start_method="spawn")
    return 0


# ---------------------------------------------------------------------- the orchestrator (root namespace)
def run_topology(link: netlink.EmulatedLink, topology: str, accumulate: int, args) -> List[dict]:
    """Both machines' runs of one topology; rank 0's rows, annotated."""
    per_machine = int(topology.split("x")[1])
    out = os.path.join(args.workdir, f"rows_{topology}_acc{accumulate}.json")
    if os.path.exists(out):
        os.remove(out)
    port = 29000 + os.getpid() % 1000
    threads = args.threads or max(1, (os.cpu_count() or 1) // (2 * per_machine))
    engines = args.engines or (ENGINES if accumulate == 1 else ACCUMULATE_ENGINES)[topology]
    argv = [sys.executable, os.path.abspath(__file__), "--model", args.model, "--steps", str(args.steps), "--warmup",
            str(args.warmup), "--batch", str(args.batch), "--seq", str(args.seq), "--rates",
            ",".join(f"{r:g}" for r in args.rates), "--engines", engines, "--accumulate", str(accumulate),
            "--ranks-per-machine", str(per_machine), "--port", str(port), "--threads", str(threads),
            "--timeout", str(args.timeout), "--out", out] + (["-v"] if args.verbose else []) + (
            ["--profile"] if args.profile else [])
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": os.path.dirname(HERE)}
    procs = [link.popen(m, argv + ["--machine", str(m)], env=link.machine_env(m, env)) for m in (0, 1)]
    deadline = time.monotonic() + args.run_timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise SystemExit(f"[bench-link] {topology}: no result within --run-timeout {args.run_timeout:.0f} s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs) or not os.path.exists(out):
        raise SystemExit(f"[bench-link] {topology}: a machine failed (exit codes {[p.returncode for p in procs]})")
    with open(out) as f:
        phases = json.load(f)
    return annotate(phases, topology, accumulate, args)


def annotate(phases: List[dict], topology: str, accumulate: int, args) -> List[dict]:
    """One row per (phase, engine): median, paired ratios to DDP and to ours exact, bytes across, bound."""
    unshaped = {e: statistics.median(t) for e, t in zip(phases[0]["engines"], phases[0]["times"])}
    rows = []
    for ph in phases:
        idx = {e: i for i, e in enumerate(ph["engines"])}
        t = ph["times"]

        def paired(i: int, ref: str) -> Optional[float]:
            return statistics.median(a / b for a, b in zip(t[i], t[idx[ref]])) if ref in idx else None

        for i, e in enumerate(ph["engines"]):
            cross = statistics.median(ph["cross_bytes"][i])
            wire = cross * 8 / (ph["rate_gbit"] * 1e9) if ph["rate_gbit"] else 0.0
            rows.append({"topology": topology, "accumulate": accumulate, "rate_gbit": ph["rate_gbit"], "engine": e,
                         "median_s": statistics.median(t[i]), "vs_ddp": paired(i, "ddp"), "vs_ours": paired(i, "ours"),
                         "cross_mb": cross / 1e6, "compute_s": unshaped[e], "bound_s": max(unshaped[e], wire),
                         "times": t[i], "losses": ph["losses"][i]})
    return rows


def table(rows: List[dict]) -> str:
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    lines = ["| machines x ranks | accumulate | link Gbit/s | engine | step ms | vs DDP | vs ours exact | MB across "
             "per step (busier direction) | compute ms (unshaped) | bound ms | step / bound |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['topology']} | {r['accumulate']} | {r['rate_gbit'] or 'unshaped'} | {r['engine']} | "
                     f"{r['median_s'] * 1e3:.0f} | {fmt(r['vs_ddp'])} | {fmt(r['vs_ours'])} | {r['cross_mb']:.1f} | "
                     f"{r['compute_s'] * 1e3:.0f} | {r['bound_s'] * 1e3:.0f} | {r['median_s'] / r['bound_s']:.2f} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topologies", default="2x1,2x2", help="machines x ranks per machine (2 machines)")
    p.add_argument("--rates", default="1,10", help="link rates in Gbit/s (each run also measures unshaped)")
    p.add_argument("--accumulate", default="1", help="micro-batches per optimizer step, a comma list (e.g. 1,4)")
    p.add_argument("--engines", default=None, help="comma list (bench.py names; default per topology: "
                   + "; ".join(f"{k}: {v}" for k, v in ENGINES.items()) + "; with --accumulate > 1: "
                   + "; ".join(f"{k}: {v}" for k, v in ACCUMULATE_ENGINES.items()) + ")")
    p.add_argument("--model", default="llama-27M", choices=sorted(MODELS))
    p.add_argument("--tiny", action="store_true", help="the tests' size: tiny model, 2 steps after 1 warmup")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank and micro-batch")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cpus / ranks)")
    p.add_argument("--timeout", type=float, default=600, help="process-group timeout (s)")
    p.add_argument("--run-timeout", type=float, default=3600, help="bound on one topology's run (s)")
    p.add_argument("--json", default=None, help="write every row here")
    p.add_argument("--workdir", default=None, help="where the machines write their rows (default: a temp dir)")
    p.set_defaults(trace_dir=None)  # (bench.profile_tables: no trace files)
    p.add_argument("--profile", action="store_true", help="print our engines' phase tables per rate (rank 0; slows "
                   "every engine: take the speed table from a run without it)")
    p.add_argument("-v", "--verbose", action="store_true")
    # inside a machine (set by the orchestrator)
    p.add_argument("--machine", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--ranks-per-machine", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        args.model, args.steps, args.warmup, args.seq = "tiny", 2, 1, 16
    args.rates = [float(r) for r in args.rates.split(",") if r]
    if args.machine is not None:
        args.engines = [e for e in args.engines.split(",") if e]
        args.accumulate = int(args.accumulate)
        return args
    args.topologies = [t for t in args.topologies.split(",") if t]
    for t in args.topologies:
        if t not in ENGINES:
            p.error(f"unknown topology {t!r}: choose from {', '.join(ENGINES)}")
    args.accumulates = [int(k) for k in args.accumulate.split(",") if k]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.machine is not None:
        return machine_main(args)
    import tempfile

    try:
        netlink.check_available()
    except netlink.LinkUnavailable as exc:
        print(f"[bench-link] cannot emulate the link here: {exc}", file=sys.stderr)
        return 2
    rows: List[dict] = []
    with contextlib.ExitStack() as stack:
        args.workdir = args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_link_"))
        link = stack.enter_context(netlink.EmulatedLink())
        print(f"[bench-link] machines {link.names} joined by {link.devices} ({link.addresses}); model {args.model}, "
              f"rates {args.rates} Gbit/s", flush=True)
        for topology in args.topologies:
            for k in args.accumulates:
                print(f"[bench-link] {topology}, accumulate {k} ...", flush=True)
                rows += run_topology(link, topology, k, args)
                print(table([r for r in rows if r["topology"] == topology and r["accumulate"] == k]), flush=True)
    head = (f"{args.model}, per-rank micro-batch {args.batch} x seq {args.seq}, {args.steps} timed steps after "
            f"{args.warmup} warmup, gloo over a veth shaped with tc tbf on both ends, {platform.machine()} "
            f"{os.cpu_count()} cpus")
    print("\n" + head + "\n\n" + table(rows) + "\n", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "head": head, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
