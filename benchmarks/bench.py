"""Side-by-side training-step benchmark: accel_flatshard vs torch FSDP1 / FSDP2 / DDP / no communication.

    .venv/bin/python benchmarks/bench.py            # (make bench) gpt2-5M, llama-5M, llama-40M (+ compile rows), llama-150M
    .venv/bin/python benchmarks/bench.py --quick    # same rows, 5 timed steps: ~1.5-2 min
    .venv/bin/python benchmarks/bench.py --rows llama-5M,gpt2-40M,llama-150M --steps 6
    .venv/bin/python benchmarks/bench.py --world-size 4        # oversubscribes a 2-core host
    .venv/bin/python benchmarks/bench.py --ours ours,ours+noreshard,ours+proposed --profile --trace-dir traces/
    .venv/bin/python benchmarks/bench.py --device cuda --world-size 1           # one GPU, NCCL
    .venv/bin/python benchmarks/bench.py --device cuda --fake-pg --world-size 8 # emulated W (no real comm)

Every rank builds the same model once per engine (same initial weights), then runs the engines'
steps INTERLEAVED (step s of every engine, in an order rotated every step, a barrier before each), so
all ratios come from one run under the same machine load.  A step is forward + backward + AdamW step +
zero_grad on this rank's part of the global batch; its time is the slowest rank's.  Reported per row:

* median step time, global tokens/s;
* ratios vs DDP, vs FSDP2 and vs the no-communication bound (same model, no collectives): the median
  over steps of the paired per-step ratios; against the bound also the median paired difference, i.e.
  the communication time that is not hidden behind compute;
* params + grads + optimizer state bytes this rank holds (unique storages; DDP's buckets not counted)
  and the step's peak RSS increase over the RSS before it (CPU; after malloc_trim) or peak
  ``max_memory_allocated`` (CUDA);
* CPU seconds per step of the busier rank's process (all threads: compute and gloo's) and its paired
  ratio to DDP's: the work a step costs, which other load on a shared host disturbs much less than
  wall time (on an idle host with one core per rank, wall time follows it closely);
* the largest |loss - DDP loss| over the steps (losses averaged over ranks; no-comm trains on local
  data, so it has none).

Variants of our engine: ``ours+opt+opt...`` with the options in ``patches.OPTIONS`` (constructor
arguments such as ``noreshard``/``fpre``/``bpre`` and monkeypatches of proposed engine changes).

Muon (``--muon-rows``, default llama-40M): ``ours/muon`` and ``ddp/muon`` step ``torch.optim.Muon`` over the hidden
2-D matrices and AdamW over the rest (embeddings, LM head, norms), as torch's Muon docs split them, built before
wrapping; a second table compares each with the same engine on AdamW: the whole step and the optimizer part
(``opt.step()`` alone, timed inside the step), medians of paired per-step ratios.
"""
from __future__ import annotations

import argparse
import copy
import ctypes
import datetime
import functools
import gc
import json
import os
import platform
import resource
import socket
import statistics
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import patches  # noqa: E402  (benchmarks/patches.py)

SIZES = {  # name -> (family, config kwargs); parameter counts printed in the table
    "gpt2-5M": ("gpt2", dict(n_layer=4, n_embd=256, n_head=4, vocab_size=8192)),
    "gpt2-40M": ("gpt2", dict(n_layer=10, n_embd=512, n_head=8, vocab_size=16384)),
    "gpt2-150M": ("gpt2", dict(n_layer=16, n_embd=768, n_head=12, vocab_size=50257)),
    "llama-5M": ("llama", dict(num_hidden_layers=4, hidden_size=256, intermediate_size=688, num_attention_heads=4, vocab_size=4096)),
    "llama-40M": ("llama", dict(num_hidden_layers=8, hidden_size=512, intermediate_size=1376, num_attention_heads=8, vocab_size=16384)),
    "llama-150M": ("llama", dict(num_hidden_layers=14, hidden_size=768, intermediate_size=2048, num_attention_heads=12, vocab_size=32000)),
    # PEFT LoRA (r 8 on q_proj and v_proj) over llama-40M: each block a frozen base and trainable adapters
    "llama-40M-lora": ("llama-lora", dict(num_hidden_layers=8, hidden_size=512, intermediate_size=1376, num_attention_heads=8, vocab_size=16384)),
}
BASE_ENGINES = ["ddp", "fsdp1", "fsdp2", "nocomm", "ddp+compile", "fsdp2+compile"]
# not in the default list: DDP with torch's fp16_compress_hook (gradients all-reduced as fp16), the lossy peer of
# ``ours+int8`` a DDP user would pick on gloo (bf16_compress_hook needs NCCL)
EXTRA_ENGINES = ["ddp+fp16"]


