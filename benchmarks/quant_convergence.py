#!/usr/bin/env python
"""Convergence of int8 quantized communication (issue 43: qwZ weights, qgZ gradients) against exact training.

The example's task (examples/train_causal_lm.py, whose data, tokenizer, model preset and evaluation are imported,
not copied): byte-level tokens of the Python Language Reference that ships with CPython (``pydoc_data.topics``),
its ``llama-tiny`` preset, AdamW with the example's weight-decay groups, cosine schedule with warmup, gradient
clipping at 1.0, W gloo ranks spawned per run.  Every configuration trains the same seeds for the same number of
optimizer steps and reports the final eval loss (the example's ``evaluate()``: the mean over the validation
blocks) of each seed, their mean and their spread (max - min):

* ours exact: accel_flatshard's ``Accelerator``, default options (FSDP environment as ``accelerate launch``
  exports it for accelerate_configs/cpu_2proc.yaml);
* accelerate DDP: the exact reference; DDP + ``fp16_compress_hook`` (through accelerate's
  ``DistributedDataParallelKwargs(comm_hook=FP16)``): the lossy peer a DDP user would pick on gloo
  (``bf16_compress_hook`` needs NCCL);
* ours with int8 weights, int8 gradients, both: ``FLATSHARD_QUANTIZED_ALL_GATHER=1``,
  ``FLATSHARD_QUANTIZED_REDUCE=1``, ``FLATSHARD_QUANT_BLOCK`` (``--block``).  Skipped, with a note, while
  accel_flatshard/core/options.py does not declare those variables.

Judging (shared/ACCELERATE_NOTES.md, "Comparing training runs"): two exact engines drift apart by rounding alone
(per seed by about 1 %), so a lossy option is judged on the mean over seeds, with the exact-vs-DDP difference of
the means printed beside it as the floor.  Issue 43's bar: the int8 runs' mean final eval loss within 1 % of the
exact run's.  The schedule is sized as HF's run_clm_no_trainer sizes it (a prepared scheduler steps
``num_processes`` times per optimizer step): each run checks that its learning rate reached the end of the cosine.

    .venv/bin/python benchmarks/quant_convergence.py [--steps 300] [--seeds 0,1,2] [--rows ours-exact,ddp,...]

Each (configuration, seed) runs in fresh processes; rank 0 writes its result to ``<output_dir>/runs/``.  The table
is printed and written to ``<output_dir>/table.md`` (and ``results.json``).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "examples"))

# What `accelerate launch --config_file accelerate_configs/cpu_2proc.yaml` exports for its fsdp_config.
FSDP_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1", "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
            "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP", "FSDP_BACKWARD_PREFETCH": "BACKWARD_PRE",
            "FSDP_FORWARD_PREFETCH": "true", "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
            "FSDP_CPU_RAM_EFFICIENT_LOADING": "false", "FSDP_SYNC_MODULE_STATES": "true",
            "FSDP_OFFLOAD_PARAMS": "false", "FSDP_USE_ORIG_PARAMS": "true", "FSDP_ACTIVATION_CHECKPOINTING": "false"}
QUANT_ALL_GATHER, QUANT_REDUCE, QUANT_BLOCK = ("FLATSHARD_QUANTIZED_ALL_GATHER", "FLATSHARD_QUANTIZED_REDUCE",
                                               "FLATSHARD_QUANT_BLOCK")


@dataclass(frozen=True)
class Config:
    key: str  # for --rows
    label: str  # in the table
    engine: str  # "ours" | "ddp" | "ddp_fp16"
    env: Dict[str, str] = field(default_factory=dict)  # FLATSHARD_* options of this row


def configs(block: int) -> List[Config]:
    b = str(block)
    return [Config("ours-exact", "ours exact", "ours"),
            Config("ddp", "accelerate DDP", "ddp"),
            Config("ddp-fp16", "DDP + fp16_compress_hook", "ddp_fp16"),
            Config("ours-int8-weights", f"ours int8 weights (block {b})", "ours",
                   {QUANT_ALL_GATHER: "1", QUANT_BLOCK: b}),
            Config("ours-int8-grads", f"ours int8 gradients (block {b})", "ours", {QUANT_REDUCE: "1", QUANT_BLOCK: b}),
            Config("ours-int8-both", f"ours int8 weights + gradients (block {b})", "ours",
                   {QUANT_ALL_GATHER: "1", QUANT_REDUCE: "1", QUANT_BLOCK: b})]


def undeclared_options(config: Config) -> List[str]:
    """The row's FLATSHARD_* variables that accel_flatshard/core/options.py does not declare (yet)."""
    from accel_flatshard.core.options import OPTIONS

    return sorted(name for name in config.env if name not in OPTIONS)


