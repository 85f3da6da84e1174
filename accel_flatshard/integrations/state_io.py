"""The Accelerator's state I/O: ``save_state`` / ``load_state``, and accelerate's free FSDP functions.

The Trainer (checkpoints, resume, ``load_best_model_at_end``) and other code call accelerate's ``save_fsdp_model``
/ ``load_fsdp_model`` / ``save_fsdp_optimizer`` / ``load_fsdp_optimizer`` directly; their torch FSDP
``state_dict_type`` context finds no torch FSDP module in an accel_flatshard model (``KeyError: None``).
:mod:`.patches` puts the functions below in their place (accelerate's original runs for a model accel_flatshard
does not shard); :func:`save_state` / :func:`load_state` use the same four.  The layout is accelerate's for torch
FSDP (names from ``accelerate.utils.constants``), so ``accelerate merge-weights`` and the Trainer's checkpoint
detection keep working: SHARDED_STATE_DICT writes the DCP directories ``pytorch_model_fsdp_{i}/`` and
``optimizer_{i}/`` from every rank (``state/sharded.py``), FULL_STATE_DICT ``pytorch_model_fsdp.bin`` /
``pytorch_model_fsdp_{i}.bin`` (i > 0) and ``optimizer.bin`` / ``optimizer_{i}.bin`` from rank 0 (atomically).
``save_state`` writes the rest (scheduler, scaler, samplers, RNG, custom objects) with accelerate's own helpers,
following accelerate 1.15's order of steps, hooks and ``automatic_checkpoint_naming`` / ``total_limit``.  Loading
reads the layout on disk (a run may switch ``state_dict_type`` between save and load, as the transformers docs
advise for the final save), rank 0 deciding for everyone.
"""
from __future__ import annotations

import logging
import os
import re
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from accelerate.checkpointing import (load_accelerator_state, load_custom_state, save_accelerator_state,
                                      save_custom_state)
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import fsdp_utils as _accelerate_fsdp_utils
from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME, SCHEDULER_NAME

from ..core import comm
from ..state import commit
from ..state.atomic import write_atomic
from ..state.sharded import (load_sharded_model, load_sharded_optimizer, model_entries, optimizer_entries, save_entries,
                             save_sharded_model, save_sharded_optimizer)
from ..core.fully_sharded import FullyShardedDataParallel
from ..core.model_state import LoadResult, find_wrapper, full_state_dict, load_full_state_dict, record_of
from ..state.optim import full_optim_state_dict, load_full_optim_state_dict
from .config import state_dict_type_name


logger = logging.getLogger(__name__)
wait_for_saves = commit.wait_for_saves  # end_training: the save in flight first

_ORIGINALS: Dict[str, Callable[..., Any]] = {name: getattr(_accelerate_fsdp_utils, name) for name in (
    "save_fsdp_model", "load_fsdp_model", "save_fsdp_optimizer", "load_fsdp_optimizer")}


def accelerate_names(base: str, index: int) -> Tuple[str, str]:
    """The SHARDED_STATE_DICT directory (DCP) and FULL_STATE_DICT file of model / optimizer ``index``, as
    ``accelerate.utils.fsdp_utils`` names them (``base``: ``FSDP_MODEL_NAME`` or ``OPTIMIZER_NAME``)."""
    return f"{base}_{index}", f"{base}.bin" if index == 0 else f"{base}_{index}.bin"


def plain_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


# ---------------------------------------------------------------------- one save, one load
def _wrapper_of(model: nn.Module, use_dcp: bool, what: str) -> Optional[FullyShardedDataParallel]:
    """The accel_flatshard wrapper of ``model`` (None: accelerate's original applies); ``use_dcp=False`` raises."""
    wrapped = find_wrapper(model)
    if wrapped is not None and not use_dcp:
        raise ValueError(
            f"{what}(use_dcp=False) (per-rank torch.save files) is not supported for accel_flatshard models: "
            "sharded checkpoints are always DCP directories that load at any world size; drop use_dcp=False")
    return wrapped


