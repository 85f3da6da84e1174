"""Global gradient-norm clipping over sharded gradients."""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .comm import ShardGroup


def clip_grad_norm_(
    parameters: Union[torch.Tensor, Iterable[torch.Tensor]],
    max_norm: float,
    norm_type: float = 2.0,
    group: Optional[ShardGroup] = None,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """Clip the gradients of original parameters by their *global* norm; return that norm.

    Gradients of wrapped parameters are 1/W shards: their contributions are summed over the shard
    group (replicas of hybrid sharding hold the same shard and are counted once).  Gradients of
    parameters that are not sharded are full copies on every rank and are counted once too.  The
    result equals ``torch.nn.utils.clip_grad_norm_`` on the unsharded model.

    Example::

        total_norm = accel_flatshard.clip_grad_norm_(model.parameters(), max_norm=1.0)
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None or getattr(p, "_flatshard_group", None) is not None]
    if group is None:
        groups = {id(g): g for g in (getattr(p, "_flatshard_group", None) for p in params) if g is not None}
        if len(groups) > 1:
            raise ValueError("parameters of several separately wrapped models: clip each model on its own")
        group = next(iter(groups.values()), None)
    norm_type = float(norm_type)
    sharded: List[torch.Tensor] = []  # one pass per step over the parameters: sharded or replicated
    replicated: List[torch.Tensor] = []
    for p in params:
        if p.grad is not None:
            (sharded if getattr(p, "_flatshard_group", None) is not None else replicated).append(p.grad)
    # the norm is all-reduced on the model's device (``device``, else the group's): under offload the gradients
    # are on the host, and "the current CUDA device" is cuda:0 when a script moved the model without set_device
    device = (device or (group.device if group is not None else None)
              or next((g.device for g in sharded + replicated), torch.device("cpu")))
    is_inf = norm_type == float("inf")
    local_sharded = _partial_norm(sharded, norm_type, device)
    local_replicated = _partial_norm(replicated, norm_type, device)
    if group is None:
        total = local_sharded + local_replicated if not is_inf else torch.maximum(local_sharded, local_replicated)
    elif is_inf:
        total = torch.maximum(local_sharded, local_replicated)
        group.all_reduce_shard_group(total, op=dist.ReduceOp.MAX)
    else:
        # replicated grads are identical on every rank: let shard rank 0 contribute them once
        total = local_sharded + (local_replicated if group.shard_rank == 0 else torch.zeros_like(local_replicated))
        group.all_reduce_shard_group(total)
    total_norm = total if is_inf else total ** (1.0 / norm_type)
    scale_by_clip_coefficient(sharded + replicated, max_norm, total_norm)
    return total_norm.to(torch.float32)


def scale_by_clip_coefficient(grads: List[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Multiply ``grads`` in place by ``min(1, max_norm / (total_norm + 1e-6))``, as
    ``torch.nn.utils.clip_grad_norm_`` does (always multiplies, also by exactly 1)."""
    clip_coef = torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)
    # one conversion per (device, dtype), not per gradient: under offload the coefficient is on the GPU and
    # the gradients on the host, and each .to() is a blocking device -> host copy (a host sync)
    coef_on: Dict[Tuple[torch.device, torch.dtype], torch.Tensor] = {}
    for g in grads:
        key = (g.device, g.dtype)
        if key not in coef_on:
            coef_on[key] = clip_coef.to(device=g.device, dtype=g.dtype)
        g.mul_(coef_on[key])


def _partial_norm(grads: List[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """sum(|g|^p) over grads (max |g| for p = inf), in float64 for a stable global sum."""
    grads = [g.detach() for g in grads if g.numel()]
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    if norm_type == float("inf"):
        return torch.stack([g.abs().max().to(torch.float64) for g in grads]).max().to(device)
    norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float64) ** norm_type for g in grads]
    return torch.stack(norms).sum().to(device)
