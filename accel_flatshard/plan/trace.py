"""The planner's measurement (plan/run.py): :class:`_Trace` counts the device's bytes in use after every op, what
lets a real run's ops run on fake tensors, and the error naming the op that could not (:func:`_why_fake_failed`).
"""
from __future__ import annotations

import collections
import copy
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..core._compat import TorchDispatchMode, outside_dispatch_modes, storage_key, tensors_in

# ``aten._grouped_mm`` (transformers' MoE experts, its default ``experts_implementation``) on other than bf16 inputs
# runs :func:`_grouped_mm_out`: torch's fake (meta) kernel accepts only bf16, its CPU kernel (and CUDA's since 2.10) any
_GROUPED_MM = getattr(torch.ops.aten, "_grouped_mm", False)


class _Trace(TorchDispatchMode):
    """The device's bytes in use after every op (``live``; ``peak``, calling ``on_peak()`` as it rises): storages ops
    make, by ``kind`` (or :meth:`relabel`), less ``known``'s and on CUDA the host's, plus the engine adapter's notes:
    gathered buffers (resized, not made by ops) and on CUDA blocks a ``record_stream`` keeps until a later event."""

    def __init__(self, cuda: bool) -> None:
        super().__init__()
        self.known, self.cuda, self.kind = set(), cuda, "activations"  # known: storages not counted
        self.storages: Dict[int, List[Any]] = {}  # key -> [bytes, kind], on the device
        self.kinds: Dict[str, int] = collections.Counter()
        self.host, self.recorded = set(), set()  # storage keys: in host memory (CUDA offload), kept past their free
        self.lingering: List[Tuple[int, int, str]] = []  # (the first event that frees it, bytes, kind)
        self.events, self.live, self.peak = 0, 0, 0
        self.on_peak: Callable[[], None] = lambda: None
        self.on_op: Optional[Callable[[], None]] = None  # called after every op (the plot's curve, plan/plot.py)
        self.failed: Any = None  # the first op that raised (named in the planner's error)
        self.real = weakref.WeakValueDictionary()  # id -> a real tensor (a batch's mask): ops on these alone run real

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs, kwargs = tensors_in((args, kwargs)), kwargs or {}
        try:
            if inputs and all(self.is_real(t) for t in inputs):  # the batch's masks and what is made of them alone
                with outside_dispatch_modes():
                    out = func(*args, **kwargs)
                self.add_real(tensors_in(out))
            elif getattr(func, "overloadpacket", None) is _GROUPED_MM and args[0].dtype != torch.bfloat16:
                out = _grouped_mm_out(*args, **kwargs)
            else:
                out = func(*args, **kwargs)
            # CUDA: an op of host tensors alone runs on the host (the offloaded optimizer step)
            on_host = self.cuda and bool(inputs) and all(storage_key(t) in self.host for t in inputs)
            self.hold(tensors_in(out), on_host=on_host)
        except Exception:
            self.failed = self.failed or func
            raise
        if self.live > self.peak:
            self.peak = self.live
            self.on_peak()
        if self.on_op is not None:
            self.on_op()
        return out

    def add_real(self, tensors: Sequence[torch.Tensor]) -> None:
        self.real.update((id(t), t) for t in tensors)

    def is_real(self, tensor: torch.Tensor) -> bool:
        return self.real.get(id(tensor)) is tensor

    def hold(self, tensors: Sequence[torch.Tensor], on_host: bool = False) -> None:
        """Count the storages of ``tensors`` until they die (an op's outputs, or tensors made outside)."""
        for t in tensors:
            storage = t.untyped_storage()
            key, nbytes = storage_key(t), storage.nbytes()
            if nbytes and key not in self.known and key not in self.host and key not in self.storages:
                self.host.add(key) if on_host else self._add(nbytes, self.kind, key)
                weakref.finalize(storage, self._died, key)

    def _add(self, nbytes: int, kind: str, key: Optional[int] = None) -> None:
        self.kinds[kind] += nbytes
        self.live += nbytes
        if key is not None:
            self.storages[key] = [nbytes, kind]

    def _died(self, key: int) -> None:
        self.host.discard(key)
        self._free(key, *self.storages.pop(key, (0, self.kind)))

    def _free(self, key: int, nbytes: int, kind: str) -> None:
        if key in self.recorded:  # reusable once the host waited for an event recorded from now on
            self.recorded.discard(key)
            self.lingering.append((self.events, nbytes, kind))
        else:
            self._add(-nbytes, kind)

    def synchronized(self, event: int) -> None:
        """The host waited for an event: the blocks freed before it was recorded are reusable."""
        for entry in [e for e in self.lingering if e[0] <= event]:
            self.lingering.remove(entry)
            self._add(-entry[1], entry[2])

    def relabel(self, tensor: Optional[torch.Tensor], kind: str) -> None:
        entry = self.storages.get(storage_key(tensor)) if tensor is not None else None
        if entry is not None:
            self.kinds[entry[1]] -= entry[0]
            self.kinds[kind] += entry[0]
            entry[1] = kind

    def place_on_host(self, tensor: torch.Tensor) -> torch.Tensor:
        key = storage_key(tensor)
        if key not in self.storages:  # (made outside the trace)
            weakref.finalize(tensor.untyped_storage(), self._died, key)
        self._add(-self.storages.get(key, (0,))[0], self.storages.pop(key, (0, self.kind))[1])
        self.host.add(key)
        return tensor

    # the device adapter's notes: a gathered buffer (of a flat parameter), a full gradient cast for its reduction
    def note_alloc(self, tensor: torch.Tensor, kind: str, key: Any = None) -> None:
        if kind == "unsharded":
            self._add(tensor.untyped_storage().nbytes(), "gathered units", storage_key(tensor))
        elif kind == "full_grad":
            self.relabel(tensor, "full gradients")

    def note_free(self, flat: Any) -> None:
        key = storage_key(flat.unsharded)
        self._free(key, *self.storages.pop(key, (0, "gathered units")))