def _save(fsdp_plugin: Any, accelerator: Any, output_dir: str, names: Tuple[str, str], what: str,
          save_sharded: Callable[[str], None], gather_full: Callable[[], Dict[str, Any]],
          entries: Callable[[], Tuple[Any, Dict, Dict]], adapter: Any) -> None:
    """Collective: ``save_sharded(dir)`` under SHARDED_STATE_DICT, else rank 0 writes ``gather_full()``.  During an
    asynchronous save (:data:`SNAPSHOTS` set) this step's state is copied to host memory instead (``entries()``
    under SHARDED, on the streams of ``adapter``, the model's device adapter; FULL: rank 0's gathered CPU copies) and
    the writer of its part goes to the save's parts (``state/commit.py``)."""
    os.makedirs(output_dir, exist_ok=True)
    sharded = state_dict_type_name(fsdp_plugin) == "SHARDED_STATE_DICT"
    path = os.path.join(output_dir, names[0] if sharded else names[1])
    background = commit.saving_in_background()
    if sharded and background:
        _, live, meta = entries()
        commit.defer_sharded(path, live, adapter, lambda writer, snapshot: save_entries(writer, path, snapshot, meta))
        return
    if sharded:
        logger.info(f"Saving {what} to {path}")
        save_sharded(path)
    else:
        state, main = gather_full(), accelerator.process_index == 0  # collective; rank 0 gets the dict, others {}
        if background:
            commit.defer_write(path, lambda writer: main and write_atomic(path, lambda tmp: torch.save(state, tmp)))
            return
        if main:
            logger.info(f"Saving {what} to {path}")
            write_atomic(path, lambda tmp: torch.save(state, tmp))  # a crash never leaves a truncated file
        del state
    accelerator.wait_for_everyone()


def _load_sharded_or_full(fsdp_plugin: Any, accelerator: Any, input_dir: str, names: Tuple[str, str], what: str,
                          load_sharded: Callable[[str], None],
                          load_full: Callable[[Optional[Dict[str, Any]]], None]) -> None:
    """Collective: the layout on disk decides (rank 0 looks); a full file is read by rank 0 and broadcast."""
    dir_name, file_name = names
    state_dict_type_name(fsdp_plugin)
    accelerator.wait_for_everyone()
    directory = os.fspath(input_dir).rstrip(os.sep)
    if os.path.basename(directory) == dir_name:  # accelerate accepts the checkpoint folder or this directory
        directory = os.path.dirname(directory)
    commit.wait_for_saves()  # e.g. the Trainer's load_best_model_at_end right after an asynchronous checkpoint
    commit.check_complete(directory)  # a save_state / Trainer checkpoint whose save was interrupted
    sharded, full = os.path.join(directory, dir_name), os.path.join(directory, file_name)
    main = accelerator.process_index == 0
    found = ("sharded" if os.path.isdir(sharded) else "full" if os.path.isfile(full) else None) if main else None
    found = comm.broadcast_object(torch.distributed.group.WORLD if accelerator.num_processes > 1 else None, found)
    if found is None:
        raise FileNotFoundError(
            f"{directory} holds neither {dir_name}/ (SHARDED_STATE_DICT) nor {file_name} (FULL_STATE_DICT): "
            f"no {what} saved by save_fsdp_* / save_state under an FSDP config with this index")
    if found == "sharded":
        load_sharded(sharded)
    else:
        load_full(torch.load(full, map_location="cpu", weights_only=True) if main else None)  # strict
    accelerator.wait_for_everyone()


# ---------------------------------------------------------------------- the four functions
def save_fsdp_model(fsdp_plugin: Any, accelerator: Any, model: nn.Module, output_dir: str, model_index: int = 0,
                    adapter_only: bool = False, use_dcp: bool = True) -> None:
    """accelerate's ``save_fsdp_model`` for accel_flatshard models (collective: every rank calls it).

    ``adapter_only`` (PEFT) is accepted and the whole model is written (a superset of the adapter that
    loads back the same way)."""
    wrapped = _wrapper_of(model, use_dcp, "save_fsdp_model")
    if wrapped is None:
        return _ORIGINALS["save_fsdp_model"](fsdp_plugin, accelerator, model, output_dir, model_index=model_index,
                                             adapter_only=adapter_only, use_dcp=use_dcp)
    _save(fsdp_plugin, accelerator, output_dir, accelerate_names(FSDP_MODEL_NAME, model_index), "model",
          lambda path: save_sharded_model(wrapped, path), lambda: full_state_dict(wrapped),
          lambda: model_entries(wrapped), wrapped.schedule.adapter)


def load_fsdp_model(fsdp_plugin: Any, accelerator: Any, model: nn.Module, input_dir: str, model_index: int = 0,
                    adapter_only: bool = False, use_dcp: bool = True) -> Any:
    """accelerate's ``load_fsdp_model`` for accel_flatshard models; SHARDED or FULL is read from disk."""
    wrapped = _wrapper_of(model, use_dcp, "load_fsdp_model")
    if wrapped is None:
        return _ORIGINALS["load_fsdp_model"](fsdp_plugin, accelerator, model, input_dir, model_index=model_index,
                                             adapter_only=adapter_only, use_dcp=use_dcp)
    _load_sharded_or_full(fsdp_plugin, accelerator, input_dir,
                          accelerate_names(FSDP_MODEL_NAME, model_index), "model",
                          lambda path: load_sharded_model(wrapped, path),
                          lambda state: load_full_state_dict(wrapped, state))
    return LoadResult([], [])


