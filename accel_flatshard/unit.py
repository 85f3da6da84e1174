"""Units and the step: each unit's state machine, and the schedule that runs every unit of one model.

A unit is one module (a transformer block, or the root) plus the flat parameters it owns.  Its state has
two coordinates, each an enum that every hook checks (as torch FSDP2's ``TrainingState`` and ``ShardedState``):

* :class:`UnitState`, where it is in the step::

      IDLE --pre_forward--> FORWARD --post_forward--> AWAIT_BACKWARD --pre_backward--> BACKWARD
        ^                 (no grad: back to IDLE)                                          | its gradients
        +--------- end of backward (the root's autograd callback) ---- BACKWARD_DONE <------+ are issued

  and SUMMONED (``summon_full_params``, gather-once generation: the parameters are full tensors, the hooks
  stand aside).  A forward recomputed in backward (activation checkpointing) changes no state.
* :class:`ShardedState`, where its parameters are: SHARDED --unshard--> GATHERING --wait_unshard--> GATHERED
  --reshard--> SHARDED, or KEPT (gathered across forwards for generation or a frozen model: reshards leave it).

An unexpected state raises :class:`UnitStateError` naming the unit, the states and the hook.

:class:`Schedule` holds the step's order, read top to bottom below: the module hooks of every unit (forward,
backward), which unit is prefetched (the next in the recorded forward order; the previous one in backward),
which stays gathered (the root, the last unit, a unit read from outside its forward), and the end of the step
(the autograd callback that completes the reductions and frees every unit).  Calls go one way: schedule ->
unit -> engine.
"""
from __future__ import annotations

import enum
import functools
import warnings
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ._compat import inside_backward_pass, map_tensors, queue_end_of_backward_callback, tensors_in
from .engine import Engine
from .flat_param import FlatParameter
from .mixed_precision import MixedPrecision
from .profiler import begin_span, end_span
from .wrap import backward_reads_parameters


class BackwardPrefetch(enum.Enum):
    """When to start gathering the unit that runs next in backward.

    ``BACKWARD_PRE``: when the current unit's backward starts (most overlap, one more unit in memory).
    ``BACKWARD_POST``: when the current unit's gradients are complete (less memory, less overlap).
    """

    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()


class UnitState(enum.Enum):
    IDLE = enum.auto()
    FORWARD = enum.auto()  # its forward runs: gathered, the module's attributes are views of the gathered buffers
    AWAIT_BACKWARD = enum.auto()  # it ran forward with grad: its backward is to come
    BACKWARD = enum.auto()  # its backward runs: gathered, views installed (not for an input embedding: wrap.py)
    BACKWARD_DONE = enum.auto()  # its gradients are issued for reduction (or, frozen, its inputs' are computed)
    SUMMONED = enum.auto()  # parameters are full tensors (summon_full_params, gather-once generation)


class ShardedState(enum.Enum):
    SHARDED = enum.auto()
    GATHERING = enum.auto()  # all-gathers issued (a prefetch, or just before use), not yet waited for
    GATHERED = enum.auto()
    KEPT = enum.auto()  # gathered until released (generation, a frozen model's no-grad forwards)


class UnitStateError(RuntimeError):
    """A hook found a unit in a state it cannot run in (a bug, or a use the engine does not support)."""


