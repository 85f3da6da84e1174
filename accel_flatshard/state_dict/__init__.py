"""State dicts in memory (no files): full gather/load one flat parameter at a time, the sharded module's
``state_dict()``/``load_state_dict()``, and optimizer state by parameter name.  Imports neither
``checkpoint/`` (on disk) nor ``integrations/``.

* :mod:`.full` - :func:`full_state_dict` / :func:`load_full_state_dict`;
* :mod:`.module_hooks` - what ``state_dict()`` of the wrapper and of the unwrapped module return;
* :mod:`.registry` - :func:`find_wrapper`, :func:`local_state_dict`, the fail-fast rendezvous;
* :mod:`.optim` / :mod:`.optim_index` - name-keyed full optimizer state dicts and the per-parameter schema;
* :mod:`.index` - where each state-dict entry lives (parameter -> flat parameter, slot, piece);
* :mod:`.types` - :class:`CheckpointError` and dtype names.
"""
from .full import full_state_dict, load_full_state_dict
from .optim import full_optim_state_dict, load_full_optim_state_dict, optim_state_dict_from_torch, optim_state_dict_to_torch
from .registry import find_wrapper, local_state_dict
from .types import CheckpointError, UnsafeCheckpointError

__all__ = [
    "CheckpointError", "UnsafeCheckpointError", "full_state_dict", "load_full_state_dict", "full_optim_state_dict",
    "load_full_optim_state_dict", "optim_state_dict_to_torch", "optim_state_dict_from_torch", "find_wrapper",
    "local_state_dict",
]
