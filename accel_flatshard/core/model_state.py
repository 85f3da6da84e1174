"""A sharded model's state dict in memory: which wrapper shards a module, where each entry lives, the full dict.

After ``FullyShardedDataParallel(model)`` (or ``accelerator.prepare``) both the wrapper and ``model`` hold 1-D
slices of the parameters.  Code written for DDP or torch FSDP calls ``state_dict()`` on either
(``save_pretrained`` without ``state_dict=``, PEFT's ``get_peft_model_state_dict``,
``accelerator.save(model.state_dict(), path)``); a dict of slices would be written as a corrupt model.  So, as
torch FSDP's default ``FULL_STATE_DICT`` with ``rank0_only=True, offload_to_cpu=True`` (accelerate's setting):

* ``state_dict()`` of either is **collective**: a rendezvous first (:func:`require_all_ranks`: a call under
  ``if is_main_process:`` fails within seconds, writing no weights), then :func:`full_state_dict` gathers one
  flat parameter at a time; global rank 0 gets the plain model's keys on CPU, other ranks ``{}``;
* the wrapper's ``load_state_dict(full)`` is :func:`load_full_state_dict`: every rank passes the dict, or rank 0
  passes it and the others ``{}``/``None`` (each tensor is then broadcast from rank 0);
* inside ``summon_full_params()`` both are the module's own (parameters are full already, no gather);
* this rank's slices go by explicit names: ``wrapper.local_state_dict()`` / ``load_local_state_dict()`` (same
  world size and rank) and, inside, the context :func:`local_slices`.

:func:`install` registers the state-dict hook; the model's record (its wrapper, schedule, shard group and
rendezvous group) is the registry's (``core/registry.py``).
"""
from __future__ import annotations

import collections
import contextlib
import datetime
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

from . import comm, options, registry
from .flat_param import gather_full
from .registry import record_of
from .state_errors import CHECKPOINT_ERRORS, CheckpointError, dtype_to_str


TIMEOUT_ENV = "FLATSHARD_STATE_DICT_TIMEOUT_S"
# how long ranks other than 0 wait for rank 0 (which often arrives late: it writes config files first)
_PEER_TIMEOUT = datetime.timedelta(minutes=30)
# what nn.Module.load_state_dict returns (its own class is private); accelerate's load_fsdp_model returns it too
LoadResult = collections.namedtuple("LoadResult", ["missing_keys", "unexpected_keys"])


# ---------------------------------------------------------------------- which wrapper shards a module
def install_full_state_dict_hook(record: registry.Prepared) -> None:
    """Make the module's ``state_dict()`` the full one (collective) for the model of ``record``."""
    record.module.register_state_dict_post_hook(_full_state_dict_hook)


def find_wrapper(module: Any) -> Optional[nn.Module]:
    """The accel_flatshard wrapper of ``module`` (the wrapper itself or the module it wraps), else None."""
    record = record_of(module)
    return None if record is None else record.wrapper


@contextlib.contextmanager
def local_slices(module: nn.Module) -> Iterator[None]:
    """Inside, ``module.state_dict()`` returns this rank's 1-D slices (no gather)."""
    record = record_of(module)
    if record is not None:
        record.local_depth += 1
    try:
        yield
    finally:
        if record is not None:
            record.local_depth -= 1


