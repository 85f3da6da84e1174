"""Mixed-precision policy: the dtypes of gathered parameters, gradient reduction and buffers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class MixedPrecision:
    """Which dtypes the engine computes and communicates in; the local shard stays full precision.

    * ``param_dtype``: of gathered parameters (forward and backward compute, all-gather traffic).
    * ``reduce_dtype``: of the reduce-scatter (default ``param_dtype``); added to the fp32 sharded gradient.
    * ``buffer_dtype``: buffers are cast to it once, at wrap time.
    * ``cast_forward_inputs``: floating-point inputs of the root's forward are cast to ``param_dtype``.

    Example::

        FullyShardedDataParallel(model, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                                       reduce_dtype=torch.float32))
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    buffer_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True

    @property
    def effective_reduce_dtype(self) -> Optional[torch.dtype]:
        return self.reduce_dtype or self.param_dtype
