"""Every setting, under one name from the yaml key or ``FLATSHARD_*`` variable to the code that reads it.

:class:`FlatShardOptions` is the one frozen options object of a wrapped model, held by the wrapper
(``wrapper.options``): the wrapper, the Accelerator, the generation control, the planner and the tests' simulator
read their settings from it, each under its field's name (``ShardGroup``, ``Engine`` and ``Schedule`` take the
values they need when they are built).  A field's metadata names its accelerate ``fsdp_config`` key and its
``FLATSHARD_*`` variable with the variable's type, default and parser (:func:`_setting`, :func:`setting_sources`);
a variable's value is the field's default in :meth:`FlatShardOptions.from_environment`, an explicit argument or
yaml key wins.  The variables that configure the process or the Accelerator, not a model, are the fields of
:class:`ProcessSettings`, declared the same way.  So a new option is a field here, the line that reads it, and its
test.

:data:`OPTIONS` (each variable's name, type, default, doc, parser and the field it sets) is derived from both
declarations.  :func:`get` returns one parsed value; :func:`check_environment` rejects unknown ``FLATSHARD_*``
names and bad values, so a misspelt option fails loudly: it runs in ``from_environment``, which every path that
builds a model's options (the wrapper, ``options_from_plugin``) or the Accelerator's settings passes.
:func:`markdown_table` renders the variable table (``accel-flatshard options`` prints it); :func:`env_flag` parses
boolean variables, accelerate's own too (``ACCELERATE_USE_FSDP``, ...), which are read where used.
:data:`SHARDING_STRATEGIES` is the one mapping between accelerate's ``fsdp_sharding_strategy`` names and the
options.  The enum :class:`BackwardPrefetch` and accelerate's wrap-policy fields live here so that the object has
no upward import.
"""
from __future__ import annotations

import dataclasses
import enum
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch

from .mixed_precision import MixedPrecision

_BOOLS = {**dict.fromkeys(("1", "true", "yes", "y", "on"), True),
          **dict.fromkeys(("0", "false", "no", "n", "off"), False)}
# accepted dtype names (also of accelerate's top-level mixed_precision)
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
GENERATION_MODES = ("budget", "full", "per_unit")


class BackwardPrefetch(enum.Enum):
    """When to start gathering the unit that runs next in backward."""

    BACKWARD_PRE = enum.auto()  # when the current unit's backward starts (most overlap, one more unit in memory)
    BACKWARD_POST = enum.auto()  # when the current unit's gradients are complete (less memory, less overlap)


def _parser(convert: Callable[[str], Any], expected: str, valid: Callable[[Any], bool] = lambda _: True) -> Callable:
    """A parser: ``convert`` of the stripped text where it succeeds and is ``valid``, else ValueError(expected)."""
    def parse(text: str) -> Any:
        try:
            value = convert(text.strip())
        except (ValueError, KeyError, OverflowError):
            raise ValueError(expected) from None
        if not valid(value):  # (a NaN is not valid either: it compares False)
            raise ValueError(expected)
        return value
    return parse


# a variable's kind: (its type as the table shows it, its parser)
BOOL = ("bool", _parser(lambda text: _BOOLS[text.lower()], f"expected one of {', '.join(_BOOLS)}"))
POSITIVE_INT = ("int > 0", _parser(int, "must be a positive integer", lambda n: n >= 1))
POSITIVE_FLOAT = ("float > 0", _parser(float, "must be a positive number", lambda x: x > 0))


