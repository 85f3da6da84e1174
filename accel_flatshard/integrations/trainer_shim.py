"""What ``transformers.Trainer`` needs beyond accelerate to train an accel_flatshard model correctly.

Under an FSDP config the Trainer builds its optimizer from the *prepared* model: it takes
``get_parameter_names(model, ...)`` (walks ``named_children``) as the weight-decay set and matches it
against ``model.named_parameters()``.  The wrapper yields the original, unprefixed names from
``named_parameters`` but its only child is ``module``, so no name would match and every parameter would
silently land in the no-decay group.  :func:`install` makes ``get_parameter_names`` walk the wrapped
module for accel_flatshard models, so both sides use the plain model's names (the names torch FSDP
with ``use_orig_params`` gives the Trainer for its own wrapper are consistent in the same way).
"""
from __future__ import annotations

import sys
from typing import Any, Callable, List, Optional

from ..fully_sharded import FullyShardedDataParallel

__all__ = ["install"]

_ORIGINAL: Optional[Callable[..., List[str]]] = None


def _get_parameter_names(model: Any, forbidden_layer_types: Any, forbidden_layer_names: Any = None) -> List[str]:
    if isinstance(model, FullyShardedDataParallel):
        model = model.module
    return _ORIGINAL(model, forbidden_layer_types, forbidden_layer_names)


def install() -> None:
    """Patch ``get_parameter_names`` in ``transformers.trainer_pt_utils`` and ``transformers.trainer`` (if
    imported; ``transformers.trainer`` binds the name when it loads).  Idempotent."""
    global _ORIGINAL
    utils = sys.modules.get("transformers.trainer_pt_utils")
    if utils is None:
        return  # transformers' Trainer is not in use
    if _ORIGINAL is None:
        _ORIGINAL = utils.get_parameter_names
    for name in ("transformers.trainer_pt_utils", "transformers.trainer"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "get_parameter_names", None) is _ORIGINAL:
            module.get_parameter_names = _get_parameter_names
