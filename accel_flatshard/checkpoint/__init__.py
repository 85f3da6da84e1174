"""Checkpoints on disk for accel_flatshard models: full and sharded, model and optimizer (DESIGN.md section 6).

The in-memory parts (full gather/load, optimizer state by name) live in ``accel_flatshard.state_dict`` and
are re-exported here.

* Full model: :func:`full_state_dict` / :func:`load_full_state_dict` - the plain model's state dict,
  gathered to rank 0 one flat parameter at a time (``save_pretrained``/``load_state_dict`` compatible).
* Sharded model: :func:`save_sharded_model` / :func:`load_sharded_model` - torch.distributed.checkpoint,
  every rank writes its own shard, loading reshards to any world size.
* Optimizer: :func:`full_optim_state_dict` / :func:`load_full_optim_state_dict` (name-keyed, full
  shapes; :func:`optim_state_dict_to_torch` / :func:`optim_state_dict_from_torch` convert to and from a
  plain torch optimizer's format) and :func:`save_sharded_optimizer` / :func:`load_sharded_optimizer`.
* Offline: :func:`read_checkpoint_info`, :func:`consolidate` (sharded model -> HF safetensors).

Example::

    from accel_flatshard.checkpoint import save_sharded_model, save_sharded_optimizer
    save_sharded_model(model, "ckpt/model")
    save_sharded_optimizer(model, optimizer, "ckpt/optim")
"""
from ..state_dict import (  # in-memory state dicts, re-exported: the documented checkpoint API
    CheckpointError,
    UnsafeCheckpointError,
    full_optim_state_dict,
    full_state_dict,
    load_full_optim_state_dict,
    load_full_state_dict,
    optim_state_dict_from_torch,
    optim_state_dict_to_torch,
)
from .consolidate import consolidate, read_checkpoint_info, read_full_tensors
from .optim_sharded import load_sharded_optimizer, save_sharded_optimizer
from .sharded import load_sharded_model, save_sharded_model

__all__ = [
    "CheckpointError",
    "UnsafeCheckpointError",
    "full_state_dict",
    "load_full_state_dict",
    "save_sharded_model",
    "load_sharded_model",
    "full_optim_state_dict",
    "load_full_optim_state_dict",
    "optim_state_dict_to_torch",
    "optim_state_dict_from_torch",
    "save_sharded_optimizer",
    "load_sharded_optimizer",
    "read_checkpoint_info",
    "read_full_tensors",
    "consolidate",
]