def _grouped_mm_out(a: torch.Tensor, b: torch.Tensor, offs: Optional[torch.Tensor] = None, bias: Any = None,
                    out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The output ``aten._grouped_mm`` allocates (the rule of torch's meta kernel, without its dtype check): 2D x 2D
    (a weight gradient) one matrix per group, 2D x 3D / 3D x 2D the jagged rows, 3D x 3D a bmm."""
    if a.dim() == 2 and b.dim() == 2:
        shape = (offs.size(0), a.size(0), b.size(1))
    else:  # (2D x 3D: a's rows; 3D x 3D: a's batch and rows)
        shape = (*a.shape[:-1], b.size(-1)) if b.dim() == 3 else (a.size(1), b.size(1))
    return torch.empty(shape, dtype=out_dtype or a.dtype, device=a.device)


def _why_fake_failed(op: Any, exc: Exception) -> str:
    """The op that did not run on fake tensors, and why (fake tensors have shapes and dtypes, no values)."""
    kind = type(exc).__name__
    if kind == "DynamicOutputShapeException":
        return (f"{op}'s output shape depends on the tensor values (as nonzero, masked_select, unique do), which fake "
               "tensors do not have: the memory depends on the data (a transformers MoE model on its eager experts "
               "path loops over the experts hit: experts_implementation='grouped_mm', its default, plans)")
    if kind == "DataDependentOutputException":
        return (f"{op} reads tensor values (.item(), bool(tensor), Python branching on them), which fake tensors do "
               "not have")
    if op is not None:
        return f"{op}'s fake (meta) kernel refused these inputs, though the op may run for real: {exc}"
    return f"{kind}: {exc}"


def copy_model(model: nn.Module, convert: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """``model`` with every parameter and buffer replaced by ``convert(tensor)`` (ties kept; the rest deep-copied)."""
    memo: Dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        new = convert(t)
        memo[id(t)] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
    with outside_dispatch_modes():  # other tensors a module holds (bitsandbytes' quantization state) stay as they are
        return copy.deepcopy(model, memo)


def _as_call(batch: Any) -> Tuple[tuple, dict]:
    if isinstance(batch, dict):
        return (), batch
    if isinstance(batch, tuple) and len(batch) == 2 and isinstance(batch[1], dict):
        return tuple(batch[0]), batch[1]
    return (tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)), {}


def _loss_of(out: Any) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if loss is None:
        loss = out[0] if isinstance(out, (tuple, list)) or hasattr(out, "to_tuple") else out
    return loss if loss.dim() == 0 else loss.float().sum()
