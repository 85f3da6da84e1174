"""Full optimizer state dicts, keyed by parameter name, and converters to/from torch's own format.

Format of a full optimizer state dict (what :func:`full_optim_state_dict` returns on rank 0)::

    {
      "state": {                                  # only parameters that have state
        "transformer.wte.weight": {"step": tensor(5.), "exp_avg": <full-shaped>, "exp_avg_sq": <full-shaped>},
        # (one entry per parameter with state)
      },
      "param_groups": [                           # the optimizer's groups, in order
        {"lr": 0.001, "betas": (0.9, 0.999), "weight_decay": 0.1, ..., "params": ["transformer.wte.weight", ...]},
        # (one dict per param group)
      ],
    }

Names are the canonical parameter names (the first name a tied parameter is registered under, as in
``named_parameters()``); per-element state has the parameter's full shape.  It does not depend on the
world size: :func:`load_full_optim_state_dict` loads it into a sharded optimizer at any world size,
and :func:`optim_state_dict_to_torch` turns it into the dict that a plain torch optimizer built for
the plain model takes (:func:`optim_state_dict_from_torch` goes the other way).

Example::

    osd = full_optim_state_dict(model, optimizer)              # rank 0: the dict; others: {}
    if rank == 0:
        plain_opt.load_state_dict(optim_state_dict_to_torch(osd, plain_model, plain_opt))
    load_full_optim_state_dict(model, optimizer, osd if rank == 0 else None)
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn

from .. import comm
from .index import ModelIndex, dict_mode, param_names, plan_on_every_rank, quiesce
from .types import CheckpointError, str_to_dtype
from .optim_index import (
    SCALAR,
    SHARDED,
    VALUE,
    check_groups,
    group_hyperparams,
    optimizer_groups,
    sharded_local,
    state_schema,
    torch_state_dict,
)

__all__ = ["full_optim_state_dict", "load_full_optim_state_dict", "optim_state_dict_to_torch", "optim_state_dict_from_torch"]


def full_optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, rank0_only: bool = True) -> Dict[str, Any]:
    """Gather the optimizer state by parameter name with full-shaped tensors (collective).

    Gathers one (flat parameter, state key) at a time inside the shard group; returns CPU tensors on
    rank 0 (``rank0_only``) or on every rank.  Example::

        osd = full_optim_state_dict(model, optimizer)
        if rank == 0:
            torch.save(osd, "optim.pt")
    """
    quiesce(model, "full_optim_state_dict")
    index = ModelIndex(model)
    group = index.group
    groups = optimizer_groups(index, optimizer)
    schema = state_schema(groups, optimizer, group)
    receives = not rank0_only or group.world_rank == 0
    gathers = not rank0_only or index.replica_index == 0
    state: Dict[str, Dict[str, Any]] = {}
    for flat in model.flat_params:
        infos = [index.by_param_id[id(p)] for p in flat.params]
        keys: Dict[str, str] = {}
        for info in infos:
            for key, (kind, dtype, _) in schema.get(info.fqn, {}).items():
                if kind == SHARDED:
                    keys.setdefault(key, dtype)
        for key, dtype in keys.items():
            if not gathers:
                break
            local = torch.zeros(flat.layout.shard_numel, dtype=str_to_dtype(dtype), device=flat.device)
            for info in infos:
                if schema.get(info.fqn, {}).get(key, (None,))[0] == SHARDED:
                    piece = info.piece
                    local[piece.shard_start : piece.shard_start + piece.length].copy_(sharded_local(info, optimizer, key, dtype))
            full = torch.empty(flat.layout.padded_numel, dtype=local.dtype, device=flat.device)
            group.all_gather(full, local, async_op=False)
            if receives:
                for slot, info in zip(flat.layout.slots, infos):
                    if schema.get(info.fqn, {}).get(key, (None,))[0] == SHARDED:
                        t = full[slot.offset : slot.offset + slot.numel].view(slot.shape)
                        state.setdefault(info.fqn, {})[key] = t.to("cpu", copy=True)
            del full, local
    if not receives:
        return {}
    ordered: Dict[str, Dict[str, Any]] = {}
    for infos in groups:
        for info in infos:
            if info.fqn not in schema:
                continue
            entry: Dict[str, Any] = {}
            for key, (kind, dtype, value) in schema[info.fqn].items():
                if kind == SHARDED:
                    entry[key] = state[info.fqn][key]
                elif kind == SCALAR:
                    entry[key] = torch.tensor(value, dtype=str_to_dtype(dtype))
                else:
                    entry[key] = value
            ordered[info.fqn] = entry
    param_groups = []
    for g, infos in zip(optimizer.param_groups, groups):
        hyper = {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in group_hyperparams(g).items()}
        hyper["params"] = [i.fqn for i in infos]
        param_groups.append(hyper)
    return {"state": ordered, "param_groups": param_groups}


def load_full_optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                               optim_state_dict: Optional[Dict[str, Any]]) -> None:
    """Load a name-keyed full optimizer state dict into the sharded model's optimizer (collective).

    Every rank passes the dict, or rank 0 only (others ``None``; tensors are then broadcast one at a
    time).  The optimizer must have the same param groups (by parameter name) as the one that saved.
    Hyperparameters (lr, betas, ...) are restored from the dict.  Example::

        osd = torch.load("optim.pt", weights_only=True) if rank == 0 else None
        load_full_optim_state_dict(model, optimizer, osd)
    """
    quiesce(model, "load_full_optim_state_dict")
    index = ModelIndex(model)
    group = index.group
    world = group.world_group
    groups = optimizer_groups(index, optimizer)
    names = [[i.fqn for i in infos] for infos in groups]
    broadcast = dict_mode(group, optim_state_dict is not None, "load_full_optim_state_dict") == "broadcast"
    plan = plan_on_every_rank(group, "broadcast" if broadcast else "local", lambda: _plan(index, names, optim_state_dict))
    schema, hyper = plan
    state: Dict[str, Dict[str, Any]] = {}
    for fqn, entry in schema.items():
        info = index.params[fqn]
        out: Dict[str, Any] = {}
        for key, (kind, dtype, value) in entry.items():
            if kind == SHARDED:
                if broadcast:
                    src = optim_state_dict["state"][fqn][key] if group.world_rank == 0 else None
                    full = torch.empty(info.numel, dtype=str_to_dtype(dtype), device=info.flat.device)
                    if src is not None:
                        full.copy_(src.detach().reshape(-1))
                    comm.broadcast_tensor(world, full)
                else:
                    full = optim_state_dict["state"][fqn][key].detach().reshape(-1)
                piece = info.piece
                out[key] = full[piece.param_start : piece.param_start + piece.length].to(info.flat.device).clone()
            elif kind == SCALAR:
                out[key] = torch.tensor(value, dtype=str_to_dtype(dtype))
            else:
                out[key] = value
        state[fqn] = out
    optimizer.load_state_dict(torch_state_dict(optimizer, names, state, hyper))


def _plan(index: ModelIndex, names: List[List[str]], osd: Any):
    """(schema, hyperparameter groups) of a full dict, after checking it against model and optimizer."""
    if not isinstance(osd, dict) or "state" not in osd or "param_groups" not in osd:
        raise CheckpointError("a full optimizer state dict needs 'state' and 'param_groups' (see accel_flatshard.checkpoint.optim)")
    check_groups(osd["param_groups"], names)
    known = {n for group in names for n in group}
    schema: Dict[str, Dict[str, Any]] = {}
    problems = []
    for fqn, entry in osd["state"].items():
        if fqn not in known:
            problems.append(f"state for {fqn!r}, which is not a parameter of this optimizer")
            continue
        info = index.params[fqn]
        desc = {}
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() >= 1:
                if tuple(value.shape) != info.shape:
                    problems.append(f"state {fqn!r}[{key!r}] has shape {tuple(value.shape)}, the parameter has {info.shape}")
                desc[key] = (SHARDED, str(value.dtype).replace("torch.", ""), None)
            elif isinstance(value, torch.Tensor):
                desc[key] = (SCALAR, str(value.dtype).replace("torch.", ""), value.item())
            else:
                desc[key] = (VALUE, None, value)
        schema[fqn] = desc
    if problems:
        raise CheckpointError("full optimizer state dict does not match:\n  " + "\n  ".join(problems))
    return schema, [group_hyperparams(g) for g in osd["param_groups"]]



def optim_state_dict_to_torch(optim_state_dict: Dict[str, Any], model: nn.Module,
                              optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """Convert a name-keyed full dict into ``optimizer.state_dict()`` format for a plain optimizer.

    ``model`` is the plain model and ``optimizer`` a torch optimizer built on its parameters with the
    same groups.  Tensors are copied (``Optimizer.load_state_dict`` would otherwise adopt them and
    update ``optim_state_dict`` in place while training).  Example::

        plain_opt.load_state_dict(optim_state_dict_to_torch(osd, plain_model, plain_opt))
    """
    ids = param_names(model)
    names = []
    for g, group in enumerate(optimizer.param_groups):
        try:
            names.append([ids[id(p)] for p in group["params"]])
        except KeyError:
            raise CheckpointError(f"optimizer param_groups[{g}] holds a parameter that is not in the model") from None
    check_groups(optim_state_dict["param_groups"], names)
    hyper = [group_hyperparams(g) for g in optim_state_dict["param_groups"]]
    state = {fqn: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in entry.items()}
             for fqn, entry in optim_state_dict["state"].items()}
    return torch_state_dict(optimizer, names, state, hyper)


def optim_state_dict_from_torch(torch_osd: Dict[str, Any], model: nn.Module,
                                optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """Convert a plain optimizer's ``state_dict()`` (indices) into the name-keyed full format.

    ``optimizer``/``model``: the plain optimizer and model it was built for.  Example::

        osd = optim_state_dict_from_torch(plain_opt.state_dict(), plain_model, plain_opt)
        load_full_optim_state_dict(sharded_model, sharded_opt, osd)
    """
    ids = param_names(model)
    index_to_name: Dict[int, str] = {}
    groups = []
    for saved, group in zip(torch_osd["param_groups"], optimizer.param_groups):
        if len(saved["params"]) != len(group["params"]):
            raise CheckpointError("the torch optimizer state dict's groups do not match the optimizer's groups")
        fqns = [ids[id(p)] for p in group["params"]]
        index_to_name.update(zip(saved["params"], fqns))
        groups.append({**group_hyperparams(saved), "params": fqns})
    state = {index_to_name[i]: dict(v) for i, v in torch_osd["state"].items()}
    return {"state": state, "param_groups": groups}
