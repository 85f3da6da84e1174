"""Run an unmodified Accelerate training script on accel_flatshard.

    python -m accel_flatshard.run train.py --lr 1e-4 ...
    accelerate launch --config_file cfg.yaml -m accel_flatshard.run train.py --lr 1e-4 ...
    accelerate launch --config_file cfg.yaml -m accel_flatshard.run -m my_package.train --lr 1e-4 ...

Calls :func:`accel_flatshard.integrations.accelerate.register` (``from accelerate import Accelerator`` gets
accel_flatshard's subclass), then runs the script as ``__main__`` as if it had been started directly.
"""
from __future__ import annotations

import os
import runpy
import sys
from typing import List, Optional

USAGE = (
    "usage: python -m accel_flatshard.run SCRIPT.py [ARGS...]\n"
    "       python -m accel_flatshard.run -m MODULE [ARGS...]\n"
    "Runs the script with accelerate.Accelerator replaced by accel_flatshard's Accelerator."
)


def main(argv: Optional[List[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        raise SystemExit(0)
    if not argv or argv == ["-m"] or (argv[0] != "-m" and not os.path.isfile(argv[0])):
        missing = f"accel_flatshard.run: no such script {argv[0]!r}\n" if argv and argv[0] != "-m" else ""
        print(missing + USAGE, file=sys.stderr)
        raise SystemExit(2)
    from .integrations.accelerate import register

    register()
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1]] + argv[2:]  # runpy puts the module's file name in sys.argv[0]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            # as `python script.py` does: the script's directory first on sys.path (sibling imports work)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    finally:
        # however the script ends, no rank exits with communicators (and gloo's threads) still open
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
