"""The per-unit state machine: what one wrapped unit does at each point of a training step.

A unit is one module (a transformer block, or the root) plus the flat parameters of the parameters
it owns.  Its transitions, each one small method below::

    IDLE --pre_forward--> FORWARD --post_forward--> AWAIT_BACKWARD --pre_backward--> BACKWARD
      ^                                                                                   |
      +------------------------------ finish (end of backward, root callback) <-----------+

* pre_forward: gather (or wait for a prefetched gather), prefetch the next unit, point the module's
  attributes at views of the unsharded buffers.
* post_forward: restore the attributes, hook the outputs for backward, reshard (unless root or
  ``reshard_after_forward=False``).
* pre_backward (first gradient reaching an output): gather again, prefetch the previous unit.
* post_backward (per flat parameter, once its full gradient is accumulated): start the reduction,
  reshard, optionally prefetch.  A unit without trainable parameters has no gradient to wait for: a
  hook on its inputs' gradients reshards it once the backward of its last call is over.

A forward that runs while the model is in backward is an activation-checkpointing recomputation: it
finds the unit unsharded (gathering if needed) and neither hooks outputs nor reshards.
"""
from __future__ import annotations

import enum
import weakref
from typing import Any, List, Optional, Protocol, Tuple

import torch
import torch.nn as nn

from ._compat import tensors_in
from .flat_param import FlatParameter
from .profiler import begin_span, end_span

class RootState(Protocol):
    """What a unit uses of the step-level state of its wrapper (``fully_sharded._RootState``)."""

    engine: Any
    backward_prefetch: Optional["BackwardPrefetch"]
    in_backward: bool
    sync_grads: bool

    def pre_root_forward(self, args: Any, kwargs: Any) -> Tuple[Any, Any]: ...
    def post_root_forward(self) -> None: ...
    def on_unit_forward(self, unit: "Unit") -> None: ...
    def runs_last_in_forward(self, unit: "Unit") -> bool: ...
    def on_backward_start(self) -> None: ...
    def prefetch_before(self, unit: "Unit") -> None: ...
    def accepts_outside_reads(self) -> bool: ...
    def note_outside_read(self, unit: "Unit") -> None: ...


class BackwardPrefetch(enum.Enum):
    """When to start gathering the unit that runs next in backward.

    ``BACKWARD_PRE``: when the current unit's backward starts (most overlap, one more unit in memory).
    ``BACKWARD_POST``: when the current unit's gradients are complete (less memory, less overlap).
    """

    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()


class UnitState(enum.Enum):
    IDLE = enum.auto()
    FORWARD = enum.auto()
    AWAIT_BACKWARD = enum.auto()
    BACKWARD = enum.auto()
    SUMMONED = enum.auto()


