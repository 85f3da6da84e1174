"""Make the libraries around accelerate (transformers' Trainer, PEFT, TRL) see through accel_flatshard's wrapper.

Five functions of theirs know only torch's wrappers; :mod:`.patches` replaces each where it is looked up (the
table there says why): ``extract_model_from_parallel`` (how PEFT and TRL unwrap) and ``get_parameter_names`` (the
Trainer's weight-decay names) get :func:`seeing_through_wrapper`; TRL's ``prepare_fsdp`` (reference / teacher
models) :func:`sharding_reference_models`; ``Trainer.save_model`` :func:`saving_final_model_in_full`;
``Trainer._validate_args`` :func:`accepting_optimizers_when_sharding`.  And the Trainer's checkpoints follow the
commit protocol (``state/commit.py``): ``Trainer._save_checkpoint`` gets :func:`committing_trainer_checkpoints`,
``get_last_checkpoint`` :func:`newest_complete_trainer_checkpoint`.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable, Optional

import torch.nn as nn
from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME

from ..core.fully_sharded import FullyShardedDataParallel
from ..state import commit
from .config import state_dict_type_name
from .state_io import accelerate_names, shard_size_of


@functools.lru_cache(maxsize=None)
def seeing_through_wrapper(original: Callable) -> Callable:
    """``original(model, ...)`` called with the module inside our wrappers (one replacement per original)."""
    @functools.wraps(original)
    def replacement(model: Any, *args: Any, **kwargs: Any) -> Any:
        while isinstance(model, FullyShardedDataParallel):
            model = model.module
        return original(model, *args, **kwargs)

    return replacement


@functools.lru_cache(maxsize=None)
def sharding_reference_models(original: Callable) -> Callable:
    """TRL's ``prepare_fsdp`` that shards with our Accelerator when it is the one given."""
    @functools.wraps(original)
    def prepare_fsdp(model: nn.Module, accelerator: Any) -> nn.Module:
        if getattr(accelerator, "flatshard_options", None) is None:
            return original(model, accelerator)
        return accelerator.prepare_model(model, evaluation_mode=True).eval()

    return prepare_fsdp


@functools.lru_cache(maxsize=None)
def saving_final_model_in_full(original: Callable) -> Callable:
    """``Trainer.save_model`` that writes the full model (weights, config, tokenizer) under SHARDED_STATE_DICT too
    when the user calls it (the Trainer's checkpoints call it with ``_internal_call=True``: left as they are)."""
    @functools.wraps(original)
    def save_model(self: Any, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        if (_internal_call or getattr(self.accelerator, "flatshard_options", None) is None
                or "FULL_STATE_DICT" in str(plugin.state_dict_type)):
            return original(self, output_dir, _internal_call)
        from torch.distributed.fsdp import StateDictType

        configured = plugin.state_dict_type
        plugin.state_dict_type = StateDictType.FULL_STATE_DICT  # what transformers branches on (only for this call)
        try:
            return original(self, output_dir, _internal_call)
        finally:
            plugin.state_dict_type = configured

    return save_model


@functools.lru_cache(maxsize=None)
def accepting_optimizers_when_sharding(original: Callable) -> Callable:
    """``Trainer._validate_args`` that lets ``optimizers=(optimizer, scheduler)`` through when our Accelerator shards
    the model: transformers refuses them under any FSDP because torch FSDP replaces the parameters an optimizer built
    beforehand holds; accel_flatshard keeps them (its other checks run unchanged)."""
    @functools.wraps(original)
    def _validate_args(self: Any) -> None:
        ours = getattr(getattr(self, "accelerator", None), "flatshard_options", None) is not None
        if not (ours and self.is_fsdp_enabled):
            return original(self)
        self.is_fsdp_enabled = False  # (read there by the optimizers check only)
        try:
            return original(self)
        finally:
            self.is_fsdp_enabled = True

    return _validate_args


# ---------------------------------------------------------------------- Trainer checkpoints (state/commit.py)
def committing_trainer_checkpoints(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Trainer._save_checkpoint`` of an accel_flatshard model: the checkpoint gets the commit marker once every
    rank's files are written; under ``FLATSHARD_ASYNC_SAVE`` its model (SHARDED) and optimizer are written in the
    background; ``save_total_limit`` is applied after the commit, never deleting the newest complete checkpoint."""
    def _save_checkpoint(self: Any, model: Any, trial: Any, *args: Any, **kwargs: Any) -> Any:
        acc = self.accelerator
        if not any(isinstance(m, FullyShardedDataParallel) for m in acc._models):
            return original(self, model, trial, *args, **kwargs)
        commit.wait_for_saves()
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"checkpoint-{self.state.global_step}")
        sharded = state_dict_type_name(acc.state.fsdp_plugin) == "SHARDED_STATE_DICT"
        parts = [accelerate_names(FSDP_MODEL_NAME, 0)[0] + "/"] if sharded else []
        if not self.args.save_only_model:
            parts.append(accelerate_names(OPTIMIZER_NAME, 0)[0 if sharded else 1] + ("/" if sharded else ""))
        manifest = commit.mark_pending(acc, output_dir, parts + ["trainer_state.json"], self.state.global_step)
        limit, best = self.args.save_total_limit, self.state.best_model_checkpoint
        background = getattr(acc, "flatshard_async_save", False)
        with commit.snapshots(background) as (writes, readies):
            if background and not sharded:  # FULL: rank 0's gathered copy is the snapshot; the Trainer writes it later
                save_now = self._save
                self._save = lambda out=None, state_dict=None: writes.append(
                    ("the model (Trainer._save)", lambda group: save_now(out, state_dict=state_dict)))
            self.args.save_total_limit = None  # rotated here, once the new checkpoint is complete
            try:
                result = original(self, model, trial, *args, **kwargs)
            finally:
                self.args.save_total_limit = limit
                self.__dict__.pop("_save", None)
        commit.commit_when_written(
            acc, output_dir, manifest, writes, readies,
            lambda: commit.prune_checkpoints(run_dir, limit, prefix="checkpoint-", protect=[best]), shard_size_of(acc))
        return result

    return _save_checkpoint


def newest_complete_trainer_checkpoint(folder: str) -> Optional[str]:
    """``transformers.trainer_utils.get_last_checkpoint`` skipping incomplete checkpoints (``resume_from_...``)."""
    return commit.newest_complete_checkpoint(folder, prefix="checkpoint-")