def build_model(row: str, seq: int) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    family, kw = SIZES[row]
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_positions=seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, **kw)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        # use_cache=False: training needs no KV cache, and with it each compiled block recompiles per layer
        cfg = transformers.LlamaConfig(max_position_embeddings=seq, num_key_value_heads=kw["num_attention_heads"],
                                       use_cache=False, **kw)
        model = transformers.LlamaForCausalLM(cfg)
    if family == "llama-lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
        for name, p in model.named_parameters():  # (B starts at zero: give the adapters gradients of their own)
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
    return model


def block_classes(model: torch.nn.Module):
    from accel_flatshard.core.wrap import block_classes_of

    return block_classes_of(model)


# ---------------------------------------------------------------------- engines
def muon_and_adamw(model: torch.nn.Module) -> List[torch.optim.Optimizer]:
    """torch.optim.Muon over the hidden 2-D matrices (not the embeddings or the LM head), AdamW over the rest."""
    hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n and "wte" not in n
              and "wpe" not in n and "lm_head" not in n]
    ids = {id(p) for p in hidden}
    return [torch.optim.Muon(hidden, lr=0.02, weight_decay=0.01),
            torch.optim.AdamW([p for p in model.parameters() if id(p) not in ids], lr=1e-3, weight_decay=0.01)]


class Runner:
    """One engine's model + optimizer(s) on this rank (default: AdamW over every parameter)."""

    def __init__(self, name: str, model: torch.nn.Module, optimizers: Optional[List] = None) -> None:
        self.name, self.model = name, model
        self.opts = optimizers or [torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3,
                                                     weight_decay=0.01)]
        self.opt_seconds = self.opt_cpu = 0.0  # the last step's optimizer part: wall, and CPU of this process

    def step(self, x: torch.Tensor) -> torch.Tensor:
        # under --profile each engine's steps are one span kind: the phase table of one engine reads its own
        with torch.profiler.record_function(f"bench::step[{self.name}]"):
            loss = self.model(input_ids=x, labels=x).loss
            loss.backward()
            start, cpu = time.perf_counter(), time.process_time()
            for opt in self.opts:
                opt.step()
            if next(self.model.parameters()).device.type == "cuda":
                torch.cuda.synchronize()
            self.opt_seconds, self.opt_cpu = time.perf_counter() - start, time.process_time() - cpu
            for opt in self.opts:
                opt.zero_grad(set_to_none=True)
        return loss.detach()

    def state_bytes(self) -> int:
        """Unique storages of params, grads and optimizer state held by this rank."""
        seen: Dict[int, int] = {}

        def add(t):
            if not isinstance(t, torch.Tensor):
                return
            t = getattr(t, "_local_tensor", t)  # DTensor (FSDP2)
            s = t.untyped_storage()
            if s.nbytes():
                seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())

        for p in self.model.parameters():
            add(p)
            add(p.grad)
        for opt in self.opts:
            for st in opt.state.values():
                for v in st.values():
                    add(v)
        return sum(seen.values())


