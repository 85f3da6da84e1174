"""accelerate's free FSDP checkpoint functions, made to work for accel_flatshard models.

``transformers.Trainer`` (checkpoints, resume, ``load_best_model_at_end``) and other code call
``accelerate.utils.save_fsdp_model`` / ``load_fsdp_model`` / ``save_fsdp_optimizer`` /
``load_fsdp_optimizer`` directly instead of ``Accelerator.save_state``.  Those enter torch FSDP's
``state_dict_type`` context, which finds no torch FSDP module in an accel_flatshard model and fails
(``KeyError: None``).  :mod:`.patches` replaces the four names everywhere they are looked up
(``accelerate.utils``, ``accelerate.utils.fsdp_utils`` and every already imported module that bound
them with ``from accelerate.utils import ...``, e.g. ``transformers.trainer``) by the functions below.
For a model that is not sharded by accel_flatshard they call accelerate's original.

Layout on disk is accelerate's own (file names from ``accelerate.utils.constants``), so accelerate's
tools (``accelerate merge-weights``) and the Trainer's checkpoint detection keep working:

* SHARDED_STATE_DICT: ``pytorch_model_fsdp_{i}/`` (a DCP directory written by every rank, keys
  ``model.<name>``) and ``optimizer_{i}/``;
* FULL_STATE_DICT: ``pytorch_model_fsdp.bin`` / ``pytorch_model_fsdp_{i}.bin`` (i > 0) and
  ``optimizer.bin`` / ``optimizer_{i}.bin``, written by rank 0 with ``torch.save`` through
  ``checkpoint.atomic.write_atomic`` (a crash never leaves a truncated file).

Loading looks at what is on disk (a run may switch ``state_dict_type`` between save and load, as the
transformers docs advise for the final save), rank 0 deciding for everyone.
"""
from __future__ import annotations

import collections
import logging
import os
from typing import Any, Callable, Dict

import torch
import torch.nn as nn
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import fsdp_utils as _accelerate_fsdp_utils
from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME

from .. import comm
from ..checkpoint.atomic import write_atomic
from ..state_dict.registry import find_wrapper
from .config import state_dict_type_name

__all__ = ["save_fsdp_model", "load_fsdp_model", "save_fsdp_optimizer", "load_fsdp_optimizer",
           "model_file_name", "model_dir_name", "optimizer_file_name", "optimizer_dir_name"]

logger = logging.getLogger(__name__)

# the load result accelerate returns (torch's nn.Module.load_state_dict result has the same fields)
LoadResult = collections.namedtuple("LoadResult", ["missing_keys", "unexpected_keys"])

_ORIGINALS: Dict[str, Callable[..., Any]] = {
    name: getattr(_accelerate_fsdp_utils, name)
    for name in ("save_fsdp_model", "load_fsdp_model", "save_fsdp_optimizer", "load_fsdp_optimizer")
}


# ---------------------------------------------------------------------- accelerate's names
def model_file_name(index: int) -> str:
    """FULL_STATE_DICT model file, as ``accelerate.utils.fsdp_utils.save_fsdp_model`` names it."""
    return f"{FSDP_MODEL_NAME}.bin" if index == 0 else f"{FSDP_MODEL_NAME}_{index}.bin"


def model_dir_name(index: int) -> str:
    """SHARDED_STATE_DICT model directory (DCP)."""
    return f"{FSDP_MODEL_NAME}_{index}"


def optimizer_file_name(index: int) -> str:
    return f"{OPTIMIZER_NAME}.bin" if index == 0 else f"{OPTIMIZER_NAME}_{index}.bin"


def optimizer_dir_name(index: int) -> str:
    return f"{OPTIMIZER_NAME}_{index}"


# ---------------------------------------------------------------------- helpers
def plain_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _check_use_dcp(use_dcp: bool, what: str) -> None:
    if not use_dcp:
        raise ValueError(
            f"{what}(use_dcp=False) (per-rank torch.save files) is not supported for accel_flatshard models: "
            "sharded checkpoints are always DCP directories that load at any world size; drop use_dcp=False"
        )