def _setting(default: Any, doc: str, yaml: Optional[str] = None, env: Optional[str] = None,
             kind: Optional[Tuple[str, Callable[[str], Any]]] = None, default_text: Optional[str] = None) -> Any:
    """A field of :class:`FlatShardOptions` (or :class:`ProcessSettings`) with where it comes from (``yaml``: its
    ``fsdp_config`` key or what accelerate sets it from; ``env``: its variable, whose ``kind`` is the type text and
    parser of :data:`BOOL`, :data:`POSITIVE_INT`, ...; ``default_text``: the default as the table shows it, else
    ``1`` / ``0``, the number or the text).  The declaration is the variable's only one: :data:`OPTIONS` is derived
    from it."""
    if env is not None:
        if kind is None:
            raise TypeError(f"{env}: a variable needs its kind (type text and parser)")
        if default_text is None:
            default_text = (("1" if default else "0") if isinstance(default, bool)
                            else f"{default:g}" if isinstance(default, (int, float)) else str(default))
    return field(default=default, metadata={"doc": doc, "yaml": yaml, "env": env, "kind": kind,
                                            "default_text": default_text})


@dataclass(frozen=True)
class FlatShardOptions:
    """How one model is sharded and scheduled.  ``FullyShardedDataParallel(model, **fields)`` or ``(model,
    options=FlatShardOptions(...))``; under Accelerate, ``options_from_plugin`` builds it from the yaml.  Example::

        opts = FlatShardOptions(limit_all_gathers=1, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
        FullyShardedDataParallel(model, options=dataclasses.replace(opts, forward_prefetch=False))
    """

    # ---- the step (wrapper, schedule, engine)
    reshard_after_forward: bool = _setting(
        True, "free gathered parameters after each unit's forward (ZeRO-3); False keeps them until backward",
        yaml="fsdp_sharding_strategy (FULL_SHARD / SHARD_GRAD_OP; fsdp_version 2: fsdp_reshard_after_forward)")
    fsdp_group_size: Optional[int] = _setting(
        None, "ranks per shard group: hybrid sharding, gradients all-reduced across groups (None: every rank); under "
        "Accelerate with `fsdp_sharding_strategy` HYBRID_SHARD / _HYBRID_SHARD_ZERO2 only (an error with any other "
        "strategy); with an accelerate `parallelism_config`, whose `dp_shard_size` sets the groups, it may only "
        "repeat that size",
        yaml="fsdp_sharding_strategy HYBRID_SHARD (LOCAL_WORLD_SIZE), parallelism_config_dp_shard_size",
        env="FLATSHARD_FSDP_GROUP_SIZE", kind=POSITIVE_INT, default_text="processes per node (`LOCAL_WORLD_SIZE`)")
    backward_prefetch: Optional[BackwardPrefetch] = _setting(
        BackwardPrefetch.BACKWARD_PRE, "when the unit next in backward starts gathering (None: not early)",
        yaml="fsdp_backward_prefetch")
    forward_prefetch: bool = _setting(True, "gather the next unit while the current one runs forward",
                                      yaml="fsdp_forward_prefetch")
    limit_all_gathers: int = _setting(
        2, "most all-gathers in flight per model (CUDA: also freed gathered buffers the GPU still reads)",
        env="FLATSHARD_LIMIT_ALL_GATHERS", kind=POSITIVE_INT)
    offload_params: bool = _setting(False, "shards, sharded gradients and optimizer state in host memory",
                                    yaml="fsdp_offload_params")
    mixed_precision: Optional[MixedPrecision] = _setting(
        None, "dtypes of gathered parameters, of the gradient reduction and of buffers",
        yaml="mixed_precision (top level); its reduce dtype: FLATSHARD_REDUCE_DTYPE (ProcessSettings.reduce_dtype)")
    sync_module_states: bool = _setting(True, "broadcast rank 0's parameters and buffers at wrap time",
                                        yaml="fsdp_sync_module_states")
    quantized_all_gather: bool = _setting(
        False, "qwZ (ZeRO++): weights all-gathered as block-wise int8 with a float32 scale a block, dequantized into "
        "the compute dtype (lossy: docs/communication.md); the master shards and the optimizer never see quantized "
        "values.  A unit resharded after forward keeps its forward's int8 codes for its backward gather (not "
        "quantized twice): about 1/4 of its shard's bytes per unit from its forward to its backward",
        env="FLATSHARD_QUANTIZED_ALL_GATHER", kind=BOOL)
    quantized_reduce: bool = _setting(
        False, "qgZ (ZeRO++): gradients reduced through one all-to-all of block-wise int8, summed in float32 (lossy: "
        "docs/communication.md); the replica all-reduce of hybrid sharding stays exact",
        env="FLATSHARD_QUANTIZED_REDUCE", kind=BOOL)
    quant_block: int = _setting(256, "elements per int8 block (one float32 scale each) of the quantized options",
                                env="FLATSHARD_QUANT_BLOCK", kind=POSITIVE_INT)
    pack_all_gathers: bool = _setting(
        True, "one all-gather per unit and pass, whatever its flat parameters hold (frozen and trainable, several "
        "dtypes: one gathered storage); off: one per flat parameter (docs/communication.md)",
        env="FLATSHARD_PACK_ALL_GATHERS", kind=BOOL)
    # ---- the collectives (ShardGroup)
    gloo_p2p: Optional[bool] = _setting(
        None, "all-gather and reduce-scatter as batched isend/irecv straight into / out of the buffers (faster than "
        "gloo's collectives, docs/performance.md; None: on with gloo)",
        env="FLATSHARD_GLOO_P2P", kind=BOOL, default_text="1 on gloo, else 0")
    reduce_scatter_via_all_reduce: bool = _setting(
        False, "with `FLATSHARD_GLOO_P2P=0` (or nccl): reduce gradients by all-reduce + slice instead of "
        "reduce-scatter", env="FLATSHARD_REDUCE_SCATTER_VIA_ALL_REDUCE", kind=BOOL)
    timeout_s: float = _setting(1800.0, "timeout in seconds of the shard / replica / node process groups "
                                "accel_flatshard creates", env="FLATSHARD_TIMEOUT_S", kind=POSITIVE_FLOAT)
    ranks_per_node: Optional[int] = _setting(
        None, "ranks per machine (consecutive ranks): the node groups of `node_local_backward_gather` and the "
        "profiler's bytes that cross machines (None: `LOCAL_WORLD_SIZE`, set by accelerate launch and torchrun; "
        "unset, one machine)", env="FLATSHARD_RANKS_PER_NODE", kind=POSITIVE_INT,
        default_text="`LOCAL_WORLD_SIZE`")
    node_local_backward_gather: bool = _setting(
        False, "hpZ (ZeRO++): after a unit's forward each rank keeps 1/`ranks_per_node` of its parameters, so the "
        "backward all-gather runs inside the machine, and gradients are summed inside the machine before 1/N of them "
        "crosses (docs/communication.md); costs that much memory per unit until its backward",
        env="FLATSHARD_NODE_LOCAL_BACKWARD_GATHER", kind=BOOL)
    # ---- accumulation over slow links (docs/communication.md "Accumulation over slow links")
    keep_gathered_across_micro_batches: bool = _setting(
        False, "inside `no_sync()` (accelerate's non-final micro-batches) units stay gathered after forward and "
        "backward, so each unit is gathered once per optimizer step; the syncing backward frees them (costs the "
        "whole model gathered, in the compute dtype, during accumulation)",
        env="FLATSHARD_KEEP_GATHERED_ACROSS_MICRO_BATCHES", kind=BOOL)
    defer_cross_machine_reduce: bool = _setting(
        False, "inside `no_sync()` gradients are reduced every micro-batch but only inside the shard group (hybrid) or "
        "the machine (`node_local_backward_gather`), the partial sums kept; what crosses machines (the replica "
        "all-reduce, hpZ's second stage) runs once, on the syncing micro-batch (costs a gradient shard, not a full "
        "gradient; an error unless hybrid or hpZ spans machines)",
        env="FLATSHARD_DEFER_CROSS_MACHINE_REDUCE", kind=BOOL)
    # ---- generation and frozen models (generation.py)
    generation_mode: str = _setting(
        "budget", "units kept gathered during `generate()`: `budget` keeps as many as `generation_budget_mb` allows "
        "(the whole model: one gather per call), `full` all, `per_unit` none (one gather per unit per token, warned "
        "once)", env="FLATSHARD_GENERATION_MODE", kind=(
        "budget | full | per_unit", _parser(lambda text: text.lower().replace("-", "_"), "expected one of "
                                            + ", ".join(GENERATION_MODES), GENERATION_MODES.__contains__)))
    generation_budget_mb: Optional[float] = _setting(
        None, "gathered MiB one `generate()` may hold per rank; `auto` (None): half the free device memory when it "
        "starts", env="FLATSHARD_GENERATION_BUDGET_MB", kind=(
        "auto | MiB >= 0", _parser(lambda text: None if text.lower() == "auto" else float(text),
                                   "expected 'auto' or a size in MiB >= 0", lambda n: n is None or n >= 0)),
        default_text="auto")
    keep_frozen_gathered: bool = _setting(
        False, "no-grad forwards of a model (e.g. a frozen reference model) keep its units gathered until the next "
        "optimizer step", env="FLATSHARD_KEEP_FROZEN_GATHERED", kind=BOOL)
    # ---- what the Accelerator does with a model (integrations/)
    auto_wrap: str = _setting("none", "units: 'transformer' (per block), 'size', 'custom' or 'none'",
                              yaml="fsdp_auto_wrap_policy")
    layer_cls_names: Optional[Tuple[str, ...]] = _setting(
        None, "transformer: the block classes (None: the model's _no_split_modules)",
        yaml="fsdp_transformer_layer_cls_to_wrap")
    min_num_params: int = _setting(0, "size: parameters per unit", yaml="fsdp_min_num_params")
    custom_policy: Optional[Callable] = _setting(None, "custom: a torch-signature policy",
                                                 yaml="fsdp_auto_wrap_policy (a callable in the plugin)")
    activation_checkpointing: bool = _setting(False, "checkpoint every inner unit",
                                              yaml="fsdp_activation_checkpointing")
    state_dict_type: str = _setting("FULL_STATE_DICT", "what save_state writes", yaml="fsdp_state_dict_type")

    def __post_init__(self) -> None:
        if self.layer_cls_names is not None:  # (a tuple: options are hashable, the planner keys its cache by them)
            object.__setattr__(self, "layer_cls_names", tuple(self.layer_cls_names))
        if self.backward_prefetch is not None and not isinstance(self.backward_prefetch, BackwardPrefetch):
            raise TypeError(f"backward_prefetch must be None or a BackwardPrefetch, got {self.backward_prefetch!r}")
        if self.fsdp_group_size is not None and (not isinstance(self.fsdp_group_size, int) or self.fsdp_group_size < 1):
            raise ValueError(f"fsdp_group_size must be None or a positive integer, got {self.fsdp_group_size!r}")
        if not isinstance(self.quant_block, int) or self.quant_block < 1:
            raise ValueError(f"quant_block must be a positive integer, got {self.quant_block!r}")
        if not isinstance(self.limit_all_gathers, int) or self.limit_all_gathers < 1:
            raise ValueError(f"limit_all_gathers must be a positive integer, got {self.limit_all_gathers!r}")
        if self.generation_mode not in GENERATION_MODES:
            raise ValueError(f"generation_mode {self.generation_mode!r}: expected one of {', '.join(GENERATION_MODES)}")

    @classmethod
    def from_environment(cls, environ: Optional[Mapping[str, str]] = None, base: Optional["FlatShardOptions"] = None,
                         **settings: Any) -> "FlatShardOptions":
        """A model's options: ``base`` (None: the defaults, the set ``FLATSHARD_*`` variables over them) with
        ``settings`` changed; a name that is not a field raises ``TypeError`` listing the fields.  Every path builds
        a model's options here (the wrapper, with or without ``options=``, and ``options_from_plugin``), so the
        environment is checked here: an unknown ``FLATSHARD_*`` name or a bad value raises, also with ``base``."""
        unknown = sorted(set(settings) - set(FIELDS))
        if unknown:
            raise TypeError(f"unknown accel_flatshard option(s) {unknown}; the options are: {', '.join(FIELDS)}")
        environ = os.environ if environ is None else environ
        values = _variables(cls, environ)
        if base is not None:
            return dataclasses.replace(base, **settings) if settings else base
        local = str(environ.get("LOCAL_WORLD_SIZE", "")).strip()  # (the launcher's ranks per machine)
        if "ranks_per_node" not in values and local.isdigit() and int(local) >= 1:
            values["ranks_per_node"] = int(local)
        return cls(**{**values, **settings})


