"""Make the libraries around accelerate (transformers, PEFT, TRL) see through accel_flatshard's wrapper.

Two functions of theirs know only torch's wrappers; both are replaced where they were imported:

* ``accelerate.utils.extract_model_from_parallel`` unwraps DDP / DeepSpeed / torch FSDP.  PEFT and TRL
  reach it through ``accelerate.utils.is_peft_model``, ``Accelerator.unwrap_model`` and
  ``transformers.modeling_utils.unwrap_model`` (so ``Trainer`` finds a PeftModel inside our wrapper, a
  DPO trainer sees LoRA).  The replacement first takes ``.module`` off every
  :class:`FullyShardedDataParallel`, then runs accelerate's own function.
* ``trl.models.utils.prepare_fsdp(model, accelerator)`` wraps TRL's reference / teacher models
  (DPO, KTO, GRPO, RLOO, ...) in torch FSDP itself.  With an accelerator that shards with
  accel_flatshard, the replacement calls ``accelerator.prepare_model(model, evaluation_mode=True)``
  instead: the reference model is sharded like the policy, gathered unit by unit in its forward,
  holds no gradients.  Any other accelerator gets TRL's function.

The replacements are installed by :mod:`.patches` (its table says where each name is looked up).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch.nn as nn

from ..fully_sharded import FullyShardedDataParallel



@functools.lru_cache(maxsize=None)
def unwrapping(original: Callable) -> Callable:
    """accelerate's ``extract_model_from_parallel`` that first takes ``.module`` off our wrappers."""
    @functools.wraps(original)
    def extract_model_from_parallel(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        while isinstance(model, FullyShardedDataParallel):
            model = model.module
        return original(model, *args, **kwargs)

    return extract_model_from_parallel


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
