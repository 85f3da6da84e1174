"""accel_flatshard's backend for ``accelerate launch --config_file <FSDP yaml> train.py`` run WITHOUT the runner.

torch calls :func:`autoload` at the end of ``import torch`` (pyproject.toml declares it in torch's entry-point group
``torch.backends``, torch's plugin mechanism for out-of-tree backends; ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns
every such plugin off).  It is a top-level module so that loading it imports nothing: in any process that is not a
launched FSDP run of W > 1 processes (``ACCELERATE_USE_FSDP`` true, ``WORLD_SIZE`` > 1: what ``accelerate launch``
exports for an FSDP yaml) it reads two environment variables and returns.  In such a run it waits (an import hook
that only watches) until accelerate has loaded ``accelerate.accelerator``, then calls
:func:`accel_flatshard.integrations.accelerate.register_for_launch_without_runner`: on a host without CUDA, where
accelerate's own FSDP either fails (FSDP1 configs: ``sync_module_states``) or trains one unsharded copy per
process (FSDP2 configs), it does what ``-m accel_flatshard.run`` does (``register()``), so the script's
``from accelerate import Accelerator`` gets accel_flatshard's, whichever of torch and accelerate it imports first.
On a host with CUDA accelerate's torch FSDP runs as configured.  docs/accelerate.md says why.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Optional

_TRUE = ("1", "true", "yes", "y", "on")


def autoload() -> None:
    """torch's entry point: arm :class:`_WhenAccelerateIsLoaded` in a launched FSDP run of several processes."""
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "").strip().lower() in _TRUE
    world = os.environ.get("WORLD_SIZE", "1").strip()
    armed = any(isinstance(f, _WhenAccelerateIsLoaded) for f in sys.meta_path)
    if fsdp and world.isdigit() and int(world) > 1 and not armed:
        sys.meta_path.insert(0, _WhenAccelerateIsLoaded())


class _WhenAccelerateIsLoaded:
    """A meta-path entry that finds nothing: at the first import after ``accelerate.accelerator`` has finished
    loading (accelerate's ``__init__`` goes on importing its other modules) it registers accel_flatshard, once,
    unless accel_flatshard's Accelerator module is loading already (the runner, or a script that imports it).
    While another accel_flatshard module is loading (one that imports accelerate, e.g. ``integrations.state_io``
    imported first) it waits for a later import: registering resolves that module's names, not yet defined."""

    done = False

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Optional[Any]:
        if self.done or _loading("accelerate.accelerator"):
            return None
        if "accel_flatshard.integrations.accelerate" in sys.modules:
            self.done = True
            return None  # the runner, or a script that imports accel_flatshard's Accelerator: it is being set up
        if any(_loading(n) for n in list(sys.modules) if n.partition(".")[0] == "accel_flatshard"):
            return None
        self.done = True  # (before registering: that imports more)
        from accel_flatshard.integrations.accelerate import register_for_launch_without_runner

        register_for_launch_without_runner()
        return None


def _loading(name: str) -> bool:
    """``name`` is not imported yet, or its import is still running."""
    module = sys.modules.get(name)
    return module is None or bool(getattr(getattr(module, "__spec__", None), "_initializing", False))
