"""Run an unmodified Accelerate training script on accel_flatshard.

    python -m accel_flatshard.run train.py --lr 1e-4 ...
    accelerate launch --config_file cfg.yaml -m accel_flatshard.run train.py --lr 1e-4 ...
    accelerate launch --config_file cfg.yaml -m accel_flatshard.run -m my_package.train --lr 1e-4 ...

Calls :func:`accel_flatshard.integrations.accelerate.register` (so the script's
``from accelerate import Accelerator`` gets accel_flatshard's subclass), then runs the script as
``__main__`` with ``sys.argv`` as if it had been started directly.
"""
from __future__ import annotations

import os
import contextlib
import runpy
import sys
from typing import List, Optional

USAGE = (
    "usage: python -m accel_flatshard.run SCRIPT.py [ARGS...]\n"
    "       python -m accel_flatshard.run -m MODULE [ARGS...]\n"
    "Runs the script with accelerate.Accelerator replaced by accel_flatshard's Accelerator."
)


def _register() -> None:
    from .integrations.accelerate import register

    register()


def main(argv: Optional[List[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        raise SystemExit(2 if not argv else 0)
    if argv[0] == "-m":
        if len(argv) < 2:
            print(USAGE, file=sys.stderr)
            raise SystemExit(2)
        _register()
        module = argv[1]
        sys.argv = [module] + argv[2:]  # runpy puts the module's file name in sys.argv[0]
        with _shutdown_process_group():
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script = argv[0]
    if not os.path.isfile(script):
        print(f"accel_flatshard.run: no such script {script!r}\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)
    _register()
    sys.argv = [script] + argv[1:]
    # as `python script.py` does: the script's directory first on sys.path (sibling imports work)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    with _shutdown_process_group():
        runpy.run_path(script, run_name="__main__")


@contextlib.contextmanager
def _shutdown_process_group():
    """Destroy the process group when the script ends, normally or by an exception, so that no rank
    exits with communicators (and gloo's threads) still open."""
    try:
        yield
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