def compile_blocks(model: torch.nn.Module, blocks: tuple) -> None:
    """Regional compilation (torchtitan's recipe, accelerate's use_regional_compilation): each repeated block
    compiled in place with ``module.compile()``, the rest eager.  The first step compiles (in warmup)."""
    for m in model.modules():
        if isinstance(m, blocks):
            m.compile()


def make_runner(engine: str, base: torch.nn.Module, device: torch.device, args, world: int) -> Runner:
    model = copy.deepcopy(base).to(device)
    if engine.endswith("/muon"):  # the optimizers hold the matrices' 2-D parameters: built before wrapping
        opts = muon_and_adamw(model)
        runner = wrap_engine(engine[: -len("/muon")], model, device, args, world)
        runner.name, runner.opts = engine, opts
        return runner
    return wrap_engine(engine, model, device, args, world)


def wrap_engine(engine: str, model: torch.nn.Module, device: torch.device, args, world: int) -> Runner:
    blocks = tuple(block_classes(model))
    if engine == "nocomm":
        return Runner(engine, model)
    if engine in ("ddp", "ddp+compile", "ddp+fp16"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel as DDP

        if engine == "ddp+compile":
            compile_blocks(model, blocks)
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        if engine == "ddp+fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return Runner(engine, ddp)
    if engine == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy as torch_policy

        policy = functools.partial(torch_policy, transformer_layer_cls=set(blocks))
        return Runner(engine, FSDP1(model, auto_wrap_policy=policy, device_id=device, use_orig_params=True))
    if engine in ("fsdp2", "fsdp2+compile"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        for m in model.modules():
            if isinstance(m, blocks):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if engine == "fsdp2+compile":
            compile_blocks(model, blocks)  # after fully_shard, as accelerate's FSDP2 path and torchtitan do
        return Runner(engine, model)
    if engine.startswith("ours"):
        from accel_flatshard import FullyShardedDataParallel, transformer_auto_wrap_policy

        kwargs, post = patches.parse_variant(engine, model)
        kwargs.setdefault("auto_wrap_policy", transformer_auto_wrap_policy(model))
        wrapped = FullyShardedDataParallel(model, **kwargs)
        for fn in post:
            fn(wrapped)
        return Runner(engine, wrapped)
    raise ValueError(f"unknown engine {engine!r}; choose from ours[+opts], {', '.join(BASE_ENGINES + EXTRA_ENGINES)}")


# ---------------------------------------------------------------------- measurement
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def step_peak_bytes(runner: Runner, x: torch.Tensor, device: torch.device) -> int:
    """Peak memory increase during one step: CUDA max_memory_allocated, or CPU VmHWM over VmRSS."""
    gc.collect()
    if device.type == "cuda":
        _sync(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        runner.step(x)
        _sync(device)
        return torch.cuda.max_memory_allocated(device) - before
    _malloc_trim()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return -1
    before = _rss_kib("VmRSS")
    runner.step(x)
    return (_rss_kib("VmHWM") - before) * 1024


def row_profiler(device: torch.device):
    """--profile: a torch.profiler (CPU, and CUDA kernels on a GPU) over all steps of a row, started."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(activities=activities)
    prof.start()
    return prof


def profile_tables(prof, runners: List[Runner], row: str, rank: int, args) -> Dict[str, str]:
    """Stop ``prof``; the phase table of each of our engines (steps after warm-up, from its bench::step spans);
    with --trace-dir the row's trace (every engine, side by side) as ``{row}_rank{rank}.json``."""
    from accel_flatshard.tools.profiling import phase_table, step_phases

    prof.stop()
    events = prof.events()
    tables = {}
    for r in runners:
        if r.name.startswith("ours"):
            steps = step_phases(events, step_prefix=f"bench::step[{r.name}]")[args.warmup :]
            tables[r.name] = phase_table(steps, title=f"accel_flatshard profile, rank {rank}")
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
        prof.export_chrome_trace(os.path.join(args.trace_dir, f"{row}_rank{rank}.json"))
    return tables


def row_engines(row: str, args) -> List[str]:
    """The engines of ``row``: compiled ones only on the rows of --compile-rows (each compiles per rank, minutes);
    on the rows of --muon-rows also ``ours/muon`` (and ``ddp/muon`` when DDP runs)."""
    engines = [e for e in args.engines + args.ours if "compile" not in e or row in args.compile_rows]
    if row in args.muon_rows:
        engines += [f"{e}/muon" for e in ("ours", "ddp") if e in engines]
    return engines


def lossy_table(results: List[dict]) -> str:
    """Each ``ours+...int8...`` engine against DDP, DDP + fp16_compress_hook and our exact engine (paired medians of
    the step time), with the bytes it sends against our exact engine's."""
    lines = ["| model | engine | vs DDP | vs DDP+fp16 | vs ours exact | sent MiB/step/rank (ours exact) |",
             "|---|---|---:|---:|---:|---:|"]
    for res in results:
        t, idx = res["times"], {e: i for i, e in enumerate(res["engines"])}

        def ratio(i: int, ref: str) -> str:
            return "-" if ref not in idx else \
                f"{statistics.median(a / b for a, b in zip(t[i], t[idx[ref]])):.2f}x"

        for e in [e for e in res["engines"] if e.startswith("ours") and "int8" in e]:
            i, exact = idx[e], res["sent_mb"][idx["ours"]] if "ours" in idx else float("nan")
            lines.append(f"| {res['row']} | {e} | {ratio(i, 'ddp')} | {ratio(i, 'ddp+fp16')} | {ratio(i, 'ours')} "
                         f"| {res['sent_mb'][i]:.1f} ({exact:.1f}) |")
    return "\n".join(lines) if len(lines) > 2 else ""


def muon_table(results: List[dict]) -> str:
    """Each ``<engine>/muon`` against ``<engine>`` on AdamW: whole step and optimizer part (paired medians)."""
    lines = ["| model | engine | step ms AdamW | step ms Muon+AdamW | step ratio (CPU s/step ratio) | optimizer ms "
             "AdamW | optimizer ms Muon+AdamW | optimizer ratio (CPU s ratio) | params+grads+optim MiB/rank AdamW / "
             "Muon+AdamW |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for res in results:
        idx = {e: i for i, e in enumerate(res["engines"])}
        for e in [e for e in res["engines"] if e.endswith("/muon") and e[:-5] in idx]:
            i, j = idx[e[:-5]], idx[e]
            t, o, c, oc = res["times"], res["opt_times"], res["cpu"], res["opt_cpu"]
            ratio = lambda a, b: statistics.median(x / y for x, y in zip(a, b))  # noqa: E731
            lines.append(f"| {res['row']} | {e[:-5]} | {statistics.median(t[i]) * 1e3:.0f} | "
                         f"{statistics.median(t[j]) * 1e3:.0f} | {ratio(t[j], t[i]):.2f}x ({ratio(c[j], c[i]):.2f}x) | "
                         f"{statistics.median(o[i]) * 1e3:.0f} | {statistics.median(o[j]) * 1e3:.0f} | "
                         f"{ratio(o[j], o[i]):.2f}x ({ratio(oc[j], oc[i]):.2f}x) | "
                         f"{res['mem'][i][0] / 2**20:.0f} / {res['mem'][j][0] / 2**20:.0f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def run_row(row: str, rank: int, world: int, device: torch.device, args, fake: bool) -> Optional[dict]:
    base = build_model(row, args.seq)
    n_params = sum(p.numel() for p in base.parameters())
    engines = row_engines(row, args)
    runners: List[Runner] = []
    for e in engines:
        runners.append(make_runner(e, base, device, args, world))
        gc.collect()
    del base
    vocab = SIZES[row][1]["vocab_size"]
    g = torch.Generator().manual_seed(1234)
    total = args.warmup + args.steps
    data = [torch.randint(0, vocab, (args.batch * world, args.seq), generator=g) for _ in range(total)]
    times = {e: [] for e in engines}
    losses = {e: [] for e in engines}
    sent = {e: 0 for e in engines}  # ours: bytes this rank sent over the timed steps (ShardGroup's counters)
    last: Dict[str, float] = {}
    cpu = {e: [] for e in engines}  # CPU seconds of this process (all threads: compute and gloo's) per step
    opt_times = {e: [] for e in engines}  # the optimizer part of each step
    opt_cpu = {e: [] for e in engines}  # its CPU seconds (all threads of this process)
    prof = row_profiler(device) if args.profile else None  # one torch.profiler over every engine's steps
    for s in range(total):
        x = data[s][rank * args.batch : (rank + 1) * args.batch].to(device)
        k = s % len(runners)
        for r in runners[k:] + runners[:k]:  # rotate the order: no engine always runs first
            _sync(device)
            dist.barrier()
            u0 = resource.getrusage(resource.RUSAGE_SELF)
            group = getattr(r.model, "shard_group", None)
            bytes0 = sum(group.sent.values()) if group is not None else 0
            t0 = time.perf_counter()
            loss = r.step(x)
            _sync(device)
            dt = time.perf_counter() - t0
            u1 = resource.getrusage(resource.RUSAGE_SELF)
            last[r.name] = dt
            if s >= args.warmup:
                sent[r.name] += (sum(group.sent.values()) - bytes0) if group is not None else 0
                times[r.name].append(dt)
                opt_times[r.name].append(r.opt_seconds)
                opt_cpu[r.name].append(r.opt_cpu)
                losses[r.name].append(loss.float().item())
                cpu[r.name].append(u1.ru_utime + u1.ru_stime - u0.ru_utime - u0.ru_stime)
        if rank == 0 and args.verbose:
            print(f"  [{row}] step {s}{' (warmup)' if s < args.warmup else ''}: "
                  + ", ".join(f"{e}={last[e]*1e3:.0f}ms" for e in engines), flush=True)
    profiles = profile_tables(prof, runners, row, rank, args) if prof is not None else {}
    # slowest rank per step, mean loss over ranks
    t = torch.tensor([times[e] for e in engines], dtype=torch.float64)
    lo = torch.tensor([losses[e] for e in engines], dtype=torch.float64)
    mem = torch.tensor([[r.state_bytes(), step_peak_bytes(r, data[0][rank * args.batch : (rank + 1) * args.batch].to(device), device)]
                        for r in runners], dtype=torch.float64)
    work = torch.tensor([cpu[e] for e in engines], dtype=torch.float64)
    sent_mb = torch.tensor([sent[e] / max(1, args.steps) / 2**20 for e in engines], dtype=torch.float64)
    opt_t = torch.tensor([opt_times[e] for e in engines], dtype=torch.float64)
    opt_c = torch.tensor([opt_cpu[e] for e in engines], dtype=torch.float64)
    if not fake:
        dist.all_reduce(opt_t, op=dist.ReduceOp.MAX)
        dist.all_reduce(opt_c, op=dist.ReduceOp.MAX)
        dist.all_reduce(work, op=dist.ReduceOp.MAX)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        dist.all_reduce(lo)
        lo /= world
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        dist.all_reduce(sent_mb, op=dist.ReduceOp.MAX)
    del runners
    gc.collect()
    if rank != 0:
        return None
    return {"row": row, "params": n_params, "engines": engines, "times": t.tolist(), "losses": lo.tolist(),
            "mem": mem.tolist(), "cpu": work.tolist(), "sent_mb": sent_mb.tolist(), "opt_times": opt_t.tolist(),
            "opt_cpu": opt_c.tolist(),
            "profiles": profiles}


def format_table(results: List[dict], args, world: int, device: torch.device, fake: bool) -> str:
    lines = [
        "| model | params | engine | step ms (median) | tokens/s | vs DDP | vs FSDP2 | vs no-comm (exposed comm) | CPU s/step/rank (vs DDP) "
        "| params+grads+optim MiB/rank | step peak Δ MiB/rank | max abs Δloss vs DDP | sent MiB/step/rank |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    tokens = args.batch * args.seq * world
    for res in results:
        engines, t = res["engines"], res["times"]
        idx = {e: i for i, e in enumerate(engines)}

        def ratio(i: int, ref: str, t=t) -> str:
            if ref not in idx:
                return "-"
            return f"{statistics.median(a / b for a, b in zip(t[i], t[idx[ref]])):.2f}x"

        cpu = res["cpu"]

        def exposed(i: int) -> str:  # paired step-time difference to the no-communication bound
            if "nocomm" not in idx:
                return "-"
            d = statistics.median(a - b for a, b in zip(t[i], t[idx["nocomm"]]))
            return f"{ratio(i, 'nocomm')} ({d * 1e3:+.0f} ms)"

        for i, e in enumerate(engines):
            # a compiled engine is compared with DDP / FSDP2 compiled the same way (when those rows run)
            ddp_ref, fsdp2_ref = [f"{ref}+compile" if "compile" in e and f"{ref}+compile" in idx else ref
                                  for ref in ("ddp", "fsdp2")]
            if e.endswith("/muon"):  # (Muon engines are compared with DDP running Muon)
                ddp_ref, fsdp2_ref = "ddp/muon", "-"
            med = statistics.median(t[i])
            if e in ("ddp", "ddp+compile", "ddp/muon", "nocomm") or fake or ddp_ref not in idx:
                dloss = "0 (ref)" if e.startswith("ddp") else "-"
            else:
                dloss = f"{max(abs(a - b) for a, b in zip(res['losses'][i], res['losses'][idx[ddp_ref]])):.1e}"
            st, peak = res["mem"][i]
            sent = f"{res['sent_mb'][i]:.1f}" if e.startswith("ours") else "-"  # (ShardGroup's counters: ours only)
            lines.append(
                f"| {res['row']} | {res['params']/1e6:.1f}M | {e} | {med*1e3:.0f} | {tokens/med:,.0f} | {ratio(i, ddp_ref)} "
                f"| {ratio(i, fsdp2_ref)} | {exposed(i)} | {statistics.median(cpu[i]):.2f} ({ratio(i, ddp_ref, cpu)}) | {st/2**20:.0f} | {peak/2**20:.0f} | {dloss} | {sent} |"
            )
    head = (
        f"W={world}{' (fake pg: no real communication)' if fake else ''}, device={device.type}, "
        f"backend={'fake' if fake else ('nccl' if device.type == 'cuda' else 'gloo')}, torch threads/rank={args.threads}, "
        f"per-rank batch {args.batch} x seq {args.seq}, {args.steps} timed steps after {args.warmup} warmup, "
        f"torch {torch.__version__}, {platform.machine()} {os.cpu_count()} cpus; '+compile' rows: each block compiled "
        "(regional, inductor; the first step compiles, in warmup) and their 'vs DDP' / 'vs FSDP2' / Δloss are against "
        "ddp+compile / fsdp2+compile (no-comm is eager); step peak = "
        + ("max_memory_allocated - allocated before the step" if device.type == "cuda" else "VmHWM - VmRSS before the step")
    )
    return head + "\n\n" + "\n".join(lines)


def worker(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=args.timeout)
    if args.fake_pg:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world, timeout=timeout,
                                device_id=device if cuda else None)
    results = []
    try:
        for row in args.rows:
            if rank == 0:
                print(f"[bench] {row}: {', '.join(row_engines(row, args))} ...", flush=True)
            res = run_row(row, rank, world, device, args, args.fake_pg)
            if res is not None:
                results.append(res)
        if rank == 0:
            table = format_table(results, args, world, device, args.fake_pg)
            muon, lossy = muon_table(results), lossy_table(results)
            if muon:
                table += ("\n\nMuon (torch.optim.Muon over the hidden matrices, AdamW over the rest) against the same "
                          "engine on AdamW:\n\n" + muon)
            if lossy:
                table += ("\n\nLossy communication (our int8 variants) against DDP and DDP + fp16_compress_hook:\n\n"
                          + lossy)
            print("\n" + table + "\n", flush=True)
            for res in results:
                for name, text in res["profiles"].items():
                    print(f"[{res['row']} / {name}]\n{text}\n")
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"argv": sys.argv, "results": results, "table": table}, f, indent=1)
    finally:
        dist.destroy_process_group()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="gpt2-5M,llama-5M,llama-40M,llama-150M", help=f"comma list of {', '.join(SIZES)}")
    p.add_argument("--compile-rows", default="llama-40M", help="rows that also run the '+compile' engines")
    p.add_argument("--muon-rows", default="llama-40M", help="rows that also run ours/muon and ddp/muon (Muon over the "
                   "hidden matrices, AdamW over the rest); '' for none")
    p.add_argument("--engines", default=",".join(BASE_ENGINES), help="comma list of ddp, fsdp1, fsdp2, nocomm")
    p.add_argument("--ours", default="ours,ours+compile", help="comma list of our engine's variants, e.g. ours,ours+noreshard+bpre "
                   f"(options: {', '.join(patches.OPTIONS)}; 'proposed' = {'+'.join(patches.PROPOSED)})")
    p.add_argument("--world-size", type=int, default=None, help="ranks (default 2 on CPU, 1 on CUDA)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="5 timed steps after 1 warmup")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cpus // W, >= 1)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--fake-pg", action="store_true", help="one process, fake process group of --world-size ranks")
    p.add_argument("--profile", action="store_true", help="run a torch.profiler over the steps; print our engines' phase tables "
                   "(it slows every engine: take the speed table from a run without it)")
    p.add_argument("--trace-dir", default=None, help="with --profile: write each row's torch.profiler Chrome trace here "
                   "(ROW_rankR.json, every engine side by side)")
    p.add_argument("--json", default=None, help="also write raw results here")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("-v", "--verbose", action="store_true", help="print every step's times")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 5, 1
    args.rows = [r for r in args.rows.split(",") if r]
    args.compile_rows = [r for r in args.compile_rows.split(",") if r]
    args.muon_rows = [r for r in args.muon_rows.split(",") if r and hasattr(torch.optim, "Muon")]
    args.engines = [e for e in args.engines.split(",") if e]
    args.ours = [e for e in args.ours.split(",") if e]
    for r in args.rows:
        if r not in SIZES:
            p.error(f"unknown row {r!r}; choose from {', '.join(SIZES)}")
    for e in args.engines:
        if e not in BASE_ENGINES + EXTRA_ENGINES:
            p.error(f"unknown engine {e!r}; choose from {', '.join(BASE_ENGINES + EXTRA_ENGINES)}")
    for v in args.ours:
        patches.parse_variant(v)  # validates
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available here")
    if args.fake_pg and "ddp" in args.engines:
        args.engines.remove("ddp")  # DDP's reducer needs its all-reduce future to carry a tensor
        print("[bench] --fake-pg: DDP left out (its reducer fails on the fake process group)", flush=True)
    if args.world_size is None:
        args.world_size = 1 if args.device == "cuda" else 2
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // (1 if args.fake_pg else args.world_size))
    if args.trace_dir:
        args.profile = True
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    print("[bench] " + " ".join([os.path.basename(sys.executable)] + sys.argv), flush=True)
    if args.device == "cuda" and not args.fake_pg and args.world_size > torch.cuda.device_count():
        raise SystemExit(f"--world-size {args.world_size} needs that many GPUs (have {torch.cuda.device_count()}); "
                         "use --fake-pg to emulate")
    if args.fake_pg:
        worker(0, args.world_size, 0, args)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(args.world_size, port, args), nprocs=args.world_size, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
