"""The planner's fake run (``Planner.trace``): the dispatch mode that records the live bytes after every op and
the marks between them (:class:`_Trace`), the engine's view handling per unit with those marks (:func:`_mark_unit`),
what lets a real run's ops run on fake tensors (an ``aten._grouped_mm`` fallback; a batch's attention masks run
for real) and the error that names the op that could not (:func:`_why_fake_failed`).
"""
from __future__ import annotations

import copy
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .._compat import TorchDispatchMode, inside_backward_pass, outside_dispatch_modes, tensors_in
from ..flat_param import FlatParameter


class _Trace(TorchDispatchMode):
    """Bytes of the storages alive after every op (``samples``; storages of ``known`` tensors excluded) and
    marks between ops (``events``: ``(kind, unit, sample index, live bytes[, flat parameter index])``)."""

    def __init__(self, known: Sequence[torch.Tensor] = ()) -> None:
        super().__init__()
        self.known = {t.untyped_storage()._cdata for t in known}
        self.live, self.samples, self.events = 0, [], []
        self.failed: Any = None  # the first op that raised (named in the planner's error)
        self.real: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> a real tensor: ops on
        # these alone run for real (Planner.trace)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs, kwargs = tensors_in((args, kwargs)), kwargs or {}
        try:
            if inputs and all(self.is_real(t) for t in inputs):  # the batch's masks and what is made of them alone
                with outside_dispatch_modes():
                    out = func(*args, **kwargs)
                self.add_real(tensors_in(out))
            elif _needs_grouped_mm_fallback(func, args):
                out = _grouped_mm_out(*args, **kwargs)
            else:
                out = func(*args, **kwargs)
        except Exception:
            self.failed = self.failed or func
            raise
        self.hold(tensors_in(out))
        self.samples.append(self.live)
        return out

    def add_real(self, tensors: Sequence[torch.Tensor]) -> None:
        self.real.update((id(t), t) for t in tensors)

    def is_real(self, tensor: torch.Tensor) -> bool:
        return self.real.get(id(tensor)) is tensor

    def hold(self, tensors: Sequence[torch.Tensor]) -> None:
        """Count the storages of ``tensors`` as live until they die (an op's outputs, or inputs made outside)."""
        for t in tensors:
            storage = t.untyped_storage()
            key, nbytes = storage._cdata, storage.nbytes()
            if nbytes and key not in self.known:
                self.known.add(key)
                self.live += nbytes
                weakref.finalize(storage, self._died, key, nbytes)

    def _died(self, key: int, nbytes: int) -> None:
        self.known.discard(key)
        self.live -= nbytes

    def mark(self, kind: str, unit: int, *flat: int) -> None:
        self.events.append((kind, unit, len(self.samples), self.live, *flat))

    def pieces(self) -> List[List[int]]:
        """The samples between each event and the next."""
        bounds = [e[2] for e in self.events] + [len(self.samples)]
        return [self.samples[a:b] for a, b in zip(bounds, bounds[1:])]


def _needs_grouped_mm_fallback(func: Any, args: Sequence[Any]) -> bool:
    """``aten._grouped_mm`` (transformers' MoE experts, its default ``experts_implementation``) on other than
    bf16 inputs: torch's fake (meta) kernel accepts only bf16, its CPU kernel (and CUDA's on torch >= 2.10) any."""
    return getattr(func, "overloadpacket", None) is getattr(torch.ops.aten, "_grouped_mm", False) and \
        args[0].dtype != torch.bfloat16


def _grouped_mm_out(a: torch.Tensor, b: torch.Tensor, offs: Optional[torch.Tensor] = None, bias: Any = None,
                    out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The output ``aten._grouped_mm`` allocates (the rule of torch's meta kernel, without its dtype check): 2D x 2D
    (a weight gradient) one matrix per group, 2D x 3D / 3D x 2D the jagged rows, 3D x 3D a bmm."""
    if a.dim() == 2 and b.dim() == 2:
        shape = (offs.size(0), a.size(0), b.size(1))
    elif a.dim() == 2:
        shape = (a.size(0), b.size(-1))
    elif b.dim() == 2:
        shape = (a.size(1), b.size(1))
    else:
        shape = (a.size(0), a.size(1), b.size(-1))
    return torch.empty(shape, dtype=out_dtype or a.dtype, device=a.device)


def _why_fake_failed(op: Any, exc: Exception) -> str:
    """The op that did not run on fake tensors, and why (fake tensors have shapes and dtypes, no values)."""
    kind = type(exc).__name__
    if kind == "DynamicOutputShapeException":
        why = (f"{op}'s output shape depends on the tensor values (as nonzero, masked_select, unique do), which fake "
               "tensors do not have: the memory depends on the data (a transformers MoE model on its eager experts "
               "path loops over the experts hit: experts_implementation='grouped_mm', its default, plans)")
    elif kind == "DataDependentOutputException":
        why = f"{op} reads tensor values (.item(), bool(tensor), Python branching on them), which fake tensors do not have"
    elif op is not None:
        why = f"{op}'s fake (meta) kernel refused these inputs, though the op may run for real: {exc}"
    else:
        why = f"{kind}: {exc}"
    return why


def _copy(model: nn.Module, convert: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """``model`` with every parameter and buffer replaced by ``convert(tensor)`` (ties kept; the rest deep-copied)."""
    memo: Dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        new = convert(t)
        memo[id(t)] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
    return copy.deepcopy(model, memo)


def _mark_unit(trace: _Trace, index: int, module: nn.Module, flats: List[FlatParameter]) -> None:
    """The engine's view handling for one unit (``unit.py``: views of the flat buffer installed for its forward
    and again, with grad, from its backward's start; one flat gradient per flat parameter, so autograd runs
    the same nodes in the same order), with marks: forward (or recomputation), the start of backward (the
    first gradient at an output), each flat gradient (dropped there: the replay holds it) and the end of
    the unit's backward (its last gradient; a frozen unit: its inputs' gradients, the reshard-only hook)."""
    trainable, arrived = [f for f in flats if f.requires_grad], []

    def views(installed: bool) -> None:
        for f in flats:
            f.install_views(f.unsharded_views()) if installed else f.uninstall_views()

    def done(*_: Any) -> None:
        views(False)
        trace.mark("done", index)

    def pre(mod: nn.Module, args: Any) -> None:
        recompute = inside_backward_pass()
        trace.mark("recompute" if recompute else "fwd", index)
        if not recompute:
            views(True)

    def post(mod: nn.Module, args: Any, out: Any) -> None:
        if inside_backward_pass():
            return
        views(False)
        trace.mark("fwd_end", index)
        outs, ins = [t for t in tensors_in(out) if t.requires_grad], [t for t in tensors_in(args) if t.requires_grad]
        if outs:
            torch.autograd.graph.register_multi_grad_hook(outs, backward, mode="any")
        if flats and not trainable and ins:
            torch.autograd.graph.register_multi_grad_hook(ins, done)

    def backward(grad: Any) -> None:
        trace.mark("bwd", index)
        with torch.enable_grad():
            views(True)

    def grad_arrived(flat: FlatParameter) -> None:
        flat.unsharded.grad = None
        trace.mark("grad", index, flats.index(flat))
        arrived.append(flat)
        if len(arrived) == len(trainable):
            arrived.clear()
            done()

    module.register_forward_pre_hook(pre, prepend=True)
    module.register_forward_hook(post)
    for f in trainable:
        f.unsharded.register_post_accumulate_grad_hook(lambda t, f=f: grad_arrived(f))


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
