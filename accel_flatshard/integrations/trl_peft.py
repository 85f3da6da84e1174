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

:func:`patch_libraries` runs in :func:`accel_flatshard.register` and whenever our ``Accelerator`` is
created (TRL's trainer modules are imported by then); it patches every already-imported module of
accelerate / transformers / peft / trl that holds the original function, and is idempotent.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import torch.nn as nn

from ..fully_sharded import FullyShardedDataParallel
from ..generation import patch_trl_summon

_LIBRARIES = ("accelerate", "transformers", "peft", "trl")
_PATCHED_MARK = "_accel_flatshard_patched"


def patch_libraries() -> None:
    """Replace ``extract_model_from_parallel`` and TRL's ``prepare_fsdp`` wherever they were imported."""
    import accelerate.utils.other as accelerate_other

    original = getattr(accelerate_other.extract_model_from_parallel, "__wrapped__", accelerate_other.extract_model_from_parallel)
    _replace_everywhere("extract_model_from_parallel", original, _unwrapping(original))

    if "trl" in sys.modules:  # never import TRL ourselves (slow, optional)
        patch_trl_summon()  # TRL's summon_full_params seam around generation (generation.py)
        try:
            import trl.models.utils as trl_model_utils
        except ImportError:  # an old TRL without it: nothing to patch
            return
        prepare = getattr(trl_model_utils, "prepare_fsdp", None)
        if prepare is not None:
            original = getattr(prepare, "__wrapped__", prepare)
            _replace_everywhere("prepare_fsdp", original, _sharding_reference_models(original))


def _replace_everywhere(name: str, original: Callable, replacement: Callable) -> None:
    for module_name, module in list(sys.modules.items()):
        if module is None or module_name.split(".", 1)[0] not in _LIBRARIES:
            continue
        if module.__dict__.get(name) is original:
            setattr(module, name, replacement)


@functools.lru_cache(maxsize=None)
def _unwrapping(original: Callable) -> Callable:
    @functools.wraps(original)
    def extract_model_from_parallel(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        while isinstance(model, FullyShardedDataParallel):
            model = model.module
        return original(model, *args, **kwargs)

    setattr(extract_model_from_parallel, _PATCHED_MARK, True)
    return extract_model_from_parallel


@functools.lru_cache(maxsize=None)
def _sharding_reference_models(original: Callable) -> Callable:
    @functools.wraps(original)
    def prepare_fsdp(model: nn.Module, accelerator: Any) -> nn.Module:
        if getattr(accelerator, "flatshard_options", None) is None:
            return original(model, accelerator)
        model = accelerator.prepare_model(model, evaluation_mode=True)
        model.eval()
        return model

    setattr(prepare_fsdp, _PATCHED_MARK, True)
    return prepare_fsdp
