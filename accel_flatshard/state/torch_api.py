"""torch's own state-dict API on a sharded model: what ``torch.distributed.checkpoint.state_dict``'s
``get_model_state_dict`` / ``get_optimizer_state_dict`` / ``get_state_dict`` and their ``set_*`` return and take for
a prepared model (the wrapper or the module it wraps), so that torchtitan-style code (``dcp.save(get_state_dict(model,
opt))``, ``dcp.load`` + ``set_state_dict``) runs unchanged with DCP's default planners.

Data layout.  A rank holds, of each parameter, one contiguous range of its row-major flattening (its piece of the
flat parameter, ``FlatParamLayout.shard_pieces``).  Such a range is a union of at most ``2 * ndim - 1`` boxes
(``state/dcp.py``'s :func:`~accel_flatshard.state.dcp.range_to_chunks`: a partial first row, whole middle rows, a
partial last row), so under the default options (sharded) each parameter is a ``ShardedTensor`` with its original
key and global shape, whose local shards are *views* of this rank's piece, one per box (no copy, no gather; an empty
piece: no local shard) and whose metadata lists every shard rank's boxes (computed from the layout, no collective;
with hybrid sharding the ShardedTensor spans this rank's shard group: replicas hold equal boxes, DCP's planner writes
each once).  Buffers are the module's own (whole on every rank).  The optimizer's state, keyed as torch documents::

    {"state": {"model.embed_tokens.weight": {"exp_avg": ShardedTensor, "exp_avg_sq": ShardedTensor, "step": tensor},
               ...},
     "param_groups": [{"lr": ..., "betas": ..., "params": ["model.embed_tokens.weight", ...]}, ...]}

per-element state as the parameter (views of the optimizer's 1-D pieces), 0-dim state (``step``) and plain values as
the optimizer holds them, a matrix optimizer's whole-matrix state (``matrix_optim.py``) as a ShardedTensor of one box
on its owner.  ``flatten_optimizer_state_dict=True`` gives torch's flat form (``state.<name>.<key>``,
``param_groups.<name>.<key>``).  ``full_state_dict=True`` gives full tensors (``core/model_state.py``'s and
``optim.py``'s gathers: on rank 0 only with ``cpu_offload=True``, as torch does).

``set_*`` take either form.  A ShardedTensor (ours at any world size after ``dcp.load``, or any other sharding) fills
this rank's piece from the overlap of its local boxes with the piece's boxes, which must cover it; a plain tensor of
the global shape is narrowed; a full dict under ``full_state_dict=True`` loads as ``load_full_state_dict`` (with
``broadcast_from_rank0``: from rank 0).

How it is called: torch's public functions call four private ones with their options (``_StateDictInfo``):
``_get_model_state_dict``, ``_load_model_state_dict``, ``_get_optim_state_dict``, ``_load_optim_state_dict``.
:func:`dispatching` wraps each (``integrations/patches.py``, applied at the first wrap of a model): a call for a
prepared model runs here, any other goes on to torch's own.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from ..core import _compat
from ..core.model_state import LoadResult, ModelIndex, ParamInfo, full_state_dict, load_state_dict
from ..core.registry import Prepared, record_of
from ..core.state_errors import CheckpointError, str_to_dtype
from .dcp import Chunk, intersect, range_to_chunks
from .optim import (LOCAL, SCALAR, SHARDED, VALUE, WHOLE, full_optim_state_dict, group_hyperparams,
                    load_full_optim_state_dict, optimizer_groups, sharded_local, state_schema, state_value,
                    torch_state_dict)

STATE, GROUPS = "state", "param_groups"


# ---------------------------------------------------------------------- the hook into torch's API
def dispatching(original: Callable[..., Any]) -> Callable[..., Any]:
    """torch's private ``original`` (one of the four named in the module docstring), running ours for a prepared
    model."""
    ours = _OURS[original.__name__]

    @functools.wraps(original)
    def call(model: nn.Module, *args: Any) -> Any:
        record = record_of(model)
        return original(model, *args) if record is None else ours(record, *args)

    return call


def _check(info: Any, what: str) -> None:
    if getattr(info, "submodule_prefixes", None):
        raise NotImplementedError(f"accel_flatshard: {what}(submodules=...) (deprecated by torch) is not supported on "
                                  "a sharded model; filter the returned state dict instead")


# ---------------------------------------------------------------------- ShardedTensors of pieces
class _Sharder:
    """Builds the ShardedTensors of one model's pieces (every shard rank's boxes computed once per flat
    parameter)."""

    def __init__(self, index: ModelIndex, cpu_offload: bool) -> None:
        self.group = index.group
        self.cpu_offload = cpu_offload
        self.ranks = dist.get_process_group_ranks(self.group.shard_group)
        self._pieces: Dict[int, List[list]] = {}

    def boxes(self, info: ParamInfo) -> List[Tuple[Tuple[int, ...], Tuple[int, ...], int, str]]:
        flat = info.flat
        if id(flat) not in self._pieces:
            self._pieces[id(flat)] = [flat.layout.shard_pieces(r) for r in range(self.group.shard_size)]
        device = "cpu" if self.cpu_offload else str(flat.device)
        out = []
        for r, pieces in enumerate(self._pieces[id(flat)]):
            piece = pieces[info.slot_index]
            for chunk in _boxes(piece.param_start, piece.length, info.shape):
                out.append((chunk.offsets, chunk.sizes, self.ranks[r], device))
        return out

    def sharded(self, info: ParamInfo, local: torch.Tensor) -> Any:
        """``local`` (this rank's piece, 1-D) as a ShardedTensor of the parameter's shape."""
        if info.numel == 0:
            return local.detach().view(info.shape)
        start = info.piece.param_start
        shards = []
        for chunk in _boxes(start, info.piece.length, info.shape):
            view = local.detach()[chunk.flat_start - start: chunk.flat_start - start + chunk.numel].view(chunk.sizes)
            shards.append((chunk.offsets, view.cpu() if self.cpu_offload else view))
        return _compat.sharded_tensor(shards, self.boxes(info), info.shape, local.dtype, self.group.shard_group)

    def whole(self, info: ParamInfo, value: Optional[torch.Tensor], owner: int, dtype: torch.dtype) -> Any:
        """A tensor of the parameter's shape held whole by shard rank ``owner``: a ShardedTensor of one box."""
        device = "cpu" if self.cpu_offload else str(info.flat.device)
        zeros = (0,) * len(info.shape)
        local = [] if value is None else [(zeros, value.detach().cpu() if self.cpu_offload else value.detach())]
        return _compat.sharded_tensor(local, [(zeros, info.shape, self.ranks[owner], device)], info.shape, dtype,
                                      self.group.shard_group)


def _boxes(start: int, length: int, shape: Tuple[int, ...]) -> List[Chunk]:
    """The boxes of ``[start, start + length)``; an empty piece is one empty box past the last row (DCP's default
    load planner drops a ShardedTensor without local shards, then misreads the whole checkpoint as torch 2.3's)."""
    if length == 0 and shape:
        return [Chunk((shape[0],) + (0,) * (len(shape) - 1), (0,) + tuple(shape[1:]), 0)]  # (no box starts there)
    return range_to_chunks(start, start + length, shape)


def fill_piece(dst: torch.Tensor, start: int, shape: Sequence[int], value: Any, key: str) -> None:
    """Copy into ``dst`` (1-D: elements ``[start, start + dst.numel())`` of the flattened tensor) from ``value``: a
    ShardedTensor whose local boxes cover that range, or a plain tensor of the global ``shape``."""
    shape = tuple(shape)
    if tuple(value.shape) != shape:
        raise CheckpointError(f"{key}: the state dict holds shape {tuple(value.shape)}, the model expects {shape}")
    if not _compat.is_sharded_tensor(value):
        dst.copy_(value.detach().reshape(-1)[start: start + dst.numel()])
        return
    boxes = _compat.local_boxes(value)
    for chunk in range_to_chunks(start, start + dst.numel(), shape):
        target = dst[chunk.flat_start - start: chunk.flat_start - start + chunk.numel].view(chunk.sizes)
        covered = 0
        for offsets, sizes, tensor in boxes:
            inter = intersect(chunk.offsets, chunk.sizes, offsets, sizes)
            if inter is None:
                continue
            lo, size = inter
            target[tuple(slice(a - b, a - b + n) for a, b, n in zip(lo, chunk.offsets, size))].copy_(
                tensor[tuple(slice(a - b, a - b + n) for a, b, n in zip(lo, offsets, size))])
            covered += math.prod(size)
        if covered != chunk.numel:
            raise CheckpointError(
                f"{key}: this rank's ShardedTensor shards hold {covered} of the {chunk.numel} elements of its piece at "
                f"offsets {chunk.offsets} (sizes {chunk.sizes}); load a checkpoint into the result of "
                "get_state_dict(model, ...) on this model (dcp.load reshards), then pass that")


# ---------------------------------------------------------------------- the model
def get_model(record: Prepared, info: Any) -> Dict[str, Any]:
    """``_get_model_state_dict(model, info)`` for a prepared model."""
    _check(info, "get_model_state_dict")
    model = record.wrapper
    if info.full_state_dict:
        out = full_state_dict(model, rank0_only=info.cpu_offload, cpu_offload=info.cpu_offload)
        frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    else:
        index = ModelIndex(model, "get_model_state_dict")
        sharder = _Sharder(index, info.cpu_offload)
        made: Dict[str, Any] = {}
        out = {}
        for key in index.keys:
            if key in index.param_of_key:
                name = index.param_of_key[key]
                if name not in made:  # (a tied parameter: one ShardedTensor under each of its keys)
                    made[name] = sharder.sharded(index.params[name], index.params[name].local())
                out[key] = made[name]
            elif key in index.buffers:
                buf = index.buffers[key].detach()
                out[key] = buf.cpu() if info.cpu_offload else buf
            else:
                out[key] = index.extra[key]
        frozen = {k for k, name in index.param_of_key.items() if not index.params[name].param.requires_grad}
    if info.ignore_frozen_params:
        out = {k: v for k, v in out.items() if k not in frozen}
    return out


def load_model(record: Prepared, state_dict: Dict[str, Any], info: Any) -> LoadResult:
    """``_load_model_state_dict(model, state_dict, info)`` for a prepared model."""
    _check(info, "set_model_state_dict")
    model = record.wrapper
    if not state_dict and not info.broadcast_from_rank0:
        return LoadResult([], [])
    if info.full_state_dict or info.broadcast_from_rank0 or not any(map(_compat.is_sharded_tensor,
                                                                          state_dict.values())):
        return load_state_dict(model, state_dict, strict=info.strict)  # full tensors (collective)
    index = ModelIndex(model, "set_model_state_dict")
    used = set()
    missing = []
    with torch.no_grad():
        for name, param in index.params.items():
            key = next((k for k in param.aliases if k in state_dict), None)
            if key is None:
                missing += [k for k in param.aliases if k not in state_dict]
                continue
            used.update(k for k in param.aliases if k in state_dict)
            fill_piece(param.local(), param.piece.param_start, param.shape, state_dict[key], key)
        for name, buf in index.buffers.items():
            if name not in state_dict:
                missing.append(name)
                continue
            used.add(name)
            value = state_dict[name]
            if _compat.is_sharded_tensor(value):
                fill_piece(buf.view(-1), 0, buf.shape, value, name)
            else:
                buf.copy_(value.detach().view(buf.shape))
    unexpected = [k for k in state_dict if k not in used and k not in index.extra]
    if info.strict and (missing or unexpected):
        raise RuntimeError(f"Error(s) in loading state_dict for {type(record.module).__name__}: missing keys "
                           f"{missing}, unexpected keys {unexpected}")
    return LoadResult(missing, unexpected)


# ---------------------------------------------------------------------- the optimizer
def get_optim(record: Prepared, optimizers: Tuple[torch.optim.Optimizer, ...], info: Any) -> Dict[str, Any]:
    """``_get_optim_state_dict(model, optimizers, info)`` for a prepared model."""
    _check(info, "get_optimizer_state_dict")
    model = record.wrapper
    out: Dict[str, Any] = {STATE: {}, GROUPS: []}
    index = None if info.full_state_dict else ModelIndex(model, "get_optimizer_state_dict")
    for optim in optimizers:
        _compat.init_optimizer_state(optim)
        osd = (full_optim_state_dict(model, optim, rank0_only=info.cpu_offload) if info.full_state_dict
               else _sharded_optim(index, optim, _Sharder(index, info.cpu_offload)))
        if osd:
            out[STATE].update(osd[STATE])
            out[GROUPS].extend(osd[GROUPS])
    if info.full_state_dict and info.cpu_offload and record.shard_group.world_rank != 0:
        return {}
    return flatten(out) if info.flatten_optimizer_state_dict else out


def _sharded_optim(index: ModelIndex, optim: torch.optim.Optimizer, sharder: _Sharder) -> Dict[str, Any]:
    groups = optimizer_groups(optim, index.by_param_id)
    schema = state_schema(groups, optim, index.group)  # (collective: a rank may hold no state for a parameter)
    state: Dict[str, Dict[str, Any]] = {}
    for info in (i for infos in groups for i in infos):
        own = optim.state.get(info.param, {})
        for key, (kind, dtype, value) in schema.get(info.fqn, {}).items():
            if kind == SHARDED:
                entry = sharder.sharded(info, sharded_local(info, optim, key, dtype))
            elif kind == WHOLE:
                entry = sharder.whole(info, own.get(key) if index.group.shard_rank == value else None, value,
                                      str_to_dtype(dtype))
            elif kind == LOCAL:
                raise CheckpointError(
                    f"optimizer state {info.fqn!r}[{key!r}] is state of each rank's piece (bitsandbytes' blockwise "
                    "8-bit state), not of the parameter: torch's state-dict API cannot express it; save it with "
                    "accelerator.save_state (SHARDED_STATE_DICT)")
            elif kind == SCALAR and isinstance(own.get(key), torch.Tensor):
                entry = own[key]
            else:
                entry = state_value(kind, dtype, value) if kind in (SCALAR, VALUE) else value
            state.setdefault(info.fqn, {})[key] = entry
    param_groups = [{**group_hyperparams(g), "params": [i.fqn for i in infos]}
                    for g, infos in zip(optim.param_groups, groups)]
    return {STATE: state, GROUPS: param_groups}


def load_optim(record: Prepared, optimizers: Tuple[torch.optim.Optimizer, ...], state_dict: Dict[str, Any],
               info: Any) -> None:
    """``_load_optim_state_dict(model, optimizers, state_dict, info)`` for a prepared model."""
    _check(info, "set_optimizer_state_dict")
    model = record.wrapper
    index = ModelIndex(model, "set_optimizer_state_dict")
    given = state_dict or None
    if given is not None and STATE not in given:
        given = unflatten(given, [[[i.fqn for i in infos] for infos in optimizer_groups(o, index.by_param_id)]
                                  for o in optimizers])
    for optim in optimizers:
        _compat.init_optimizer_state(optim)
        names = [[i.fqn for i in infos] for infos in optimizer_groups(optim, index.by_param_id)]
        mine = _split(given, names) if given is not None else None
        if info.full_state_dict or info.broadcast_from_rank0 or not _any_sharded(mine):
            load_full_optim_state_dict(model, optim, mine)  # (collective; None elsewhere: from rank 0)
            continue
        groups = optimizer_groups(optim, index.by_param_id)
        schema = state_schema(groups, optim, index.group)  # (collective) which state a matrix's owner holds whole
        state: Dict[str, Dict[str, Any]] = {}
        with torch.no_grad():
            for fqn, entry in mine[STATE].items():
                param, out = index.params[fqn], state.setdefault(fqn, {})
                for key, value in entry.items():
                    kind, _, holder = schema.get(fqn, {}).get(key, (None, None, None))
                    where = f"state.{fqn}.{key}"
                    if kind == WHOLE:  # only its owner keeps it
                        if index.group.shard_rank == holder:
                            out[key] = torch.empty(param.shape, dtype=value.dtype, device=param.flat.device)
                            fill_piece(out[key].view(-1), 0, param.shape, value, where)
                    elif isinstance(value, torch.Tensor) and value.dim() >= 1 and tuple(value.shape) == param.shape:
                        out[key] = torch.empty(param.piece.length, dtype=value.dtype, device=param.flat.device)
                        fill_piece(out[key], param.piece.param_start, param.shape, value, where)
                    else:
                        out[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
        optim.load_state_dict(torch_state_dict(optim, names, state, [group_hyperparams(g) for g in mine[GROUPS]]))


def _any_sharded(osd: Optional[Dict[str, Any]]) -> bool:
    return osd is not None and any(_compat.is_sharded_tensor(v) for entry in osd[STATE].values()
                                   for v in entry.values())


def _split(osd: Dict[str, Any], names: List[List[str]]) -> Dict[str, Any]:
    """The part of a (merged) optimizer state dict for the optimizer whose groups hold ``names``, in its order."""
    groups = []
    for g, group_names in enumerate(names):
        found = next((s for s in osd[GROUPS] if group_names and group_names[0] in s.get("params", ())), None)
        if found is None or set(found["params"]) != set(group_names):
            raise CheckpointError(f"optimizer param_groups[{g}] ({group_names[:3]}...) is not a group of the state "
                                  "dict given")
        groups.append(found)
    known = {n for group_names in names for n in group_names}
    return {STATE: {k: v for k, v in osd[STATE].items() if k in known}, GROUPS: groups}


def flatten(osd: Dict[str, Any]) -> Dict[str, Any]:
    """torch's ``flatten_optimizer_state_dict`` form: ``state.<name>.<key>`` and ``param_groups.<name>.<key>``."""
    out = {f"{STATE}.{fqn}.{key}": value for fqn, entry in osd[STATE].items() for key, value in entry.items()}
    for group in osd[GROUPS]:
        for fqn in group["params"]:
            out.update({f"{GROUPS}.{fqn}.{k}": v for k, v in group.items() if k != "params"})
    return out


def unflatten(flat: Dict[str, Any], names: List[List[List[str]]]) -> Dict[str, Any]:
    """The nested form of :func:`flatten`'s, for optimizers whose groups hold ``names`` (per optimizer)."""
    state: Dict[str, Dict[str, Any]] = {}
    groups = []
    all_names = {n for per_optim in names for group in per_optim for n in group}
    for key, value in flat.items():
        section, _, rest = key.partition(".")
        fqn = max((n for n in all_names if rest.startswith(n + ".")), key=len, default=None)
        if section == STATE and fqn is not None:
            state.setdefault(fqn, {})[rest[len(fqn) + 1:]] = value
    for per_optim in names:
        for group in per_optim:
            hyper = {key[len(f"{GROUPS}.{group[0]}."):]: v for key, v in flat.items()
                     if group and key.startswith(f"{GROUPS}.{group[0]}.")}
            groups.append({**hyper, "params": list(group)})
    return {STATE: state, GROUPS: groups}


_OURS: Dict[str, Callable[..., Any]] = {"_get_model_state_dict": get_model, "_load_model_state_dict": load_model,
                                        "_get_optim_state_dict": get_optim, "_load_optim_state_dict": load_optim}