def _is_main(accelerator: Any) -> bool:
    return accelerator.process_index == 0


def atomic_torch_save(obj: Any, path: str) -> None:
    """``torch.save`` through the atomic writer: a crash never leaves a truncated checkpoint file."""
    write_atomic(path, lambda tmp: torch.save(obj, tmp))


def _layout(accelerator: Any, directory: str, dir_name: str, file_name: str, what: str) -> str:
    """``"sharded"`` or ``"full"`` by what ``directory`` holds (rank 0 decides), else FileNotFoundError."""
    if _is_main(accelerator):
        found = ("sharded" if os.path.isdir(os.path.join(directory, dir_name))
                 else "full" if os.path.isfile(os.path.join(directory, file_name)) else None)
    else:
        found = None
    found = comm.broadcast_object(torch.distributed.group.WORLD if accelerator.num_processes > 1 else None, found)
    if found is None:
        raise FileNotFoundError(
            f"{directory} holds neither {dir_name}/ (SHARDED_STATE_DICT) nor {file_name} (FULL_STATE_DICT): "
            f"no {what} saved by save_fsdp_* / save_state under an FSDP config with this index"
        )
    return found


def _input_dir(directory: str, dir_name: str) -> str:
    # accelerate accepts the checkpoint folder or the model/optimizer directory itself
    directory = os.fspath(directory)
    return os.path.dirname(directory.rstrip(os.sep)) if os.path.basename(directory.rstrip(os.sep)) == dir_name \
        else directory


# ---------------------------------------------------------------------- the four functions
def save_fsdp_model(fsdp_plugin: Any, accelerator: Any, model: nn.Module, output_dir: str, model_index: int = 0,
                    adapter_only: bool = False, use_dcp: bool = True) -> None:
    """accelerate's ``save_fsdp_model`` for accel_flatshard models (collective: every rank calls it).

    ``adapter_only`` (PEFT) is accepted and the whole model is written (a superset of the adapter that
    loads back the same way)."""
    wrapped = find_wrapper(model)
    if wrapped is None:
        return _ORIGINALS["save_fsdp_model"](fsdp_plugin, accelerator, model, output_dir, model_index=model_index,
                                             adapter_only=adapter_only, use_dcp=use_dcp)
    from ..checkpoint import full_state_dict, save_sharded_model

    _check_use_dcp(use_dcp, "save_fsdp_model")
    os.makedirs(output_dir, exist_ok=True)
    if state_dict_type_name(fsdp_plugin) == "SHARDED_STATE_DICT":
        path = os.path.join(output_dir, model_dir_name(model_index))
        logger.info(f"Saving model to {path}")
        save_sharded_model(wrapped, path)
    else:
        path = os.path.join(output_dir, model_file_name(model_index))
        state = full_state_dict(wrapped, rank0_only=True, cpu_offload=True)
        if _is_main(accelerator):
            logger.info(f"Saving model to {path}")
            atomic_torch_save(state, path)
        del state
    accelerator.wait_for_everyone()


def load_fsdp_model(fsdp_plugin: Any, accelerator: Any, model: nn.Module, input_dir: str, model_index: int = 0,
                    adapter_only: bool = False, use_dcp: bool = True) -> Any:
    """accelerate's ``load_fsdp_model`` for accel_flatshard models; SHARDED or FULL is read from disk."""
    wrapped = find_wrapper(model)
    if wrapped is None:
        return _ORIGINALS["load_fsdp_model"](fsdp_plugin, accelerator, model, input_dir, model_index=model_index,
                                             adapter_only=adapter_only, use_dcp=use_dcp)
    from ..checkpoint import load_full_state_dict, load_sharded_model

    _check_use_dcp(use_dcp, "load_fsdp_model")
    state_dict_type_name(fsdp_plugin)
    accelerator.wait_for_everyone()
    input_dir = _input_dir(input_dir, model_dir_name(model_index))
    layout = _layout(accelerator, input_dir, model_dir_name(model_index), model_file_name(model_index), "model")
    if layout == "sharded":
        load_sharded_model(wrapped, os.path.join(input_dir, model_dir_name(model_index)))
    else:
        path = os.path.join(input_dir, model_file_name(model_index))
        state = torch.load(path, map_location="cpu", weights_only=True) if _is_main(accelerator) else None
        load_full_state_dict(wrapped, state)  # strict: a missing or unexpected key is an error
        del state
    accelerator.wait_for_everyone()
    return LoadResult([], [])