class Unit:
    """One module, the flat parameters it owns, and its state."""

    def __init__(self, module: nn.Module, name: str, flat_params: List[FlatParameter], engine: Engine,
                 is_root: bool, reshard_after_forward: bool) -> None:
        self.module = module
        self.name = name or "<root>"
        self.flat_params = flat_params
        self.engine = engine
        self.is_root = is_root
        self.reshard_after_forward = reshard_after_forward and not is_root
        # an untied input embedding: its backward needs no parameters, so it is not gathered for it (wrap.py)
        self.gathers_for_backward = backward_reads_parameters(module)
        self.trainable = sum(f.requires_grad for f in flat_params)  # flat params with a gradient
        self.state = UnitState.IDLE
        self.sharded_state = ShardedState.SHARDED
        self.views_installed = False
        self.grads_arrived = 0  # trainable flat params whose gradient arrived in this backward
        self.open_backward_uses = 0  # calls whose backward started and (frozen units) has not ended
        self.forward_span: Any = None  # the open flatshard::forward[name] profiler span, if a profiler runs

    def __repr__(self) -> str:
        return f"Unit({self.name}, {len(self.flat_params)} flat params, {self.state.name}, {self.sharded_state.name})"

    def expect(self, hook: str, *states: UnitState) -> None:
        if self.state not in states:
            raise self.error(hook, f"expected {' or '.join(s.name for s in states)}")

    def error(self, hook: str, what: str) -> UnitStateError:
        return UnitStateError(f"accel_flatshard: unit {self.name}: {hook} in state {self.state.name}/"
                              f"{self.sharded_state.name}: {what}")

    # ------------------------------------------------------------------ gather / free
    def unshard(self) -> None:
        """Start gathering (nothing to do once gathering or gathered)."""
        if self.sharded_state is ShardedState.SHARDED:
            for flat in self.flat_params:
                self.engine.unshard(flat, self.name)
            self.sharded_state = ShardedState.GATHERING

    def wait_unshard(self) -> None:
        if self.sharded_state is ShardedState.GATHERING:
            for flat in self.flat_params:
                self.engine.wait_unshard(flat, self.name)
            self.sharded_state = ShardedState.GATHERED
        elif self.sharded_state is ShardedState.SHARDED:
            raise self.error("wait_unshard", "no all-gather was issued")

    def reshard(self) -> None:
        """Free the gathered buffers (a kept unit stays)."""
        if self.sharded_state is ShardedState.GATHERED:
            for flat in self.flat_params:
                self.engine.reshard(flat)
            self.sharded_state = ShardedState.SHARDED
        elif self.sharded_state is ShardedState.GATHERING:
            raise self.error("reshard", "its all-gather is in flight (wait_unshard first, or release)")

    def release(self) -> None:
        """Free whatever is gathered or gathering (a prefetch that no forward used is waited for first)."""
        if self.sharded_state is ShardedState.GATHERING:
            self.wait_unshard()
        self.reshard()

    def keep(self) -> None:
        self.unshard()
        self.wait_unshard()
        self.sharded_state = ShardedState.KEPT

    def unkeep(self) -> None:
        """A kept unit is freed now if idle, else by the next forward or the end of backward."""
        if self.sharded_state is ShardedState.KEPT:
            self.sharded_state = ShardedState.GATHERED
            if self.state is UnitState.IDLE:
                self.reshard()

    # ------------------------------------------------------------------ views
    def install_views(self) -> None:
        for flat in self.flat_params:
            flat.install_views(flat.unsharded_views())
        self.views_installed = True

    def uninstall_views(self) -> None:
        if self.views_installed:
            for flat in self.flat_params:
                flat.uninstall_views()
            self.views_installed = False

    def finish(self) -> None:
        """End of backward: sharded (unless kept), idle."""
        self.uninstall_views()
        self.release()
        self.state = UnitState.IDLE
        self.grads_arrived = 0
        self.open_backward_uses = 0


# Schedules whose backward has started but not finished; optimizer steps must not see their gradients yet.
_IN_BACKWARD: "weakref.WeakSet[Schedule]" = weakref.WeakSet()


