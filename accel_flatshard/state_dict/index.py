"""Where every state-dict entry of a wrapped model lives: parameter -> flat parameter, slot, piece.

Read-only view over ``FullyShardedDataParallel`` attributes (``flat_params``, their ``layout.slots``,
``pieces``, ``local_shard``, ``params``) and the module's ``state_dict(keep_vars=True)`` keys.

Example::

    index = ModelIndex(model)
    info = index.params["lm_head.weight"]      # the tied GPT-2 weight is one entry...
    info.aliases                               # ...("transformer.wte.weight", "lm_head.weight")
    info.local()                               # this rank's 1-D slice (a view of local_shard)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import torch
import torch.nn as nn

from .. import comm
from .registry import find_wrapper, local_state_dict
from .types import CheckpointError, agree, dtype_to_str


@dataclass
class ParamInfo:
    """One original parameter (one slot), under its canonical name ``fqn`` (first registration)."""

    fqn: str
    aliases: Tuple[str, ...]  # every state-dict key of this parameter, canonical first
    shape: Tuple[int, ...]
    numel: int
    dtype: torch.dtype
    flat: Any  # FlatParameter
    slot_index: int
    param: nn.Parameter

    @property
    def piece(self):
        return self.flat.pieces[self.slot_index]

    def local(self) -> torch.Tensor:
        """This rank's part of the flattened parameter (1-D view of ``local_shard``, maybe empty)."""
        piece = self.piece
        return self.flat.local_shard.narrow(0, piece.shard_start, piece.length)


class ModelIndex:
    """Parameters (by canonical name), buffers and state-dict key order of a wrapped model."""

    def __init__(self, model: nn.Module) -> None:
        if find_wrapper(model) is not model:
            raise TypeError(f"expected an accel_flatshard FullyShardedDataParallel model, got {type(model).__name__}")
        self.model = model
        self.module: nn.Module = model.module
        self.group = model.shard_group
        by_id: Dict[int, Tuple[Any, int]] = {}
        for flat in model.flat_params:
            for i, p in enumerate(flat.params):
                by_id[id(p)] = (flat, i)
        names: Dict[int, List[str]] = {}
        self.param_of_key: Dict[str, str] = {}  # every state-dict key of a parameter -> canonical name
        self.buffers: Dict[str, torch.Tensor] = {}
        self.extra: Dict[str, Any] = {}
        self.keys: List[str] = []
        with local_state_dict(self.module):
            local = self.module.state_dict(keep_vars=True)
        for key, value in local.items():
            self.keys.append(key)
            if isinstance(value, nn.Parameter) and id(value) in by_id:
                names.setdefault(id(value), []).append(key)
            elif isinstance(value, torch.Tensor):
                self.buffers[key] = value
            else:
                self.extra[key] = value
        self.params: Dict[str, ParamInfo] = {}
        self.by_param_id: Dict[int, ParamInfo] = {}
        for flat in model.flat_params:
            for i, (slot, p) in enumerate(zip(flat.layout.slots, flat.params)):
                keys = names.get(id(p), [])
                canonical = slot.fqn if slot.fqn in keys or not keys else keys[0]
                aliases = tuple([canonical] + [k for k in keys if k != canonical])
                info = ParamInfo(canonical, aliases, tuple(slot.shape), slot.numel, flat.dtype, flat, i, p)
                self.params[canonical] = info
                self.by_param_id[id(p)] = info
                for k in aliases:
                    self.param_of_key[k] = canonical

    # ------------------------------------------------------------------ groups
    @property
    def world_rank(self) -> int:
        return self.group.world_rank

    @property
    def replica_index(self) -> int:
        """Which shard group (replica) this rank is in; 0 writes checkpoints under hybrid sharding."""
        return self.group.replica_index

    def world_group(self):
        return self.group.world_group

    def describe(self) -> Dict[str, Any]:
        """The JSON description of the model's tensors (canonical names, shapes, dtypes, aliases)."""
        tensors: Dict[str, Any] = {}
        for name, info in self.params.items():
            tensors[name] = {"kind": "param", "shape": list(info.shape), "dtype": dtype_to_str(info.dtype),
                             "aliases": list(info.aliases[1:])}
        for name, buf in self.buffers.items():
            tensors[name] = {"kind": "buffer", "shape": list(buf.shape), "dtype": dtype_to_str(buf.dtype)}
        return tensors


def quiesce(model: nn.Module, what: str) -> None:
    """Refuse to run during forward/backward; finish in-flight collectives first."""
    ensure_idle = getattr(model, "ensure_idle", None)
    if ensure_idle is not None:
        ensure_idle(what)


def param_names(module: nn.Module) -> Dict[int, str]:
    """``id(parameter) -> canonical name`` of any module (first registration, like ``named_parameters``)."""
    return {id(p): n for n, p in module.named_parameters()}


def dict_mode(group, has_dict: bool, what: str) -> str:
    """Collective: ``"local"`` when every rank passed a dict, ``"broadcast"`` when only global rank 0 did
    (its tensors are then broadcast one at a time); otherwise an error on every rank."""
    flags = comm.all_gather_object(group.world_group if group.world_size > 1 else None, has_dict)
    if all(flags):
        return "local"
    if flags[0] and not any(flags[1:]):
        return "broadcast"
    raise CheckpointError(f"{what}: pass the dict on every rank, or on rank 0 only (None elsewhere); "
                          f"got a dict on ranks {[r for r, f in enumerate(flags) if f]}")


def plan_on_every_rank(group, mode: str, make_plan) -> Any:
    """``make_plan()`` (which raises CheckpointError/ValueError for a bad dict) run where the dict is: on
    rank 0 then broadcast (``mode == "broadcast"``), or on every rank with the error agreed on."""
    error = plan = None
    if mode == "local" or group.world_rank == 0:
        try:
            plan = make_plan()
        except Exception as e:  # noqa: BLE001 - reported on every rank
            error = f"{type(e).__name__}: {e}" if not isinstance(e, CheckpointError) else str(e)
    world = group.world_group if group.world_size > 1 else None
    if mode == "broadcast":
        plan, error = comm.broadcast_object(world, (plan, error))
        if error is not None:
            raise CheckpointError(error)
        return plan
    agree(world, error)
    return plan
