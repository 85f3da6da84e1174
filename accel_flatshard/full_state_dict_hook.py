"""What the *unwrapped* model's ``state_dict()`` returns: the full state dict, gathered collectively.

After ``FullyShardedDataParallel(model)`` (or ``accelerator.prepare``), ``model`` - the user's own
module, what ``accelerator.unwrap_model`` returns - holds 1-D slices of its parameters.  Code written
for DDP calls ``model.state_dict()`` on it (``save_pretrained`` without ``state_dict=``, PEFT's
``get_peft_model_state_dict``, ``torch.save(unwrap_model(model).state_dict(), path)``); a dict of
slices would be written as a corrupt model.  So a state-dict post-hook on that root module replaces
every parameter entry by its full value, as torch FSDP's ``FULL_STATE_DICT`` with
``rank0_only=True, offload_to_cpu=True`` (accelerate's setting) does:

* global rank 0 gets the plain model's state dict on CPU (tied parameters share one tensor, so
  ``save_pretrained``/safetensors drop the alias exactly as for the plain model); other ranks get
  ``{}`` (they must not write);
* it is **collective**: every rank must call it.  A rendezvous on a dedicated gloo group comes first:
  rank 0 waits at most ``FLATSHARD_STATE_DICT_TIMEOUT_S`` (default 5) seconds for the others and
  then raises an error that says what to call instead - a call under ``if is_main_process:`` fails
  fast and writes no weights, instead of hanging until the process-group timeout;
* unchanged (no gather, no rendezvous) inside ``summon_full_params()`` (parameters are full already)
  and for internal callers that want this rank's slices (:func:`local_state_dict`: the wrapper's own
  ``state_dict()``, the sharded-checkpoint code).

Example::

    with local_state_dict(model.module):        # this rank's 1-D slices (internal use)
        shards = model.module.state_dict(keep_vars=True)
"""
from __future__ import annotations

import contextlib
import datetime
import weakref
from typing import Any, Dict, Iterator, Optional

import torch.distributed as dist
import torch.nn as nn

from . import options

__all__ = ["install", "local_state_dict", "require_all_ranks", "rendezvous_timeout_s"]

TIMEOUT_ENV = "FLATSHARD_STATE_DICT_TIMEOUT_S"
# how long ranks other than 0 wait for rank 0 (which often arrives late: it writes config files first)
_PEER_TIMEOUT = datetime.timedelta(minutes=30)

# the user's root module -> its hook (weak: a dropped model leaves nothing behind)
_HOOKS: "weakref.WeakKeyDictionary[nn.Module, _FullStateDictHook]" = weakref.WeakKeyDictionary()


def rendezvous_timeout_s() -> float:
    return options.get(TIMEOUT_ENV)


class _FullStateDictHook:
    """The post-hook on the root module; holds the wrapper (the module's parameters stay shards as long as
    the module lives, so the wrapper that can gather them must live as long) and the gloo group."""

    def __init__(self, wrapper: nn.Module) -> None:
        self._wrapper = lambda: wrapper
        self.local_depth = 0  # > 0 while an internal caller wants local slices
        group = wrapper.shard_group
        self.world_size = group.world_size
        self.world_rank = group.world_rank
        self.gloo_group = None
        # torch's fake process group (one process emulating W ranks, for memory checks) cannot build a gloo
        # group and has no peers to wait for: no rendezvous there
        if self.world_size > 1 and group.backend != "fake":
            world = group.world_group
            ranks = list(range(self.world_size)) if world is dist.group.WORLD else dist.get_process_group_ranks(world)
            # monitored_barrier needs gloo (also under nccl); only this model's ranks need to create it
            self.gloo_group = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)

    def __call__(self, module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
        wrapper = self._wrapper()
        if wrapper is None or self.local_depth > 0 or _summoned(wrapper):
            return
        from .checkpoint.full import full_state_dict  # late: checkpoint imports this module

        full = full_state_dict(wrapper, rank0_only=True, cpu_offload=True)  # rendezvous + gather
        if self.world_rank == 0:
            for key, value in full.items():
                state_dict[prefix + key] = value  # existing keys: order is kept
        else:
            with local_state_dict(module):
                keys = list(module.state_dict(keep_vars=True))
            for key in keys:
                state_dict.pop(prefix + key, None)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "accel_flatshard: pickling a sharded model (e.g. torch.save(model)) would store this rank's 1-D "
            "slices of its parameters; save its state dict instead (`state = accelerator.unwrap_model(model)"
            ".state_dict()` on every rank, `torch.save(state, path)` on the main process) or use save_pretrained")

    def __deepcopy__(self, memo: Dict[int, Any]) -> "_FullStateDictHook":
        # a deep copy of the module is a separate, unsharded-looking model: it must not gather ours
        copy = object.__new__(_FullStateDictHook)
        copy.__dict__.update(self.__dict__, _wrapper=lambda: None)
        return copy


def _summoned(wrapper: nn.Module) -> bool:
    from .unit import UnitState

    return any(u.state == UnitState.SUMMONED for u in wrapper.units)


def install(wrapper: nn.Module) -> None:
    """Register the full-state-dict hook on ``wrapper.module`` (collective at wrap time: it creates a
    gloo group over the model's ranks)."""
    module = wrapper.module
    hook = _FullStateDictHook(wrapper)
    module.register_state_dict_post_hook(hook)
    _HOOKS[module] = hook


@contextlib.contextmanager
def local_state_dict(module: nn.Module) -> Iterator[None]:
    """Inside, ``module.state_dict()`` returns this rank's 1-D slices (no gather)."""
    hook = _HOOKS.get(module)
    if hook is None:
        yield
        return
    hook.local_depth += 1
    try:
        yield
    finally:
        hook.local_depth -= 1


def require_all_ranks(wrapper: nn.Module, what: str) -> None:
    """Fail within seconds on rank 0 (instead of hanging) when the other ranks do not join ``what``."""
    hook: Optional[_FullStateDictHook] = _HOOKS.get(getattr(wrapper, "module", None))
    if hook is None or hook.gloo_group is None:
        return
    timeout_s = rendezvous_timeout_s()
    timeout = datetime.timedelta(seconds=timeout_s) if hook.world_rank == 0 else _PEER_TIMEOUT
    try:
        dist.monitored_barrier(group=hook.gloo_group, timeout=timeout, wait_all_ranks=True)
    except RuntimeError as e:
        model = type(wrapper.module).__name__
        raise RuntimeError(
            f"accel_flatshard: {what} of {model} is collective (its parameters are sharded over "
            f"{hook.world_size} ranks), but rank {hook.world_rank} waited {timeout_s:g} s and the other ranks did "
            f"not join ({str(e).strip()}). Call it on every rank, not under `if accelerator.is_main_process:`: "
            "`accelerator.unwrap_model(model).save_pretrained(dir, is_main_process=accelerator.is_main_process)` "
            "on every rank, or `sd = accelerator.get_state_dict(model)` (or `accelerator.save_model(model, dir)`) "
            "on every rank and write `sd` on the main process only. No model weights were written. If the ranks are "
            f"just far apart in time, raise {TIMEOUT_ENV} (now {timeout_s:g})."
        ) from None
