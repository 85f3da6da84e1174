"""The step of one wrapped model, and the only writer of its units' state (:class:`Schedule`).

Read top to bottom: the units' hooks (forward, backward), prefetch (the next unit in the recorded forward order;
the previous one in backward), what stays gathered (the root, the last unit, a unit read outside its forward)
and the end of backward (an autograd callback).  Outside the step it gathers the whole model (:meth:`summon`) or
keeps chosen units gathered (:meth:`keep`, generation.py decides which).  Also: :func:`refuse_step_during_backward`.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

from ._compat import inside_backward_pass, map_tensors, queue_end_of_backward_callback, tensors_in
from .engine import Engine
from .flat_param import FlatParameter, gather_full
from . import registry
from .options import BackwardPrefetch, FlatShardOptions
from .outside_reads import enable_outside_reads
from .spans import begin_span, end_span
from .unit import ShardedState, Unit, UnitState



class Schedule:
    """The step of one wrapped model: the hooks of its units and what spans units (order, prefetch, backward).  Its
    ``options``: ``backward_prefetch``, ``forward_prefetch``, ``mixed_precision`` (the root's input cast)."""

    def __init__(self, engine: Engine, options: FlatShardOptions) -> None:
        self.engine = engine
        # the settings it reads, taken now (the model's options object is the wrapper's alone)
        self.forward_prefetch, self.backward_prefetch = options.forward_prefetch, options.backward_prefetch
        self.mixed_precision = options.mixed_precision
        self.keep_gathered_across_micro_batches = options.keep_gathered_across_micro_batches
        self.defer_cross_machine_reduce = options.defer_cross_machine_reduce
        self.units: List[Unit] = []
        self.sync_grads = True  # False inside the wrapper's no_sync(): a micro-batch before the last of a step
        # FSDP2's switches for raw loops (the wrapper's set_reshard_after_backward / set_requires_all_reduce)
        self.reshard_after_backward = True
        self.requires_all_reduce = True
        self._kept_for_step: Dict[Unit, None] = {}  # units kept gathered between the micro-batches of a step
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

    @property
    def adapter(self) -> Any:
        """The model's device adapter (``device.py``), for work on its streams outside the step: the matrix
        optimizers' exchange, the asynchronous save's host snapshot (``checkpoint/commit.py``)."""
        return self.engine.streams

    def slots(self) -> Dict[int, Tuple[Any, int]]:
        """``id(original parameter) -> (its FlatParameter, its slot index)`` for every parameter of the model."""
        return {id(p): (flat, i) for unit in self.units for flat in unit.flat_params for i, p in enumerate(flat.params)}

    def add_unit(self, unit: Unit) -> None:
        pre_forward = functools.partial(self._pre_forward, unit)
        unit.module.register_forward_pre_hook(pre_forward, prepend=True, with_kwargs=True)
        unit.module.register_forward_hook(functools.partial(self._post_forward, unit))
        for index, flat in enumerate(unit.flat_params):
            if flat.requires_grad:
                flat.unsharded.register_post_accumulate_grad_hook(self._post_backward_hook(unit, index))
        if not unit.is_root:
            enable_outside_reads(self, unit)  # e.g. TRL's fused LM head reads lm_head.weight in the root's forward
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
            unit.gather()  # (views installed stay until the unit's backward ends)
            return args, kwargs
        unit.expect("pre_forward", UnitState.IDLE, UnitState.AWAIT_BACKWARD)
        unit.state = UnitState.FORWARD
        if not unit.is_root:  # (the root's forward is the flatshard::forward span)
            end_span(unit.forward_span)  # still open if the unit's previous forward raised
            unit.forward_span = begin_span(f"forward[{unit.name}]")
        unit.gather(new_views=True)
        self._record_and_prefetch(unit)
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
            # units gathered since an earlier forward (root, last unit) may be stale if the shards were written
            # since (summon, load_state_dict) without a backward: freed (that forward's backward regathers them)
            unit.release()
            unit.forget_forward_codes()  # (an earlier forward's, whose backward never ran: the shards may differ now)
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
                    stacklevel=4)
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
            if self._keeps_gathered_after_forward():
                self._keep_for_step(unit)  # (its backward and the step's next forwards gather nothing)
            elif (unit.reshard_after_forward and not runs_last and not keep
                  and unit.sharded_state is not ShardedState.KEPT):  # (kept: its backward needs no gather)
                unit.keep_secondary()  # (hpZ: its backward gather stays inside the machine)
                unit.reshard()
            else:
                unit.forget_forward_codes()  # gathered until its backward: no backward gather sends them
        else:
            unit.state = UnitState.IDLE
            unit.forget_forward_codes()
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
        """Code outside ``unit``'s forward reads its parameter (outside_reads.py): while the model runs forward (or
        recomputes it in backward: every rank reads then too) gather the unit, install its views, return True
        (kept to the forward's end, with grad to its backward's: ``_end_outside_reads``); else False (the shard)."""
        if not (self.in_forward or (self.in_backward and inside_backward_pass())):
            return False
        unit.gather()
        if not self.in_backward and unit not in self._outside_reads:
            self._outside_reads.append(unit)
        return True

    def _end_outside_reads(self) -> None:
        """The forward that read units from outside ended: their attributes show shards again.  With grad, autograd
        saved the views (frozen ones too: input gradients need them), so the unit stays gathered for backward
        (gathered again when backward starts if a no-grad forward in between freed it)."""
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
            self.engine.phase = "backward"
            self._backward_span = begin_span("backward")
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
            # Checkpointed layers may recompute forward inside backward without running module hooks
            # (transformers checkpoints `forward`, not `__call__`): the attributes must already resolve to
            # autograd-tracked views, so build them with grad mode on (hooks run with it off).
            with torch.enable_grad():
                unit.gather(new_views=True)
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
        # (AWAIT_BACKWARD, IDLE: read from outside its forward, no backward hook of its own; BACKWARD_DONE: a
        # unit called twice under reentrant checkpointing, one inner backward per call, each reduced and summed)
        unit.expect("post_backward", UnitState.BACKWARD, UnitState.AWAIT_BACKWARD, UnitState.IDLE,
                    UnitState.BACKWARD_DONE)
        deferred = self._defers_cross_machine_reduce()
        if self.sync_grads or deferred:
            grad = flat.unsharded.grad
            flat.unsharded.grad = None
            # (deferred: reduced inside the shard group / machine only, the partial sum kept by the engine)
            self.engine.reduce_grad(flat, grad, unit.name, deferred=deferred)
        # no_sync: the full gradient stays in flat.unsharded.grad and keeps accumulating
        unit.grads_arrived += 1
        if unit.grads_arrived % unit.trainable == 0:  # (a second call's recomputation gathers it again)
            self._end_unit_backward(unit)  # nothing in this backward reads its parameters again

    def _post_backward_frozen(self, unit: Unit, grads: Any) -> None:
        unit.open_backward_uses -= 1
        if unit.state is UnitState.BACKWARD and unit.open_backward_uses <= 0:
            self._end_unit_backward(unit)  # (else another call of this unit still runs backward)

    def _end_unit_backward(self, unit: Unit) -> None:
        unit.uninstall_views()
        if self._keeps_gathered_after_backward():
            self._keep_for_step(unit)
        elif unit in self._kept_for_step:  # the step's last backward is done with it: freed now
            del self._kept_for_step[unit]
            unit.unkeep()
        unit.reshard()
        unit.state = UnitState.BACKWARD_DONE
        if self.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            self._prefetch_before(unit)

    # ------------------------------------------------------------------ accumulation over slow links
    def _keeps_gathered_after_forward(self) -> bool:
        """keep_gathered_across_micro_batches inside no_sync(): FSDP2's reshard_after_forward=False for the step."""
        return self.keep_gathered_across_micro_batches and not self.sync_grads

    def _keeps_gathered_after_backward(self) -> bool:
        """FSDP2's set_reshard_after_backward(False), or keep_gathered_across_micro_batches inside no_sync()."""
        return not self.reshard_after_backward or self._keeps_gathered_after_forward()

    def _defers_cross_machine_reduce(self) -> bool:
        """This backward reduces only what stays inside the shard group / machine (the engine keeps the partial
        sum): defer_cross_machine_reduce inside no_sync(), or FSDP2's set_requires_all_reduce(False)."""
        wanted = (self.defer_cross_machine_reduce and not self.sync_grads) or not self.requires_all_reduce
        return wanted and self.engine.can_defer_cross_machine

    def _keep_for_step(self, unit: Unit) -> None:
        """Keep a gathered unit (ShardedState.KEPT) until the step's last backward ends, or until anything writes the
        shards (an optimizer step, load_state_dict, summon: :meth:`ensure_idle`, :func:`release_kept_after_step`)."""
        if unit.sharded_state is ShardedState.GATHERED:  # (an embedding skipped by its backward stays sharded)
            unit.keep()
            self._kept_for_step[unit] = None

    def release_kept_for_step(self) -> None:
        """Free the units kept between micro-batches (stale once the shards change): now if idle, else at the end
        of their backward."""
        kept, self._kept_for_step = list(self._kept_for_step), {}
        for unit in kept:
            unit.unkeep()

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
        """The autograd callback at the end of backward: complete the reductions, free and reset every unit."""
        self.engine.finish_reduces()
        self._reset_after_backward()

    def _reset_after_backward(self) -> None:
        self.engine.phase = "forward"
        if not self._keeps_gathered_after_backward():
            self.release_kept_for_step()  # (units whose backward did not run: kept since their forward)
        for unit in self.units:
            unit.finish()
            unit.state = UnitState.IDLE
        self._needed_by_backward = []
        self.in_backward = False
        end_span(self._backward_span)
        self._backward_span = None

    def _abandon_backward(self) -> None:
        """A backward that raised never ran the end-of-backward callback: finish the collectives it started
        (every rank started the same ones) and start clean; its partial gradients are dropped."""
        warnings.warn("accel_flatshard: the previous backward did not complete; its gradients are discarded")
        self.engine.drain_discarding_reductions()
        self._reset_after_backward()

    # ------------------------------------------------------------------ outside the step
    @property
    def device(self) -> torch.device:
        return self.engine.device

    def ensure_idle(self, what: str) -> None:
        """Raise during forward/backward; else free kept units (stale once shards are written), drain collectives."""
        busy = [u.name for u in self.units if u.state not in (UnitState.IDLE, UnitState.AWAIT_BACKWARD)]
        if busy or self.in_backward:
            raise RuntimeError(f"{what} cannot run during forward/backward (units busy: {busy})")
        self.release()
        for unit in self.units:
            unit.secondary = None  # (hpZ's slices of the shards as they were: a write makes them stale)
            unit.forget_forward_codes()  # (qwZ's codes of the shards as they were: likewise)
        self.engine.drain()

    def keep(self, units: List[Unit]) -> None:
        """Gather ``units`` now (issued together, so they overlap) and keep them gathered until :meth:`release`."""
        self.engine.begin_step()  # (CUDA: the gathers see the latest optimizer update)
        for unit in units:
            unit.unshard()
        for unit in units:
            unit.keep()

    def release(self) -> None:
        """Kept units are freed now if idle, else by the next forward or the end of backward."""
        self._kept_for_step = {}
        for unit in self.units:
            unit.unkeep()

    @property
    def is_summoned(self) -> bool:
        return any(unit.state is UnitState.SUMMONED for unit in self.units)

    @contextlib.contextmanager
    def summon(self, writeback: bool, dtype: str = "master") -> Iterator[None]:
        """Full parameters until exit; units are SUMMONED (hooks stand aside), gradients stashed (a 1-D ``.grad``
        cannot sit next to a full ``.data``).  ``dtype``: ``"master"``, buffers gathered now after :meth:`ensure_idle`
        (``writeback`` keeps changes); ``"compute"``, the kept units' buffers.  ``model.to(dtype)`` inside (TRL's
        GRPO, ``bf16=True``) is undone on exit, never written back: the masters keep every bit."""
        if dtype not in ("master", "compute"):
            raise ValueError(f"summon: dtype must be 'master' or 'compute', got {dtype!r}")
        if dtype == "master":
            self.ensure_idle("summon_full_params")
        for unit in self.units:
            unit.expect("summon", UnitState.IDLE, UnitState.AWAIT_BACKWARD)
        states = [unit.state for unit in self.units]
        root = next(unit.module for unit in self.units if unit.is_root)
        buffers = [(m, n, b) for m in root.modules() for n, b in m._buffers.items() if b is not None]
        gathered: List[Tuple[FlatParameter, torch.Tensor, list, List[torch.Tensor]]] = []
        try:
            for flat in (flat for unit in self.units for flat in unit.flat_params):
                full = gather_full(flat, self.engine.group) if dtype == "master" else flat.unsharded.detach()
                grads = [p.grad for p in flat.params]
                for p in flat.params:
                    p.grad = None
                flat.point_params_at_full(full)
                gathered.append((flat, full, grads, [p.data for p in flat.params]))
            for unit in self.units:
                unit.state = UnitState.SUMMONED
            yield
        finally:
            for flat, full, grads, views in gathered:
                if writeback:
                    for p, view in zip(flat.params, views):
                        # `p.data = new` inside keeps its values; a dtype cast is not a change of values
                        if p.data.data_ptr() != view.data_ptr() and p.dtype == view.dtype and p.shape == view.shape:
                            view.copy_(p.data)
                    flat.set_local_shard_from_full(full)
                flat.point_params_at_shard()
                for p, g in zip(flat.params, grads):
                    p.grad = g
            for module, name, buf in buffers:
                now = module._buffers.get(name)
                if now is not None and now is not buf and now.dtype != buf.dtype:
                    module._buffers[name] = buf  # cast inside the summon (model.to(dtype)): the original comes back
            for unit, state in zip(self.units, states):
                unit.state = state