# ---------------------------------------------------------------------- one run (W spawned ranks)
def _train(rank: int, world: int, port: int, config: Config, seed: int, args: argparse.Namespace,
           result_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    if config.engine == "ours":
        os.environ.update(FSDP_ENV)
    os.environ.update(config.env)
    torch.set_num_threads(1)  # W ranks share this machine's cores

    import datasets
    import transformers
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs, set_seed
    from torch.utils.data import DataLoader

    import train_causal_lm as example

    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()
    if config.engine == "ours":
        from accel_flatshard.integrations.accelerate import Accelerator

        accelerator = Accelerator()
    else:
        from accelerate import Accelerator

        handlers = [DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)] \
            if config.engine == "ddp_fp16" else []
        accelerator = Accelerator(cpu=True, kwargs_handlers=handlers)
    if accelerator.num_processes != world:
        raise SystemExit(f"{config.label}: accelerate sees {accelerator.num_processes} processes, not {world}")

    example_args = example.parse_args(["--output_dir", args.output_dir, "--block_size", str(args.block_size),
                                       "--seed", str(seed), "--max_eval_samples", str(args.eval_samples)])
    set_seed(seed)
    tokenizer = example.byte_tokenizer()
    model = example.build_model(args.model, len(tokenizer), args.block_size)
    blocks = example.load_blocks(example_args, accelerator.main_process_first, tokenizer)
    blocks.set_format("torch")
    train_loader = DataLoader(blocks["train"], shuffle=True, batch_size=args.batch)
    eval_loader = DataLoader(blocks["validation"], batch_size=16)
    no_decay = ("bias", "norm", "ln_")  # the example's groups, by name
    named = list(model.named_parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for n, p in named if not any(k in n.lower() for k in no_decay)], "weight_decay": 0.01},
         {"params": [p for n, p in named if any(k in n.lower() for k in no_decay)], "weight_decay": 0.0}],
        lr=args.lr)
    # A prepared scheduler steps num_processes times per step: sized as run_clm_no_trainer sizes it.
    scheduler = transformers.get_scheduler("cosine", optimizer=optimizer,
                                           num_warmup_steps=args.warmup * accelerator.num_processes,
                                           num_training_steps=args.steps * accelerator.num_processes)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler)
    engine = type(model).__name__
    expected = "FullyShardedDataParallel" if config.engine == "ours" else "DistributedDataParallel"
    if engine != expected:
        raise SystemExit(f"{config.label}: the prepared model is a {engine}, not a {expected}")

    start, step, history = time.perf_counter(), 0, []
    model.train()
    while step < args.steps:
        for batch in train_loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if step % args.log_every == 0 or step == args.steps:
                history.append([step, accelerator.reduce(loss.detach(), "mean").item()])
            if step == args.steps:
                break
    train_s = time.perf_counter() - start
    metrics = example.evaluate(model, eval_loader, accelerator)
    if accelerator.is_main_process:
        with open(result_path, "w") as f:
            json.dump({"eval_loss": metrics["eval_loss"], "train_s": train_s, "final_lr": scheduler.get_last_lr()[0],
                       "first_lr_peak": args.lr, "train_loss": history, "engine": engine}, f)
    accelerator.wait_for_everyone()
    import torch.distributed as dist

    dist.destroy_process_group()


