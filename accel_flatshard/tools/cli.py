"""``accel-flatshard``: offline tools for sharded checkpoints (no process group, no GPU needed), and the planner.

CKPT_DIR: a sharded model/optimizer checkpoint, or a directory written by ``accelerator.save_state``
(``pytorch_model_fsdp_0/``, ``optimizer_0/``, ...)::

    accel-flatshard inspect CKPT_DIR [--json]       # keys, shapes, dtypes, saved world size, sizes
    accel-flatshard consolidate CKPT_DIR OUT_DIR [--max-shard-size 5GB] [--no-verify]   # -> HF safetensors
    accel-flatshard plan --model M --config_file YAML --batch_size B --seq_len S   # each rank's peak memory
    accel-flatshard options                         # the FLATSHARD_* variables (markdown table)
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional



def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def _print_tensors(tensors: dict, indent: str = "") -> None:
    rows = [(n, "x".join(map(str, d["shape"])) or "()", d["dtype"], d.get("kind", "")) for n, d in tensors.items()]
    width = max([len(r[0]) for r in rows] + [4])
    for name, shape, dtype, kind in [("name", "shape", "dtype", "kind")] + rows:
        print(f"{indent}{name:<{width}}  {shape:<16} {dtype:<10} {kind}".rstrip())


def _inspect(args: argparse.Namespace) -> int:
    from ..state import read_checkpoint_info
    from ..state.offline import is_save_state_dir, read_save_state_info

    save_state = is_save_state_dir(args.checkpoint)
    info = (read_save_state_info if save_state else read_checkpoint_info)(args.checkpoint)
    if args.json:
        print(json.dumps(info, indent=1, default=str))
    elif save_state:
        _print_save_state(info)
    else:
        source = info.get("model_class") or "?"
        if info.get("optimizer_class"):
            source = f"{info['optimizer_class']} for {source}"
        print(f"checkpoint: {info['directory']}\nkind: {info['kind']} ({source})")
        print(f"saved at world size {info['world_size']} (shard group size {info['shard_size']}), "
              f"torch {info.get('torch_version')}, {info.get('saved_at')}")
        print(f"tensors: {len(info['tensors'])}, {_human(info['total_bytes'])} of tensor data, "
              f"{_human(info['file_bytes'])} on disk")
        _print_tensors(info["tensors"])
        for g, group in enumerate(info.get("param_groups") or []):
            hyper = {k: v for k, v in group.items() if k != "params"}
            print(f"param_groups[{g}]: {len(group.get('params', []))} params, {hyper}")
    return 0


def _print_save_state(info: dict) -> None:
    print(f"accelerator.save_state directory: {info['directory']}")
    for entry in info["models"] + info["optimizers"]:
        kind = "model" if entry in info["models"] else "optimizer"
        layout = ("sharded (SHARDED_STATE_DICT), saved at world size " + str(entry["world_size"])
                  if entry["layout"] == "sharded" else "full file")
        source = entry.get("optimizer_class") or entry.get("model_class")
        source = f", {source}" if source else ""
        print(f"{kind} {entry['name']}: {layout}{source}, {_human(entry['file_bytes'])} on disk")
        if "tensors" in entry:
            print(f"  tensors: {len(entry['tensors'])}, {_human(entry['total_bytes'])} of tensor data" +
                  ("" if kind == "model" else f" (`accel-flatshard inspect {entry['path']}` lists them)"))
            if kind == "model":
                _print_tensors(entry["tensors"], indent="  ")
    print("other files:")
    for name, size in info["other"].items():
        print(f"  {name:<32} {_human(size)}")


def _consolidate(args: argparse.Namespace) -> int:
    from ..state import consolidate
    from ..state.offline import consolidate_save_state, is_save_state_dir

    run = consolidate_save_state if is_save_state_dir(args.checkpoint) else consolidate  # (its model)
    for f in run(args.checkpoint, args.out_dir, max_shard_size=args.max_shard_size,
                 verify_checksums=not args.no_verify):
        print(f)
    return 0


def _options(args: argparse.Namespace) -> int:
    from ..core.options import markdown_table

    print(markdown_table())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="accel-flatshard", description="Tools for accel_flatshard checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="print keys, shapes, dtypes, saved world size and size of a checkpoint")
    p.add_argument("checkpoint", help="a directory written by save_sharded_model, save_sharded_optimizer or "
                   "accelerator.save_state")
    p.add_argument("--json", action="store_true", help="print the information as JSON")
    p.set_defaults(func=_inspect)
    p = sub.add_parser("consolidate", help="sharded model checkpoint -> Hugging Face safetensors")
    p.add_argument("checkpoint", help="a directory written by save_sharded_model or accelerator.save_state")
    p.add_argument("out_dir", help="where model.safetensors (or shards and an index) go")
    p.add_argument("--max-shard-size", default="5GB", help="largest output file, e.g. 5GB, 500MB (default 5GB)")
    p.add_argument("--no-verify", action="store_true", help="skip checksum verification of the input")
    p.set_defaults(func=_consolidate)
    p = sub.add_parser("options", help="the FLATSHARD_* variables: type, default and what each does (a markdown "
                       "table, rendered from their declarations in accel_flatshard/core/options.py)")
    p.set_defaults(func=_options)
    sub.add_parser("plan", add_help=False, help="each rank's peak memory in a training step, before the launch "
                   "(accel-flatshard plan --help)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``accel-flatshard`` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:  # its flags include accelerate launch's own
        from .plan_cli import main as plan

        return plan(argv[1:])
    args = build_parser().parse_args(argv)
    from ..state import CheckpointError

    try:
        return args.func(args)
    except (CheckpointError, ValueError, OSError) as e:
        print(f"accel-flatshard {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