def save_fsdp_optimizer(fsdp_plugin: Any, accelerator: Any, optimizer: Any, model: nn.Module, output_dir: str,
                        optimizer_index: int = 0, use_dcp: bool = True) -> None:
    """accelerate's ``save_fsdp_optimizer`` for optimizers of accel_flatshard models (collective)."""
    wrapped = _wrapper_of(model, use_dcp, "save_fsdp_optimizer")
    if wrapped is None:
        return _ORIGINALS["save_fsdp_optimizer"](fsdp_plugin, accelerator, optimizer, model, output_dir,
                                                 optimizer_index=optimizer_index, use_dcp=use_dcp)
    optimizer = plain_optimizer(optimizer)
    _save(fsdp_plugin, accelerator, output_dir, accelerate_names(OPTIMIZER_NAME, optimizer_index), "Optimizer state",
          lambda path: save_sharded_optimizer(wrapped, optimizer, path),
          lambda: full_optim_state_dict(wrapped, optimizer), lambda: optimizer_entries(wrapped, optimizer),
          wrapped.schedule.adapter)


def load_fsdp_optimizer(fsdp_plugin: Any, accelerator: Any, optimizer: Any, model: nn.Module, input_dir: str,
                        optimizer_index: int = 0, adapter_only: bool = False, use_dcp: bool = True) -> None:
    """accelerate's ``load_fsdp_optimizer`` for optimizers of accel_flatshard models; layout read from disk."""
    wrapped = _wrapper_of(model, use_dcp, "load_fsdp_optimizer")
    if wrapped is None:
        return _ORIGINALS["load_fsdp_optimizer"](fsdp_plugin, accelerator, optimizer, model, input_dir,
                                                 optimizer_index=optimizer_index, adapter_only=adapter_only,
                                                 use_dcp=use_dcp)
    optimizer = plain_optimizer(optimizer)
    _load_sharded_or_full(fsdp_plugin, accelerator, input_dir,
                          accelerate_names(OPTIMIZER_NAME, optimizer_index), "optimizer state",
                          lambda path: load_sharded_optimizer(wrapped, optimizer, path),
                          lambda state: load_full_optim_state_dict(wrapped, optimizer, state))


# ---------------------------------------------------------------------- save_state / load_state
def _each_model_and_optimizer(acc: Any, directory: str, model_fn: Callable[..., Any],
                              optimizer_fn: Callable[..., Any]) -> None:
    """``model_fn`` for every accel_flatshard model of ``acc._models`` (index ``i`` in prepare order), then
    ``optimizer_fn`` for every optimizer with the one model whose parameters it updates."""
    models = [m for m in acc._models if isinstance(m, FullyShardedDataParallel)]
    if not models:
        raise RuntimeError("save_state/load_state: no model was prepared with accel_flatshard")
    owners = []
    for index, opt in enumerate(acc._optimizers):
        params = {id(p) for g in plain_optimizer(opt).param_groups for p in g["params"]}
        mine = [m for m in models if any(id(p) in params for p in record_of(m).module.parameters())]
        if len(mine) != 1:
            raise ValueError(
                f"optimizer {index} updates parameters of {len(mine)} prepared models "
                f"{[type(m.module).__name__ for m in mine]}; save_state under accel_flatshard needs each optimizer "
                "to belong to exactly one prepared model (make one optimizer per model)")
        owners.append(mine[0])
    for i, model in enumerate(models):
        model_fn(acc.state.fsdp_plugin, acc, model, directory, model_index=i)
    for i, (opt, model) in enumerate(zip(acc._optimizers, owners)):
        optimizer_fn(acc.state.fsdp_plugin, acc, opt, model, directory, optimizer_index=i)


def shard_size_of(acc: Any) -> int:
    """The shard group size of the first accel_flatshard model of ``acc`` (the background writer's)."""
    return next(m for m in acc._models if isinstance(m, FullyShardedDataParallel)).shard_group.shard_size


def _parts(acc: Any, sharded: bool) -> List[str]:
    """What a ``save_state`` directory holds once complete (``state/commit.py``'s manifest)."""
    models = [m for m in acc._models if isinstance(m, FullyShardedDataParallel)]
    parts = []
    for base, count in ((FSDP_MODEL_NAME, len(models)), (OPTIMIZER_NAME, len(acc._optimizers))):
        parts += [accelerate_names(base, i)[0] + "/" if sharded else accelerate_names(base, i)[1] for i in range(count)]
    parts += [f"{SCHEDULER_NAME}.bin" if i == 0 else f"{SCHEDULER_NAME}_{i}.bin" for i in range(len(acc._schedulers))]
    parts += [f"random_states_{r}.pkl" for r in range(acc.num_processes)]
    return parts + [f"custom_checkpoint_{i}.pkl" for i in range(len(acc._custom_objects))]


