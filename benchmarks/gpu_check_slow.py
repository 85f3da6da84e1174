"""Slow-GPU mode of gpu_check's parity parts: the GPU falls behind the host where a missing wait would matter.

With small models a GPU never falls behind the host, so a missing stream wait or event rarely reads a buffer
before it is written: the parity checks pass on a racy engine.  In this mode the device is made slow where the
engine's ordering is at stake, by queueing a spin of ``torch.cuda._sleep`` (benchmark code: a private torch
API used here only, never by the package):

* on the compute stream before every backward and every optimizer step (``lag()``, called by the training
  loops): the optimizer's writes and the backward's reads/writes of gathered buffers land late, so a side
  stream that does not wait for them reads stale values;
* on the engine's side streams before every collective (all-gather, reduce-scatter, replica all-reduce): every
  ``collective()`` of ``accel_flatshard.core.engine``'s stream adapters is wrapped from here (the engine's code is
  not touched), so a compute stream that does not wait for a collective reads its output unwritten.

On CPU (the smoke run) there is no device queue: a short ``time.sleep`` stands in, so the same code runs.

    with slow_gpu(device, enabled=True):   # parity run in slow-GPU mode
        ... lag() before backward / optimizer step ...
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch

from accel_flatshard.core import device as _device

# ~2.5 ms at the H200's ~2 GHz: longer than any kernel of the small parity models, so work queued after the
# sleep runs well after the host has moved on
SLEEP_CYCLES = 5_000_000
CPU_STAND_IN_S = 0.0005

_state = {"on": False, "device": None}


def _sleep(device: torch.device) -> None:
    if device.type == "cuda":
        with torch.cuda.device(device):  # (ranks without set_device: the model's device, not cuda:0)
            torch.cuda._sleep(SLEEP_CYCLES)  # on that device's current stream
    else:
        time.sleep(CPU_STAND_IN_S)


def lag() -> None:
    """Queue a sleep on the compute stream (the current one) when slow-GPU mode is on; nothing otherwise."""
    if _state["on"]:
        _sleep(_state["device"])


@contextlib.contextmanager
def slow_gpu(device: torch.device, enabled: bool = True) -> Iterator[None]:
    """Slow-GPU mode on ``device`` for the block (see the module docstring); ``enabled=False``: unchanged."""
    if not enabled:
        yield
        return
    patched = []
    for cls in (_device.HostAdapter, _device.CudaStreams):
        original = cls.__dict__.get("collective")
        if original is None:
            continue

        def collective(self, stream, issue, keep=None, _original=original):
            with self.on(stream):  # before the collective, on its side stream
                _sleep(device)
            return _original(self, stream, issue, keep)

        cls.collective = collective
        patched.append((cls, original))
    _state.update(on=True, device=device)
    try:
        yield
    finally:
        _state.update(on=False, device=None)
        for cls, original in patched:
            cls.collective = original


MODES = (("as is", False), ("slow GPU", True))  # every parity run: (label, slow-GPU mode on)