def run_one(config: Config, seed: int, args: argparse.Namespace) -> Dict:
    os.makedirs(os.path.join(args.output_dir, "runs"), exist_ok=True)
    result_path = os.path.join(args.output_dir, "runs", f"{config.key}-seed{seed}.json")
    if os.path.exists(result_path):
        os.remove(result_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    t0 = time.perf_counter()
    procs = [ctx.Process(target=_train, args=(r, args.world_size, port, config, seed, args, result_path))
             for r in range(args.world_size)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    wall = time.perf_counter() - t0
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if failed or not os.path.exists(result_path):
        raise SystemExit(f"{config.label}, seed {seed}: a rank failed (exit codes {[p.exitcode for p in procs]})")
    with open(result_path) as f:
        result = json.load(f)
    result["wall_s"] = wall
    if result["final_lr"] > 1e-3 * args.lr:
        raise SystemExit(f"{config.label}, seed {seed}: the learning rate ended at {result['final_lr']:.3g}, not at "
                         f"the end of the cosine: the schedule is not sized for num_processes")
    return result


# ---------------------------------------------------------------------- the table
def _pct(value: float, reference: float) -> str:
    return f"{100 * (value - reference) / reference:+.2f}%"


def table(results: Dict[str, Dict], seeds: List[int], notes: List[str]) -> str:
    head = (["configuration"] + [f"seed {s}" for s in seeds]
            + ["mean", "spread (max-min)", "mean vs ours exact", "largest per-seed diff vs ours exact",
               "train s / seed", "row wall s", "load avg (1 min) after row"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    exact = results.get("ours exact")
    for label, row in results.items():
        losses = [r["eval_loss"] for r in row["runs"]]
        mean = statistics.fmean(losses)
        versus = largest = "-"
        if exact is not None and label != "ours exact":
            exact_losses = [r["eval_loss"] for r in exact["runs"]]
            versus = _pct(mean, statistics.fmean(exact_losses))
            diffs = [(a - b) / b for a, b in zip(losses, exact_losses)]
            largest = f"{100 * max(diffs, key=abs):+.2f}%"
        cells = ([label] + [f"{x:.4f}" for x in losses]
                 + [f"{mean:.4f}", f"{max(losses) - min(losses):.4f}", versus, largest,
                    f"{statistics.fmean(r['train_s'] for r in row['runs']):.0f}", f"{row['wall_s']:.0f}",
                    f"{row['load']:.2f}"])
        lines.append("| " + " | ".join(cells) + " |")
    if exact is not None and "accelerate DDP" in results:
        floor = _pct(statistics.fmean(r["eval_loss"] for r in results["accelerate DDP"]["runs"]),
                     statistics.fmean(r["eval_loss"] for r in exact["runs"]))
        lines.append(f"\nFloor (two exact engines, rounding alone): accelerate DDP's mean vs ours exact {floor}. "
                     f"Issue 43's bar: an int8 row's mean within 1% of ours exact.")
        for label, row in results.items():
            if label == "DDP + fp16_compress_hook" or label.startswith("ours int8"):
                mean = statistics.fmean(r["eval_loss"] for r in row["runs"])
                exact_mean = statistics.fmean(r["eval_loss"] for r in exact["runs"])
                within = abs(mean - exact_mean) <= 0.01 * exact_mean
                lines.append(f"- {label}: mean {_pct(mean, exact_mean)} vs ours exact (floor {floor}): "
                             f"{'within' if within else 'OUTSIDE'} the 1% bar")
    lines += [f"\n{note}" for note in notes]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--rows", default=None, help="comma-separated keys (default: all): "
                   + ", ".join(c.key for c in configs(256)))
    p.add_argument("--block", type=int, default=256, help="FLATSHARD_QUANT_BLOCK of the int8 rows")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--model", default="llama-tiny", help="a preset of examples/train_causal_lm.py")
    p.add_argument("--block_size", type=int, default=128, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--eval-samples", type=int, default=128, help="validation blocks evaluated at the end")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--output_dir", default=os.path.join(REPO, "outputs", "quant_convergence"))
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    chosen = configs(args.block)
    if args.rows:
        keys = args.rows.split(",")
        unknown = set(keys) - {c.key for c in chosen}
        if unknown:
            raise SystemExit(f"unknown --rows {sorted(unknown)}; known: {[c.key for c in chosen]}")
        chosen = [c for c in chosen if c.key in keys]
    print(f"W={args.world_size} gloo ranks (1 thread each), {args.model}, {args.steps} steps of {args.batch} x "
          f"{args.block_size} tokens per rank, AdamW lr {args.lr} cosine (warmup {args.warmup}), seeds {seeds}; "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the start",
          flush=True)
    results: Dict[str, Dict] = {}
    notes = []
    for config in chosen:
        missing = undeclared_options(config)
        if missing:
            notes.append(f"Skipped {config.label}: accel_flatshard/core/options.py does not declare {', '.join(missing)} "
                         f"yet (the int8 communication of issue 43 is not wired into the engine).")
            print(notes[-1], flush=True)
            continue
        t0 = time.perf_counter()
        runs = []
        for seed in seeds:
            runs.append(run_one(config, seed, args))
            print(f"{config.label}, seed {seed}: eval loss {runs[-1]['eval_loss']:.6f} (train "
                  f"{runs[-1]['train_s']:.0f} s, run {runs[-1]['wall_s']:.0f} s, load {os.getloadavg()[0]:.2f})",
                  flush=True)
        results[config.label] = {"runs": runs, "wall_s": time.perf_counter() - t0, "load": os.getloadavg()[0]}
    exact = results.get("ours exact")
    for label, row in results.items():  # an int8 row equal to the exact one bit for bit: the option did nothing
        if exact is not None and label.startswith("ours int8") and \
                [r["eval_loss"] for r in row["runs"]] == [r["eval_loss"] for r in exact["runs"]]:
            notes.append(f"Warning: {label} equals ours exact bit for bit on every seed: was the option applied?")
    text = table(results, seeds, notes)
    print("\n" + text)
    with open(os.path.join(args.output_dir, "table.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump({"args": vars(args), "results": results, "notes": notes}, f, indent=1)


if __name__ == "__main__":
    main()
