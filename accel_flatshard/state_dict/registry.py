"""Which wrapper shards a module, whether its ``state_dict()`` should gather, and the fail-fast rendezvous.

``register(wrapper)`` (at wrap time, collective: it creates a gloo group over the model's ranks) stores one
:class:`ShardedModuleRecord` on both the wrapper and the user's module (``__dict__``, so a dropped model
leaves nothing behind).  From it:

* :func:`find_wrapper` - the accel_flatshard wrapper of a wrapper or of the module it wraps, else None
  (the one wrapped-model detection of the package);
* :func:`local_state_dict` - inside, the module's ``state_dict()`` returns this rank's 1-D slices;
* :func:`require_all_ranks` - a monitored barrier on the gloo group: rank 0 waits at most
  ``FLATSHARD_STATE_DICT_TIMEOUT_S`` (default 5) seconds, then raises an error saying what to call instead.

Example::

    with local_state_dict(model.module):        # this rank's 1-D slices
        shards = model.module.state_dict(keep_vars=True)
"""
from __future__ import annotations

import contextlib
import datetime
from typing import Any, Dict, Iterator, Optional

import torch.nn as nn

from .. import comm, options

__all__ = ["register", "find_wrapper", "record_of", "local_state_dict", "require_all_ranks", "rendezvous_timeout_s"]

TIMEOUT_ENV = "FLATSHARD_STATE_DICT_TIMEOUT_S"
# how long ranks other than 0 wait for rank 0 (which often arrives late: it writes config files first)
_PEER_TIMEOUT = datetime.timedelta(minutes=30)
_ATTR = "_flatshard_record"


def rendezvous_timeout_s() -> float:
    return options.get(TIMEOUT_ENV)


class ShardedModuleRecord:
    """The wrapper of a sharded module (the module's parameters stay shards as long as it lives, so the
    wrapper that can gather them must live as long), the gloo rendezvous group and the local-slices depth."""

    def __init__(self, wrapper: nn.Module) -> None:
        self.wrapper = lambda: wrapper
        self.local_depth = 0  # > 0 while a caller wants this rank's slices
        group = wrapper.shard_group
        self.world_size, self.world_rank = group.world_size, group.world_rank
        # torch's fake process group (one process emulating W ranks, for memory checks) cannot build a gloo
        # group and has no peers to wait for: no rendezvous there
        self.gloo_group = comm.new_gloo_group(group.world_group) if self.world_size > 1 and group.backend != "fake" else None

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "accel_flatshard: pickling a sharded model (e.g. torch.save(model)) would store this rank's 1-D "
            "slices of its parameters; save its state dict instead (`state = accelerator.unwrap_model(model)"
            ".state_dict()` on every rank, `torch.save(state, path)` on the main process) or use save_pretrained")

    def __deepcopy__(self, memo: Dict[int, Any]) -> "ShardedModuleRecord":
        # a deep copy of the module is a separate, unsharded-looking model: it must not gather ours
        copy = object.__new__(ShardedModuleRecord)
        copy.__dict__.update(self.__dict__, wrapper=lambda: None)
        return copy


def register(wrapper: nn.Module) -> ShardedModuleRecord:
    record = ShardedModuleRecord(wrapper)
    wrapper.__dict__[_ATTR] = record
    wrapper.module.__dict__[_ATTR] = record
    return record


def record_of(module: Any) -> Optional[ShardedModuleRecord]:
    return getattr(module, "__dict__", {}).get(_ATTR)


def find_wrapper(module: Any) -> Optional[nn.Module]:
    """The accel_flatshard wrapper of ``module`` (the wrapper itself or the module it wraps), else None."""
    record = record_of(module)
    return None if record is None else record.wrapper()


@contextlib.contextmanager
def local_state_dict(module: nn.Module) -> Iterator[None]:
    """Inside, ``module.state_dict()`` returns this rank's 1-D slices (no gather)."""
    record = record_of(module)
    if record is None:
        yield
        return
    record.local_depth += 1
    try:
        yield
    finally:
        record.local_depth -= 1


def require_all_ranks(wrapper: nn.Module, what: str) -> None:
    """Fail within seconds on rank 0 (instead of hanging) when the other ranks do not join ``what``."""
    record = record_of(wrapper)
    if record is None or record.gloo_group is None:
        return
    timeout_s = rendezvous_timeout_s()
    timeout = datetime.timedelta(seconds=timeout_s) if record.world_rank == 0 else _PEER_TIMEOUT
    problem = comm.rendezvous_or_fail(record.gloo_group, timeout)
    if problem is not None:
        model = type(wrapper.module).__name__
        raise RuntimeError(
            f"accel_flatshard: {what} of {model} is collective (its parameters are sharded over "
            f"{record.world_size} ranks), but rank {record.world_rank} waited {timeout_s:g} s and the other ranks "
            f"did not join ({problem}). Call it on every rank, not under `if accelerator.is_main_process:`: "
            "`accelerator.unwrap_model(model).save_pretrained(dir, is_main_process=accelerator.is_main_process)` "
            "on every rank, or `sd = accelerator.get_state_dict(model)` / `model.state_dict()` (or "
            "`accelerator.save_model(model, dir)`) on every rank and write `sd` on the main process only. No model "
            f"weights were written. If the ranks are just far apart in time, raise {TIMEOUT_ENV} (now {timeout_s:g})."
        )
