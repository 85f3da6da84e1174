"""``accel-flatshard``: offline tools for sharded checkpoints (no process group, no GPU needed).

Commands::

    accel-flatshard inspect CKPT_DIR [--json]
        keys, shapes, dtypes, the world size it was saved at, total size
    accel-flatshard consolidate CKPT_DIR OUT_DIR [--max-shard-size 5GB] [--no-verify]
        sharded model checkpoint -> Hugging Face model.safetensors (or shards + index)

Example::

    accel-flatshard consolidate ckpt/model hf_out --max-shard-size 2GB
    python -c "from transformers import AutoConfig; AutoConfig.from_pretrained('gpt2').save_pretrained('hf_out')"
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

__all__ = ["main"]


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n} B"


def _inspect(args: argparse.Namespace) -> int:
    from .checkpoint import read_checkpoint_info

    info = read_checkpoint_info(args.checkpoint)
    if args.json:
        print(json.dumps(info, indent=1, default=str))
        return 0
    source = info.get("model_class") or "?"
    if info.get("optimizer_class"):
        source = f"{info['optimizer_class']} for {source}"
    print(f"checkpoint: {info['directory']}")
    print(f"kind: {info['kind']} ({source})")
    print(f"saved at world size {info['world_size']} (shard group size {info['shard_size']}), "
          f"torch {info.get('torch_version')}, {info.get('saved_at')}")
    print(f"tensors: {len(info['tensors'])}, {_human(info['total_bytes'])} of tensor data, "
          f"{_human(info['file_bytes'])} on disk")
    rows = [(name, "x".join(map(str, d["shape"])) or "()", d["dtype"], d.get("kind", "")) for name, d in info["tensors"].items()]
    width = max([len(r[0]) for r in rows] + [4])
    print(f"{'name':<{width}}  {'shape':<16} {'dtype':<10} kind")
    for name, shape, dtype, kind in rows:
        print(f"{name:<{width}}  {shape:<16} {dtype:<10} {kind}")
    if info.get("param_groups"):
        for g, group in enumerate(info["param_groups"]):
            hyper = {k: v for k, v in group.items() if k != "params"}
            print(f"param_groups[{g}]: {len(group.get('params', []))} params, {hyper}")
    return 0


def _consolidate(args: argparse.Namespace) -> int:
    from .checkpoint import consolidate

    files = consolidate(args.checkpoint, args.out_dir, max_shard_size=args.max_shard_size,
                        verify_checksums=not args.no_verify)
    for f in files:
        print(f)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="accel-flatshard", description="Tools for accel_flatshard checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="print keys, shapes, dtypes, saved world size and size of a checkpoint")
    p.add_argument("checkpoint", help="a directory written by save_sharded_model or save_sharded_optimizer")
    p.add_argument("--json", action="store_true", help="print the information as JSON")
    p.set_defaults(func=_inspect)
    p = sub.add_parser("consolidate", help="sharded model checkpoint -> Hugging Face safetensors")
    p.add_argument("checkpoint", help="a directory written by save_sharded_model")
    p.add_argument("out_dir", help="where model.safetensors (or shards and an index) go")
    p.add_argument("--max-shard-size", default="5GB", help="largest output file, e.g. 5GB, 500MB (default 5GB)")
    p.add_argument("--no-verify", action="store_true", help="skip checksum verification of the input")
    p.set_defaults(func=_consolidate)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``accel-flatshard`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    from .checkpoint import CheckpointError

    try:
        return args.func(args)
    except (CheckpointError, ValueError, OSError) as e:
        print(f"accel-flatshard {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
