"""``save_state`` / ``load_state`` for the Accelerate backend.

The directory layout is accelerate's for torch FSDP, so tools and habits carry over:

* FULL_STATE_DICT: ``pytorch_model_fsdp.bin`` and ``optimizer.bin`` (rank 0 writes, ``torch.save``);
  a second model/optimizer ``pytorch_model_fsdp_1.bin`` / ``optimizer_1.bin``;
* SHARDED_STATE_DICT: ``pytorch_model_fsdp_{i}/`` and ``optimizer_{i}/`` (every rank writes its shard);
* always, through accelerate's own helpers: ``scheduler.bin``, ``scaler.pt``, sampler states,
  ``random_states_{rank}.pkl`` and ``custom_checkpoint_{i}.pkl``.

Every accel_flatshard-wrapped model in ``accelerator._models`` is saved (index ``i`` in prepare order) and
every optimizer (index ``i``, saved against the one model whose parameters it updates), through the same
functions the Trainer calls (:mod:`.fsdp_utils_shim`: accelerate's ``save_fsdp_model`` & co. for
accel_flatshard models, backed by ``accel_flatshard.checkpoint``).  Everything else is accelerate's code
(``save_accelerator_state`` / ``load_accelerator_state`` with empty model and optimizer lists, as its
FSDP path does), and the order of steps, the hooks and ``automatic_checkpoint_naming`` /
``total_limit`` follow ``Accelerator.save_state`` / ``load_state`` of accelerate 1.15.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from typing import Any, Dict, List, Optional, Protocol

import torch
from accelerate.checkpointing import load_accelerator_state, load_custom_state, save_accelerator_state
from accelerate.checkpointing import save_custom_state

from ..fully_sharded import FullyShardedDataParallel
from . import fsdp_utils_shim



class Accelerator(Protocol):
    """What these functions use of :class:`.accelerate.Accelerator` (accelerate's attributes; a Protocol,
    so this module does not import the class that imports it)."""

    _models: List[Any]
    _optimizers: List[Any]
    _schedulers: List[Any]
    _dataloaders: List[Any]
    _custom_objects: List[Any]
    _save_model_state_pre_hook: Dict[Any, Any]
    _load_model_state_pre_hook: Dict[Any, Any]
    project_configuration: Any
    project_dir: Optional[str]
    save_iteration: int
    scaler: Any
    state: Any
    step: int

    @property
    def is_main_process(self) -> bool: ...

    @property
    def is_local_main_process(self) -> bool: ...

    def wait_for_everyone(self) -> None: ...

logger = logging.getLogger(__name__)


def _checkpoint_number(folder: str) -> int:
    # accelerate's sort key for checkpoint_<n> folders
    return list(map(int, re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", folder)))[0]


def _save_dir(acc: "Accelerator", output_dir: Optional[str]) -> str:
    """Where to save: ``output_dir``, or the next ``checkpoints/checkpoint_<n>`` (oldest beyond total_limit removed)."""
    config = acc.project_configuration
    if config.automatic_checkpoint_naming:
        output_dir = os.path.join(acc.project_dir, "checkpoints")
    if output_dir is None:
        raise ValueError("save_state needs output_dir unless ProjectConfiguration(automatic_checkpoint_naming=True)")
    os.makedirs(output_dir, exist_ok=True)
    if config.automatic_checkpoint_naming:
        folders = [os.path.join(output_dir, f) for f in os.listdir(output_dir)]
        if config.total_limit is not None and len(folders) + 1 > config.total_limit and acc.is_main_process:
            folders.sort(key=_checkpoint_number)
            logger.warning(f"Deleting {len(folders) + 1 - config.total_limit} checkpoints to make room for new checkpoint.")
            for folder in folders[: len(folders) + 1 - config.total_limit]:
                shutil.rmtree(folder)
        output_dir = os.path.join(output_dir, f"checkpoint_{acc.save_iteration}")
        if os.path.exists(output_dir):
            raise ValueError(
                f"Checkpoint directory {output_dir} ({acc.save_iteration}) already exists. Please manually override "
                "`self.save_iteration` with what iteration to start with."
            )
        acc.wait_for_everyone()
    os.makedirs(output_dir, exist_ok=True)
    return output_dir


def _load_dir(acc: "Accelerator", input_dir: Optional[str]) -> str:
    if input_dir is not None:
        input_dir = os.path.expanduser(input_dir)
        if not os.path.isdir(input_dir):
            raise ValueError(f"Tried to find {input_dir} but folder does not exist")
        return input_dir
    if acc.project_configuration.automatic_checkpoint_naming:
        root = os.path.join(acc.project_dir, "checkpoints")
        folders = sorted((os.path.join(root, f) for f in os.listdir(root)), key=_checkpoint_number)
        if not folders:
            raise ValueError(f"no checkpoint_<n> folder in {root}")
        return folders[-1]
    raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")


_plain_optimizer = fsdp_utils_shim.plain_optimizer


def _wrapped_models(acc: "Accelerator") -> List[FullyShardedDataParallel]:
    """Every accel_flatshard-wrapped model in ``acc._models``, in prepare order (index ``i`` -> ``_i`` names)."""
    models = [m for m in acc._models if isinstance(m, FullyShardedDataParallel)]
    if not models:
        raise RuntimeError("save_state/load_state: no model was prepared with accel_flatshard")
    return models


def _owner(models: List[FullyShardedDataParallel], opt: Any, index: int) -> FullyShardedDataParallel:
    """The model whose parameters optimizer ``index`` updates (accelerate pairs them by position)."""
    params = {id(p) for g in _plain_optimizer(opt).param_groups for p in g["params"]}
    owners = [m for m in models if any(id(p) in params for p in m.parameters())]
    if len(owners) != 1:
        names = [type(m.module).__name__ for m in owners]
        raise ValueError(
            f"optimizer {index} updates parameters of {len(owners)} prepared models {names}; save_state under "
            "accel_flatshard needs each optimizer to belong to exactly one prepared model (make one optimizer "
            "per model)"
        )
    return owners[0]


def save_state(acc: "Accelerator", output_dir: Optional[str], safe_serialization: bool = True) -> str:
    output_dir = _save_dir(acc, output_dir)
    logger.info(f"Saving current state to {output_dir}")
    plugin = acc.state.fsdp_plugin
    models = _wrapped_models(acc)
    # one implementation with the Trainer's path: accelerate's save_fsdp_* names, accel_flatshard's code
    for i, model in enumerate(models):
        fsdp_utils_shim.save_fsdp_model(plugin, acc, model, output_dir, model_index=i)
    for i, opt in enumerate(acc._optimizers):
        fsdp_utils_shim.save_fsdp_optimizer(plugin, acc, opt, _owner(models, opt, i), output_dir, optimizer_index=i)

    # accelerate calls the pre-hooks here, with no weights for FSDP models
    for hook in acc._save_model_state_pre_hook.values():
        hook(acc._models, [], output_dir)
    save_on_each_node = acc.project_configuration.save_on_each_node
    # Every rank would torch.save the same scaler.pt concurrently; let the writers of shared files do it.
    writes_shared = acc.is_main_process or (save_on_each_node and acc.is_local_main_process)
    save_location = save_accelerator_state(
        output_dir, [], [], acc._schedulers, acc._dataloaders, acc.state.process_index, acc.step,
        acc.scaler if writes_shared else None,
        save_on_each_node=save_on_each_node, safe_serialization=safe_serialization,
    )
    for i, obj in enumerate(acc._custom_objects):
        save_custom_state(obj, output_dir, i, save_on_each_node=save_on_each_node)
    acc.project_configuration.iteration += 1
    acc.wait_for_everyone()  # a load (or a copy) right after must see every rank's files
    return str(save_location)


def load_state(acc: "Accelerator", input_dir: Optional[str], load_kwargs: Optional[dict] = None,
               **load_model_func_kwargs: Any) -> None:
    input_dir = _load_dir(acc, input_dir)
    logger.info(f"Loading states from {input_dir}")
    plugin = acc.state.fsdp_plugin
    models = _wrapped_models(acc)
    # The layout on disk decides (FULL or SHARDED; a run may switch state_dict_type between save and load).
    for i, model in enumerate(models):
        fsdp_utils_shim.load_fsdp_model(plugin, acc, model, input_dir, model_index=i)
    for i, opt in enumerate(acc._optimizers):
        fsdp_utils_shim.load_fsdp_optimizer(plugin, acc, opt, _owner(models, opt, i), input_dir, optimizer_index=i)

    for hook in acc._load_model_state_pre_hook.values():
        hook([], input_dir)  # accelerate passes no models for FSDP
    map_location = load_model_func_kwargs.pop("map_location", None) or "cpu"
    override = load_accelerator_state(
        input_dir, [], [], acc._schedulers, acc._dataloaders, acc.state.process_index, acc.scaler,
        map_location, load_kwargs, **load_model_func_kwargs,
    )
    if "step" in override:
        acc.step = override["step"]
    custom = [f for f in os.listdir(input_dir) if re.search(r"^custom_checkpoint_\d+\.pkl$", f) is not None]
    if len(custom) != len(acc._custom_objects):
        raise RuntimeError(
            f"Number of custom checkpoints in folder {input_dir} does not match the number of registered objects:"
            f"\n\tFound checkpoints: {len(custom)}\n\tRegistered objects: {len(acc._custom_objects)}\n"
            "Please make sure to only load checkpoints from folders that were created with the same set of "
            "registered objects."
        )
    for index, obj in enumerate(acc._custom_objects):
        load_custom_state(obj, input_dir, index)