@dataclass(frozen=True)
class ProcessSettings:
    """The ``FLATSHARD_*`` variables that configure the process or the Accelerator, not a model (no
    :class:`FlatShardOptions` field): declared here as fields, read with :func:`get` or
    ``ProcessSettings.from_environment()``."""

    reduce_dtype: Optional[torch.dtype] = _setting(
        None, "Accelerator: dtype of the gradient reduction under mixed precision (`mixed_precision.reduce_dtype`; "
        "no effect without it)", env="FLATSHARD_REDUCE_DTYPE", default_text="the mixed-precision dtype",
        kind=("fp32 | bf16 | fp16", _parser(lambda text: DTYPES[text.lower()], "expected one of fp32, bf16, fp16")))
    state_dict_timeout_s: float = _setting(
        5.0, "seconds rank 0 waits for the other ranks when the unwrapped model's `state_dict()` (collective) "
        "gathers, before failing", env="FLATSHARD_STATE_DICT_TIMEOUT_S", kind=POSITIVE_FLOAT)
    profile: Optional[str] = _setting(  # None: off, "": the table only, else a directory
        None, "profile every wrapped model with torch.profiler: a directory gets one Chrome trace and phase table "
        "per rank; `1`: print the phase table only", env="FLATSHARD_PROFILE", default_text="off", kind=(
            "directory | bool", lambda text: {True: "", False: None}.get(_BOOLS.get(text.strip().lower()),
                                                                         text.strip())))
    profile_every: int = _setting(10, "with `FLATSHARD_PROFILE`: write / print every N optimizer steps (the last "
                                  "N - 1 steps recorded)", env="FLATSHARD_PROFILE_EVERY", kind=POSITIVE_INT)
    async_save: bool = _setting(
        False, "`save_state` (Accelerator, Trainer) returns once the model and optimizer state is copied to host "
        "memory and writes the files in the background (docs/checkpoints.md); `save_state(..., async_save=...)` "
        "overrides it", env="FLATSHARD_ASYNC_SAVE", kind=BOOL)

    @classmethod
    def from_environment(cls, environ: Optional[Mapping[str, str]] = None) -> "ProcessSettings":
        """The settings, from the ``FLATSHARD_*`` variables (the whole environment is checked, as for a model's)."""
        return cls(**_variables(cls, os.environ if environ is None else environ))