def save_fsdp_optimizer(fsdp_plugin: Any, accelerator: Any, optimizer: Any, model: nn.Module, output_dir: str,
                        optimizer_index: int = 0, use_dcp: bool = True) -> None:
    """accelerate's ``save_fsdp_optimizer`` for optimizers of accel_flatshard models (collective)."""
    wrapped = find_wrapper(model)
    if wrapped is None:
        return _ORIGINALS["save_fsdp_optimizer"](fsdp_plugin, accelerator, optimizer, model, output_dir,
                                                 optimizer_index=optimizer_index, use_dcp=use_dcp)
    from ..checkpoint import full_optim_state_dict, save_sharded_optimizer

    _check_use_dcp(use_dcp, "save_fsdp_optimizer")
    os.makedirs(output_dir, exist_ok=True)
    optimizer = plain_optimizer(optimizer)
    if state_dict_type_name(fsdp_plugin) == "SHARDED_STATE_DICT":
        path = os.path.join(output_dir, optimizer_dir_name(optimizer_index))
        logger.info(f"Saving Optimizer state to {path}")
        save_sharded_optimizer(wrapped, optimizer, path)
    else:
        path = os.path.join(output_dir, optimizer_file_name(optimizer_index))
        state = full_optim_state_dict(wrapped, optimizer)  # collective; rank 0 gets the dict
        if _is_main(accelerator):
            logger.info(f"Saving Optimizer state to {path}")
            atomic_torch_save(state, path)
        del state
    accelerator.wait_for_everyone()


def load_fsdp_optimizer(fsdp_plugin: Any, accelerator: Any, optimizer: Any, model: nn.Module, input_dir: str,
                        optimizer_index: int = 0, adapter_only: bool = False, use_dcp: bool = True) -> None:
    """accelerate's ``load_fsdp_optimizer`` for optimizers of accel_flatshard models; layout read from disk."""
    wrapped = find_wrapper(model)
    if wrapped is None:
        return _ORIGINALS["load_fsdp_optimizer"](fsdp_plugin, accelerator, optimizer, model, input_dir,
                                                 optimizer_index=optimizer_index, adapter_only=adapter_only,
                                                 use_dcp=use_dcp)
    from ..checkpoint import load_full_optim_state_dict, load_sharded_optimizer

    _check_use_dcp(use_dcp, "load_fsdp_optimizer")
    state_dict_type_name(fsdp_plugin)
    accelerator.wait_for_everyone()
    optimizer = plain_optimizer(optimizer)
    input_dir = _input_dir(input_dir, optimizer_dir_name(optimizer_index))
    layout = _layout(accelerator, input_dir, optimizer_dir_name(optimizer_index),
                     optimizer_file_name(optimizer_index), "optimizer state")
    if layout == "sharded":
        load_sharded_optimizer(wrapped, optimizer, os.path.join(input_dir, optimizer_dir_name(optimizer_index)))
    else:
        path = os.path.join(input_dir, optimizer_file_name(optimizer_index))
        state = torch.load(path, map_location="cpu", weights_only=True) if _is_main(accelerator) else None
        load_full_optim_state_dict(wrapped, optimizer, state)
        del state
    accelerator.wait_for_everyone()
