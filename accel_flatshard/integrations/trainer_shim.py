"""What ``transformers.Trainer`` needs beyond accelerate to train an accel_flatshard model correctly.

Under an FSDP config the Trainer builds its optimizer from the *prepared* model: it takes
``get_parameter_names(model, ...)`` (walks ``named_children``) as the weight-decay set and matches it
against ``model.named_parameters()``.  The wrapper yields the original, unprefixed names from
``named_parameters`` but its only child is ``module``, so no name would match and every parameter would
silently land in the no-decay group.  :func:`parameter_names_of_wrapped_module` makes
``get_parameter_names`` walk the wrapped module for accel_flatshard models (installed by :mod:`.patches`),
so both sides use the plain model's names (the names torch FSDP with ``use_orig_params`` gives the Trainer
for its own wrapper are consistent in the same way).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, List

from ..fully_sharded import FullyShardedDataParallel

__all__ = ["parameter_names_of_wrapped_module"]


@functools.lru_cache(maxsize=None)
def parameter_names_of_wrapped_module(original: Callable[..., List[str]]) -> Callable[..., List[str]]:
    """transformers' ``get_parameter_names`` that looks inside accel_flatshard's wrapper."""

    @functools.wraps(original)
    def get_parameter_names(model: Any, forbidden_layer_types: Any, *args: Any, **kwargs: Any) -> List[str]:
        if isinstance(model, FullyShardedDataParallel):
            model = model.module
        return original(model, forbidden_layer_types, *args, **kwargs)

    return get_parameter_names
