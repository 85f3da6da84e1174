"""The one registry of prepared models: every feature finds a model's schedule, units, shard group, offload and
generation control here, from the wrapper, the user's module, a unit's module or one of the original parameters.

* :class:`Prepared` is the record of one wrapped model.  The user's module and the wrapper carry it in their
  ``__dict__`` under one name (:data:`ATTR`), so it lives exactly as long as the model (a dropped model leaves
  nothing behind); parameters and unit modules find it through weak dictionaries keyed by identity.
* Features attach their per-model state to the record (``record.generation``), never to the user's objects.
* Two process-wide optimizer hooks, one before and one after every ``optimizer.step()``, registered the first time a
  model is prepared (:func:`on_step` adds what they run).  Each runs its handlers for every optimizer, giving them
  the records of the prepared models whose parameters it holds (none for a plain optimizer: a step of any optimizer
  may still concern a prepared model, e.g. TRL's ``sync_ref_model`` writes a frozen reference after the policy's).
* Wrap listeners (:func:`on_wrap`): what features do to a module before it is sharded (bitsandbytes' 4-bit layers)
  and to its record after (gather-once ``generate()``, the ``FLATSHARD_PROFILE`` profiler).  A feature's module
  registers them when it is imported; ``accel_flatshard/__init__.py`` imports every such module.

It imports nothing of the package, so every layer may use it.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

ATTR = "_flatshard_prepared"  # the record, in the __dict__ of the user's module and of the wrapper

StepHandler = Callable[[torch.optim.Optimizer, List["Prepared"]], None]


class Prepared:
    """One wrapped model: ``wrapper``, the user's ``module``, its ``schedule`` (units, engine, device adapter),
    ``shard_group``, ``offload`` (the host offload, or None), ``gloo_group`` (the rendezvous group of collective
    state dicts, None with one rank), and the features' slots: ``generation`` (its GenerationControl),
    ``local_depth`` (> 0 while a caller wants this rank's slices from ``state_dict()``)."""

    def __init__(self, wrapper: nn.Module, schedule: Any, offload: Any, gloo_group: Any) -> None:
        self.wrapper = wrapper
        self.module: nn.Module = wrapper.module
        self.schedule = schedule
        self.shard_group = wrapper.shard_group
        self.offload = offload
        self.gloo_group = gloo_group
        self.generation: Any = None
        self.local_depth = 0

    @property
    def units(self) -> List[Any]:
        return self.schedule.units

    def parameters(self) -> Iterable[torch.Tensor]:
        return (p for unit in self.schedule.units for flat in unit.flat_params for p in flat.params)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "accel_flatshard: pickling a sharded model (e.g. torch.save(model)) would store this rank's 1-D "
            "slices of its parameters; save its state dict instead (`state = accelerator.unwrap_model(model)"
            ".state_dict()` on every rank, `torch.save(state, path)` on the main process) or use save_pretrained")

    def __deepcopy__(self, memo: Dict[int, Any]) -> None:
        # a deep copy of the module is a separate, unsharded-looking model: it must not gather ours (nor keep it
        # alive); ``copy.deepcopy`` stores None under ATTR, which no lookup takes for a record
        return None


_BY_PARAM: "WeakIdKeyDictionary" = WeakIdKeyDictionary()  # original parameter -> weakref(Prepared)
_UNIT_OF: "WeakIdKeyDictionary" = WeakIdKeyDictionary()  # unit module -> weakref(Unit)
# optimizer -> (its param groups' signature, weak references to the records of its models)
_OPTIMIZER_RECORDS: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple]" = weakref.WeakKeyDictionary()
_PRE: List[StepHandler] = []
_POST: List[StepHandler] = []
_BEFORE_WRAP: List[Callable[[nn.Module, Any], None]] = []
_AFTER_WRAP: List[Callable[["Prepared"], None]] = []
_HOOKS: List[Any] = []  # torch's handles of the two optimizer hooks, once registered


def add_model(record: Prepared) -> None:
    """Record a newly wrapped model, find it from its parameters and units, run the after-wrap listeners."""
    record.wrapper.__dict__[ATTR] = record.module.__dict__[ATTR] = record
    ref = weakref.ref(record)
    for p in record.parameters():
        _BY_PARAM[p] = ref
    for unit in record.units:
        _UNIT_OF[unit.module] = weakref.ref(unit)
    if not _HOOKS:
        _HOOKS.append(register_optimizer_step_pre_hook(_dispatch(_PRE)))
        _HOOKS.append(register_optimizer_step_post_hook(_dispatch(_POST)))
    for listener in _AFTER_WRAP:
        listener(record)


def before_wrap(module: nn.Module, options: Any) -> None:
    """Run the before-wrap listeners (the wrapper calls it before it changes ``module``)."""
    for listener in _BEFORE_WRAP:
        listener(module, options)


def record_of(obj: Any) -> Optional[Prepared]:
    """The record of the model ``obj`` (the wrapper or the user's module), else None."""
    record = getattr(obj, "__dict__", {}).get(ATTR)
    return record if isinstance(record, Prepared) else None


def record_of_param(param: torch.Tensor) -> Optional[Prepared]:
    """The record of the live model that shards ``param`` (one of its original parameters), else None."""
    ref = _BY_PARAM.get(param)
    return ref() if ref is not None else None


def unit_of(module: nn.Module) -> Optional[Any]:
    """The Unit whose module is ``module``, else None."""
    ref = _UNIT_OF.get(module)
    return ref() if ref is not None else None


def records_of_optimizer(optimizer: torch.optim.Optimizer) -> List[Prepared]:
    """The prepared models whose parameters ``optimizer`` holds, in the order of its parameters.  Cached per
    optimizer while its param groups keep their lists and lengths (a lookup per parameter costs about 1.4 us: 2.8 ms
    a step for 2,000 parameters, before and after the step)."""
    signature = tuple((id(group["params"]), len(group["params"])) for group in optimizer.param_groups)
    cached = _OPTIMIZER_RECORDS.get(optimizer)
    if cached is not None and cached[0] == signature:
        records = [ref() for ref in cached[1]]
        if all(record is not None for record in records):
            return records
    found: Dict[int, Prepared] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            record = record_of_param(p)
            if record is not None:
                found.setdefault(id(record), record)
    _OPTIMIZER_RECORDS[optimizer] = (signature, [weakref.ref(r) for r in found.values()])  # (weak: no model kept)
    return list(found.values())


def on_step(pre: Optional[StepHandler] = None, post: Optional[StepHandler] = None) -> None:
    """Run ``pre(optimizer, records)`` before and ``post(optimizer, records)`` after each step of every optimizer
    (in the order handlers were added); ``records``: the prepared models whose parameters it holds, maybe none."""
    for handlers, handler in ((_PRE, pre), (_POST, post)):
        if handler is not None and handler not in handlers:
            handlers.append(handler)


def on_wrap(before: Optional[Callable[[nn.Module, Any], None]] = None,
            after: Optional[Callable[[Prepared], None]] = None) -> None:
    """Run ``before(module, options)`` before a model is sharded, ``after(record)`` once it is."""
    for listeners, listener in ((_BEFORE_WRAP, before), (_AFTER_WRAP, after)):
        if listener is not None and listener not in listeners:
            listeners.append(listener)


def _dispatch(handlers: List[StepHandler]) -> Callable[..., None]:
    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        records = records_of_optimizer(optimizer) if handlers else []
        for handler in list(handlers):
            handler(optimizer, records)
    return hook
