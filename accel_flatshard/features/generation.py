"""Generation and online RL under sharding: how often units are gathered while a model generates.

Gathering every unit at every decoding step (the training schedule) costs W-1 shards of the whole model per
token.  The alternatives:

* A *generation session* around the unwrapped model's ``generate()`` (:func:`generate_in_session`, set at wrap
  time): the planned units are gathered once and kept (``Schedule.keep``, compute dtype) to the end of the call,
  the others gathered per step; when all are kept the session summons them (no hook work per step).
  ``generation_mode`` (``FLATSHARD_GENERATION_MODE``): ``budget`` (default) keeps units while the gathered bytes
  held at any moment stay within ``generation_budget_mb`` (``auto``: half the memory free when generate() starts;
  warned once when not all fit); ``full`` keeps every unit (DeepSpeed's ``ds3_gather_for_generation``);
  ``per_unit`` is the training schedule.
* TRL's seam (:func:`trl_summon_full_params`, ``patches.py``): ``summon_full_params(model_wrapped, recurse=False)``
  is a summon without writeback when the whole model (master dtype) fits the budget, else the session.
* Frozen models (``keep_frozen_gathered``, off by default): no-grad forwards (a DPO/KTO/GRPO
  reference's log-probs) keep the planned units gathered for the next ones, until any optimizer step (TRL's
  ``sync_ref_model`` writes after it), a forward of that model with grad, or ``ensure_idle`` (checkpoint loads,
  summon: no stale buffer survives a write to the shards).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
import warnings
import weakref
from typing import Any, Callable, Iterator, List, Tuple

import torch
import torch.nn as nn

from ..core import device, registry
from ..core.options import FlatShardOptions
from ..core.schedule import Schedule
from ..core.unit import ShardedState, Unit

_GENERATION_FIELDS = ("generation_mode", "generation_budget_mb", "keep_frozen_gathered")


# ---------------------------------------------------------------------- planning
def unit_bytes(unit: Unit, master: bool = False) -> int:
    """Bytes of ``unit`` gathered: compute dtype (per-unit / session) or master dtype (summon)."""
    return sum(f.layout.padded_numel * (f.dtype if master else f.compute_dtype).itemsize for f in unit.flat_params)


def peak_held_bytes(units: List[Unit], kept: List[Unit], forward_prefetch: bool, master: bool = False) -> int:
    """Gathered bytes held at the worst moment of a decoding step when ``kept`` stay gathered: the kept
    units, the root (gathered for the whole forward) and the largest other unit (two with prefetch)."""
    kept_ids = {id(u) for u in kept}
    held = sum(unit_bytes(u, master) for u in units if u.is_root or id(u) in kept_ids)
    others = sorted((unit_bytes(u, master) for u in units if not u.is_root and id(u) not in kept_ids), reverse=True)
    return held + sum(others[: 2 if forward_prefetch else 1])


def plan_kept_units(units: List[Unit], budget: int, forward_prefetch: bool, master: bool = False) -> List[Unit]:
    """Units to keep gathered so that :func:`peak_held_bytes` stays within ``budget``: the root first
    (gathered for the whole forward anyway), then the others in model order."""
    kept: List[Unit] = []
    for unit in sorted(units, key=lambda u: not u.is_root):
        if peak_held_bytes(units, kept + [unit], forward_prefetch, master) <= budget:
            kept.append(unit)
    return kept


class GenerationControl:
    """Per wrapped model (its registry record's ``generation``): the warnings said once, the units kept gathered
    now.  Its options are the generation fields of the wrapper's ``FlatShardOptions``, read there."""

    def __init__(self, wrapper: nn.Module) -> None:
        self._wrapper = weakref.ref(wrapper)
        self.schedule: Schedule = wrapper.schedule  # (it holds no reference to the wrapper)
        self.active = False
        self._said: set = set()
        self._frozen_hook: Any = None  # the root pre-forward hook of keep_frozen_gathered, while it is on
        self.last_plan: Tuple[int, int, int] = (0, 0, 0)  # kept units, kept bytes, budget (for tests/bench)

    @property
    def wrapper(self) -> nn.Module:
        wrapper = self._wrapper()
        assert wrapper is not None
        return wrapper

    @property
    def options(self) -> FlatShardOptions:
        return self.wrapper.options

    def budget(self) -> int:
        """Collective: the smallest of the ranks' budgets (different plans would issue different gathers: a hang)."""
        mib = self.options.generation_budget_mb
        mine = device.free_bytes(self.schedule.device) // 2 if mib is None else int(mib * 2**20)
        agreed = torch.tensor(mine, dtype=torch.int64, device=self.schedule.device)
        return int(self.wrapper.shard_group.all_reduce(agreed, torch.distributed.ReduceOp.MIN, over_world=True).item())

    def plan(self, master: bool = False) -> List[Unit]:
        """The units a generation keeps gathered now, saying once when it is not all of them."""
        units = self.schedule.units
        prefetch = bool(self.options.forward_prefetch)
        total = sum(unit_bytes(u, master) for u in units)
        mode = self.options.generation_mode
        if mode == "full":
            return list(units)
        budget = self.budget()
        if mode == "per_unit":
            if total <= budget:
                self._say_once("per_unit", f"accel_flatshard: generation gathers every unit at every decoding step "
                               f"(FLATSHARD_GENERATION_MODE=per_unit) although the whole model ({_mib(total)}) fits "
                               f"in {_mib(budget)}; FLATSHARD_GENERATION_MODE=budget (default) gathers it once per "
                               "generate()")
            return []
        kept = plan_kept_units(units, budget, prefetch, master)
        self.last_plan = (len(kept), sum(unit_bytes(u, master) for u in kept), budget)
        if len(kept) < len(units):
            self._say_once("budget", f"accel_flatshard: generation keeps {len(kept)} of {len(units)} units gathered "
                           f"({_mib(self.last_plan[1])} of {_mib(total)}, budget {_mib(budget)} from "
                           "FLATSHARD_GENERATION_BUDGET_MB); the others are gathered at every decoding step (holding "
                           f"up to {_mib(peak_held_bytes(units, kept, prefetch, master))}). A budget of {_mib(total)} "
                           "gathers once per generate()")
        return kept

    def _say_once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            warnings.warn(message, stacklevel=4)

    @property
    def kept(self) -> List[Unit]:
        return [u for u in self.schedule.units if u.sharded_state is ShardedState.KEPT]

    @contextlib.contextmanager
    def session(self) -> Iterator[bool]:
        """Keep the planned units gathered for one generation; yields whether every unit is kept."""
        schedule = self.schedule
        if self.active or schedule.is_summoned:
            yield True  # nested (generate inside TRL's seam or a summon): the outer one decides
            return
        schedule.release()  # (frozen-model units kept from earlier forwards: the plan below decides afresh)
        self.active = True
        try:
            schedule.keep(self.plan())
            if len(self.kept) == len(schedule.units):
                with schedule.summon(writeback=False, dtype="compute"):
                    yield True
            else:
                yield False
        finally:
            self.active = False
            schedule.release()

    def sync_frozen_hook(self) -> None:
        """The root pre-forward hook of ``keep_frozen_gathered`` is registered while the option is on."""
        if self.options.keep_frozen_gathered and self._frozen_hook is None:
            registry.on_step(post=release_frozen_units)  # (from the first frozen model on; idempotent)
            self._frozen_hook = self.wrapper.module.register_forward_pre_hook(_keep_units_of_no_grad_forwards)
        elif not self.options.keep_frozen_gathered and self._frozen_hook is not None:
            self._frozen_hook.remove()
            self._frozen_hook = None


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


# Process-wide on purpose: release_frozen_units runs after every optimizer step, and a step of one model's
# optimizer
# must release every frozen model's kept units (TRL's sync_ref_model writes the reference's shards after the policy's
# step).  Weak: a dropped model leaves nothing; each control is otherwise its own model's object.
_CONTROLS: "weakref.WeakSet[GenerationControl]" = weakref.WeakSet()


def control_of(model: nn.Module) -> GenerationControl:
    """The generation control of a wrapped model (or of the unwrapped module inside it), made at its first use."""
    record = registry.record_of(model)
    if record is None:
        raise ValueError(f"{type(model).__name__} is not wrapped by accel_flatshard")
    if record.generation is None:
        record.generation = control = GenerationControl(record.wrapper)
        control.sync_frozen_hook()
        _CONTROLS.add(control)
    return record.generation


def set_generation_options(model: nn.Module, **changes: Any) -> FlatShardOptions:
    """Change a wrapped model's generation options (``generation_mode``, ``generation_budget_mb``,
    ``keep_frozen_gathered``); returns its options."""
    control = control_of(model)
    unknown = set(changes) - set(_GENERATION_FIELDS)
    if unknown:
        raise TypeError(f"unknown generation options {sorted(unknown)}; known: {list(_GENERATION_FIELDS)}")
    # the wrapper's options are the one copy (the schedule reads no generation field)
    control.wrapper.options = dataclasses.replace(control.options, **changes)  # (invalid values raise there)
    control._said.clear()
    control.sync_frozen_hook()
    return control.options


# ---------------------------------------------------------------------- generate() of the unwrapped module
def generate_in_session(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``generate`` of the unwrapped module (``accelerator.unwrap_model(model).generate``), set on the instance at
    wrap time: the class's ``generate`` inside a session, for any decoding strategy."""
    control = control_of(self)
    with control.session() as everything_kept:
        if not everything_kept and control.wrapper.shard_group.world_size > 1 and kwargs.get("synced_gpus") is None:
            # units gathered per step: every rank must run every step, also after its own sequences ended
            # (transformers enables this only for torch FSDP / ZeRO-3 modules)
            kwargs["synced_gpus"] = True
        return type(self).generate(self, *args, **kwargs)


def _keep_units_of_no_grad_forwards(module: nn.Module, args: Any) -> None:
    """Root pre-forward hook (after the root unit's) of ``keep_frozen_gathered``: a no-grad forward keeps the
    planned units gathered for the following ones; a forward with grad releases them first."""
    control: GenerationControl = registry.record_of(module).generation
    if control.active:
        return
    if torch.is_grad_enabled():
        control.schedule.release()
    elif not control.kept and not control.schedule.is_summoned:
        control.schedule.keep(control.plan())


def release_frozen_units(optimizer: torch.optim.Optimizer, records: List[Any]) -> None:
    """After every optimizer step (``registry.on_step``): it may change shards, so frozen models' units are
    freed."""
    for control in list(_CONTROLS):
        if not control.active:
            control.schedule.release()


# ---------------------------------------------------------------------- TRL's seam (patch table entry)
def trl_summon_full_params(original: Callable) -> Callable:
    """Replacement of ``trl.distributed.DistributedBackend.summon_full_params`` (``patches.py``; TRL's GRPO,
    RLOO and distillation trainers wrap generation in it, and torch's version does nothing on our wrapper):
    accel_flatshard models go to :func:`trl_generation_context`, others to TRL's."""

    @functools.wraps(original)
    @contextlib.contextmanager
    def summon_full_params(self: Any, module: nn.Module, **kwargs: Any) -> Iterator[None]:
        ours = registry.record_of(module) is not None
        with trl_generation_context(module, **kwargs) if ours else original(self, module, **kwargs):
            yield

    return summon_full_params


@contextlib.contextmanager
def trl_generation_context(wrapper: nn.Module, recurse: bool = True, writeback: bool = True) -> Iterator[None]:
    """TRL's ``summon_full_params(model_wrapped, recurse=False)`` here: a summon without writeback when the whole
    model in master dtype fits the generation budget (or mode ``full``), else the generation session
    (``recurse``, torch's nesting flag, does not apply: units are not nested instances)."""
    control = control_of(wrapper)
    kept = [] if control.options.generation_mode == "per_unit" else control.plan(master=True)
    everything = len(kept) == len(control.schedule.units)  # (mode full: plan() keeps every unit)
    with control.schedule.summon(writeback=False) if everything else control.session():
        yield


def _on_wrap(record: registry.Prepared) -> None:
    """After a model is wrapped: its module's ``generate()`` runs in a session (gather-once), and with
    ``keep_frozen_gathered`` its no-grad forwards keep units gathered from the first one."""
    module = record.module
    if callable(getattr(type(module), "generate", None)):
        module.__dict__["generate"] = types.MethodType(generate_in_session, module)
    if record.wrapper.options.keep_frozen_gathered:
        control_of(record.wrapper)


registry.on_wrap(after=_on_wrap)
