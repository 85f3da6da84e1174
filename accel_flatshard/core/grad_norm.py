"""Global gradient-norm clipping over sharded gradients (of one wrapped model, or of several together)."""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import registry
from .comm import ShardGroup


def clip_grad_norm_(parameters: Union[torch.Tensor, Iterable[torch.Tensor]], max_norm: float, norm_type: float = 2.0,
                    group: Optional[ShardGroup] = None, device: Optional[torch.device] = None) -> torch.Tensor:
    """Clip the gradients of original parameters by their *global* norm (what ``torch.nn.utils.clip_grad_norm_``
    gives on the unsharded model); return that norm.

    Sharded gradients' parts are summed over their shard group (hybrid replicas count once); unsharded ones are
    full copies on every rank, counted once.  Parameters of several wrapped models give the norm over all of them:
    collective over every group involved, in the order they appear.

    Example::

        total_norm = accel_flatshard.clip_grad_norm_(model.parameters(), max_norm=1.0)
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    norm_type = float(norm_type)
    is_inf = norm_type == float("inf")
    groups: Dict[int, Tuple[ShardGroup, List[torch.Tensor]]] = {}  # shard group -> its gradients (this rank's)
    replicated: List[torch.Tensor] = []  # one pass per step over the parameters: sharded or replicated
    for p in parameters:
        record = registry.record_of_param(p)
        if record is not None:
            owner = record.shard_group  # (without a gradient too: its group's all-reduce runs on every rank)
            owner = group or owner
            grads = groups.setdefault(id(owner), (owner, []))[1]
            if p.grad is not None:
                grads.append(p.grad)
        elif p.grad is not None:
            replicated.append(p.grad)
    every = [g for _, grads in groups.values() for g in grads] + replicated
    # each part is all-reduced on its model's device (``device``, else the group's): under offload the gradients
    # are on the host, and "the current CUDA device" is cuda:0 when a script moved the model without set_device
    parts = [_partial_norm(replicated, norm_type, device or next((g.device for g in every), torch.device("cpu")))]
    for index, (owner, grads) in enumerate(groups.values()):
        part = _partial_norm(grads, norm_type, device or owner.device)
        if index == 0:  # replicated gradients are identical on every rank: the first group's shard rank 0 adds them
            replicated_part = parts.pop().to(part.device)
            part = torch.maximum(part, replicated_part) if is_inf else part + replicated_part * (owner.shard_rank == 0)
        parts.append(owner.all_reduce(part, op=dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM))
    parts = [t.to(parts[0].device) for t in parts]
    total = torch.stack(parts).max() if is_inf else torch.stack(parts).sum() ** (1.0 / norm_type)
    scale_by_clip_coefficient(every, max_norm, total)
    return total.to(torch.float32)


def scale_by_clip_coefficient(grads: List[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Multiply ``grads`` in place by ``min(1, max_norm / (total_norm + 1e-6))`` (also by 1), as torch's clip does."""
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
