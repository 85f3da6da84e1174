"""Reads of a unit's parameters by code outside that unit's own forward.

Outside its forward a unit's parameters are 1-D slices of this rank's shard.  Some models read a
child unit's parameter directly from the parent's forward: TRL's fused LM head computes
``hidden @ lm_head.weight.T`` inside the model's forward without calling ``lm_head``, and
``transformer_auto_wrap_policy`` makes an untied ``lm_head`` a unit of its own.  Such a read must see
the full parameter, and its gradient must reach the unit's flat gradient like any other.

How: every module that registers a parameter of a non-root unit gets a subclass of its own class
(same name, so class-name lookups and ``isinstance`` keep working, as torch's ``fully_shard`` does with
its ``FSDP<cls>`` classes) whose ``__getattr__`` intercepts those parameter names.  Python calls
``__getattr__`` only when normal lookup misses: inside the unit's own forward the attribute already
resolves to a view in the module's ``__dict__`` (see ``FlatParameter.install_views``), so the unit's
hot path is untouched.  A miss while the wrapped model runs forward (or recomputes it in backward)
gathers the unit, installs its views and returns the one asked for; the unit then stays gathered
until its gradients are reduced (``Unit.read_outside_forward``).  A miss at any other time (user code
between steps) returns the shard as before: gathering is collective and must not start on one rank.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict

import torch.nn as nn

if TYPE_CHECKING:
    from .unit import Unit

# module.__dict__ key: {attribute name: Unit owning the parameter registered under that name}
_READS_ATTR = "_flatshard_outside_reads"
_CLASS_MARK = "_flatshard_reading_class"
_READING_CLASSES: Dict[type, type] = {}
_NO_READS: Dict[str, "Unit"] = {}


def enable_outside_reads(unit: "Unit") -> None:
    """Let code outside ``unit``'s forward read its parameters in full while the model runs."""
    for flat in unit.flat_params:
        for users in flat.users:
            for module, name in users:
                reads = module.__dict__.get(_READS_ATTR)
                if reads is None:
                    module.__class__ = _reading_class(type(module))
                    reads = module.__dict__[_READS_ATTR] = {}
                reads[name] = unit


def _reading_class(cls: type) -> type:
    if cls.__dict__.get(_CLASS_MARK):
        return cls
    sub = _READING_CLASSES.get(cls)
    if sub is not None:
        return sub
    base_getattr = cls.__getattr__

    def __getattr__(self: nn.Module, name: str) -> Any:
        unit = self.__dict__.get(_READS_ATTR, _NO_READS).get(name)
        # (in_forward / in_backward first: plain attributes dynamo traces, so a compiled forward on gathered
        # parameters, e.g. gather-once generation, breaks no graph here; read_outside_forward is dynamo-disabled)
        if unit is not None and (unit.root.in_forward or unit.root.in_backward) and unit.read_outside_forward():
            view = self.__dict__.get(name)
            if view is not None:
                return view
        return base_getattr(self, name)

    sub = type(cls.__name__, (cls,), {
        "__getattr__": __getattr__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        _CLASS_MARK: True,  # one of ours: never subclassed twice
    })
    _READING_CLASSES[cls] = sub
    return sub