class Schedule:
    """The step of one wrapped model: the hooks of its units and what spans units (order, prefetch, backward)."""

    def __init__(self, engine: Engine, backward_prefetch: Optional[BackwardPrefetch], forward_prefetch: bool,
                 mixed_precision: Optional[MixedPrecision]) -> None:
        self.engine = engine
        self.backward_prefetch = backward_prefetch
        self.forward_prefetch = forward_prefetch
        self.mixed_precision = mixed_precision
        self.units: List[Unit] = []
        self.sync_grads = True
        self.in_forward = False
        self.in_backward = False  # from the first backward hook to the end-of-backward callback
        self.recorded_order: Optional[List[Unit]] = None
        self._order_index: Dict[Unit, int] = {}
        self._current_order: Dict[Unit, None] = {}  # this forward's units (ordered set)
        self._order_ok = True
        self._warned_order = False
        self._outside_reads: List[Unit] = []  # units read outside their forward in the running forward
        self._needed_by_backward: List[Unit] = []  # ... in a forward with grad: gathered when backward starts
        # open flatshard::forward / flatshard::backward profiler spans (None unless a torch.profiler runs)
        self._forward_span: Any = None
        self._backward_span: Any = None

    def add_unit(self, unit: Unit) -> None:
        unit.module.register_forward_pre_hook(functools.partial(self._pre_forward, unit), prepend=True, with_kwargs=True)
        unit.module.register_forward_hook(functools.partial(self._post_forward, unit))
        for index, flat in enumerate(unit.flat_params):
            if flat.requires_grad:
                flat.unsharded.register_post_accumulate_grad_hook(self._post_backward_hook(unit, index))
        if not unit.is_root:
            _enable_outside_reads(self, unit)  # e.g. TRL's fused LM head reads lm_head.weight in the root's forward
        self.units.append(unit)

    # ------------------------------------------------------------------ forward
    # The hooks (and read_outside_forward) are dynamo-disabled: under torch.compile they run eagerly, so the
    # graph breaks only at unit boundaries and a compiled block sees plain views (compilation.py).
    @torch.compiler.disable
    def _pre_forward(self, unit: Unit, module: nn.Module, args: Any, kwargs: Any) -> Tuple[Any, Any]:
        if unit.state is UnitState.SUMMONED:
            return args, kwargs  # the parameters are full: the plain module runs
        if unit.is_root and not (self.in_backward and inside_backward_pass()):
            args, kwargs = self._pre_root_forward(args, kwargs)
        if self.in_backward:  # an activation-checkpointing recomputation through module __call__
            unit.unshard()
            unit.wait_unshard()
            if not unit.views_installed:  # (they stay until the unit's backward ends)
                unit.install_views()
            return args, kwargs
        unit.expect("pre_forward", UnitState.IDLE, UnitState.AWAIT_BACKWARD)
        unit.state = UnitState.FORWARD
        if not unit.is_root:  # (the root's forward is the flatshard::forward span)
            end_span(unit.forward_span)  # still open if the unit's previous forward raised
            unit.forward_span = begin_span(f"forward[{unit.name}]")
        unit.unshard()
        unit.wait_unshard()
        self._record_and_prefetch(unit)
        unit.install_views()
        if torch.is_grad_enabled() and unit.flat_params and not unit.trainable:
            # no gradient of its own to wait for: reshard once the gradients of all its inputs are computed,
            # i.e. its backward is over (torch FSDP1's reshard-only hook); inputs without grad: no backward
            tensors = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, functools.partial(self._post_backward_frozen, unit), mode="all")
        return args, kwargs

    def _pre_root_forward(self, args: Any, kwargs: Any) -> Tuple[Any, Any]:
        if self.in_backward:
            self._abandon_backward()
        end_span(self._forward_span)  # still open if the previous forward raised
        self._forward_span = begin_span("forward")
        for unit in self.units:
            if unit.state is UnitState.FORWARD:  # the previous forward raised inside this unit
                unit.uninstall_views()
                unit.state = UnitState.IDLE
            # Units still gathered from an earlier forward (the root, the last unit) are freed: their buffers may
            # be stale if the shards were written since (summon, load_state_dict) and no backward followed.  A
            # backward of that earlier forward gathers them again.
            unit.release()
            for flat in unit.flat_params:
                flat.check_params_are_shard_views()
                flat.release_grad_if_unused()
        self.engine.begin_step()
        self._end_outside_reads()  # left over by a forward that raised
        self.in_forward = True
        self._current_order, self._order_ok = {}, True
        args, kwargs = self.engine.streams.move_inputs(args, kwargs)  # to the model's device, as torch FSDP
        mp = self.mixed_precision
        if mp is not None and mp.param_dtype is not None and mp.cast_forward_inputs:
            cast = lambda t: t.to(mp.param_dtype) if t.is_floating_point() else t
            args, kwargs = map_tensors(cast, args), map_tensors(cast, kwargs)
        return args, kwargs

    def _record_and_prefetch(self, unit: Unit) -> None:
        """Record the execution order, check it against the recorded one, prefetch the next unit."""
        if unit in self._current_order:
            return  # a unit called twice in one forward keeps its first position
        index = len(self._current_order)
        self._current_order[unit] = None
        recorded = self.recorded_order
        if recorded is None:
            return
        if self._order_ok and (index >= len(recorded) or recorded[index] is not unit):
            self._order_ok = False
            if not self._warned_order:
                self._warned_order = True
                warnings.warn(
                    "accel_flatshard: units ran in a different order than in the first step; prefetch is "
                    f"off for this step and follows the new order afterwards.\n  recorded: "
                    f"{[u.name for u in recorded]}\n  now (so far): {[u.name for u in self._current_order]}",
                    stacklevel=4,
                )
        if self.forward_prefetch and self._order_ok and index + 1 < len(recorded):
            recorded[index + 1].unshard()

    @torch.compiler.disable
    def _post_forward(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> Any:
        if unit.state is UnitState.SUMMONED or self.in_backward:
            return output
        unit.expect("post_forward", UnitState.FORWARD)
        unit.uninstall_views()
        keep = unit in self._outside_reads  # read from outside: gathered until the model's forward ends
        if torch.is_grad_enabled():
            tensors = [t for t in tensors_in(output) if t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, functools.partial(self._pre_backward, unit),
                                                              mode="any")
            unit.state = UnitState.AWAIT_BACKWARD
            recorded = self.recorded_order
            # the last unit's backward comes first: keep it, as FSDP2 does
            runs_last = self._order_ok and recorded and len(recorded) > 1 and recorded[-1] is unit
            if unit.reshard_after_forward and not runs_last and not keep:
                unit.reshard()
        else:
            unit.state = UnitState.IDLE
            if not unit.is_root and not keep:
                unit.reshard()
        if unit.is_root:
            self._post_root_forward()
        end_span(unit.forward_span)
        unit.forward_span = None
        return output

    def _post_root_forward(self) -> None:
        self.in_forward = False
        self._end_outside_reads()
        if self.recorded_order is None or not self._order_ok or len(self._current_order) != len(self.recorded_order):
            self.recorded_order = list(self._current_order)
            self._order_index = {u: i for i, u in enumerate(self.recorded_order)}
        if not torch.is_grad_enabled():
            for unit in self.units:  # no backward follows: free everything
                unit.release()
        end_span(self._forward_span)
        self._forward_span = None

    # ------------------------------------------------------------------ reads from outside a unit's forward
    @torch.compiler.disable
    def read_outside_forward(self, unit: Unit) -> bool:
        """A parameter of ``unit`` is read by code outside its forward (``_reading_class``).  While the model
        runs forward (or recomputes it in backward: every rank does the same read then) gather the unit, install
        its views and return True; otherwise False (the reader gets the shard).  Read in a forward, the unit
        stays gathered until that forward ends, and with grad until its backward is over (``_end_outside_reads``)."""
        if not (self.in_forward or (self.in_backward and inside_backward_pass())):
            return False
        unit.unshard()
        unit.wait_unshard()
        if not unit.views_installed:
            unit.install_views()
        if not self.in_backward and unit not in self._outside_reads:
            self._outside_reads.append(unit)
        return True

    def _end_outside_reads(self) -> None:
        """The forward that read units from outside ended: their attributes show shards again.  With grad enabled
        autograd saved the views (also of frozen parameters: the input gradient needs them), so a unit stays
        gathered for backward, and is gathered again when backward starts if something freed it meanwhile (a
        no-grad forward in between)."""
        for unit in self._outside_reads:
            unit.uninstall_views()
            if torch.is_grad_enabled():
                if unit not in self._needed_by_backward:
                    self._needed_by_backward.append(unit)
                if unit.state is UnitState.IDLE:
                    unit.state = UnitState.AWAIT_BACKWARD
            elif unit not in self._needed_by_backward:
                unit.state = UnitState.IDLE
                unit.reshard()
        self._outside_reads = []

    # ------------------------------------------------------------------ backward
    def _start_backward(self) -> None:
        if not self.in_backward:
            self.in_backward = True
            self._backward_span = begin_span("backward")
            _IN_BACKWARD.add(self)
            queue_end_of_backward_callback(self._end_backward)
            for unit in self._needed_by_backward:  # tensors saved from outside reads must find their data
                unit.unshard()
                unit.wait_unshard()

    def _pre_backward(self, unit: Unit, grads: Any) -> None:
        self._start_backward()
        unit.open_backward_uses += 1  # (counted for frozen units: closed by _post_backward_frozen)
        if unit.state is UnitState.BACKWARD:
            return  # a second output (or a second forward's output) of the same backward
        # (BACKWARD_DONE: a frozen unit called twice is resharded after each use's backward; IDLE: a second
        # backward through a retained graph, or after a no-grad forward in between)
        unit.expect("pre_backward", UnitState.AWAIT_BACKWARD, UnitState.BACKWARD_DONE, UnitState.IDLE)
        unit.state = UnitState.BACKWARD
        if unit.gathers_for_backward:
            unit.unshard()
            unit.wait_unshard()
            # Checkpointed layers may recompute forward inside backward without running module hooks
            # (transformers checkpoints `forward`, not `__call__`): the attributes must already resolve to
            # autograd-tracked views, so build them with grad mode on (hooks run with it off).
            with torch.enable_grad():
                unit.install_views()
        if self.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
            self._prefetch_before(unit)

    def _post_backward_hook(self, unit: Unit, index: int):
        # weak: held from the tensor's C++ side, a reference to the schedule (or unit) is a cycle gc cannot break
        schedule, unit_ref = weakref.ref(self), weakref.ref(unit)

        def hook(tensor: torch.Tensor) -> None:
            owner, target = schedule(), unit_ref()
            if owner is not None and target is not None:
                owner._post_backward(target, target.flat_params[index])

        return hook

    def _post_backward(self, unit: Unit, flat: FlatParameter) -> None:
        """``flat``'s full gradient is accumulated: reduce it; once all of the unit's are, its backward is over."""
        self._start_backward()  # a unit whose outputs carried no hook still ends the step
        # (AWAIT_BACKWARD, IDLE: read from outside its forward, no backward hook of its own)
        unit.expect("post_backward", UnitState.BACKWARD, UnitState.AWAIT_BACKWARD, UnitState.IDLE)
        if self.sync_grads:
            grad = flat.unsharded.grad
            flat.unsharded.grad = None
            self.engine.reduce_grad(flat, grad, unit.name)
        # no_sync: the full gradient stays in flat.unsharded.grad and keeps accumulating
        unit.grads_arrived += 1
        if unit.grads_arrived == unit.trainable:
            self._end_unit_backward(unit)  # nothing in this backward reads its parameters again

    def _post_backward_frozen(self, unit: Unit, grads: Any) -> None:
        unit.open_backward_uses -= 1
        if unit.state is UnitState.BACKWARD and unit.open_backward_uses <= 0:
            self._end_unit_backward(unit)  # (else another call of this unit still runs backward)

    def _end_unit_backward(self, unit: Unit) -> None:
        unit.uninstall_views()
        unit.reshard()
        unit.state = UnitState.BACKWARD_DONE
        if self.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            self._prefetch_before(unit)

    def _prefetch_before(self, unit: Unit) -> None:
        """Start gathering the unit that ran just before ``unit`` in forward (next in backward)."""
        if not self._order_ok or self.recorded_order is None:
            return
        index = self._order_index.get(unit)
        if index:
            previous = self.recorded_order[index - 1]
            if previous.state is UnitState.AWAIT_BACKWARD and previous.gathers_for_backward:
                previous.unshard()

    def _end_backward(self) -> None:
        """End of backward (autograd callback): complete the reductions, free every unit, reset the states."""
        self.engine.finish_reduces()
        self._reset_after_backward()

    def _reset_after_backward(self) -> None:
        for unit in self.units:
            unit.finish()
        self._needed_by_backward = []
        self.in_backward = False
        _IN_BACKWARD.discard(self)
        end_span(self._backward_span)
        self._backward_span = None

    def _abandon_backward(self) -> None:
        """A backward that raised never ran the end-of-backward callback: finish the collectives it started
        (every rank started the same ones) and start clean; its partial gradients are dropped."""
        warnings.warn("accel_flatshard: the previous backward did not complete; its gradients are discarded")
        self.engine.drain_discarding_reductions()
        self._reset_after_backward()

    # ------------------------------------------------------------------ outside the step
    def ensure_idle(self, what: str) -> None:
        """Raise during forward/backward; else free kept units (they go stale once the shards are written) and
        finish every collective in flight."""
        busy = [u.name for u in self.units if u.state not in (UnitState.IDLE, UnitState.AWAIT_BACKWARD)]
        if busy or self.in_backward:
            raise RuntimeError(f"{what} cannot run during forward/backward (units busy: {busy})")
        for unit in self.units:
            unit.unkeep()
        self.engine.drain()


def refuse_step_during_backward(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Optimizer step pre-hook (an entry of ``patches.py``): no step on gradients of an unfinished backward."""
    if not _IN_BACKWARD:
        return
    busy = {id(schedule.engine.group) for schedule in _IN_BACKWARD}
    if any(id(getattr(p, "_flatshard_group", None)) in busy for g in optimizer.param_groups for p in g["params"]):
        if inside_backward_pass():
            raise RuntimeError(
                "optimizer.step() was called while a backward of an accel_flatshard model is still running: its "
                "gradients are reduced only when that backward finishes. Call step() after loss.backward() returns."
            )
        raise RuntimeError(
            "optimizer.step() after a backward that did not complete (it raised): the gradients are partial and "
            "unreduced. Run forward and backward again before stepping."
        )


# ---------------------------------------------------------------------- reads from outside a unit's forward
# Some models read a child unit's parameter from the parent's forward (TRL's fused LM head computes
# ``hidden @ lm_head.weight.T`` without calling an untied ``lm_head`` unit).  Every module that registers a
# parameter of a non-root unit gets a subclass of its own class (same name: class-name lookups and
# ``isinstance`` keep working, as with torch ``fully_shard``'s ``FSDP<cls>``) whose ``__getattr__`` intercepts
# those names.  Python calls it only when normal lookup misses (inside the unit's forward the view in
# ``__dict__`` is found: the hot path is untouched).  A miss while the model runs calls
# :meth:`Schedule.read_outside_forward`; at any other time the shard is returned (a gather is collective).
_READS_ATTR = "_flatshard_outside_reads"  # module.__dict__ key: {attribute name: (schedule, unit owning it)}
_CLASS_MARK = "_flatshard_reading_class"
_READING_CLASSES: Dict[type, type] = {}
_NO_READS: Dict[str, Tuple[Schedule, Unit]] = {}


def _enable_outside_reads(schedule: Schedule, unit: Unit) -> None:
    for flat in unit.flat_params:
        for users in flat.users:
            for module, name in users:
                reads = module.__dict__.get(_READS_ATTR)
                if reads is None:
                    module.__class__ = _reading_class(type(module))
                    reads = module.__dict__[_READS_ATTR] = {}
                reads[name] = (schedule, unit)


def _reading_class(cls: type) -> type:
    if cls.__dict__.get(_CLASS_MARK):
        return cls
    sub = _READING_CLASSES.get(cls)
    if sub is not None:
        return sub
    base_getattr = cls.__getattr__

    def __getattr__(self: nn.Module, name: str) -> Any:
        entry = self.__dict__.get(_READS_ATTR, _NO_READS).get(name)
        # (in_forward / in_backward first: plain attributes dynamo traces, so a compiled forward on gathered
        # parameters, e.g. gather-once generation, breaks no graph here; read_outside_forward is dynamo-disabled)
        if entry is not None and (entry[0].in_forward or entry[0].in_backward) and entry[0].read_outside_forward(entry[1]):
            view = self.__dict__.get(name)
            if view is not None:
                return view
        return base_getattr(self, name)

    sub = type(cls.__name__, (cls,), {"__getattr__": __getattr__, "__module__": cls.__module__,
                                      "__qualname__": cls.__qualname__, _CLASS_MARK: True})  # never subclassed twice
    _READING_CLASSES[cls] = sub
    return sub
