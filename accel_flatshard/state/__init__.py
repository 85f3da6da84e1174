"""State above the wrapper, as torch's state-dict API sits above FSDP: optimizer state by parameter name
(:mod:`.optim`), checkpoints on disk (:mod:`.atomic` the one file writer, :mod:`.dcp` DCP's planners over flat
shards, :mod:`.sharded` sharded model and optimizer checkpoints, :mod:`.commit` the commit protocol and the
asynchronous save, :mod:`.offline` tools that need no process group, :mod:`.torch_api` torch's own state-dict API
(``get_state_dict`` / ``set_state_dict``: ShardedTensors of this rank's pieces)).  The model's own full state dict
is the core's (``core/model_state.py``); it is re-exported here with the rest.  Every name is loaded on first use.
"""
import importlib
from typing import Any

_HOMES = {
    **dict.fromkeys(["CheckpointError", "UnsafeCheckpointError"], "..core.state_errors"),
    **dict.fromkeys(["full_state_dict", "load_full_state_dict", "find_wrapper", "local_slices"],
                    "..core.model_state"),
    **dict.fromkeys(["full_optim_state_dict", "load_full_optim_state_dict", "optim_state_dict_to_torch",
                     "optim_state_dict_from_torch"], ".optim"),
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
