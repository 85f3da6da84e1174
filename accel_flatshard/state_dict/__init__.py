"""State dicts in memory (no files): the full model state dict gathered/loaded one flat parameter at a time, what
the sharded module's ``state_dict()``/``load_state_dict()`` return and take (:mod:`.model`), optimizer state by
parameter name (:mod:`.optim`).  Imports neither ``checkpoint/`` (on disk: only its ``format``, the errors and
dtype names) nor ``integrations/``."""
from .model import find_wrapper, full_state_dict, load_full_state_dict, local_slices
from .optim import (full_optim_state_dict, load_full_optim_state_dict, optim_state_dict_from_torch,
                    optim_state_dict_to_torch)

__all__ = [
    "full_state_dict", "load_full_state_dict", "full_optim_state_dict", "load_full_optim_state_dict",
    "optim_state_dict_to_torch", "optim_state_dict_from_torch", "find_wrapper", "local_slices",
]
