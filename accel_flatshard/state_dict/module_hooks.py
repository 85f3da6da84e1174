"""What ``state_dict()`` / ``load_state_dict()`` of a sharded model return and take: the full state dict.

After ``FullyShardedDataParallel(model)`` (or ``accelerator.prepare``) both the wrapper (the prepared model)
and ``model`` (the user's own module, what ``accelerator.unwrap_model`` returns) hold 1-D slices of the
parameters.  Code written for DDP or torch FSDP calls ``state_dict()`` on either (``save_pretrained`` without
``state_dict=``, PEFT's ``get_peft_model_state_dict``, ``accelerator.save(model.state_dict(), path)``,
accelerate's ``test_merge_weights.py``); a dict of slices would be written as a corrupt model.  So, as torch
FSDP's default ``FULL_STATE_DICT`` with ``rank0_only=True, offload_to_cpu=True`` (accelerate's setting):

* ``state_dict()`` of either is **collective**: a rendezvous first (``registry.require_all_ranks``: a call
  under ``if is_main_process:`` fails within seconds and writes no weights), then every parameter is
  gathered one flat parameter at a time; global rank 0 gets the plain model's keys on CPU (tied
  parameters share one tensor), other ranks ``{}``;
* the wrapper's ``load_state_dict(full)`` loads a full dict and reshards it: every rank passes it, or
  rank 0 passes it and the others ``{}``/``None`` (then each tensor is broadcast from rank 0);
* inside ``summon_full_params()`` both are the module's own (parameters are full already, no gather);
* this rank's slices go by explicit names: ``wrapper.local_state_dict()`` / ``load_local_state_dict()``
  (same world size only) and the context :func:`registry.local_state_dict`.

Example::

    sd = model.state_dict()                       # every rank; rank 0 holds the full dict
    if accelerator.is_main_process:
        torch.save(sd, "model.pt")
    model.load_state_dict(torch.load("model.pt") if accelerator.is_main_process else {})
"""
from __future__ import annotations

import collections
from typing import Any, Dict, Optional

import torch.nn as nn

from ..unit import UnitState
from .full import full_state_dict, load_full_state_dict
from .registry import local_state_dict, record_of, register

__all__ = ["install", "state_dict", "load_state_dict", "local_state_dict_of", "load_local_state_dict", "LoadResult"]

# what nn.Module.load_state_dict returns (its own class is private)
LoadResult = collections.namedtuple("LoadResult", ["missing_keys", "unexpected_keys"])


def _summoned(wrapper: nn.Module) -> bool:
    return any(u.state == UnitState.SUMMONED for u in wrapper.units)


class _FullStateDictHook:
    """The state-dict post-hook on the user's module: replaces this rank's slices by the full values."""

    def __call__(self, module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
        record = record_of(module)
        wrapper = record.wrapper() if record is not None else None
        if wrapper is None or record.local_depth > 0 or _summoned(wrapper):
            return
        full = full_state_dict(wrapper, rank0_only=True, cpu_offload=True)  # rendezvous + gather
        if record.world_rank == 0:
            for key, value in full.items():
                state_dict[prefix + key] = value  # existing keys: order is kept
        else:
            with local_state_dict(module):
                keys = list(module.state_dict(keep_vars=True))
            for key in keys:
                state_dict.pop(prefix + key, None)


def install(wrapper: nn.Module) -> None:
    """Register ``wrapper`` and the full-state-dict hook on ``wrapper.module`` (collective at wrap time:
    it creates a gloo group over the model's ranks)."""
    register(wrapper)
    wrapper.module.register_state_dict_post_hook(_FullStateDictHook())


# ---------------------------------------------------------------------- the wrapper's methods
def state_dict(wrapper: nn.Module, *args: Any, **kwargs: Any) -> Dict[str, Any]:
    """The wrapper's ``state_dict()``: the module's, i.e. the full dict (keys without a wrapper prefix)."""
    return wrapper.module.state_dict(*args, **kwargs)


def local_state_dict_of(wrapper: nn.Module, *args: Any, **kwargs: Any) -> Dict[str, Any]:
    """This rank's 1-D slices under the original names (no collective); loads back at the same world size."""
    with local_state_dict(wrapper.module):
        return wrapper.module.state_dict(*args, **kwargs)


def load_local_state_dict(wrapper: nn.Module, state_dict: Dict[str, Any], strict: bool = True) -> Any:
    """Load slices from :func:`local_state_dict_of` (same world size and rank)."""
    return wrapper.module.load_state_dict(state_dict, strict=strict)


def load_state_dict(wrapper: nn.Module, state_dict: Optional[Dict[str, Any]], strict: bool = True,
                    assign: bool = False) -> LoadResult:
    """The wrapper's ``load_state_dict``: a full dict, resharded (collective outside ``summon_full_params``)."""
    if assign:
        raise ValueError("load_state_dict(assign=True) would detach parameters from their shards")
    if _summoned(wrapper):
        return wrapper.module.load_state_dict(state_dict, strict=strict)
    rank = wrapper.shard_group.world_rank
    given = state_dict if (state_dict or rank == 0) else None  # rank 0's state_dict() result elsewhere is {}
    load_full_state_dict(wrapper, given, strict=strict)
    if given is None:
        return LoadResult([], [])
    with local_state_dict(wrapper.module):
        keys = list(wrapper.module.state_dict(keep_vars=True))
    return LoadResult([k for k in keys if k not in given], [k for k in given if k not in keys])