def require_all_ranks(wrapper: nn.Module, what: str) -> None:
    """Fail within seconds on rank 0 (instead of hanging) when the other ranks do not join ``what``."""
    record = record_of(wrapper)
    if record is None or record.gloo_group is None:
        return
    timeout_s, group = options.get(TIMEOUT_ENV), record.shard_group
    timeout = datetime.timedelta(seconds=timeout_s) if group.world_rank == 0 else _PEER_TIMEOUT
    failed = comm.agree_on_failure(record.gloo_group, timeout=timeout)  # (a monitored barrier: who did not come)
    if failed:
        problem = failed[0][1]
        raise RuntimeError(
            f"accel_flatshard: {what} of {type(wrapper.module).__name__} is collective (its parameters are sharded "
            f"over {group.world_size} ranks), but rank {group.world_rank} waited {timeout_s:g} s and the other "
            f"ranks did not join ({problem}). Call it on every rank, not under `if accelerator.is_main_process:`: "
            "`accelerator.unwrap_model(model).save_pretrained(dir, is_main_process=accelerator.is_main_process)` "
            "on every rank, or `sd = accelerator.get_state_dict(model)` / `model.state_dict()` (or "
            "`accelerator.save_model(model, dir)`) on every rank and write `sd` on the main process only. No model "
            f"weights were written. If the ranks are just far apart in time, raise {TIMEOUT_ENV} (now {timeout_s:g})."
        )


# ---------------------------------------------------------------------- where every entry lives
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
    """Parameters (by canonical name), buffers and state-dict key order of a wrapped model, taken once the
    wrapper is idle: ``what`` is refused during forward/backward and in-flight collectives finish first."""

    def __init__(self, model: nn.Module, what: str) -> None:
        record = record_of(model)
        if record is None or record.wrapper is not model:
            raise TypeError(f"expected an accel_flatshard FullyShardedDataParallel model, got {type(model).__name__}")
        record.schedule.ensure_idle(what)
        self.module: nn.Module = record.module
        self.group = record.shard_group
        self.flat_params = [flat for unit in record.units for flat in unit.flat_params]
        by_id = {id(p) for flat in self.flat_params for p in flat.params}
        names: Dict[int, List[str]] = {}
        self.param_of_key: Dict[str, str] = {}  # every state-dict key of a parameter -> canonical name
        self.buffers: Dict[str, torch.Tensor] = {}
        self.extra: Dict[str, Any] = {}
        with local_slices(self.module):
            local = self.module.state_dict(keep_vars=True)
        self.keys: List[str] = list(local)
        for key, value in local.items():
            if isinstance(value, nn.Parameter) and id(value) in by_id:
                names.setdefault(id(value), []).append(key)
            elif isinstance(value, torch.Tensor):
                self.buffers[key] = value
            else:
                self.extra[key] = value
        self.params: Dict[str, ParamInfo] = {}
        self.by_param_id: Dict[int, ParamInfo] = {}
        for flat in self.flat_params:
            for i, (slot, p) in enumerate(zip(flat.layout.slots, flat.params)):
                keys = names.get(id(p), [])
                canonical = slot.fqn if slot.fqn in keys or not keys else keys[0]
                aliases = tuple([canonical] + [k for k in keys if k != canonical])
                info = ParamInfo(canonical, aliases, tuple(slot.shape), slot.numel, flat.dtype, flat, i, p)
                self.params[canonical] = self.by_param_id[id(p)] = info
                self.param_of_key.update(dict.fromkeys(aliases, canonical))

    def describe(self) -> Dict[str, Any]:
        """The JSON description of the model's tensors (canonical names, shapes, dtypes, aliases)."""
        tensors = {name: {"kind": "param", "shape": list(info.shape), "dtype": dtype_to_str(info.dtype),
                          "aliases": list(info.aliases[1:])} for name, info in self.params.items()}
        tensors.update({name: {"kind": "buffer", "shape": list(buf.shape), "dtype": dtype_to_str(buf.dtype)}
                        for name, buf in self.buffers.items()})
        return tensors


