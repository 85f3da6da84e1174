"""Several wrapped models in one process: what spans them (one gradient norm over all of them).

Every model given to ``Accelerator.prepare`` is sharded by its own :class:`FullyShardedDataParallel`,
with its own engine and process-group handle; nothing is shared between them except the world.  The
only operation that needs more than one of them at a time is clipping a parameter list that mixes
models (e.g. a policy and a value head prepared separately, clipped together): its norm must be the
norm over the union, as ``torch.nn.utils.clip_grad_norm_`` on the unsharded models would give.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from ..grad_norm import clip_grad_norm_ as _clip_grad_norm
from ..grad_norm import scale_by_clip_coefficient


def clip_grad_norm_over_models(params: List[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip ``params`` (from one or several wrapped models, and unwrapped ones) by their global norm.

    Each model's contribution is its global norm over its own shard group (computed without changing
    any gradient: max_norm=inf scales by exactly 1); the norms are combined, then every gradient is
    scaled by the same coefficient.  Returns the total norm.  Collective over every model's group.
    """
    by_group: Dict[int, List[torch.Tensor]] = {}
    unsharded: List[torch.Tensor] = []
    for p in params:
        group = getattr(p, "_flatshard_group", None)
        if group is None:
            unsharded.append(p)
        else:
            by_group.setdefault(id(group), []).append(p)
    if len(by_group) <= 1:
        return _clip_grad_norm(params, max_norm, norm_type)
    norm_type = float(norm_type)
    # unsharded parameters (full copies on every rank) are counted once, with the first model's
    parts = list(by_group.values())
    parts[0] = parts[0] + unsharded
    norms = torch.stack([_clip_grad_norm(part, float("inf"), norm_type).double() for part in parts])
    if norm_type == float("inf"):
        total = norms.max()
    else:
        total = (norms ** norm_type).sum() ** (1.0 / norm_type)
    scale_by_clip_coefficient([p.grad for p in params if p.grad is not None], max_norm, total)
    return total.to(torch.float32)