def refuse_step_during_backward(optimizer: torch.optim.Optimizer, records: List[Any]) -> None:
    """Before every optimizer step (``registry.on_step``): no step on gradients of a prepared model's unfinished
    backward."""
    for record in records:
        if record.schedule.in_backward:
            if inside_backward_pass():
                raise RuntimeError(
                    "optimizer.step() was called while a backward of an accel_flatshard model is still running: its "
                    "gradients are reduced only when that backward finishes. Call step() after loss.backward() "
                    "returns.")
            raise RuntimeError(
                "optimizer.step() after a backward that did not complete (it raised): the gradients are partial and "
                "unreduced. Run forward and backward again before stepping.")


def release_kept_after_step(optimizer: torch.optim.Optimizer, records: List[Any]) -> None:
    """After every optimizer step (``registry.on_step``): units kept gathered between micro-batches hold the old
    parameters; free them (the next forward gathers the new ones)."""
    for record in records:
        record.schedule.release_kept_for_step()


def forget_forward_codes_before_step(optimizer: torch.optim.Optimizer, records: List[Any]) -> None:
    """Before every optimizer step (``registry.on_step``): the step writes the shards, so int8 codes kept from a
    forward for its backward (``unit.forward_codes``) are stale: a backward after the step quantizes the new ones, as
    the exact path gathers them (a forward, a step, then its backward)."""
    for record in records:
        for unit in record.schedule.units:
            unit.forget_forward_codes()


registry.on_step(pre=refuse_step_during_backward, post=release_kept_after_step)
registry.on_step(pre=forget_forward_codes_before_step)
