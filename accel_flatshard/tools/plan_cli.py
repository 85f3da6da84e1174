"""``accel-flatshard plan`` / ``python -m accel_flatshard.tools.plan_cli``: the memory planner's command line (its
flags: :func:`build_parser`; accelerate's launch flags and yaml are planned, inert or refused by name in
``plan_launch.py``)."""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import runpy
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..integrations.config import options_from_launch_args
from ..core.sizes import parse_size
from ..plan import HARDWARE, Config, Planner, recommend, settings, step_time
from ..plan.link import estimated_compute_s, link_report, parse_link
from ..plan.run import PERSISTENT
from ..plan.trace import copy_model
from .plan_launch import check_launch_args


def _function(spec: str) -> Callable:
    """``package.module:function`` or ``path/to/file.py:function``."""
    where, _, name = spec.rpartition(":")
    namespace = runpy.run_path(where) if where.endswith(".py") else vars(importlib.import_module(where))
    if not callable(namespace.get(name)):
        raise ValueError(f"{spec}: {where} has no function {name!r}")
    return namespace[name]


def model_factory(spec: str) -> Callable[[], nn.Module]:
    """``--model``: ``module:function`` / ``file.py:function`` returning the ``nn.Module`` (called on the meta
    device), else a Hugging Face config (a directory, or a hub name cached: nothing is downloaded)."""
    if ":" in spec and not os.path.isdir(spec):
        factory = _function(spec)
    else:
        import transformers

        try:
            config = transformers.AutoConfig.from_pretrained(spec, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--model {spec}: no module:function, no Hugging Face config here or cached "
                             f"({exc})") from None

        def factory() -> nn.Module:
            try:
                return transformers.AutoModelForCausalLM.from_config(config)
            except ValueError:  # not a causal LM: the base model
                return transformers.AutoModel.from_config(config)

    def build() -> nn.Module:
        with torch.device("meta"):
            model = factory()
        if not isinstance(model, nn.Module):
            raise ValueError(f"the model factory returned {type(model).__name__}, not an nn.Module")
        try:
            return model.to("meta")  # (parameters it made elsewhere)
        except RuntimeError:  # a parameter subclass .to() cannot move (bitsandbytes' 4-bit weights): their storage
            return copy_model(model, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"))
    return build


def report(planner: Planner, cfg: Config, device_memory: Optional[int], link: Optional[str] = None,
           compute_ms: Optional[float] = None) -> Dict[str, Any]:
    """What ``accel-flatshard plan`` prints (``--json``: this dictionary; ``link``: ``--link``'s text, its section
    ``plan/link.py``'s)."""
    pred, W = planner.predict(cfg), planner.world_size
    checkpointing = cfg.options.activation_checkpointing
    other = planner.predict(cfg.replace(activation_checkpointing=not checkpointing))  # (for the comparison)
    steps = planner.batch_size // cfg.micro_batch
    out: Dict[str, Any] = {
        "model": f"{planner.class_name}, {planner.numel / 1e6:,.2f} M parameters in {len(planner.names)} units "
                 f"({', '.join(planner.names[:3])}{', ..., ' + planner.names[-1] if len(planner.names) > 3 else ''})",
        "config": f"{cfg.describe(W)}{f' x {steps} accumulation steps' if steps > 1 else ''}; {W} ranks, compute in "
                  f"{str(planner.param_dtype or 'torch.float32')[6:]}, {planner.device}",
        "peak_bytes": pred.peak_bytes, "where": pred.where, "at_peak": pred.parts,
        "activations_saved_for_backward": {"without_checkpointing": (other if checkpointing else pred).saved,
                                           "with_checkpointing": (pred if checkpointing else other).saved}}
    out.update({"host_async_save_snapshot_bytes": pred.snapshot} if pred.snapshot else {})
    if link is not None:
        compute_s = compute_ms / 1e3 if compute_ms else estimated_compute_s(planner, cfg, HARDWARE["flops"])
        out["link"] = link_report(planner, cfg, parse_link(link), compute_s, device_memory, settings)
    if device_memory is None:
        return out
    rows = recommend(planner, device_memory)
    out.update(device_memory=device_memory, fits=[dict(c.knobs(), strategy=c.strategy(W),
               description=c.describe(W), peak_bytes=p.peak_bytes, where=p.where, step_time_s=t) for c, p, t in rows],
               cost_model=" ".join(step_time.__doc__.split()) + " Assumed: " + ", ".join(
                   f"{k} {v:.3g}" for k, v in HARDWARE.items()))
    if rows:
        # FLATSHARD_GENERATION_BUDGET_MB: what generate() may keep gathered next to what persists (gradients are
        # released by then) and a training forward's activations (a bound for generation's and its KV cache)
        best, parts = rows[0][0], rows[0][1].parts
        budget = device_memory - sum(parts[kind] for kind in PERSISTENT) - rows[0][1].saved
        whole = planner.sizes(best.shard_size(W))["gathered"]
        out["recommended"] = settings(best, W, planner.batch_size) + [
            f"RL generation: FLATSHARD_GENERATION_BUDGET_MB={max(0, budget) // 2**20} (the whole model gathered is "
            f"{whole / 2**20:,.1f} MiB; within the budget generate() gathers it once)"]
    return out


def print_report(out: Dict[str, Any]) -> None:
    mib, saved = (lambda n: f"{n / 2**20:,.1f}"), out["activations_saved_for_backward"]
    print(f"{out['model']}\n{out['config']}\n{'per rank':<40}{'MiB':>10}")
    for name, value in out["at_peak"].items():
        print(f"  {name + ('' if name in PERSISTENT else ' at the peak'):<38}{mib(value):>10}")
    print(f"  {'activations saved for backward':<38}{mib(saved['without_checkpointing']):>10}   (with activation "
          f"checkpointing: {mib(saved['with_checkpointing'])})\n{'peak':<40}{mib(out['peak_bytes']):>10}   in the "
          f"{out['where']}")
    if "host_async_save_snapshot_bytes" in out:
        print(f"host memory, not the device's:\n  {'async save snapshot':<38}"
              f"{mib(out['host_async_save_snapshot_bytes']):>10}   (FLATSHARD_ASYNC_SAVE=1, until its write ends)")
    if "fits" in out:
        print(f"\nconfigurations that fit in {mib(out['device_memory'])} MiB, expected fastest first:" +
              ("" if out["fits"] else " none (more ranks, a shorter sequence or a smaller model)"))
    for i, r in enumerate(out.get("fits", [])):
        print(f"  {'*' if i == 0 else ' '} {r['description']}: {mib(r['peak_bytes'])} MiB, step time "
              f"{r['step_time_s'] / out['fits'][0]['step_time_s']:.2f}x")
    if "link" in out:
        print_link(out["link"])
    if out.get("recommended"):
        print("to run the expected fastest (*), set:\n  " + "\n  ".join(out["recommended"]) +
              f"\nstep time: {out['cost_model']}")


def print_link(link: Dict[str, Any]) -> None:
    """``--link``'s section: the candidates, fastest first, and the recommendation with its reason."""
    print(f"\nover a {link['link']} link between {link['machines']} machines ({link['ranks_per_machine']} "
          f"ranks each) "
          f"(FULL_SHARD's compute {link['reference_compute_s']:.3f} s per step), predicted fastest first:\n"
          f"    {'configuration':<42}{'MB across/step':>15}{'step s':>9}{'peak MiB':>10}")
    best = link.get("recommended", {}).get("name")
    for r in link["candidates"]:
        mark = "*" if r["name"] == best else " "
        note = ("  (lossy)" if r["lossy"] else "") + ("" if r["fits"] else "  does not fit")
        print(f"  {mark} {r['name']:<42}{r['across_bytes_per_step'] / 1e6:>15,.1f}{r['step_s']:>9.2f}"
              f"{r['peak_bytes'] / 2**20:>10,.1f}{note}")
    if best is None:
        print("none fits in the device memory")
        return
    print(f"recommended: {link['recommended']['reason']}\n  set: " + "; ".join(link["recommended"]["settings"]) +
          f"\n  model: {link['model']}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="accel-flatshard plan", description="Each rank's peak memory in a training step, "
                                "before the launch.", epilog="Every other flag is accelerate launch's: --config_file, "
                                "--num_processes, --num_machines, --mixed_precision, --use_fsdp, --fsdp_*, "
                                "--parallelism_config_dp_*, --gradient_accumulation_steps (the script's: an FSDP "
                                "launch does not pass it on); flags that would change memory in ways the plan does "
                                "not model are refused by name.")
    p.add_argument("--model", required=True, help="a Hugging Face config directory or cached hub name, or "
                   "module:function / file.py:function returning your nn.Module")
    p.add_argument("--batch_size", type=int, default=1, help="per device and micro-step: the dataloader's batch "
                   "(default 1)")
    p.add_argument("--accumulation", choices=("no_sync", "sync_each_batch"), default=None, help="with "
                   "--gradient_accumulation_steps > 1: what the script's accumulation does between optimizer steps; "
                   "default no_sync (accelerator.accumulate keeps the full gradients unreduced until the last "
                   "micro-step), sync_each_batch: GradientAccumulationPlugin(sync_each_batch=True) (reduces every "
                   "micro-step, keeps the gradient shards)")
    p.add_argument("--seq_len", type=int, default=None, help="tokens per sample")
    p.add_argument("--make_batch", default=None, help="module:function(batch_size, seq_len) returning the forward's "
                   "keyword (dict) or positional (tuple) arguments; default: input_ids and labels")
    p.add_argument("--device_memory", default=None, help="e.g. 80GiB: the configurations that fit, fastest first")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if this host has one")
    p.add_argument("--optimizer", default="AdamW", help="a torch.optim class (default AdamW)")
    p.add_argument("--link", default=None, metavar="RATE[:LATENCY]", help="the link between machines, e.g. 1gbit "
                   "or 10gbit:0.2ms (with --num_machines > 1): each sharding strategy's bytes across machines per step "
                   "and predicted step, exact and int8, and the fastest that fits")
    p.add_argument("--compute_ms", type=float, default=None, help="with --link: one rank's FULL_SHARD step with no "
                   "cross-machine limit (measured unshaped or on one machine); default: estimated from FLOPs")
    p.add_argument("--json", action="store_true", help="print the result as JSON (the peak: peak_bytes)")
    p.add_argument("--plot", default=None, metavar="FILE", help="also draw rank 0's memory over the planned step, by "
                   "kind, the peak marked, as a PNG (needs matplotlib: pip install 'accel_flatshard[docs]')")
    p.add_argument("--measured", default=None, metavar="FILE", help="with --plot: a measured run's JSON drawn beside "
                   "the plan (peak_bytes per rank, optionally curve per rank: tests/scripts/plan_measure.py --curve)")
    return p


def planned(args: argparse.Namespace, launch: List[str]) -> Tuple[Planner, Config]:
    """The planner and configuration for the plan's own flags and accelerate's launch flags (not traced yet)."""
    options, launched = options_from_launch_args(launch)
    check_launch_args(launched)
    steps = 1 if launched.gradient_accumulation_steps is None else int(launched.gradient_accumulation_steps)
    if steps < 1:
        raise ValueError(f"--gradient_accumulation_steps {steps}: must be >= 1")
    if args.accumulation and steps == 1:
        raise ValueError(f"--accumulation {args.accumulation} needs --gradient_accumulation_steps > 1")
    build, W, seq = model_factory(args.model), launched.num_processes, args.seq_len
    model = build()
    if args.make_batch:
        make_batch = _function(args.make_batch)
        batch = lambda n: make_batch(n, seq)  # noqa: E731
    elif not hasattr(getattr(model, "config", None), "vocab_size") or seq is None:
        raise ValueError("give --seq_len (a Hugging Face model), or --make_batch for other inputs")
    else:
        keys = ("input_ids", "labels")[:1 + ("labels" in inspect.signature(model.forward).parameters)]
        batch = lambda n: {k: torch.zeros(n, seq, dtype=torch.long) for k in keys}  # noqa: E731
    optimizer = getattr(torch.optim, args.optimizer, None)
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        raise ValueError(f"--optimizer {args.optimizer}: not a torch.optim optimizer class")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    planner = Planner(build, options, W, args.batch_size * steps, batch, device,
                      launched.mixed_precision in ("bf16", "fp16"), optimizer, launched.num_machines, seq or 1)
    accumulation = (args.accumulation or "no_sync") if steps > 1 else "none"  # (accelerate's default: no_sync)
    return planner, Config(options, args.batch_size, accumulation)


def main(argv: Optional[List[str]] = None) -> int:
    """``accel-flatshard plan`` / ``python -m accel_flatshard.tools.plan_cli``; returns the exit status."""
    args, launch = build_parser().parse_known_args(argv)
    try:
        if args.link is not None:
            parse_link(args.link)  # (a bad --link fails before the traces)
        elif args.compute_ms is not None:
            raise ValueError("--compute_ms is the compute estimate of --link")
        if args.compute_ms is not None and args.compute_ms <= 0:
            raise ValueError(f"--compute_ms {args.compute_ms:g}: must be positive")
        planner, cfg = planned(args, launch)
        memory = parse_size(args.device_memory, "--device_memory") if args.device_memory else None
        if args.measured and not args.plot:
            raise ValueError("--measured is drawn with --plot FILE")
        if args.plot:
            from .plan_plot import plot_plan, read_measured

            plot_plan(planner, cfg, args.plot, read_measured(args.measured) if args.measured else None)
        out = report(planner, cfg, memory, args.link, args.compute_ms)
    except (ValueError, OSError, ImportError) as exc:
        print(f"accel-flatshard plan: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(out, indent=1, default=str)) if args.json else print_report(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
