"""Full (unsharded) model state dicts: gathered to rank 0 one flat parameter at a time.

``full_state_dict`` returns exactly what the plain model's ``state_dict()`` returns (same keys, order,
shapes; tied parameters under every name, sharing one tensor; persistent buffers), so it loads with
``plain_model.load_state_dict(sd, strict=True)`` and saves with ``save_pretrained(state_dict=sd)``.
Peak memory on rank 0 is the result plus one gathered flat parameter; other ranks hold one gathered
flat parameter at most (none with hybrid sharding outside rank 0's shard group).

Example::

    sd = full_state_dict(model)                 # rank 0: full dict on CPU; other ranks: {}
    if rank == 0:
        plain.load_state_dict(sd)
        plain.save_pretrained("out", state_dict=sd)
    load_full_state_dict(model, sd if rank == 0 else None)   # rank 0's dict is broadcast per tensor
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn

from .. import comm
from .index import ModelIndex, dict_mode, plan_on_every_rank, quiesce
from .registry import local_state_dict, require_all_ranks
from .types import CheckpointError

__all__ = ["full_state_dict", "load_full_state_dict"]


def full_state_dict(model: nn.Module, rank0_only: bool = True, cpu_offload: bool = True) -> Dict[str, Any]:
    """Gather the plain model's state dict from a sharded model (collective: call on every rank).

    Args:
        model: a ``FullyShardedDataParallel`` model (outside forward/backward).
        rank0_only: only global rank 0 receives the dict; other ranks get ``{}``.
        cpu_offload: return CPU tensors (copies); otherwise tensors stay on the model's device.

    Example::

        sd = full_state_dict(model)
        if dist.get_rank() == 0:
            torch.save(sd, "model.pt")
    """
    quiesce(model, "full_state_dict")
    require_all_ranks(model, "gathering the full state dict")  # a main-process-only call fails fast
    index = ModelIndex(model)
    group = index.group
    receives = not rank0_only or group.world_rank == 0
    gathers = not rank0_only or index.replica_index == 0  # only rank 0's shard group must gather
    full_of: Dict[int, torch.Tensor] = {}
    if gathers:
        for flat in model.flat_params:
            buf = torch.empty(flat.layout.padded_numel, dtype=flat.dtype, device=flat.device)
            # (.to: under CPU offload the shard is host memory; the gather runs on the shards' device)
            group.all_gather(buf, flat.local_shard.to(buf.device), async_op=False)
            if receives:
                for slot, p in zip(flat.layout.slots, flat.params):
                    t = buf[slot.offset : slot.offset + slot.numel].view(slot.shape)
                    full_of[id(p)] = _detached_copy(t, cpu_offload)
            del buf
    if not receives:
        return {}
    out: Dict[str, Any] = {}
    with local_state_dict(model.module):
        local = model.module.state_dict(keep_vars=True)
    for key, value in local.items():
        if isinstance(value, nn.Parameter) and id(value) in full_of:
            out[key] = full_of[id(value)]
        elif isinstance(value, torch.Tensor):
            out[key] = _detached_copy(value, cpu_offload)
        else:
            out[key] = value
    return out


def _detached_copy(t: torch.Tensor, cpu_offload: bool) -> torch.Tensor:
    t = t.detach()
    return t.to("cpu", copy=True) if cpu_offload else t.clone()


def load_full_state_dict(model: nn.Module, state_dict: Optional[Dict[str, Any]], strict: bool = True) -> None:
    """Load a full (plain-model) state dict into a sharded model; each rank keeps only its slices.

    Every rank passes the dict, or only global rank 0 passes it and the others pass ``None`` (then
    each tensor is broadcast from rank 0 in turn, so no rank holds more than one extra tensor).
    Collective: call on every rank.

    ``strict``: every key of the model must be present and no other key (like
    ``nn.Module.load_state_dict``); with ``strict=False`` missing keys keep their current values and
    unexpected keys are ignored, and a tied parameter is loaded from whichever of its names is present.
    Shapes must always match; values are cast to the parameter's dtype.

    Example::

        sd = torch.load("model.pt", weights_only=True) if rank == 0 else None
        load_full_state_dict(model, sd)
    """
    quiesce(model, "load_full_state_dict")
    index = ModelIndex(model)
    group = index.group
    if group.world_size == 1 and state_dict is None:
        raise CheckpointError("load_full_state_dict: rank 0 passed None; it must pass the state dict")
    mode = dict_mode(group, state_dict is not None, "load_full_state_dict")
    sources: Dict[str, str] = plan_on_every_rank(group, mode, lambda: _validate(index, state_dict, strict))

    def value_of(key: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if mode == "local":
            return state_dict[key].detach().reshape(-1)
        buf = (state_dict[key].detach().reshape(-1).to(device=device, dtype=dtype).contiguous()
               if group.world_rank == 0 else torch.empty(numel, dtype=dtype, device=device))
        return comm.broadcast_tensor(group.world_group, buf)

    with torch.no_grad():
        for name, info in index.params.items():
            if name in sources:
                piece = info.piece
                buf = value_of(sources[name], info.numel, info.dtype, info.flat.device)
                info.local().copy_(buf[piece.param_start : piece.param_start + piece.length])
        for name, tensor in index.buffers.items():
            if name in sources:
                tensor.copy_(value_of(name, tensor.numel(), tensor.dtype, tensor.device).view(tensor.shape))


def _validate(index: ModelIndex, sd: Dict[str, Any], strict: bool) -> Dict[str, str]:
    """Which dict key feeds each parameter/buffer; raises a CheckpointError naming every problem."""
    if not isinstance(sd, dict):
        raise CheckpointError(f"load_full_state_dict: expected a dict, got {type(sd).__name__}")
    problems: List[str] = []
    missing = [k for k in index.keys if k not in sd and k not in index.extra]
    unexpected = [k for k in sd if k not in index.param_of_key and k not in index.buffers and k not in index.extra]
    sources: Dict[str, str] = {}
    for name, info in index.params.items():
        present = [k for k in info.aliases if k in sd]
        if present:
            sources[name] = present[0]
        for k in present:
            problems += _check_tensor(k, sd[k], info.shape)
    for name, buf in index.buffers.items():
        if name in sd:
            sources[name] = name
            problems += _check_tensor(name, sd[name], tuple(buf.shape))
    if strict and missing:
        tied = [k for k in missing if k in index.param_of_key and k not in sources.values()
                and index.param_of_key[k] in sources]
        hint = (f" ({tied} share a parameter with a key that is present, as in save_pretrained output; "
                "pass strict=False to load tied parameters from any of their names)") if tied else ""
        problems.insert(0, f"missing keys: {missing}{hint}")
    if strict and unexpected:
        problems.insert(0, f"unexpected keys: {unexpected}")
    if problems:
        raise CheckpointError("error(s) loading a full state dict into " + type(index.module).__name__ + ":\n  " + "\n  ".join(problems))
    return sources


def _check_tensor(key: str, value: Any, shape) -> List[str]:
    if not isinstance(value, torch.Tensor):
        return [f"{key}: expected a tensor, got {type(value).__name__}"]
    if tuple(value.shape) != tuple(shape):
        return [f"size mismatch for {key}: checkpoint has shape {tuple(value.shape)}, the model expects {tuple(shape)}"]
    return []