def _variables(cls: type, environ: Mapping[str, str]) -> Dict[str, Any]:
    """``{field: value}`` of the variables of ``cls``' fields that are set, after checking the whole environment
    (the one place that checks it: both ``from_environment`` pass here)."""
    check_environment(environ)
    return {f.name: get(f.metadata["env"], environ) for f in dataclasses.fields(cls)
            if f.metadata["env"] and str(environ.get(f.metadata["env"], "")).strip()}


FIELDS = tuple(f.name for f in dataclasses.fields(FlatShardOptions))


def setting_sources() -> Dict[str, Dict[str, Optional[str]]]:
    """``{field: {"yaml": ..., "env": ...}}`` for every field of :class:`FlatShardOptions` (docs, tests)."""
    return {f.name: {key: f.metadata[key] for key in ("yaml", "env")} for f in dataclasses.fields(FlatShardOptions)}


# accelerate's fsdp_sharding_strategy names -> (reshard_after_forward, over which ranks a parameter is sharded:
# "world" every rank, "groups" fsdp_group_size ranks with replicas across the groups, "none" each rank holds it all)
SHARDING_STRATEGIES: Dict[str, Tuple[bool, str]] = {
    "FULL_SHARD": (True, "world"), "SHARD_GRAD_OP": (False, "world"), "HYBRID_SHARD": (True, "groups"),
    "_HYBRID_SHARD_ZERO2": (False, "groups"), "NO_SHARD": (False, "none")}


