"""Make the libraries around accelerate (transformers' Trainer, PEFT, TRL) see through accel_flatshard's wrapper.

Three functions of theirs know only torch's wrappers; :mod:`.patches` replaces each where it is looked up:

* ``accelerate.utils.extract_model_from_parallel`` unwraps DDP / DeepSpeed / torch FSDP.  PEFT and TRL reach it
  through ``accelerate.utils.is_peft_model``, ``Accelerator.unwrap_model`` and
  ``transformers.modeling_utils.unwrap_model`` (so ``Trainer`` finds a PeftModel inside our wrapper, a DPO
  trainer sees LoRA).
* ``transformers.trainer_pt_utils.get_parameter_names``: under an FSDP config the Trainer builds its optimizer
  from the *prepared* model and takes these names (it walks ``named_children``) as the weight-decay set, matched
  against ``model.named_parameters()``.  The wrapper yields the plain names from ``named_parameters`` but its only
  child is ``module``, so no name would match and every parameter would silently get no weight decay.

  Both get :func:`seeing_through_wrapper`: take ``.module`` off every :class:`FullyShardedDataParallel`, then
  call the original.
* ``trl.models.utils.prepare_fsdp(model, accelerator)`` wraps TRL's reference / teacher models (DPO, KTO, GRPO,
  RLOO, ...) in torch FSDP itself.  With an accelerator that shards with accel_flatshard,
  :func:`sharding_reference_models` calls ``accelerator.prepare_model(model, evaluation_mode=True)`` instead: the
  reference model is sharded like the policy, gathered unit by unit in its forward, holds no gradients.  Any
  other accelerator gets TRL's function.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch.nn as nn

from ..fully_sharded import FullyShardedDataParallel

__all__ = ["seeing_through_wrapper", "sharding_reference_models"]


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
        model = accelerator.prepare_model(model, evaluation_mode=True)
        model.eval()
        return model

    return prepare_fsdp