class Unit:
    """One module and the flat parameters it owns."""

    def __init__(
        self,
        module: nn.Module,
        name: str,
        flat_params: List[FlatParameter],
        root: RootState,
        is_root: bool,
        reshard_after_forward: bool,
    ) -> None:
        self.module = module
        self.name = name or "<root>"
        self.flat_params = flat_params
        self.root = root
        self.is_root = is_root
        self.reshard_after_forward = reshard_after_forward and not is_root
        self.state = UnitState.IDLE
        self._grads_arrived = 0  # trainable flat params whose gradient arrived in this backward
        self._open_backward_uses = 0  # calls whose backward started and (frozen units) has not ended
        self._views_installed = False
        self._installed_by_recompute = False
        self._outside_read_pending = False  # read from outside in the running forward (read_outside_forward)
        self._needed_by_backward = False  # read from outside in a forward with grad, its backward still to come
        self._forward_span: Any = None  # the open flatshard::forward[name] profiler span, if a profiler runs
        self.keep_gathered = False  # kept across forwards by a generation / frozen model (generation.py)
        self._handles = [
            module.register_forward_pre_hook(self._pre_forward_hook, prepend=True, with_kwargs=True),
            module.register_forward_hook(self._post_forward_hook),
        ]
        for flat in flat_params:
            if flat.requires_grad:
                self._handles.append(flat.unsharded.register_post_accumulate_grad_hook(self._make_post_backward(flat)))

    def __repr__(self) -> str:
        return f"Unit({self.name}, {len(self.flat_params)} flat params, {self.state.name})"

    @property
    def trainable_flats(self) -> List[FlatParameter]:
        return [f for f in self.flat_params if f.requires_grad]

    # ------------------------------------------------------------------ gather / free
    def unshard(self) -> None:
        for flat in self.flat_params:
            self.root.engine.unshard(flat, self.name)

    def wait_unshard(self) -> None:
        for flat in self.flat_params:
            self.root.engine.wait_unshard(flat, self.name)

    def reshard(self) -> None:
        if self.keep_gathered:
            return  # generation.py releases it (end of generate(), optimizer step, ensure_idle)
        for flat in self.flat_params:
            self.root.engine.reshard(flat)

    def is_unsharded(self) -> bool:
        return all(f.is_unsharded for f in self.flat_params)

    # ------------------------------------------------------------------ forward
    @torch.compiler.disable
    def _pre_forward_hook(self, module: nn.Module, args: Any, kwargs: Any):
        if self.state == UnitState.SUMMONED:
            return args, kwargs  # inside summon_full_params the parameters are full: the plain module runs
        if self.is_root:
            args, kwargs = self.root.pre_root_forward(args, kwargs)
        if self.root.in_backward:  # activation-checkpointing recomputation through module __call__
            self.unshard()
            self.wait_unshard()
            if not self._views_installed:
                self._install_views()
                self._installed_by_recompute = True
            return args, kwargs
        self.state = UnitState.FORWARD
        if not self.is_root:  # (the root's forward is the flatshard::forward span, opened by the root state)
            end_span(self._forward_span)  # still open if the unit's previous forward raised
            self._forward_span = begin_span(f"forward[{self.name}]")
        self.unshard()
        self.wait_unshard()
        self.root.on_unit_forward(self)
        self._install_views()
        if torch.is_grad_enabled() and self.flat_params and not self.trainable_flats:
            args, kwargs = self._hook_inputs_for_frozen_backward(args, kwargs)
        return args, kwargs

    def _install_views(self) -> None:
        for flat in self.flat_params:
            flat.install_views(flat.unsharded_views())
        self._views_installed = True

    def _uninstall_views(self) -> None:
        if self._views_installed:
            for flat in self.flat_params:
                flat.uninstall_views()
            self._views_installed = False
            self._installed_by_recompute = False

    @torch.compiler.disable
    def _post_forward_hook(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.state == UnitState.SUMMONED:
            return output
        if self.root.in_backward:
            if self._installed_by_recompute:
                self._uninstall_views()
            return output
        self._uninstall_views()
        if torch.is_grad_enabled():
            self._hook_outputs_for_backward(output)
            self.state = UnitState.AWAIT_BACKWARD
            if self.reshard_after_forward and not self.root.runs_last_in_forward(self) and not self._outside_read_pending:
                self.reshard()  # (the last unit's backward comes first: keep it, as FSDP2 does)
        else:
            self.state = UnitState.IDLE
            if not self.is_root and not self._outside_read_pending:
                self.reshard()
        if self.is_root:
            self.root.post_root_forward()
        end_span(self._forward_span)
        self._forward_span = None
        return output

    def _hook_outputs_for_backward(self, output: Any) -> None:
        tensors = [t for t in tensors_in(output) if t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self._pre_backward, mode="any")

    # ------------------------------------------------------------------ backward
    def _hook_inputs_for_frozen_backward(self, args: Any, kwargs: Any) -> Tuple[Any, Any]:
        """A unit without trainable parameters gets no post-backward hook from its gradients: reshard it
        once the gradients of all its inputs are computed, i.e. its backward is over (torch FSDP1's
        reshard-only hook).  Inputs that need no gradient mean no backward reaches this unit."""
        tensors = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self._post_backward_frozen, mode="all")
        return args, kwargs

    def _post_backward_frozen(self, grads: Any) -> None:
        self._open_backward_uses -= 1
        if self.state != UnitState.BACKWARD or self._open_backward_uses > 0:
            return  # another call of this unit (same forward, or an earlier one) still runs backward
        self._end_unit_backward()

    def _pre_backward(self, grad: Optional[torch.Tensor]) -> None:
        self.root.on_backward_start()
        self._open_backward_uses += 1  # (counted for frozen units: closed by _post_backward_frozen)
        if self.state == UnitState.BACKWARD and self.is_unsharded():
            return  # a second output (or a second forward's output) of the same backward
        # (a frozen unit called twice is resharded after each use's backward: gather it again)
        self.state = UnitState.BACKWARD
        self.unshard()
        self.wait_unshard()
        # Checkpointed layers may recompute forward inside backward without running module hooks
        # (transformers checkpoints `forward`, not `__call__`): the attributes must already resolve to
        # autograd-tracked views, so build them with grad mode on (hooks run with it off).
        with torch.enable_grad():
            self._install_views()
        if self.root.backward_prefetch == BackwardPrefetch.BACKWARD_PRE:
            self.root.prefetch_before(self)

    def _make_post_backward(self, flat: FlatParameter):
        # weak: held from the tensor's C++ side, a reference to the unit (or flat) is a cycle gc cannot break
        unit, index = weakref.ref(self), self.flat_params.index(flat)

        def hook(tensor: torch.Tensor) -> None:
            owner = unit()
            if owner is not None:
                owner._post_backward(owner.flat_params[index])

        return hook

    def _post_backward(self, flat: FlatParameter) -> None:
        self.root.on_backward_start()  # a unit whose outputs carried no hook still ends the step
        if self.root.sync_grads:
            grad = flat.unsharded.grad
            flat.unsharded.grad = None
            self.root.engine.reduce_grad(flat, grad, self.name)
        # no_sync: the full gradient stays in flat.unsharded.grad and keeps accumulating
        self._grads_arrived += 1
        if self._grads_arrived == len(self.trainable_flats):
            # every gradient of this unit is complete: nothing in this backward reads its params again
            self._end_unit_backward()

    def _end_unit_backward(self) -> None:
        self._uninstall_views()
        self.reshard()
        if self.root.backward_prefetch == BackwardPrefetch.BACKWARD_POST:
            self.root.prefetch_before(self)

    # ------------------------------------------------------------------ reads from outside the unit's forward
    @torch.compiler.disable
    def read_outside_forward(self) -> bool:
        """A parameter of this unit is read by code outside the unit's forward (outside_reads.py), e.g. the
        parent's forward reading ``lm_head.weight``.  While the model runs forward (or recomputes it in
        backward) gather the unit, install its views and return True; otherwise return False (the reader
        gets the shard).  The unit stays gathered until the model's forward ends."""
        if not self.root.accepts_outside_reads():
            return False
        self.unshard()
        self.wait_unshard()
        if not self._views_installed:
            self._install_views()
            self._installed_by_recompute = self.root.in_backward
        if not self.root.in_backward and not self._outside_read_pending:
            self._outside_read_pending = True
            self.root.note_outside_read(self)
        return True

    def end_outside_read(self) -> None:
        """The model's forward that read this unit from outside has ended: the attributes show shards again.
        With grad enabled autograd saved the views (also of frozen parameters: the input gradient needs
        them), so the unit stays gathered for backward; the root gathers it again at backward start if
        something freed it meanwhile (a no-grad forward in between), see regather_for_backward."""
        self._outside_read_pending = False
        self._uninstall_views()
        if torch.is_grad_enabled():
            self._needed_by_backward = True
            if self.state == UnitState.IDLE:
                self.state = UnitState.AWAIT_BACKWARD
        elif not self._needed_by_backward:
            self.state = UnitState.IDLE
            self.reshard()

    def regather_for_backward(self) -> None:
        """Backward is starting: make sure tensors saved from an outside read find their data."""
        if self._needed_by_backward and not self.is_unsharded():
            self.unshard()
            self.wait_unshard()

    # ------------------------------------------------------------------ end of step
    def finish(self) -> None:
        self._uninstall_views()
        self.reshard()
        self.state = UnitState.IDLE
        self._grads_arrived = 0
        self._open_backward_uses = 0
        self._needed_by_backward = False

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