def sharding_strategy(reshard_after_forward: bool, fsdp_group_size: Optional[int], world_size: int) -> str:
    """The ``fsdp_sharding_strategy`` name of these options at ``world_size`` ranks (the inverse of
    :data:`SHARDING_STRATEGIES`): a group smaller than the world is hybrid, a group of one rank (W > 1) NO_SHARD."""
    group = fsdp_group_size or world_size
    scope = "none" if group == 1 and world_size > 1 else "groups" if group < world_size else "world"
    return next(name for name, (reshard, where) in SHARDING_STRATEGIES.items()
                if where == scope and (scope == "none" or reshard == bool(reshard_after_forward)))


def env_flag(name: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the environment variable ``name`` is set to a true value; anything else (unset, empty, not a
    boolean) is False, as accelerate's ``str_to_bool`` treats its own variables."""
    return _BOOLS.get(str((os.environ if environ is None else environ).get(name, "")).strip().lower(), False)


@dataclass(frozen=True)
class Option:
    """One ``FLATSHARD_*`` variable, derived from its field's declaration (:func:`_setting`)."""

    name: str
    type: str  # as shown in the table
    default: Any  # the value when unset or empty (its field's default)
    default_text: str  # the default as the table shows it
    parse: Callable[[str], Any]
    doc: str
    setting: Optional[str] = None  # the FlatShardOptions field it sets (None: a ProcessSettings field)


OPTIONS: Dict[str, Option] = {
    f.metadata["env"]: Option(f.metadata["env"], f.metadata["kind"][0], f.default, f.metadata["default_text"],
                              f.metadata["kind"][1], f.metadata["doc"], f.name if cls is FlatShardOptions else None)
    for cls in (FlatShardOptions, ProcessSettings) for f in dataclasses.fields(cls) if f.metadata["env"]}


def get(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The parsed value of option ``name`` (its default when unset or empty); ``ValueError`` if invalid."""
    option = OPTIONS[name]
    text = (os.environ if environ is None else environ).get(name)
    if text is None or text.strip() == "":
        return option.default
    try:
        return option.parse(text)
    except ValueError as exc:
        raise ValueError(f"accel_flatshard: environment variable {name}={text!r} is invalid ({exc}); allowed: "
                         f"{option.type} (default {option.default_text}: {option.doc})") from None


def check_environment(environ: Optional[Mapping[str, str]] = None) -> None:
    """Raise ``ValueError`` for an unknown ``FLATSHARD_*`` variable or an invalid value of a known one."""
    environ = os.environ if environ is None else environ
    unknown = sorted(k for k in environ if k.startswith("FLATSHARD_") and k not in OPTIONS)
    if unknown:
        known = "\n".join(f"  {o.name} ({o.type}): {o.doc}" for o in OPTIONS.values())
        raise ValueError(f"accel_flatshard: unknown environment variable(s) {unknown} (misspelt?); the known ones "
                         f"are:\n{known}")
    for name in OPTIONS:
        get(name, environ)


def markdown_table() -> str:
    """The variable table (name | type | default | what it does), rendered from :data:`OPTIONS` (``accel-flatshard
    options`` prints it; docs/accelerate.md says so)."""
    rows = [f"| `{o.name}` | {o.type.replace('|', chr(92) + '|')} | {o.default_text} | {o.doc} |"
            for o in OPTIONS.values()]
    return "\n".join(["| variable | type | default | what it does |", "|---|---|---|---|", *rows])
