"""torch.compile of a sharded model: which regions are compiled, and that none silently runs eagerly.

* ``regional=True`` (accelerate's ``use_regional_compilation``): each inner unit's ``forward`` is compiled
  *inside* the unit's hooks (gather, views and free run eagerly around it); blocks of one class share one graph.
  Never slower than compiling each block's whole ``__call__`` (docs/compile.md).
* ``regional=False``: ``model.compile()`` in place; dynamo breaks the graph only at the units' hooks.

No silent eager fall-back: a unit's forward goes through a probe whose body runs only when dynamo did not run
compiled code for that call (a skipped frame, the recompile limit); it warns once per class with cause and fix.
"""
from __future__ import annotations

import functools
import types
import warnings
from typing import TYPE_CHECKING, Any, Callable, Dict

import torch
import torch.nn as nn

from ..core._compat import dynamo_counters

if TYPE_CHECKING:
    from ..core.fully_sharded import FullyShardedDataParallel

_WARNED: set = set()
_PROBES: Dict[type, Callable] = {}


def compile_model(model: "FullyShardedDataParallel", regional: bool = True, **compile_kwargs: Any) -> None:
    """Compile the wrapped ``model`` in place; ``compile_kwargs`` go to ``torch.compile`` (``backend``, ``mode``...)."""
    if not regional:
        model.compile(**compile_kwargs)
    for unit in model.units:
        module = unit.module
        if unit.is_root or getattr(module.__dict__.get("forward"), "_flatshard_probe", False):
            continue  # the root's forward runs the other units: only whole-model compile covers it
        if "forward" in module.__dict__:
            raise ValueError(f"cannot compile unit {unit.name}: its module has its own instance `forward` "
                             f"({module.__dict__['forward']!r}); compile the model before that is set")
        probe = _probe_for(type(module))
        # the probe is what is compiled (regional) or inlined (whole model): `type(m).forward` keeps every
        # instance of a class on one set of guards, so blocks do not recompile per layer
        module.forward = functools.partial(torch.compile(probe, **compile_kwargs) if regional else probe, module)
        module.forward._flatshard_probe = True


def _probe_for(cls: type) -> Callable:
    """One copy of ``_forward_probe`` per class with its own code object: dynamo keeps compiled entries and
    the recompile limit per code object, as it does for each class's own ``forward``."""
    probe = _PROBES.get(cls)
    if probe is None:
        code = _forward_probe.__code__.replace(co_name=f"{cls.__name__}_forward")
        probe = _PROBES[cls] = types.FunctionType(code, _forward_probe.__globals__, code.co_name)
    return probe


def _forward_probe(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    if not torch.compiler.is_compiling():  # True while dynamo traces: compiled code has no such branch
        _warn_eager(module)
    return type(module).forward(module, *args, **kwargs)


def _warn_eager(module: nn.Module) -> None:
    cls = type(module).__name__
    if cls in _WARNED:
        return
    _WARNED.add(cls)
    reasons = [k.split("\n")[0] for k in dynamo_counters()["unimplemented"] if "compiler.disable" not in k]
    if any("recompile limit" in r for r in reasons):
        what = ("dynamo hit its recompile limit (torch._dynamo.config.recompile_limit) and runs what is past it "
                "eagerly (TORCH_LOGS=recompiles names the function and the failing guard). Usual causes: a layer "
                "index read as a constant, i.e. HF models with use_cache=True (fix: use_cache=False for training, "
                "or torch._dynamo.config.allow_unspec_int_on_nn_module = True); new input shapes with dynamic=False "
                "(fix: fixed shapes, or dynamic unset)")
    else:
        what = (f"dynamo did not compile {cls}.forward ({'; '.join(reasons) or 'compilation disabled'}). "
                "TORCH_LOGS=graph_breaks shows where; fullgraph=True makes it an error")
    warnings.warn(f"accel_flatshard: torch.compile was requested but {cls} runs eagerly: {what}", stacklevel=3)
