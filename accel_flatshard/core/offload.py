"""CPU offload of parameters (``fsdp_offload_params: true``): what lives in host memory and how it moves.

With :class:`CPUOffload` ``(offload_params=True)`` everything persistent of a flat parameter lives in host memory
(pinned on a GPU, so copies run asynchronously to the host): ``local_shard`` (the fp32 master: the optimizer steps on
the host and keeps its state there), ``sharded_grad`` (one buffer per flat parameter, reused across steps) and, when
gradients accumulate over several backwards, staging buffers the host adds.  The device holds only what is in flight (a
unit's copied shard until gathered, gathered units, full gradients, a reduced shard until its copy to the host is
issued, activations).  The engine moves them on its side streams through the device adapter (``to_device`` / ``to_host``
/ ``host_empty``; which stream, and who waits for a copy: docs/architecture-details.md section 5); reduced shards land
in :meth:`HostOffload.grad_target`.  On a CPU device the host *is* the device: nothing is pinned.  The two optimizer
step handlers below (wait for the copies to the device, which read the host shards; a fused host Adam) run from the
registry's step hook (``core/registry.py``).
"""
from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List

import torch

from . import registry
from .flat_param import FlatParameter


@dataclass(frozen=True)
class CPUOffload:
    """torch FSDP1's ``CPUOffload``: ``offload_params=True`` keeps shards, gradients and optimizer state
    in host memory; the device holds only gathered units, unreduced gradients and activations."""

    offload_params: bool = False


class HostOffload:
    """The host-side buffers of an offloaded model and the device adapter that moves them."""

    def __init__(self, streams: Any) -> None:
        self.streams = streams
        self._staging: Dict[FlatParameter, List[torch.Tensor]] = {}
        self._handed: Dict[FlatParameter, List[torch.Tensor]] = {}  # targets of this backward's reductions
        # every host buffer allocated (all persistent: reused, never freed while the model lives)
        self.host_buffers: List[torch.Tensor] = []
        _LIVE.add(self)

    def _host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self.host_buffers.append(self.streams.host_empty(numel, dtype))
        return self.host_buffers[-1]

    def place_shard(self, flat: FlatParameter) -> None:
        """Give ``flat`` a host (pinned) ``local_shard``, before it is filled and the parameters point at it."""
        flat.local_shard = self._host_empty(flat.layout.shard_numel, flat.dtype).zero_()
        flat.keep_grad_buffer = True

    def wait_for_host_to_device_copies(self) -> None:
        """Before the host writes the host shards: wait until the copies to the device issued so far read them."""
        s = self.streams
        s.synchronize(s.record(s.side_stream("all_gather")))

    def grad_target(self, flat: FlatParameter) -> torch.Tensor:
        """Host buffer for this backward's next reduced shard of ``flat``: ``sharded_grad`` when every ``.grad`` is
        None and it is the first, else a staging buffer the host adds at the end of backward (one per reduction:
        the copies run concurrently).  All are allocated once and reused (:meth:`targets_consumed`)."""
        if flat.sharded_grad is None:
            flat.sharded_grad = self._host_empty(flat.layout.shard_numel, flat.dtype)
        handed = self._handed.setdefault(flat, [])
        if not handed and all(p.grad is None for p in flat.params):
            target = flat.sharded_grad
        else:
            staging = self._staging.setdefault(flat, [])
            used = sum(t is not flat.sharded_grad for t in handed)
            if used == len(staging):
                staging.append(self._host_empty(flat.layout.shard_numel, flat.dtype))
            target = staging[used]
        handed.append(target)
        return target

    def targets_consumed(self) -> None:
        """End of backward (or an aborted one): the targets handed out are added or dropped; reuse them."""
        self._handed.clear()


# ---------------------------------------------------------------------- the host optimizer step Process-wide on
# purpose: any optimizer step may write another model's host shards (TRL's sync_ref_model
# after the policy's step).  Weak: a dropped model leaves nothing.
_LIVE: "weakref.WeakSet[HostOffload]" = weakref.WeakSet()


def wait_for_copies_before_step(optimizer: torch.optim.Optimizer, records: List[Any]) -> None:
    """Any step may write offloaded shards on the host (TRL's ``sync_ref_model`` writes a reference's after it)."""
    for offload in list(_LIVE):
        offload.wait_for_host_to_device_copies()


# Measured (benchmarks/offload_adamw.py, 40M parameters, 2 CPU threads, torch 2.13): AdamW for-loop 49 ms,
# foreach 54 ms, fused 12.7 ms per step; fused differs from the for-loop by at most 6 ulps where
# |p| >= 1e-3 (2.4e-7 absolute).  torch picks the for-loop for CPU tensors unless told otherwise.
_FAST_HOST_STEP_WARNED = False
_MADE_FUSED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list]" = weakref.WeakKeyDictionary()


def prefer_fused_host_adam(optimizer: torch.optim.Optimizer, records: List[Any]) -> None:
    """Offload onto a GPU moved the user's (Adam/AdamW) step to the host, where torch's default is its
    slowest variant: use the fused CPU kernel instead, unless the user chose ``foreach`` or ``fused``."""
    global _FAST_HOST_STEP_WARNED
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return
    for group in optimizer.param_groups:
        if group.get("fused") is not None or group.get("foreach") is not None or group.get("differentiable"):
            continue
        offloaded = [getattr(registry.record_of_param(p), "offload", None) for p in group["params"]]
        if not offloaded or not all(o is not None and o.streams.stream_ordered for o in offloaded):
            continue
        group["fused"] = True
        optimizer._step_supports_amp_scaling = True  # as torch sets for fused optimizers (GradScaler)
        _MADE_FUSED.setdefault(optimizer, []).append(group)
        if not _FAST_HOST_STEP_WARNED:
            _FAST_HOST_STEP_WARNED = True
            warnings.warn("accel_flatshard: with CPU offload the Adam/AdamW step runs on the host; using "
                          "fused=True there (about 4x faster than torch's CPU default, same result within a few "
                          "ulps). Pass foreach=False or fused=False to the optimizer to keep the for-loop.",
                          stacklevel=3)


registry.on_step(pre=wait_for_copies_before_step)
registry.on_step(pre=prefer_fused_host_adam)
