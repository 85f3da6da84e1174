"""Optimizer state of a sharded model by parameter name: its schema, the full optimizer state dict, torch's format.

A stock torch optimizer keeps, per parameter (a 1-D slice of a shard), tensors of this rank's piece's size
("sharded": ``exp_avg``), 0-dim tensors ("scalar": ``step``) and Python values ("value").  A matrix optimizer
stepped owner-computes (``matrix_optim.py``: Muon's ``momentum_buffer``) keeps a tensor of the parameter's full
shape on the one rank of the shard group that owns the matrix ("whole"; its value in the schema: that shard rank).
bitsandbytes' 8-bit optimizers keep, besides per-element codes, a scale per 256-element block of the piece and
lookup tables ("local": state of this rank's piece, not of the parameter; its value in the schema: each shard rank's
shape).  Local state is saved rank by rank and loads only at the shard group size it was saved at.
:func:`state_schema` describes it by name (``{name: {key: (kind, dtype, value)}}``, merged over ranks);
:func:`encode_groups` writes JSON-able param groups.  A full optimizer state dict (:func:`full_optim_state_dict`'s,
on rank 0)::

    {
      "state": {"transformer.wte.weight": {"step": tensor(5.), "exp_avg": <full-shaped>, ...}, ...},
      "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), ..., "params": ["transformer.wte.weight", ...]}, ...],
    }

Names are canonical (a tied parameter's first, as in ``named_parameters()``); per-element state is full-shaped,
so it loads at any world size, and :func:`optim_state_dict_to_torch` / :func:`optim_state_dict_from_torch`
convert to / from a plain torch optimizer's ``state_dict()``.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..core import comm
from ..core.state_errors import CheckpointError, dtype_to_str, str_to_dtype
from ..core.model_state import ModelIndex, ParamInfo, gather_full, plan_where_given


SHARDED, SCALAR, VALUE, WHOLE, LOCAL = "sharded", "scalar", "value", "whole", "local"
_SKIP_GROUP_KEYS = ("params", "param_names")
# bitsandbytes' per-block scales and lookup tables (by key: a table of 256 entries would pass for a piece of 256)
_LOCAL_KEYS = frozenset(("absmax1", "absmax2", "qmap1", "qmap2", "max1", "max2", "new_max1", "new_max2", "gnorm_vec",
                         "unorm_vec"))
_RANK_LOCAL = "rank_local"  # in a full dict: {"rank_local": [shard rank 0's tensor, ...]}


# ---------------------------------------------------------------------- the schema
def optimizer_groups(optimizer: torch.optim.Optimizer, of_param: Dict[int, Any]) -> List[List[Any]]:
    """``of_param[id(p)]`` (a model's :class:`ParamInfo` or name) for the parameters of each param group."""
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in of_param:
                raise CheckpointError(f"optimizer param_groups[{g}] holds a parameter (shape {tuple(p.shape)}) that "
                                      "is not the model's; build the optimizer from model.parameters()")
    return [[of_param[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def _describe(value: Any) -> Tuple[str, Optional[str], Any]:
    """``(kind, dtype, value)`` of one optimizer state entry (value only for scalar and plain state)."""
    if isinstance(value, dict) and _RANK_LOCAL in value:  # (a full dict's)
        return LOCAL, dtype_to_str(value[_RANK_LOCAL][0].dtype), [list(t.shape) for t in value[_RANK_LOCAL]]
    if isinstance(value, torch.Tensor) and value.dim() >= 1:
        return SHARDED, dtype_to_str(value.dtype), None
    if isinstance(value, torch.Tensor):
        return SCALAR, dtype_to_str(value.dtype), value.item()
    return VALUE, None, value


def state_schema(groups: List[List[ParamInfo]], optimizer: torch.optim.Optimizer, shard_group) -> Dict[str, dict]:
    """The union of every rank's state schema (collective when the world size is > 1)."""
    local: Dict[str, Dict[str, Tuple]] = {}
    for info in (i for infos in groups for i in infos):
        for key, value in optimizer.state.get(info.param, {}).items():
            desc = _describe(value)
            if desc[0] == SHARDED and value.dim() >= 2 and tuple(value.shape) == tuple(info.shape):
                desc = (WHOLE, desc[1], shard_group.shard_rank)  # held whole by its owner (1-D pieces are 1-D)
            elif desc[0] == SHARDED and (key in _LOCAL_KEYS or value.numel() != info.piece.length):
                desc = (LOCAL, desc[1], {shard_group.shard_rank: list(value.shape)})
            local.setdefault(info.fqn, {})[key] = desc
    merged: Dict[str, Dict[str, Tuple]] = {}
    for schema in comm.all_gather_object(shard_group.world_group, local):
        for fqn, entry in schema.items():
            target = merged.setdefault(fqn, {})
            for key, desc in entry.items():
                if key in target and target[key][:2] != desc[:2]:
                    raise CheckpointError(
                        f"optimizer state {fqn!r}[{key!r}] differs between ranks: {target[key][:2]} vs {desc[:2]}")
                if desc[0] == LOCAL and key in target:
                    target[key][2].update(desc[2])  # every shard rank's shape
                else:
                    target.setdefault(key, desc)
    return merged


def sharded_local(info: ParamInfo, optimizer: torch.optim.Optimizer, key: str, dtype: str) -> torch.Tensor:
    """This rank's piece of a sharded state tensor (zeros if this rank has none)."""
    value = optimizer.state.get(info.param, {}).get(key)
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(-1)
    return torch.zeros(info.piece.length, dtype=str_to_dtype(dtype), device=info.flat.device)


def state_value(kind: str, dtype: Optional[str], value: Any) -> Any:
    """A scalar or plain entry of the schema as the optimizer holds it."""
    return torch.tensor(value, dtype=str_to_dtype(dtype)) if kind == SCALAR else value


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
            raise CheckpointError(f"optimizer param_groups[{g}] differs: parameters not in the checkpoint's group: "
                                  f"{missing}; in the checkpoint's group but not the optimizer's: {extra}")


def torch_state_dict(optimizer: torch.optim.Optimizer, names: List[List[str]], state: Dict[str, Dict[str, Any]],
                     hyper: List[Dict[str, Any]]) -> Dict[str, Any]:
    """``{"state": {index: ...}, "param_groups": [...]}`` in the optimizer's own parameter order; ``hyper``: the
    groups' hyperparameters (their ``params`` and ``param_names`` are ignored)."""
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
        g = {k: v if isinstance(v, torch.Tensor) else decode_value(v, group.get(k))
             for k, v in h.items() if k not in _SKIP_GROUP_KEYS}
        if "param_names" in group:
            g["param_names"] = list(group["param_names"])
        g["params"] = ids
        out_groups.append(g)
    return {"state": out_state, "param_groups": out_groups}


# ---------------------------------------------------------------------- the full optimizer state dict
def full_optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, rank0_only: bool = True) -> dict:
    """Gather the optimizer state by parameter name, one (flat parameter, key) at a time (collective); CPU
    tensors on rank 0 (``rank0_only``) or on every rank.  Example::

        osd = full_optim_state_dict(model, optimizer)
        if rank == 0:
            torch.save(osd, "optim.pt")
    """
    index = ModelIndex(model, "full_optim_state_dict")
    group = index.group
    groups = optimizer_groups(optimizer, index.by_param_id)
    schema = state_schema(groups, optimizer, group)
    receives = not rank0_only or group.world_rank == 0
    state: Dict[str, Dict[str, Any]] = {}
    for flat in index.flat_params if not rank0_only or group.replica_index == 0 else ():
        infos = [index.by_param_id[id(p)] for p in flat.params]
        # one gather per key and dtype (bitsandbytes keeps uint8 codes for large parameters, fp32 for small ones)
        keys = dict.fromkeys((key, dtype) for i in infos
                             for key, (kind, dtype, _) in schema.get(i.fqn, {}).items() if kind == SHARDED)
        for key, dtype in keys:
            holders = [i for i in infos if schema.get(i.fqn, {}).get(key, (None, None))[:2] == (SHARDED, dtype)]
            shard = torch.zeros(flat.layout.shard_numel, dtype=str_to_dtype(dtype), device=flat.device)
            for info in holders:
                piece = info.piece
                shard.narrow(0, piece.shard_start, piece.length).copy_(sharded_local(info, optimizer, key, dtype))
            full = gather_full(flat, group, shard)
            for info in holders if receives else ():
                slot = flat.layout.slots[info.slot_index]
                value = full[slot.offset : slot.offset + slot.numel].view(slot.shape)
                state.setdefault(info.fqn, {})[key] = value.to("cpu", copy=True)
            del full, shard
    for info in (i for infos in groups for i in infos) if not rank0_only or group.replica_index == 0 else ():
        for key, (kind, dtype, holder) in schema.get(info.fqn, {}).items():
            if kind == WHOLE:  # from the matrix's owner, one tensor at a time
                own = optimizer.state.get(info.param, {}).get(key) if group.shard_rank == holder else None
                full = (own.detach().contiguous() if own is not None else
                        torch.empty(info.shape, dtype=str_to_dtype(dtype), device=info.flat.device))
                comm.broadcast_tensor(group.shard_group, full, src=holder)
                if receives:
                    state.setdefault(info.fqn, {})[key] = full.to("cpu", copy=True)
                del full
            elif kind == LOCAL:  # every shard rank's own tensor, in shard rank order
                pieces = []
                for r in range(group.shard_size):
                    own = optimizer.state[info.param][key] if r == group.shard_rank else None
                    piece = (own.detach().contiguous() if own is not None else
                             torch.empty(holder[r], dtype=str_to_dtype(dtype), device=info.flat.device))
                    comm.broadcast_tensor(group.shard_group, piece, src=r)
                    pieces.append(piece.to("cpu", copy=True) if receives else None)
                if receives:
                    state.setdefault(info.fqn, {})[key] = {_RANK_LOCAL: pieces}
    if not receives:
        return {}
    ordered = {info.fqn: {key: state[info.fqn][key] if kind in (SHARDED, WHOLE, LOCAL) else
                          state_value(kind, dtype, value)
                          for key, (kind, dtype, value) in schema[info.fqn].items()}
               for infos in groups for info in infos if info.fqn in schema}
    param_groups = [{**{k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
                        for k, v in group_hyperparams(g).items()}, "params": [i.fqn for i in infos]}
                    for g, infos in zip(optimizer.param_groups, groups)]
    return {"state": ordered, "param_groups": param_groups}


def load_full_optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                               optim_state_dict: Optional[Dict[str, Any]]) -> None:
    """Load a name-keyed full optimizer state dict, hyperparameters included, into the sharded model's optimizer
    (collective; same param groups by name as the saver's).  Every rank passes the dict, or rank 0 only (others
    ``None``: tensors are broadcast one at a time).  Example::

        osd = torch.load("optim.pt", weights_only=True) if rank == 0 else None
        load_full_optim_state_dict(model, optimizer, osd)
    """
    index = ModelIndex(model, "load_full_optim_state_dict")
    group = index.group
    names = [[i.fqn for i in infos] for infos in optimizer_groups(optimizer, index.by_param_id)]
    fetch, (schema, hyper) = plan_where_given(group, optim_state_dict, "load_full_optim_state_dict",
                                              lambda: _plan(index, names, optim_state_dict))
    state: Dict[str, Dict[str, Any]] = {}
    for fqn, entry in schema.items():
        info, out = index.params[fqn], state.setdefault(fqn, {})
        for key, (kind, dtype, value) in entry.items():
            given = optim_state_dict["state"][fqn] if optim_state_dict is not None else None
            if kind == SHARDED:
                full = fetch(given, key, info.numel, str_to_dtype(dtype), info.flat.device)
                out[key] = full.narrow(0, info.piece.param_start, info.piece.length).to(info.flat.device).clone()
            elif kind == LOCAL:  # this shard rank's own (each is broadcast in turn when rank 0 alone has the dict)
                source = dict(enumerate(given[key][_RANK_LOCAL])) if given is not None else None
                for r, shape in enumerate(value):
                    numel = math.prod(shape)
                    piece = fetch(source, r, numel, str_to_dtype(dtype), info.flat.device)
                    if r == group.shard_rank:
                        out[key] = piece.to(info.flat.device).reshape(shape).clone()
            else:
                out[key] = state_value(kind, dtype, value)
    optimizer.load_state_dict(torch_state_dict(optimizer, names, state, hyper))


def _plan(index: ModelIndex, names: List[List[str]], osd: Any):
    """(schema, hyperparameter groups) of a full dict, after checking it against model and optimizer."""
    if not isinstance(osd, dict) or "state" not in osd or "param_groups" not in osd:
        raise CheckpointError("a full optimizer state dict needs 'state' and 'param_groups' (state_dict/optim.py)")
    check_groups(osd["param_groups"], names)
    known = {n for group in names for n in group}
    schema: Dict[str, Dict[str, Any]] = {}
    problems = []
    for fqn, entry in osd["state"].items():
        if fqn not in known:
            problems.append(f"state for {fqn!r}, which is not a parameter of this optimizer")
            continue
        shape = index.params[fqn].shape
        schema[fqn] = {key: _describe(value) for key, value in entry.items()}
        size = index.group.shard_size
        problems += [f"state {fqn!r}[{key!r}] is state of each rank's piece, saved with a shard group of "
                     f"{len(desc[2])} ranks: it loads only at that size, not {size}"
                     for key, desc in schema[fqn].items() if desc[0] == LOCAL and len(desc[2]) != size]
        problems += [f"state {fqn!r}[{key!r}] has shape {tuple(value.shape)}, the parameter has {shape}"
                     for key, value in entry.items() if schema[fqn][key][0] == SHARDED and tuple(value.shape) != shape]
    if problems:
        raise CheckpointError("full optimizer state dict does not match:\n  " + "\n  ".join(problems))
    return schema, [group_hyperparams(g) for g in osd["param_groups"]]


# ---------------------------------------------------------------------- torch's format
def optim_state_dict_to_torch(optim_state_dict: Dict[str, Any], model: nn.Module,
                              optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """A name-keyed full dict in ``optimizer.state_dict()`` format for a plain ``model`` and its ``optimizer``
    (same groups).  Tensors are copied: ``load_state_dict`` would adopt them and update them in place.  Example::

        plain_opt.load_state_dict(optim_state_dict_to_torch(osd, plain_model, plain_opt))
    """
    # canonical names: a tied parameter's first
    names = optimizer_groups(optimizer, {id(p): n for n, p in model.named_parameters()})
    check_groups(optim_state_dict["param_groups"], names)
    state = {fqn: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in entry.items()}
             for fqn, entry in optim_state_dict["state"].items()}
    return torch_state_dict(optimizer, names, state, optim_state_dict["param_groups"])


def optim_state_dict_from_torch(torch_osd: Dict[str, Any], model: nn.Module,
                                optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """A plain optimizer's ``state_dict()`` (indices) in the name-keyed full format (``optimizer``/``model``: the
    plain optimizer and model it was built for).  Example::

        osd = optim_state_dict_from_torch(plain_opt.state_dict(), plain_model, plain_opt)
        load_full_optim_state_dict(sharded_model, sharded_opt, osd)
    """
    index_to_name: Dict[int, str] = {}
    groups = []
    names = optimizer_groups(optimizer, {id(p): n for n, p in model.named_parameters()})
    for saved, fqns in zip(torch_osd["param_groups"], names):
        if len(saved["params"]) != len(fqns):
            raise CheckpointError("the torch optimizer state dict's groups do not match the optimizer's groups")
        index_to_name.update(zip(saved["params"], fqns))
        groups.append({**group_hyperparams(saved), "params": fqns})
    state = {index_to_name[i]: dict(v) for i, v in torch_osd["state"].items()}
    return {"state": state, "param_groups": groups}
