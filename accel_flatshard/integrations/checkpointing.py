"""``save_state`` / ``load_state`` for the Accelerate backend.

The directory layout is accelerate's for torch FSDP, so tools and habits carry over:

* FULL_STATE_DICT: ``pytorch_model_fsdp.bin`` and ``optimizer.bin`` (rank 0 writes, ``torch.save``);
* SHARDED_STATE_DICT: ``pytorch_model_fsdp_0/`` and ``optimizer_0/`` (every rank writes its shard);
* always, through accelerate's own helpers: ``scheduler.bin``, ``scaler.pt``, sampler states,
  ``random_states_{rank}.pkl`` and ``custom_checkpoint_{i}.pkl``.

Model and optimizer go through ``accel_flatshard.checkpoint``; everything else is accelerate's code
(``save_accelerator_state`` / ``load_accelerator_state`` with empty model and optimizer lists, as its
FSDP path does), and the order of steps, the hooks and ``automatic_checkpoint_naming`` /
``total_limit`` follow ``Accelerator.save_state`` / ``load_state`` of accelerate 1.15.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from typing import TYPE_CHECKING, Any, Optional

import torch
from accelerate.checkpointing import load_accelerator_state, load_custom_state, save_accelerator_state
from accelerate.checkpointing import save_custom_state
from accelerate.optimizer import AcceleratedOptimizer

if TYPE_CHECKING:
    from .accelerate import Accelerator

logger = logging.getLogger(__name__)

FULL_MODEL_FILE = "pytorch_model_fsdp{suffix}.bin"  # accelerate's FSDP_MODEL_NAME
SHARDED_MODEL_DIR = "pytorch_model_fsdp_{index}"
FULL_OPTIM_FILE = "optimizer{suffix}.bin"  # accelerate's OPTIMIZER_NAME
SHARDED_OPTIM_DIR = "optimizer_{index}"


def _suffix(index: int) -> str:
    return "" if index == 0 else f"_{index}"


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


def _plain_optimizer(opt: Any) -> torch.optim.Optimizer:
    while isinstance(opt, AcceleratedOptimizer):
        opt = opt.optimizer
    return opt


def _state_dict_type(acc: "Accelerator") -> str:
    # read at call time: scripts switch it (plugin.set_state_dict_type) e.g. for a final FULL save
    sdt = getattr(acc.state.fsdp_plugin, "state_dict_type", None)
    return getattr(sdt, "name", None) or str(sdt or acc.flatshard_options.state_dict_type).upper()


def save_state(acc: "Accelerator", output_dir: Optional[str], safe_serialization: bool = True) -> str:
    from ..checkpoint import full_optim_state_dict, full_state_dict, save_sharded_model, save_sharded_optimizer

    output_dir = _save_dir(acc, output_dir)
    logger.info(f"Saving current state to {output_dir}")
    sdt = _state_dict_type(acc)
    model = acc._flatshard_model()
    if sdt == "SHARDED_STATE_DICT":
        save_sharded_model(model, os.path.join(output_dir, SHARDED_MODEL_DIR.format(index=0)))
        for i, opt in enumerate(acc._optimizers):
            save_sharded_optimizer(model, _plain_optimizer(opt), os.path.join(output_dir, SHARDED_OPTIM_DIR.format(index=i)))
    else:
        state = full_state_dict(model, rank0_only=True, cpu_offload=True)
        if acc.is_main_process:
            _atomic_torch_save(state, os.path.join(output_dir, FULL_MODEL_FILE.format(suffix="")))
        del state
        for i, opt in enumerate(acc._optimizers):
            osd = full_optim_state_dict(model, _plain_optimizer(opt))  # collective
            if acc.is_main_process:
                _atomic_torch_save(osd, os.path.join(output_dir, FULL_OPTIM_FILE.format(suffix=_suffix(i))))
            del osd

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
    from ..checkpoint import load_full_optim_state_dict, load_full_state_dict, load_sharded_model
    from ..checkpoint import load_sharded_optimizer

    input_dir = _load_dir(acc, input_dir)
    logger.info(f"Loading states from {input_dir}")
    model = acc._flatshard_model()
    sharded_dir = os.path.join(input_dir, SHARDED_MODEL_DIR.format(index=0))
    full_file = os.path.join(input_dir, FULL_MODEL_FILE.format(suffix=""))
    # The layout on disk decides (a run may switch state_dict_type between save and load).  Rank 0
    # decides for everyone: FULL files are read by rank 0 only and broadcast, so other nodes need not
    # see them.
    layout = [("sharded" if os.path.isdir(sharded_dir) else "full" if os.path.isfile(full_file) else None)
              if acc.is_main_process else None]
    if acc.num_processes > 1:
        torch.distributed.broadcast_object_list(layout, src=0)
    if layout[0] == "sharded":
        load_sharded_model(model, sharded_dir)
        for i, opt in enumerate(acc._optimizers):
            load_sharded_optimizer(model, _plain_optimizer(opt), os.path.join(input_dir, SHARDED_OPTIM_DIR.format(index=i)))
    elif layout[0] == "full":
        main = acc.is_main_process
        load_full_state_dict(model, torch.load(full_file, map_location="cpu", weights_only=True) if main else None)
        for i, opt in enumerate(acc._optimizers):
            path = os.path.join(input_dir, FULL_OPTIM_FILE.format(suffix=_suffix(i)))
            osd = torch.load(path, map_location="cpu", weights_only=True) if main else None
            load_full_optim_state_dict(model, _plain_optimizer(opt), osd)
    else:
        raise FileNotFoundError(
            f"{input_dir} holds neither {os.path.basename(sharded_dir)}/ (SHARDED_STATE_DICT) nor "
            f"{os.path.basename(full_file)} (FULL_STATE_DICT): not a checkpoint written by save_state under FSDP"
        )

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


def _atomic_torch_save(obj: Any, path: str) -> None:
    """Write to a temporary name, then rename: a crash never leaves a truncated checkpoint file."""
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)
