"""The wrapper: ``FullyShardedDataParallel(model)`` decides the units (root + auto-wrapped blocks), assigns every
parameter to one unit (tied ones to the lowest unit containing all their users), materialises a meta-device
model one unit at a time (a rank holds about ``model size / W`` plus one unit), builds and shards the flat
parameters.  The step (hooks, order, prefetch, backward) is ``schedule.Schedule``.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch
import torch.nn as nn

from . import comm, model_state, registry
from .comm import ShardGroup, broadcast_tensor
from .engine import Engine
from .flat_param import FlatParameter, pack_gathered
from .grad_norm import clip_grad_norm_ as _clip_grad_norm
from .options import FlatShardOptions
from .schedule import Schedule
from .unit import Unit
from .wrap import Policy, select_units

ParamInitFn = Callable[[nn.Module], None]
logger = logging.getLogger(__name__)

_UNSET = object()  # backward_prefetch not given (None means no prefetch)
_NOTHING_TO_DEFER = (
    "defer_cross_machine_reduce (FLATSHARD_DEFER_CROSS_MACHINE_REDUCE) defers the part of a gradient reduction that "
    "crosses shard groups or machines, and this model's has none: its shard group ({group} of {world} ranks) is not "
    "hybrid, and node_local_backward_gather is off, or its shard group is on one machine (ranks_per_node), or the "
    "gradients are int8 (quantized_reduce, whose all-to-all has no inside-the-machine stage). Set fsdp_group_size "
    "below the world size (HYBRID_SHARD) or node_local_backward_gather with ranks_per_node below the shard group size; "
    "or unset it and use keep_gathered_across_micro_batches, or plain no_sync (which reduces once per step)")


class FullyShardedDataParallel(nn.Module):
    """Shard a model's parameters, gradients and optimizer state over data-parallel ranks (ZeRO-3).

    Args:
        module: the model; its parameters must all be on one device (CPU with gloo, CUDA with nccl).
        process_group: ranks to shard over (default: the world).
        auto_wrap_policy: ``policy(module, recurse, nonwrapped_numel)`` choosing the inner units, e.g.
            :func:`transformer_auto_wrap_policy`; torch's policies work too.  ``None``: one unit (the root).
        reshard_after_forward, backward_prefetch, forward_prefetch, fsdp_group_size: haiscale's arguments, in its
            order (code written for its wrapper runs unchanged): settings of :class:`FlatShardOptions` like the
            keywords below; not given, the option's default (or its ``FLATSHARD_*`` variable) holds.
        param_init_fn: ``fn(module)`` materialising one meta-device module's own tensors, unit by unit
            (default: ``to_empty`` + ``reset_parameters``).
        device_id: the device to shard onto.  Default: the module's device; with nccl and a CPU or meta
            module, the current CUDA device.  A module elsewhere is copied there unit by unit.
        cpu_offload: torch FSDP's spelling of ``offload_params``: ``CPUOffload(offload_params=True)`` (ours or
            torch's), torch FSDP2's ``CPUOffloadPolicy`` or a bool.
        options: a :class:`FlatShardOptions` (default: from the ``FLATSHARD_*`` variables).
        **settings: any of its fields, overriding ``options``: ``reshard_after_forward`` (free gathered parameters after
            each unit's forward; False keeps them until backward, ZeRO-2 like), ``backward_prefetch``
            (``BackwardPrefetch.BACKWARD_PRE``, the default, ``BACKWARD_POST`` or None), ``forward_prefetch`` (default
            True: with BACKWARD_PRE the fastest exact schedule measured, docs/performance.md), ``fsdp_group_size``
            (hybrid: shard inside groups of this many ranks, all-reduce across groups), ``mixed_precision`` (a
            :class:`MixedPrecision`), ``sync_module_states`` (broadcast rank 0's parameters and buffers, unit by unit:
            other ranks may hold a meta-device model), ``limit_all_gathers`` (all-gathers in flight; on CUDA also freed
            gathered buffers the GPU still reads), ``offload_params`` (shards, sharded gradients and optimizer state in
            (pinned) host memory; the optimizer steps on the host, ``offload.py``), ...

    After wrapping, ``model.named_parameters()`` yields the original names and ``nn.Parameter`` objects, each
    a 1-D view of this rank's slice; build the optimizer from them (before or after wrapping).  Example::

        model = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
    """

    def __init__(
        self,
        module: nn.Module,
        process_group=None,
        auto_wrap_policy: Optional[Policy] = None,
        reshard_after_forward: Optional[bool] = None,
        backward_prefetch: Any = _UNSET,
        forward_prefetch: Optional[bool] = None,
        fsdp_group_size: Optional[int] = None,
        *,
        param_init_fn: Optional[ParamInitFn] = None,
        device_id: Optional[Union[int, torch.device]] = None,
        cpu_offload: Any = None,
        options: Optional[FlatShardOptions] = None,
        **settings: Any,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"FullyShardedDataParallel wraps an nn.Module, got {type(module).__name__}")
        check_not_wrapped(module)
        # the seed's (haiscale's) positional arguments: given ones are settings like any other keyword
        seed_args = {"reshard_after_forward": reshard_after_forward, "forward_prefetch": forward_prefetch,
                     "fsdp_group_size": fsdp_group_size}
        settings.update({k: v for k, v in seed_args.items() if v is not None})
        if backward_prefetch is not _UNSET:  # (None is a value here: no backward prefetch)
            settings["backward_prefetch"] = backward_prefetch
        if cpu_offload is not None:
            settings.setdefault("offload_params", wants_offload(cpu_offload))
        # (an unknown FLATSHARD_* name or a bad value fails there, on every path, also with ``options``)
        self.options = options = FlatShardOptions.from_environment(base=options, **settings)
        registry.before_wrap(module, options)  # e.g. bitsandbytes' 4-bit layers compute on gathered views
        self.module = module
        self.shard_group = ShardGroup(process_group, options)
        device = _target_device(module, self.shard_group, device_id)
        if self.shard_group.uses_nccl and not self.shard_group.uses_gloo and device.type != "cuda":
            raise ValueError(f"the nccl backend needs CUDA parameters but {type(module).__name__} is on {device}; call "
                             "model.to('cuda') first or use gloo")
        if self.shard_group.uses_gloo and not self.shard_group.uses_nccl and device.type == "cuda":
            raise ValueError(f"{type(module).__name__} is on {device} but the process group uses gloo; use the nccl "
                             "backend for CUDA")
        self.shard_group.bind_device(device)
        mixed_precision, sync_module_states = options.mixed_precision, options.sync_module_states
        lossy = [what for what, on in (("int8 weights", options.quantized_all_gather),
                                       ("int8 gradients", options.quantized_reduce)) if on]
        if lossy and self.shard_group.world_rank == 0:  # (said once per model, in the run's log)
            logger.warning("accel_flatshard: quantized communication on: %s, blocks of %d elements "
                           "(docs/communication.md)", " and ".join(lossy), options.quant_block)
        engine = Engine(self.shard_group, device, options)
        if options.defer_cross_machine_reduce and not engine.can_defer_cross_machine:
            raise ValueError(_NOTHING_TO_DEFER.format(world=self.shard_group.world_size,
                                                      group=self.shard_group.shard_size))
        # the model's step and its operations outside the step: generation, state dicts and the planner use it
        self.schedule = schedule = Schedule(engine, options)

        unit_modules = select_units(module, auto_wrap_policy)
        names = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
        owned, innermost = assign_owners(module, unit_modules)
        param_dtype = mixed_precision.param_dtype if mixed_precision else None
        for unit_module in unit_modules:
            # materialise (if on meta), flatten and shard one unit at a time: low peak memory
            unit_users = {id(m): m for groups in owned[id(unit_module)] for users in groups[2] for m, _ in users}
            unit_users.update({id(m): m for m in module.modules() if innermost[id(m)] is unit_module})
            # without a param_init_fn, meta tensors get host memory: the flat build copies them into the
            # device buffer, so the device holds one copy of one unit, not two
            _materialize(unit_users.values(), device if param_init_fn else torch.device("cpu"), param_init_fn)
            for user in unit_users.values():  # buffers go to the shards' device (parameters: the flat build)
                for name, buf in list(user._buffers.items()):
                    if buf is not None and buf.device != device and not buf.is_meta:
                        user._buffers[name] = buf.to(device)
            flats = [self._build_flat(params, fqns, users, param_dtype, sync_module_states, engine)
                     for params, fqns, users in owned[id(unit_module)]]
            if options.pack_all_gathers and len(flats) > 1:
                pack_gathered(flats)  # one gathered storage, one all-gather per pass (flat_param.py)
            unit = Unit(unit_module, names[id(unit_module)], flats, engine, unit_module is module,
                        options.reshard_after_forward)
            schedule.add_unit(unit)
        buffer_dtype = mixed_precision.buffer_dtype if mixed_precision else None
        for owner in module.modules():
            for name, buf in [(n, b) for n, b in owner._buffers.items() if b is not None]:
                if sync_module_states:
                    broadcast_tensor(self.shard_group.world_group, buf)
                if buffer_dtype is not None and buf.is_floating_point():
                    owner._buffers[name] = buf.to(buffer_dtype)
        # torch's fake process group (one process emulating W ranks, for memory checks) cannot build a gloo
        # group and has no peers to wait for: no rendezvous for collective state dicts there
        group = self.shard_group
        real = group.world_size > 1 and not group.backend.startswith("fake")  # (also the planner's fake_gloo)
        record = registry.Prepared(self, schedule, engine.offload,
                                   comm.new_gloo_group(group.world_group) if real else None)
        model_state.install_full_state_dict_hook(record)  # state_dict() of the module gathers (collective)
        registry.add_model(record)  # after-wrap listeners: gather-once generate(), FLATSHARD_PROFILE, ...

    # ------------------------------------------------------------------ construction helpers
    def _build_flat(self, params, fqns, users, param_dtype, sync_module_states, engine: Engine) -> FlatParameter:
        # materialised modules may hold new Parameter objects: re-read them, re-tie those several modules share
        # (each module's to_empty made its own copy)
        for i, ((module, attr), *others) in enumerate(users):
            params[i] = module._parameters[attr]
            for other, other_attr in others:
                other._parameters[other_attr] = params[i]
        group = self.shard_group
        compute_dtype = param_dtype if param_dtype is not None and params[0].is_floating_point() else None
        flat = FlatParameter(params, fqns, users, group.shard_rank, group.shard_size, compute_dtype,
                             device=engine.device)
        if engine.offload is not None:
            engine.offload.place_shard(flat)
        full = flat.full_flat_from_params()
        if sync_module_states:
            broadcast_tensor(group.world_group, full)
        flat.set_local_shard_from_full(full)
        flat.point_params_at_shard()
        return flat

    # ------------------------------------------------------------------ nn.Module surface
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The original parameters under their original names (no wrapper prefix)."""
        return self.module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.module.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    # state dicts (model_state.py): full, collective, like torch FSDP's FULL_STATE_DICT default
    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        """Collective: the plain model's state dict on global rank 0 (CPU), ``{}`` on other ranks."""
        return self.module.state_dict(*args, **kwargs)  # (its post-hook gathers; keys without a wrapper prefix)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Collective: load a full dict (on every rank, or on rank 0 with ``{}`` elsewhere) and reshard it."""
        return model_state.load_state_dict(self, state_dict, strict=strict, assign=assign)

    def local_state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        """This rank's 1-D slices under the original names (not collective; same world size to load)."""
        with model_state.local_slices(self.module):
            return self.module.state_dict(*args, **kwargs)

    def load_local_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)

    # ------------------------------------------------------------------ public API
    @property
    def units(self) -> List[Unit]:
        return self.schedule.units

    @property
    def flat_params(self) -> List[FlatParameter]:
        return [f for u in self.schedule.units for f in u.flat_params]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate full gradients locally; the first backward outside reduces them all at once (costs one
        full-size gradient per unit in memory, saves one reduce-scatter per micro-step).  With
        ``keep_gathered_across_micro_batches`` units also stay gathered inside (one gather per unit and step); with
        ``defer_cross_machine_reduce`` gradients are reduced inside the shard group / machine each micro-batch
        instead, and only the syncing backward crosses machines (docs/communication.md)."""
        previous = self.schedule.sync_grads
        self.schedule.sync_grads = False
        try:
            yield
        finally:
            self.schedule.sync_grads = previous

    def set_reshard_after_backward(self, reshard_after_backward: bool) -> None:
        """FSDP2's switch for raw accumulation loops: False keeps every unit gathered after its backward (and from then
        on, so the next micro-batches gather nothing) until a backward with True ends; an optimizer step,
        ``load_state_dict`` or ``summon_full_params`` in between frees them first (they would be stale).  The
        option ``keep_gathered_across_micro_batches`` does this (and keeps them after forward too) inside
        ``no_sync()``, which accelerate's ``accumulate`` uses.  Example (4 micro-batches a step)::

            for i, batch in enumerate(micro_batches):
                last = i == len(micro_batches) - 1
                model.set_reshard_after_backward(last)
                model.set_requires_all_reduce(last)  # hybrid / hpZ: cross machines once, on the last
                model(batch).loss.backward()  # (scaled by 1 / len(micro_batches) for the mean)
            optimizer.step()
            optimizer.zero_grad()
        """
        self.schedule.reshard_after_backward = bool(reshard_after_backward)

    def set_requires_all_reduce(self, requires_all_reduce: bool) -> None:
        """FSDP2's switch: False makes each backward reduce gradients only inside the shard group (hybrid) or the
        machine (hpZ's first stage) and carry the partial sums; the next backward with True adds them in before its
        one reduction across machines (example: :meth:`set_reshard_after_backward`).  The option
        ``defer_cross_machine_reduce`` does this inside ``no_sync()``.  No effect on a model whose reduction does not
        cross shard groups or machines (every backward reduces in full, as FSDP2 without a replica group)."""
        self.schedule.requires_all_reduce = bool(requires_all_reduce)

    @contextlib.contextmanager
    def summon_full_params(self, writeback: bool = True, recurse: bool = True) -> Iterator[None]:
        """Every parameter in full inside, on every rank, on the model's device (``state_dict()`` is the plain
        model's; forwards and ``generate()`` gather nothing); ``writeback`` keeps changes made inside.  ``recurse``
        is accepted for torch FSDP's signature (the whole model is gathered).  See ``Schedule.summon``."""
        with self.schedule.summon(writeback):
            yield

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip all gradients by their global norm over every rank; returns the total norm."""
        return _clip_grad_norm(list(self.parameters()), max_norm, norm_type, group=self.shard_group,
                               device=self.schedule.device)

    def sharded_bytes(self) -> int:
        """Bytes this rank holds in parameter shards and sharded gradients."""
        return sum(f.numel_bytes() for f in self.flat_params)

    def extra_repr(self) -> str:
        g = self.shard_group
        return f"units={len(self.units)}, shard_size={g.shard_size}, replicas={g.world_size // g.shard_size}"


def wants_offload(cpu_offload: Any) -> bool:
    """``cpu_offload`` as given to the wrapper: None, a bool, ours or torch's ``CPUOffload``, or torch
    FSDP2's ``CPUOffloadPolicy`` / ``OffloadPolicy``."""
    if cpu_offload is None or isinstance(cpu_offload, bool):
        return bool(cpu_offload)
    if type(cpu_offload).__name__ == "CPUOffloadPolicy":
        return True
    if hasattr(cpu_offload, "offload_params"):
        return bool(cpu_offload.offload_params)
    if type(cpu_offload).__name__ == "OffloadPolicy":
        return False
    raise TypeError(f"cpu_offload must be None, a bool, CPUOffload(offload_params=...) or CPUOffloadPolicy, "
                    f"got {cpu_offload!r}")


# ---------------------------------------------------------------------- ownership
def assign_owners(root: nn.Module, unit_modules: List[nn.Module]) -> Tuple[Dict[int, list], Dict[int, nn.Module]]:
    """Each unit's flat-parameter groups (params, fqns, users), one per (dtype, requires_grad), and each module's
    innermost unit module.  A parameter belongs to its module's innermost unit; one registered by modules of
    several units (tied weights) to their lowest common ancestor unit."""
    unit_ids = {id(m) for m in unit_modules}
    innermost: Dict[int, nn.Module] = {}  # module id -> innermost unit module containing it
    unit_parent: Dict[int, Optional[nn.Module]] = {id(root): None}

    def visit(module: nn.Module, current_unit: nn.Module) -> None:
        innermost[id(module)] = current_unit
        for child in (c for c in module.children() if id(c) not in innermost):
            if id(child) in unit_ids:
                unit_parent[id(child)] = current_unit
            visit(child, child if id(child) in unit_ids else current_unit)

    visit(root, root)

    def chain(unit: nn.Module) -> List[nn.Module]:
        out = [unit]
        while unit_parent[id(unit)] is not None:
            unit = unit_parent[id(unit)]
            out.append(unit)
        return out

    # parameter id -> (parameter, its first name, its (module, attribute) users), in first registration order
    found: Dict[int, Tuple[nn.Parameter, str, List[Tuple[nn.Module, str]]]] = {}
    for mod_name, module in root.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is None:
                continue
            users = found.setdefault(id(p), (p, f"{mod_name}.{attr}" if mod_name else attr, []))[2]
            if (module, attr) not in users:
                users.append((module, attr))

    groups: Dict[int, Dict[Tuple[torch.dtype, bool], Tuple[list, list, list]]] = {id(m): {} for m in unit_modules}
    for p, name, users in found.values():
        chains = [chain(innermost[id(m)]) for m, _ in users]
        owner = next(u for u in chains[0] if all(any(u is v for v in c) for c in chains[1:]))
        if not p.is_floating_point():
            raise TypeError(f"parameter {name} has dtype {p.dtype}; only floating-point parameters can be sharded")
        bucket = groups[id(owner)].setdefault((p.dtype, p.requires_grad), ([], [], []))
        for column, value in zip(bucket, (p, name, users)):
            column.append(value)
    return {uid: list(g.values()) for uid, g in groups.items()}, innermost


def _target_device(module: nn.Module, group: ShardGroup, device_id) -> torch.device:
    """Where the shards live: ``device_id``, else the module's device; a CPU/meta module with nccl goes to
    the current CUDA device (accelerate and torchrun scripts set it to the local rank's GPU)."""
    if device_id is not None:
        return torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
    devices = {}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        devices.setdefault(t.device, name)
    if len(devices) > 1:  # meta tensors are materialised unit by unit on the others' device
        devices.pop(torch.device("meta"), None)
    if len(devices) > 1:
        listing = ", ".join(f"{d} (e.g. {n})" for d, n in devices.items())
        raise ValueError(f"all parameters must be on one device before wrapping; found {listing}. "
                         "Move the model with .to(device) first")
    device = next(iter(devices), torch.device("cpu"))
    # (also for "cuda:nccl,cpu:gloo", which accelerate may ask for: the GPU is where it trains)
    if group.uses_nccl and (device.type == "meta" or (device.type == "cpu" and torch.cuda.is_available())):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu") if device.type == "meta" else device  # gloo: a meta model goes to the host


def _has_own_meta_tensors(module: nn.Module) -> bool:
    return any(t is not None and t.is_meta for t in [*module._parameters.values(), *module._buffers.values()])


def _materialize(modules: Iterable[nn.Module], device: torch.device, param_init_fn: Optional[ParamInitFn]) -> None:
    """Materialise one unit's modules that hold meta tensors of their own: ``param_init_fn(module)`` (every rank;
    only that module's own tensors, ``recurse=False``: other units' may be sharded already), else storage on
    ``device`` and the module's ``reset_parameters``."""
    for module in filter(_has_own_meta_tensors, modules):
        if param_init_fn is not None:
            param_init_fn(module)
        else:
            # uninitialised storage; to_empty() would create new Parameter objects, detaching an optimizer built
            # before wrapping: swapping keeps their identity
            for p in module._parameters.values():
                if p is not None and p.is_meta:
                    torch.utils.swap_tensors(p, nn.Parameter(torch.empty_like(p, device=device),
                                                             requires_grad=p.requires_grad))
            for name, b in list(module._buffers.items()):
                if b is not None and b.is_meta:
                    module._buffers[name] = torch.empty_like(b, device=device)
            if callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
        if _has_own_meta_tensors(module):
            raise RuntimeError(f"param_init_fn left meta tensors in {type(module).__name__}; it must materialise the "
                               "module's own parameters and buffers, e.g. module.to_empty(device=..., recurse=False)")


def check_not_wrapped(module: nn.Module) -> None:
    """Refuse a model that accel_flatshard, torch DDP, torch FSDP1 or fully_shard (FSDP2) wraps already, naming the
    (sub)module; ``accelerator.prepare`` calls it too, before it changes anything."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.nn.parallel import DistributedDataParallel

    for name, sub in module.named_modules():
        fsdp2 = type(sub).__name__.startswith("FSDP") and hasattr(sub, "unshard")  # fully_shard's class swap
        wrapped = registry.unit_of(sub) is not None or isinstance(sub, FullyShardedDataParallel)
        kind = ("accel_flatshard" if wrapped else
                "torch DistributedDataParallel" if isinstance(sub, DistributedDataParallel) else
                "torch FullyShardedDataParallel (FSDP1)" if isinstance(sub, TorchFSDP) else
                "torch fully_shard (FSDP2)" if fsdp2 else None)
        if kind:
            where = f"its submodule {name!r}" if name else type(module).__name__
            raise ValueError(f"{where} is already wrapped by {kind}; pass the plain model: accel_flatshard shards it "
                             "itself, once")
