"""Reading a unit's parameters outside its forward: the per-class ``__getattr__`` that asks the schedule.

Some models read a child unit's parameter from the parent's forward (TRL's fused LM head computes
``hidden @ lm_head.weight.T`` without calling an untied ``lm_head`` unit).  Every module that registers a
parameter of a non-root unit gets a subclass of its own class (same name: ``isinstance`` and class-name lookups
keep working, as with torch's ``FSDP<cls>``) whose ``__getattr__`` runs only when normal lookup misses (not in
the unit's forward: the hot path is untouched).  A miss while the model runs calls
``Schedule.read_outside_forward``; at any other time the shard is returned (a gather is collective).
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch.nn as nn

# module.__dict__ key: {attribute name: (schedule, unit owning it)}; in the module itself (not a registry), so the
# miss path is one dict lookup and a dropped module takes it along
_READS_ATTR = "_flatshard_outside_reads"
_READING_CLASSES: Dict[type, type] = {}  # user's class -> our subclass of it
_NO_READS: Dict[str, Tuple[Any, Any]] = {}


def enable_outside_reads(schedule: Any, unit: Any) -> None:
    """Route reads of ``unit``'s (a ``unit.Unit``) parameters by its modules' attributes to ``schedule`` (a
    ``schedule.Schedule``, which imports this module) when normal lookup misses."""
    for flat in unit.flat_params:
        for users in flat.users:
            for module, name in users:
                reads = module.__dict__.get(_READS_ATTR)
                if reads is None:
                    module.__class__ = _reading_class(type(module))
                    reads = module.__dict__[_READS_ATTR] = {}
                reads[name] = (schedule, unit)


def _reading_class(cls: type) -> type:
    if cls in _READING_CLASSES.values():  # never subclassed twice
        return cls
    sub = _READING_CLASSES.get(cls)
    if sub is not None:
        return sub
    base_getattr = cls.__getattr__

    def __getattr__(self: nn.Module, name: str) -> Any:
        owner, unit = self.__dict__.get(_READS_ATTR, _NO_READS).get(name, (None, None))
        # (in_forward / in_backward first: plain attributes dynamo traces, so a compiled forward on gathered
        # parameters, e.g. gather-once generation, breaks no graph here; read_outside_forward is dynamo-disabled)
        if owner is not None and (owner.in_forward or owner.in_backward) and owner.read_outside_forward(unit):
            view = self.__dict__.get(name)
            if view is not None:
                return view
        return base_getattr(self, name)

    sub = type(cls.__name__, (cls,), {"__getattr__": __getattr__, "__module__": cls.__module__,
                                      "__qualname__": cls.__qualname__})
    _READING_CLASSES[cls] = sub
    return sub
