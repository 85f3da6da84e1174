"""One unit (a module: a transformer block, or the root; the flat parameters it owns) and its state.

Its state has two coordinates, each an enum that every hook checks (as torch FSDP2's ``TrainingState`` and
``ShardedState``; docs/ARCHITECTURE.md section 4 draws both): :class:`UnitState`, where it is in the step (only the
schedule, ``schedule.py``, moves it), and :class:`ShardedState`, where its parameters are (KEPT: gathered across
forwards, reshards leave it), moved by the methods below, which call the engine (schedule -> unit -> engine).  An
unexpected state raises :class:`UnitStateError` naming the unit, the states and the hook.
"""
from __future__ import annotations

import enum
from typing import Any, List

import torch
import torch.nn as nn

from .flat_param import FlatParameter
from .wrap import backward_reads_parameters


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

    def __init__(self, module: nn.Module, name: str, flat_params: List[FlatParameter], engine: Any,
                 is_root: bool, reshard_after_forward: bool) -> None:
        self.module = module
        self.name = name or "<root>"
        self.flat_params = flat_params
        self.engine = engine  # the model's engine.Engine (not imported: the schedule builds on both)
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
        self.secondary: Any = None  # hpZ: this rank's slices kept after forward for a gather inside the machine
        # qwZ: this rank's shards as int8 codes and scales, quantized for the forward's gather and sent again by the
        # backward's (the masters are the same in between): held from a grad-mode forward gather of a unit resharded
        # after forward to its backward gather, dropped wherever the shards may change (forget_forward_codes)
        self.forward_codes: Any = None

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
            codes, self.forward_codes = self.forward_codes, None  # (sent once: a second gather quantizes again)
            sent = self.engine.unshard(self.flat_params, self.name, self.secondary, codes)
            self.sharded_state = ShardedState.GATHERING
            if (sent is not None and self.engine.phase == "forward" and torch.is_grad_enabled()
                    and self.reshard_after_forward and self.gathers_for_backward and self.engine.reuses_forward_codes):
                self.forward_codes = sent  # (a backward gather follows: _post_forward drops them if it does not)

    def forget_forward_codes(self) -> None:
        """Drop the kept int8 codes: the shards may change (an optimizer step, a state-dict load, a summon's
        writeback), or no backward gather of this forward will send them."""
        self.forward_codes = None

    def wait_unshard(self) -> None:
        if self.sharded_state is ShardedState.GATHERING:
            self.engine.wait_unshard(self.flat_params)
            self.sharded_state = ShardedState.GATHERED
        elif self.sharded_state is ShardedState.SHARDED:
            raise self.error("wait_unshard", "no all-gather was issued")

    def reshard(self) -> None:
        """Free the gathered buffers (a kept unit stays)."""
        if self.sharded_state is ShardedState.GATHERED:
            self.engine.reshard(self.flat_params)
            self.sharded_state = ShardedState.SHARDED
        elif self.sharded_state is ShardedState.GATHERING:
            raise self.error("reshard", "its all-gather is in flight (wait_unshard first, or release)")

    def release(self) -> None:
        """Free whatever is gathered or gathering (a prefetch that no forward used is waited for first)."""
        if self.sharded_state is ShardedState.GATHERING:
            self.wait_unshard()
        self.reshard()

    def keep_secondary(self) -> None:
        """hpZ: before a reshard after forward, keep this rank's slices for the backward gather (once per backward)."""
        if self.secondary is None and self.gathers_for_backward and self.engine.node_local:
            self.secondary = self.engine.keep_secondary(self.flat_params)

    def keep(self) -> None:
        self.unshard()
        self.wait_unshard()
        self.sharded_state = ShardedState.KEPT
        self.forget_forward_codes()  # (gathered until released: no backward gather of it is coming)

    def unkeep(self) -> None:
        """A kept unit is freed now if idle, else by the next forward or the end of backward."""
        if self.sharded_state is ShardedState.KEPT:
            self.sharded_state = ShardedState.GATHERED
            if self.state is UnitState.IDLE:
                self.reshard()

    # ------------------------------------------------------------------ views
    def gather(self, new_views: bool = False) -> None:
        """Gathered, its attributes views of the gathered buffers: views already installed stay unless
        ``new_views`` (built in the current grad mode)."""
        self.unshard()
        self.wait_unshard()
        if new_views or not self.views_installed:
            for flat in self.flat_params:
                flat.install_views(flat.unsharded_views())
            self.views_installed = True

    def uninstall_views(self) -> None:
        if self.views_installed:
            for flat in self.flat_params:
                flat.uninstall_views()
            self.views_installed = False

    def finish(self) -> None:
        """End of backward: sharded (unless kept), no views, no counts (the schedule sets the state)."""
        self.uninstall_views()
        self.release()
        self.grads_arrived = 0
        self.open_backward_uses = 0
        self.secondary = None
        self.forget_forward_codes()
