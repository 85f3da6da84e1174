"""Optimizer state of a sharded model, described by parameter name.

Every original parameter is a 1-D slice of its flat parameter's shard, so a stock torch optimizer keeps,
per parameter, tensors the size of this rank's piece (``exp_avg``, ``momentum_buffer``: "sharded"
state), 0-dim tensors (``step``: "scalar" state) and plain Python values ("value" state).  This module
maps that to names and back:

* :func:`optimizer_groups` - the optimizer's param groups as lists of :class:`ParamInfo`;
* :func:`state_schema` - ``{name: {key: (kind, dtype, value)}}`` merged over all ranks;
* :func:`encode_groups` / :func:`decode_groups` - hyperparameters as JSON-able dicts with parameter names;
* :func:`torch_state_dict` - the index-keyed dict that ``optimizer.load_state_dict`` takes.

Example::

    groups = optimizer_groups(ModelIndex(model), optimizer)
    schema = state_schema(groups, optimizer, model.shard_group)   # {"lm_head.weight": {"exp_avg": ("sharded", "float32", None), ...}}
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import torch

from .. import comm
from .index import ModelIndex, ParamInfo
from .types import CheckpointError, dtype_to_str, str_to_dtype

SHARDED, SCALAR, VALUE = "sharded", "scalar", "value"
_SKIP_GROUP_KEYS = ("params", "param_names")


def optimizer_groups(index: ModelIndex, optimizer: torch.optim.Optimizer) -> List[List[ParamInfo]]:
    out = []
    for g, group in enumerate(optimizer.param_groups):
        infos = []
        for p in group["params"]:
            info = index.by_param_id.get(id(p))
            if info is None:
                raise CheckpointError(f"optimizer param_groups[{g}] holds a parameter (shape {tuple(p.shape)}) that is not a "
                                      "parameter of the sharded model; build the optimizer from model.parameters()")
            infos.append(info)
        out.append(infos)
    return out


def local_schema(groups: List[List[ParamInfo]], optimizer: torch.optim.Optimizer) -> Dict[str, Dict[str, Tuple]]:
    schema: Dict[str, Dict[str, Tuple]] = {}
    for infos in groups:
        for info in infos:
            state = optimizer.state.get(info.param)
            if not state:
                continue
            entry = schema.setdefault(info.fqn, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() >= 1:
                    if value.numel() != info.piece.length:
                        raise CheckpointError(
                            f"optimizer state {info.fqn!r}[{key!r}] has {value.numel()} elements, but this rank's piece of "
                            f"the parameter has {info.piece.length}; only per-element state can be sharded")
                    entry[key] = (SHARDED, dtype_to_str(value.dtype), None)
                elif isinstance(value, torch.Tensor):
                    entry[key] = (SCALAR, dtype_to_str(value.dtype), value.item())
                else:
                    entry[key] = (VALUE, None, value)
    return schema


def state_schema(groups: List[List[ParamInfo]], optimizer: torch.optim.Optimizer, shard_group) -> Dict[str, Dict[str, Tuple]]:
    """The union of every rank's state schema (collective when the world size is > 1)."""
    everyone = comm.all_gather_object(shard_group.world_group, local_schema(groups, optimizer))
    merged: Dict[str, Dict[str, Tuple]] = {}
    for schema in everyone:
        for fqn, entry in schema.items():
            target = merged.setdefault(fqn, {})
            for key, desc in entry.items():
                if key in target and target[key][:2] != desc[:2]:
                    raise CheckpointError(f"optimizer state {fqn!r}[{key!r}] differs between ranks: {target[key][:2]} vs {desc[:2]}")
                target.setdefault(key, desc)
    return merged


def sharded_local(info: ParamInfo, optimizer: torch.optim.Optimizer, key: str, dtype: str) -> torch.Tensor:
    """This rank's piece of a sharded state tensor (zeros if this rank has none)."""
    value = optimizer.state.get(info.param, {}).get(key)
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(-1)
    return torch.zeros(info.piece.length, dtype=str_to_dtype(dtype), device=info.flat.device)


# ---------------------------------------------------------------------- param groups
def encode_value(value: Any, where: str) -> Any:
    if isinstance(value, torch.Tensor):
        return {"__tensor__": value.detach().cpu().tolist(), "dtype": dtype_to_str(value.dtype)}
    if isinstance(value, (tuple, list)):
        return [encode_value(v, where) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    raise CheckpointError(f"{where} = {value!r} of type {type(value).__name__} cannot be saved as JSON")


def decode_value(value: Any, like: Any = None) -> Any:
    if isinstance(value, dict) and "__tensor__" in value:
        return torch.tensor(value["__tensor__"], dtype=str_to_dtype(value["dtype"]))
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    if isinstance(value, list):
        items = [decode_value(v) for v in value]
        return tuple(items) if isinstance(like, tuple) or like is None else items
    return value


def group_hyperparams(group: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in group.items() if k not in _SKIP_GROUP_KEYS}


def encode_groups(optimizer: torch.optim.Optimizer, groups: List[List[ParamInfo]]) -> List[Dict[str, Any]]:
    out = []
    for g, (group, infos) in enumerate(zip(optimizer.param_groups, groups)):
        enc = {k: encode_value(v, f"param_groups[{g}][{k!r}]") for k, v in group_hyperparams(group).items()}
        enc["params"] = [i.fqn for i in infos]
        out.append(enc)
    return out


def check_groups(saved: List[Dict[str, Any]], names: List[List[str]]) -> None:
    """The saved groups must hold the same parameter names as the optimizer's groups."""
    if len(saved) != len(names):
        raise CheckpointError(f"the checkpoint has {len(saved)} optimizer param groups, the optimizer has {len(names)}")
    for g, (s, mine) in enumerate(zip(saved, names)):
        s_names = list(s.get("params", []))
        if set(s_names) != set(mine):
            missing = [n for n in mine if n not in s_names]
            extra = [n for n in s_names if n not in mine]
            raise CheckpointError(f"optimizer param_groups[{g}] differs: parameters not in the checkpoint's group: {missing}; "
                                  f"in the checkpoint's group but not the optimizer's: {extra}")


def torch_state_dict(optimizer: torch.optim.Optimizer, names: List[List[str]], state: Dict[str, Dict[str, Any]],
                     hyper: List[Dict[str, Any]]) -> Dict[str, Any]:
    """``{"state": {index: ...}, "param_groups": [...]}`` in the optimizer's own parameter order."""
    out_state: Dict[int, Any] = {}
    out_groups = []
    idx = 0
    for group, group_names, h in zip(optimizer.param_groups, names, hyper):
        ids = []
        for name in group_names:
            if name in state:
                out_state[idx] = state[name]
            ids.append(idx)
            idx += 1
        g = {k: decode_value(v, group.get(k)) if not isinstance(v, torch.Tensor) else v for k, v in h.items() if k not in _SKIP_GROUP_KEYS}
        if "param_names" in group:
            g["param_names"] = list(group["param_names"])
        g["params"] = ids
        out_groups.append(g)
    return {"state": out_state, "param_groups": out_groups}