def save_state(acc: Any, output_dir: Optional[str], safe_serialization: bool = True,
               async_save: Optional[bool] = None) -> str:
    """``Accelerator.save_state`` for accel_flatshard models; ``async_save`` (default: ``FLATSHARD_ASYNC_SAVE``)
    returns once the state is in host memory and writes it in the background (``state/commit.py``)."""
    commit.wait_for_saves()
    background = getattr(acc, "flatshard_async_save", False) if async_save is None else bool(async_save)
    config = acc.project_configuration
    root = output_dir = (os.path.join(acc.project_dir, "checkpoints") if config.automatic_checkpoint_naming
                         else output_dir)
    if output_dir is None:
        raise ValueError("save_state needs output_dir unless ProjectConfiguration(automatic_checkpoint_naming=True)")
    if config.automatic_checkpoint_naming:
        output_dir = commit.fresh_numbered_dir(acc, root, config.total_limit, acc.save_iteration)
    logger.info(f"Saving current state to {output_dir}")
    sharded = state_dict_type_name(acc.state.fsdp_plugin) == "SHARDED_STATE_DICT"
    manifest = commit.mark_pending(acc, output_dir, _parts(acc, sharded), acc.step)
    with commit.snapshots(background) as (writes, readies):
        _each_model_and_optimizer(acc, output_dir, save_fsdp_model, save_fsdp_optimizer)
    for hook in acc._save_model_state_pre_hook.values():
        hook(acc._models, [], output_dir)  # accelerate calls the pre-hooks here, with no weights for FSDP models
    save_on_each_node = config.save_on_each_node
    # Every rank would torch.save the same scaler.pt concurrently; let the writers of shared files do it.
    writes_shared = acc.is_main_process or (save_on_each_node and acc.is_local_main_process)
    save_location = save_accelerator_state(
        output_dir, [], [], acc._schedulers, acc._dataloaders, acc.state.process_index, acc.step,
        acc.scaler if writes_shared else None, save_on_each_node=save_on_each_node,
        safe_serialization=safe_serialization)
    for i, obj in enumerate(acc._custom_objects):
        save_custom_state(obj, output_dir, i, save_on_each_node=save_on_each_node)
    config.iteration += 1
    commit.commit_when_written(
        acc, output_dir, manifest, writes, readies,
        lambda: config.automatic_checkpoint_naming and commit.prune_checkpoints(root, config.total_limit),
        shard_size_of(acc))
    return str(save_location)


def load_state(acc: Any, input_dir: Optional[str], load_kwargs: Optional[dict] = None,
               **load_model_func_kwargs: Any) -> None:
    """``Accelerator.load_state`` for accel_flatshard models; the layout (FULL or SHARDED) is read from disk.
    An incomplete checkpoint is refused; without ``input_dir`` (automatic naming) the newest complete one loads
    and the next ``save_state`` continues its numbering."""
    commit.wait_for_saves()
    if input_dir is not None:
        input_dir = os.path.expanduser(input_dir)
        if not os.path.isdir(input_dir):  # (its completeness: _load checks it)
            raise ValueError(f"Tried to find {input_dir} but folder does not exist")
    elif acc.project_configuration.automatic_checkpoint_naming:
        root = os.path.join(acc.project_dir, "checkpoints")
        input_dir = commit.newest_complete_checkpoint(root)
        if input_dir is None:
            raise ValueError(f"no complete checkpoint_<n> folder in {root}")
        # the number of checkpoint_<n>, as accelerate's sort key reads it
        acc.project_configuration.iteration = int(re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", input_dir)[0]) + 1
    else:
        raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
    logger.info(f"Loading states from {input_dir}")
    _each_model_and_optimizer(acc, input_dir, load_fsdp_model, load_fsdp_optimizer)
    for hook in acc._load_model_state_pre_hook.values():
        hook([], input_dir)  # accelerate passes no models for FSDP
    map_location = load_model_func_kwargs.pop("map_location", None) or "cpu"
    override = load_accelerator_state(input_dir, [], [], acc._schedulers, acc._dataloaders, acc.state.process_index,
                                      acc.scaler, map_location, load_kwargs, **load_model_func_kwargs)
    acc.step = override.get("step", acc.step)
    custom = [f for f in os.listdir(input_dir) if re.search(r"^custom_checkpoint_\d+\.pkl$", f) is not None]
    if len(custom) != len(acc._custom_objects):
        raise RuntimeError(
            f"Number of custom checkpoints in folder {input_dir} does not match the number of registered objects:"
            f"\n\tFound checkpoints: {len(custom)}\n\tRegistered objects: {len(acc._custom_objects)}\n"
            "Please make sure to only load checkpoints from folders that were created with the same set of "
            "registered objects.")
    for index, obj in enumerate(acc._custom_objects):
        load_custom_state(obj, input_dir, index)