# ---------------------------------------------------------------------- collective helpers
def plan_where_given(group, given: Any, what: str,
                     make_plan: Callable[[], Any]) -> Tuple[Callable[..., torch.Tensor], Any]:
    """Collective: ``(fetch, plan)`` for a dict being loaded.  When every rank passed it (``given``), ``make_plan()``
    (which raises CheckpointError/ValueError for a bad dict) runs on every rank, the error agreed on, and
    ``fetch(source, key, numel, dtype, device)`` is this rank's ``source[key]`` flattened; when only global rank 0
    did, the plan is made there and broadcast, and ``fetch`` broadcasts rank 0's tensor (``source`` is None
    elsewhere).  Otherwise an error on every rank."""
    world = group.world_group if group.world_size > 1 else None
    flags = comm.all_gather_object(world, given is not None)
    if not all(flags) and not (flags[0] and not any(flags[1:])):
        raise CheckpointError(f"{what}: pass the dict on every rank, or on rank 0 only (None elsewhere); "
                              f"got a dict on ranks {[r for r, f in enumerate(flags) if f]}")
    local = all(flags)
    error = plan = None
    if given is not None:
        try:
            plan = make_plan()
        except Exception as e:  # noqa: BLE001 - reported on every rank
            error = e if isinstance(e, CheckpointError) else CheckpointError(f"{type(e).__name__}: {e}")
    if not local:
        plan, error = comm.broadcast_object(world, (plan, error))
    # (broadcast: every rank has rank 0's error already)
    comm.agree_on_error(world if local else None, error, CHECKPOINT_ERRORS, CheckpointError)

    def fetch(source: Optional[Dict[str, Any]], key: str, numel: int, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
        if local:
            return source[key].detach().reshape(-1)
        buf = (source[key].detach().reshape(-1).to(device=device, dtype=dtype).contiguous()
               if group.world_rank == 0 else torch.empty(numel, dtype=dtype, device=device))
        return comm.broadcast_tensor(group.world_group, buf)

    return fetch, plan


# ---------------------------------------------------------------------- the full state dict
def full_state_dict(model: nn.Module, rank0_only: bool = True, cpu_offload: bool = True) -> Dict[str, Any]:
    """Collective: the plain model's ``state_dict()`` (same keys, order, shapes; tied parameters under every name,
    sharing one tensor) gathered from ``model`` outside forward/backward; ``rank0_only``: other ranks get ``{}``;
    ``cpu_offload``: CPU copies.  Peak memory on rank 0: the result plus one gathered flat parameter."""
    index = ModelIndex(model, "full_state_dict")
    require_all_ranks(model, "gathering the full state dict")  # a main-process-only call fails fast
    group = index.group
    receives = not rank0_only or group.world_rank == 0
    full_of: Dict[int, torch.Tensor] = {}
    for flat in index.flat_params if not rank0_only or group.replica_index == 0 else ():  # (rank 0's shard group)
        full = gather_full(flat, group)
        for slot, p in zip(flat.layout.slots, flat.params) if receives else ():
            full_of[id(p)] = _copy(full[slot.offset : slot.offset + slot.numel].view(slot.shape), cpu_offload)
        del full
    if not receives:
        return {}
    return {key: full_of[id(index.params[index.param_of_key[key]].param)] if key in index.param_of_key
            else _copy(index.buffers[key], cpu_offload) if key in index.buffers else index.extra[key]
            for key in index.keys}


def _copy(t: torch.Tensor, cpu_offload: bool) -> torch.Tensor:
    t = t.detach()
    return t.to("cpu", copy=True) if cpu_offload else t.clone()


def load_full_state_dict(model: nn.Module, state_dict: Optional[Dict[str, Any]], strict: bool = True) -> None:
    """Collective: load a full (plain-model) state dict; each rank keeps its slices.  Every rank passes the dict,
    or rank 0 only and the others ``None`` (each tensor is then broadcast in turn: one extra tensor at most).
    ``strict`` as ``nn.Module.load_state_dict``; with ``strict=False`` a tied parameter loads from any of its
    names.  Shapes must match; values are cast to the parameter's dtype."""
    index = ModelIndex(model, "load_full_state_dict")
    group = index.group
    if group.world_size == 1 and state_dict is None:
        raise CheckpointError("load_full_state_dict: rank 0 passed None; it must pass the state dict")
    fetch, sources = plan_where_given(group, state_dict, "load_full_state_dict",
                                      lambda: _validate(index, state_dict, strict))
    with torch.no_grad():
        for name, info in index.params.items():
            if name in sources:
                full = fetch(state_dict, sources[name], info.numel, info.dtype, info.flat.device)
                info.local().copy_(full.narrow(0, info.piece.param_start, info.piece.length))
        for name, tensor in index.buffers.items():
            if name in sources:
                tensor.copy_(fetch(state_dict, name, tensor.numel(), tensor.dtype, tensor.device).view(tensor.shape))


def _validate(index: ModelIndex, sd: Dict[str, Any], strict: bool) -> Dict[str, str]:
    """Which dict key feeds each parameter/buffer; raises a CheckpointError naming every problem."""
    if not isinstance(sd, dict):
        raise CheckpointError(f"load_full_state_dict: expected a dict, got {type(sd).__name__}")
    problems: List[str] = []
    missing = [k for k in index.keys if k not in sd and k not in index.extra]
    unexpected = [k for k in sd if k not in index.param_of_key and k not in index.buffers and k not in index.extra]
    sources: Dict[str, str] = {}
    expected = [(name, info.aliases, info.shape) for name, info in index.params.items()]
    for name, aliases, shape in expected + [(n, (n,), tuple(b.shape)) for n, b in index.buffers.items()]:
        present = [k for k in aliases if k in sd]
        if present:
            sources[name] = present[0]
        for k in present:
            if not isinstance(sd[k], torch.Tensor):
                problems.append(f"{k}: expected a tensor, got {type(sd[k]).__name__}")
            elif tuple(sd[k].shape) != tuple(shape):
                problems.append(f"size mismatch for {k}: checkpoint has shape {tuple(sd[k].shape)}, the model "
                                f"expects {tuple(shape)}")
    if strict and missing:
        tied = [k for k in missing if k in index.param_of_key and k not in sources.values()
                and index.param_of_key[k] in sources]
        hint = (f" ({tied} share a parameter with a key that is present, as in save_pretrained output; "
                "pass strict=False to load tied parameters from any of their names)") if tied else ""
        problems.insert(0, f"missing keys: {missing}{hint}")
    if strict and unexpected:
        problems.insert(0, f"unexpected keys: {unexpected}")
    if problems:
        raise CheckpointError(f"error(s) loading a full state dict into {type(index.module).__name__}:\n  "
                              + "\n  ".join(problems))
    return sources


# ---------------------------------------------------------------------- what state_dict() returns
def _full_state_dict_hook(module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """The state-dict post-hook on the user's module: replaces this rank's slices by the full values."""
    record = record_of(module)
    if record is None or record.local_depth > 0 or record.schedule.is_summoned:
        return
    full = full_state_dict(record.wrapper, rank0_only=True, cpu_offload=True)  # rendezvous + gather
    if record.shard_group.world_rank == 0:
        for key, value in full.items():
            state_dict[prefix + key] = value  # existing keys: order is kept
    else:
        for key in _local_keys(module):
            state_dict.pop(prefix + key, None)


def _local_keys(module: nn.Module) -> List[str]:
    with local_slices(module):
        return list(module.state_dict(keep_vars=True))


def load_state_dict(wrapper: nn.Module, state_dict: Optional[Dict[str, Any]], strict: bool = True,
                    assign: bool = False) -> LoadResult:
    """The wrapper's ``load_state_dict``: a full dict, resharded (collective outside ``summon_full_params``)."""
    if assign:
        raise ValueError("load_state_dict(assign=True) would detach parameters from their shards")
    if record_of(wrapper).schedule.is_summoned:
        return wrapper.module.load_state_dict(state_dict, strict=strict)
    rank = wrapper.shard_group.world_rank
    given = state_dict if (state_dict or rank == 0) else None  # rank 0's state_dict() result elsewhere is {}
    load_full_state_dict(wrapper, given, strict=strict)
    if given is None:
        return LoadResult([], [])
    keys = _local_keys(wrapper.module)
    return LoadResult([k for k in keys if k not in given], [k for k in given if k not in keys])
