"""Checkpoints on disk for accel_flatshard models (its modules: docs/ARCHITECTURE.md, "Checkpoints on disk").

The full (gathered) state dicts are in memory: their home is :mod:`accel_flatshard.state_dict`.  Every name here is
loaded on first use: importing ``.format`` from ``state_dict/`` runs this file, which must not import ``state_dict/``
back.
"""
import importlib
from typing import Any

_HOMES = {
    **dict.fromkeys(["CheckpointError", "UnsafeCheckpointError"], ".format"),
    **dict.fromkeys(["save_sharded_model", "load_sharded_model", "save_sharded_optimizer", "load_sharded_optimizer"],
                    ".sharded"),
    **dict.fromkeys(["read_checkpoint_info", "read_full_tensors", "consolidate"], ".offline"),
    "newest_complete_checkpoint": ".commit",
}
__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name], __name__), name)
