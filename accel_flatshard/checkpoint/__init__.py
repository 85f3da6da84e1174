"""Checkpoints on disk for accel_flatshard models: sharded model and optimizer (DCP, resharded on load), offline tools.

* :mod:`.sharded` - :func:`save_sharded_model` / :func:`load_sharded_model`, :func:`save_sharded_optimizer` /
  :func:`load_sharded_optimizer`: every rank writes its own shard; a load reshards to any world size; the
  directory format (``flatshard.json``, checksums, the allow-list reader of DCP's metadata);
* :mod:`.dcp` - the DCP planners and storage layer (the one user of DCP internals);
* :mod:`.atomic` - the project's one file writer (temporary file, fsync, rename);
* :mod:`.commit` - crash-consistent ``save_state`` directories (commit marker, :func:`newest_complete_checkpoint`,
  pruning) and the asynchronous save (host snapshot, background writer);
* :mod:`.offline` - :func:`read_checkpoint_info`, :func:`read_full_tensors`, :func:`consolidate` (sharded model ->
  HF safetensors), and the same for ``accelerator.save_state`` directories;
* :mod:`.format` - :class:`CheckpointError`, :class:`UnsafeCheckpointError` and the dtype names checkpoints record
  (``state_dict/`` raises them too: it imports that module alone).

The full (gathered) state dicts are in memory, not on disk: :mod:`accel_flatshard.state_dict`.  Its functions
are importable from here too, as the README documents them.  Every name here is loaded on first use: importing
``.format`` from ``state_dict/`` runs this file, which must not import ``state_dict/`` back.
"""
import importlib
from typing import Any

_HOMES = {
    **dict.fromkeys(["CheckpointError", "UnsafeCheckpointError"], ".format"),
    **dict.fromkeys(["full_state_dict", "load_full_state_dict", "full_optim_state_dict", "load_full_optim_state_dict",
                     "optim_state_dict_to_torch", "optim_state_dict_from_torch"], "..state_dict"),
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
