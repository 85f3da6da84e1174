"""Sharded optimizer checkpoints with DCP, resharded on load like the model.

Per-element state (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ...) of parameter ``name`` is
saved under the DCP key ``state.<name>.<key>`` as a tensor of the parameter's true shape, written
in chunks by the ranks that hold each piece (shard group 0 only under hybrid sharding); 0-dim state
(``step``) under the same kind of key, written once.  ``flatshard.json`` holds the param groups
(hyperparameters and parameter names), plain-Python state values and the key map.

Example::

    save_sharded_optimizer(model, optimizer, "ckpt/optim")
    load_sharded_optimizer(model, optimizer, "ckpt/optim")   # any world size; restores lr etc.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn

from ._dcp_io import load_entries, open_checkpoint, save_entries
from ..state_dict.index import ModelIndex, quiesce
from ..state_dict.types import CheckpointError, dtype_to_str, str_to_dtype
from ..state_dict.optim_index import (
    SCALAR,
    SHARDED,
    check_groups,
    decode_value,
    encode_groups,
    encode_value,
    optimizer_groups,
    sharded_local,
    state_schema,
    torch_state_dict,
)
from ._planner import Entry, FlatRange

__all__ = ["save_sharded_optimizer", "load_sharded_optimizer"]


def _dcp_key(fqn: str, key: str) -> str:
    return f"state.{fqn}.{key}"


def save_sharded_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str) -> None:
    """Write this rank's optimizer state pieces to ``directory`` (collective, atomic).

    Example::

        save_sharded_optimizer(model, optimizer, "ckpt/optim")
    """
    quiesce(model, "save_sharded_optimizer")
    index = ModelIndex(model)
    groups = optimizer_groups(index, optimizer)
    schema = state_schema(groups, optimizer, index.group)
    entries: Dict[str, Entry] = {}
    tensors: Dict[str, Any] = {}
    values: Dict[str, Dict[str, Any]] = {}
    for infos in groups:
        for info in infos:
            for key, (kind, dtype, value) in schema.get(info.fqn, {}).items():
                name = _dcp_key(info.fqn, key)
                if kind == SHARDED:
                    tensors[name] = {"kind": "state", "param": info.fqn, "key": key, "shape": list(info.shape), "dtype": dtype}
                    if index.replica_index == 0:
                        entries[name] = FlatRange(sharded_local(info, optimizer, key, dtype), info.piece.param_start, info.shape)
                elif kind == SCALAR:
                    tensors[name] = {"kind": "scalar", "param": info.fqn, "key": key, "shape": [], "dtype": dtype}
                    own = optimizer.state.get(info.param, {}).get(key)
                    if isinstance(own, torch.Tensor):
                        entries[name] = own.detach().cpu()
                else:
                    values.setdefault(info.fqn, {})[key] = encode_value(value, f"optimizer state {info.fqn!r}[{key!r}]")
    meta = {
        "kind": "optimizer",
        "optimizer_class": type(optimizer).__name__,
        "model_class": type(index.module).__name__,
        "param_shapes": {n: list(i.shape) for n, i in index.params.items()},
        "tensors": tensors,
        "values": values,
        "param_groups": encode_groups(optimizer, groups),
    }
    save_entries(index.group, directory, entries, meta)


def load_sharded_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str,
                           verify_checksums: bool = True) -> None:
    """Load optimizer state saved by :func:`save_sharded_optimizer` at any world size (collective).

    The optimizer must have the same param groups, by parameter name, as the one that saved; its
    hyperparameters (lr, betas, weight_decay, ...) are restored from the checkpoint.  Existing state
    tensors of the right size are filled in place (so the state is not held twice); if reading fails
    half-way (a corrupt file), model or optimizer state may be partly loaded.  Example::

        optimizer = torch.optim.AdamW(groups_by_name(model), lr=1e-3)
        load_sharded_optimizer(model, optimizer, "ckpt/optim")
    """
    quiesce(model, "load_sharded_optimizer")
    index = ModelIndex(model)
    groups = optimizer_groups(index, optimizer)
    names = [[i.fqn for i in infos] for infos in groups]
    entries: Dict[str, Entry] = {}
    error: Optional[Exception] = None
    directory_found, meta, md = directory, {"files": {}}, None
    try:
        directory_found, meta, md = open_checkpoint(directory, "optimizer")
        check_groups(meta.get("param_groups", []), names)
        known = {n for g in names for n in g}
        problems: List[str] = []
        for name, desc in meta["tensors"].items():
            fqn = desc.get("param")
            if fqn not in known:
                problems.append(f"{name}: state of {fqn!r}, which is not a parameter of this optimizer")
                continue
            info = index.params[fqn]
            dtype = str_to_dtype(desc["dtype"], name)
            if desc["kind"] == "state":
                if tuple(desc["shape"]) != info.shape:
                    problems.append(f"{name}: checkpoint shape {tuple(desc['shape'])}, the parameter has shape {info.shape}")
                    continue
                if dtype != info.dtype:
                    problems.append(f"{name}: checkpoint dtype {desc['dtype']}, the parameter is {dtype_to_str(info.dtype)}")
                    continue
                entries[name] = FlatRange(_target(optimizer, info, desc["key"], dtype), info.piece.param_start, info.shape)
            elif desc["kind"] == "scalar":
                entries[name] = torch.empty((), dtype=dtype)
            else:
                problems.append(f"{name}: unknown entry kind {desc['kind']!r}")
        if problems:
            error = CheckpointError("optimizer checkpoint does not match the optimizer:\n  " + "\n  ".join(problems))
    except Exception as e:  # noqa: BLE001 - raised on every rank by load_entries
        error = e
    if error is None:
        # zero-element pieces take no part in DCP reads but are still state
        load_set = {k: v for k, v in entries.items() if not (isinstance(v, FlatRange) and v.local.numel() == 0)}
    else:
        load_set = {}
    load_entries(index.group, directory_found, meta, md, load_set, verify_checksums, error)
    state: Dict[str, Dict[str, Any]] = {}
    for name, desc in meta["tensors"].items():
        entry = entries[name]
        state.setdefault(desc["param"], {})[desc["key"]] = entry.local if isinstance(entry, FlatRange) else entry
    for fqn, vals in meta.get("values", {}).items():
        for key, value in vals.items():
            state.setdefault(fqn, {})[key] = decode_value(value)
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in meta["param_groups"]]
    optimizer.load_state_dict(torch_state_dict(optimizer, names, state, hyper))


def _target(optimizer: torch.optim.Optimizer, info, key: str, dtype: torch.dtype) -> torch.Tensor:
    """The tensor to load a sharded state entry into: the existing state tensor when it fits (loads in
    place, no second copy of the optimizer state), else a new one."""
    current = optimizer.state.get(info.param, {}).get(key)
    if isinstance(current, torch.Tensor) and current.dtype == dtype and current.numel() == info.piece.length \
            and current.is_contiguous():
        return current if current.dim() == 1 else current.view(-1)
    return torch.empty(info.piece.length, dtype=dtype, device=info.flat.device)
