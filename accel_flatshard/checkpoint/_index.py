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
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn


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
        if not hasattr(model, "flat_params") or not hasattr(model, "shard_group"):
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
        from ..full_state_dict_hook import local_state_dict

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
        from ._files import dtype_to_str

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


def agree_on_error(group: Optional[Any], error: Union[None, str, BaseException]) -> None:
    """Collective: raise on every rank if any rank had an error (so no rank is left waiting in the
    next collective).  A rank re-raises its own exception; the others raise a
    :class:`CheckpointError` (or :class:`UnsafeCheckpointError`) carrying the first failing rank's
    message.  ``group``: a process group, or None for a single process."""
    import torch.distributed as dist

    from ._files import CheckpointError, UnsafeCheckpointError

    if isinstance(error, str):
        error = CheckpointError(error)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        mine = None if error is None else (type(error).__name__, str(error))
        everyone: List[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        failed = [(r, e) for r, e in enumerate(everyone) if e is not None]
        if failed and error is None:
            rank, (cls, message) = failed[0]
            kind = UnsafeCheckpointError if cls == "UnsafeCheckpointError" else CheckpointError
            raise kind(f"rank {rank} failed: {message}")
    if error is not None:
        raise error
