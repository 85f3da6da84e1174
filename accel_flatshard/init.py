"""Low-RAM initialisation: materialise a meta-device model one unit at a time while sharding it.

A model built under ``torch.device("meta")`` holds no memory.  The wrapper materialises the modules
of one unit, flattens and shards them, and drops the full tensors before moving to the next unit, so
a rank's peak host memory is about ``model size / W`` plus one unit.  Values come either from
``param_init_fn`` (on every rank) or from rank 0 (``sync_module_states=True``, a real model on rank 0
and meta models elsewhere).
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
import torch.nn as nn

ParamInitFn = Callable[[nn.Module], None]


def has_own_meta_tensors(module: nn.Module) -> bool:
    tensors = list(module._parameters.values()) + list(module._buffers.values())
    return any(t is not None and t.is_meta for t in tensors)


def materialization_device(uses_nccl: bool) -> torch.device:
    """Where the shards of a meta model live: the current CUDA device with nccl, else the CPU."""
    if uses_nccl:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def default_param_init_fn(device: torch.device) -> ParamInitFn:
    """Allocate a module's own tensors on ``device`` and run its ``reset_parameters`` if it has one."""

    def init(module: nn.Module) -> None:
        materialize_own_tensors(module, device)
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()

    return init


def materialize_own_tensors(module: nn.Module, device: torch.device) -> None:
    """Give a module's own meta parameters and buffers (uninitialised) storage on ``device``.

    ``to_empty()`` would create new Parameter objects (a meta tensor cannot take real data in place),
    detaching an optimizer built before wrapping; swapping the tensors' contents keeps identity.
    """
    for name, p in list(module._parameters.items()):
        if p is not None and p.is_meta:
            torch.utils.swap_tensors(p, nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad))
    for name, b in list(module._buffers.items()):
        if b is not None and b.is_meta:
            module._buffers[name] = torch.empty_like(b, device=device)


def materialize(modules: Iterable[nn.Module], device: torch.device, param_init_fn: Optional[ParamInitFn]) -> None:
    """Materialise the modules that still hold meta tensors of their own.

    ``param_init_fn(module)`` must allocate and initialise only that module's own parameters and
    buffers (``recurse=False``): modules of other units may already be sharded.
    """
    init = param_init_fn or default_param_init_fn(device)
    for module in modules:
        if has_own_meta_tensors(module):
            init(module)
            if has_own_meta_tensors(module):
                raise RuntimeError(
                    f"param_init_fn left meta tensors in {type(module).__name__}; it must materialise the "
                    "module's own parameters and buffers, e.g. module.to_empty(device=..., recurse=False)"
                )
