"""Every setting, under one name from the yaml key or ``FLATSHARD_*`` variable to the code that reads it.

:class:`FlatShardOptions` is the one frozen options object of a wrapped model: ``ShardGroup``, ``Engine``,
``Schedule``, the wrapper, the Accelerator, the generation control, the planner and the tests' simulator read their
settings from it, each under its field's name.  A field's metadata names its accelerate ``fsdp_config`` key and its
``FLATSHARD_*`` variable (:func:`setting_sources`); a variable's value is the field's default in
:meth:`FlatShardOptions.from_environment` (what the plain wrapper uses), an explicit argument or yaml key wins.  So a
new option is a field here, the line that reads it, and its test.

:data:`OPTIONS` declares each ``FLATSHARD_*`` variable (name, type, default, doc, parser, and the field it sets, if
any; four configure the process or the Accelerator, not a model).  :func:`get` returns one parsed value;
:func:`check_environment`, called by the wrapper and the ``Accelerator``, rejects unknown ``FLATSHARD_*`` names and
bad values, so a misspelt option fails loudly.  :func:`markdown_table` renders the variable table of docs/accelerate.md;
:func:`env_flag` parses boolean variables, accelerate's own too (``ACCELERATE_USE_FSDP``, ...), which are read where
used.  The enum
:class:`BackwardPrefetch` and accelerate's wrap-policy fields live here so that the object has no upward import.
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


def _setting(default: Any, doc: str, yaml: Optional[str] = None, env: Optional[str] = None) -> Any:
    """A field of :class:`FlatShardOptions` with where it comes from (``yaml``: its ``fsdp_config`` key or what
    accelerate sets it from; ``env``: its variable)."""
    return field(default=default, metadata={"doc": doc, "yaml": yaml, "env": env})


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
        env="FLATSHARD_FSDP_GROUP_SIZE")
    backward_prefetch: Optional[BackwardPrefetch] = _setting(
        BackwardPrefetch.BACKWARD_PRE, "when the unit next in backward starts gathering (None: not early)",
        yaml="fsdp_backward_prefetch")
    forward_prefetch: bool = _setting(True, "gather the next unit while the current one runs forward",
                                      yaml="fsdp_forward_prefetch")
    limit_all_gathers: int = _setting(
        2, "most all-gathers in flight per model (CUDA: also freed gathered buffers the GPU still reads)",
        env="FLATSHARD_LIMIT_ALL_GATHERS")
    offload_params: bool = _setting(False, "shards, sharded gradients and optimizer state in host memory",
                                    yaml="fsdp_offload_params")
    mixed_precision: Optional[MixedPrecision] = _setting(
        None, "dtypes of gathered parameters, of the gradient reduction and of buffers",
        yaml="mixed_precision (top level)", env="FLATSHARD_REDUCE_DTYPE")
    sync_module_states: bool = _setting(True, "broadcast rank 0's parameters and buffers at wrap time",
                                        yaml="fsdp_sync_module_states")
    quantized_all_gather: bool = _setting(
        False, "qwZ (ZeRO++): weights all-gathered as block-wise int8 with a float32 scale a block, dequantized into "
        "the compute dtype (lossy: docs/communication.md); the master shards and the optimizer never see quantized "
        "values", env="FLATSHARD_QUANTIZED_ALL_GATHER")
    quantized_reduce: bool = _setting(
        False, "qgZ (ZeRO++): gradients reduced through one all-to-all of block-wise int8, summed in float32 (lossy: "
        "docs/communication.md); the replica all-reduce of hybrid sharding stays exact",
        env="FLATSHARD_QUANTIZED_REDUCE")
    quant_block: int = _setting(256, "elements per int8 block (one float32 scale each) of the quantized options",
                                env="FLATSHARD_QUANT_BLOCK")
    pack_all_gathers: bool = _setting(
        True, "one all-gather per unit and pass, whatever its flat parameters hold (frozen and trainable, several "
        "dtypes: one gathered storage); off: one per flat parameter (docs/communication.md)",
        env="FLATSHARD_PACK_ALL_GATHERS")
    # ---- the collectives (ShardGroup)
    gloo_p2p: Optional[bool] = _setting(
        None, "all-gather and reduce-scatter as batched isend/irecv straight into / out of the buffers (faster than "
        "gloo's collectives, docs/performance.md; None: on with gloo)",
        env="FLATSHARD_GLOO_P2P")
    reduce_scatter_via_all_reduce: bool = _setting(
        False, "with `FLATSHARD_GLOO_P2P=0` (or nccl): reduce gradients by all-reduce + slice instead of "
        "reduce-scatter", env="FLATSHARD_REDUCE_SCATTER_VIA_ALL_REDUCE")
    timeout_s: float = _setting(1800.0, "timeout in seconds of the shard / replica / node process groups "
                                "accel_flatshard creates", env="FLATSHARD_TIMEOUT_S")
    ranks_per_node: Optional[int] = _setting(
        None, "ranks per machine (consecutive ranks): the node groups of `node_local_backward_gather` and the "
        "profiler's bytes that cross machines (None: `LOCAL_WORLD_SIZE`, set by accelerate launch and torchrun; "
        "unset, one machine)", env="FLATSHARD_RANKS_PER_NODE")
    node_local_backward_gather: bool = _setting(
        False, "hpZ (ZeRO++): after a unit's forward each rank keeps 1/`ranks_per_node` of its parameters, so the "
        "backward all-gather runs inside the machine, and gradients are summed inside the machine before 1/N of them "
        "crosses (docs/communication.md); costs that much memory per unit until its backward",
        env="FLATSHARD_NODE_LOCAL_BACKWARD_GATHER")
    # ---- generation and frozen models (generation.py)
    generation_mode: str = _setting(
        "budget", "units kept gathered during `generate()`: `budget` keeps as many as `generation_budget_mb` allows "
        "(the whole model: one gather per call), `full` all, `per_unit` none (one gather per unit per token, warned "
        "once)", env="FLATSHARD_GENERATION_MODE")
    generation_budget_mb: Optional[float] = _setting(
        None, "gathered MiB one `generate()` may hold per rank; `auto` (None): half the free device memory when it "
        "starts", env="FLATSHARD_GENERATION_BUDGET_MB")
    keep_frozen_gathered: bool = _setting(
        False, "no-grad forwards of a model (e.g. a frozen reference model) keep its units gathered until the next "
        "optimizer step", env="FLATSHARD_KEEP_FROZEN_GATHERED")
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
    cpu_ram_efficient_loading: bool = _setting(False, "ranks > 0 load empty weights, rank 0's are broadcast",
                                               yaml="fsdp_cpu_ram_efficient_loading")

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
    def from_environment(cls, environ: Optional[Mapping[str, str]] = None, **settings: Any) -> "FlatShardOptions":
        """The options whose ``FLATSHARD_*`` variables are set take their values, ``settings`` override; a name that
        is not a field raises ``TypeError`` listing the fields."""
        unknown = sorted(set(settings) - set(FIELDS))
        if unknown:
            raise TypeError(f"unknown accel_flatshard option(s) {unknown}; the options are: {', '.join(FIELDS)}")
        environ = os.environ if environ is None else environ
        values = {}
        for option in OPTIONS.values():
            value = get(option.name, environ)
            if option.setting and option.setting not in settings and value is not None:
                values[option.setting] = value
        local = str(environ.get("LOCAL_WORLD_SIZE", "")).strip()  # (the launcher's ranks per machine)
        if "ranks_per_node" not in values and local.isdigit() and int(local) >= 1:
            values["ranks_per_node"] = int(local)
        return cls(**{**values, **settings})


FIELDS = tuple(f.name for f in dataclasses.fields(FlatShardOptions))


def setting_sources() -> Dict[str, Dict[str, Optional[str]]]:
    """``{field: {"yaml": ..., "env": ...}}`` for every field of :class:`FlatShardOptions` (docs, tests)."""
    return {f.name: {key: f.metadata[key] for key in ("yaml", "env")} for f in dataclasses.fields(FlatShardOptions)}


def env_flag(name: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the environment variable ``name`` is set to a true value; anything else (unset, empty, not a
    boolean) is False, as accelerate's ``str_to_bool`` treats its own variables."""
    return _BOOLS.get(str((os.environ if environ is None else environ).get(name, "")).strip().lower(), False)


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


_bool = _parser(lambda text: _BOOLS[text.lower()], f"expected one of {', '.join(_BOOLS)}")
_positive_int = _parser(int, "must be a positive integer", lambda n: n >= 1)
_positive_float = _parser(float, "must be a positive number", lambda x: x > 0)


@dataclass(frozen=True)
class Option:
    name: str
    type: str  # as shown in the README table
    default: Any  # the value when unset or empty
    default_text: str  # the default as the README shows it
    parse: Callable[[str], Any]
    setting: Optional[str] = None  # the FlatShardOptions field it sets (None: a process-wide switch)
    own_doc: str = ""  # what a variable that sets no field does (else its field's doc)

    @property
    def doc(self) -> str:
        return self.own_doc or _FIELD_DOCS[self.setting]


_FIELD_DOCS = {f.name: f.metadata["doc"] for f in dataclasses.fields(FlatShardOptions)}


OPTIONS: Dict[str, Option] = {o.name: o for o in (
    Option("FLATSHARD_FSDP_GROUP_SIZE", "int > 0", None, "processes per node (`LOCAL_WORLD_SIZE`)", _positive_int,
           "fsdp_group_size"),
    Option("FLATSHARD_LIMIT_ALL_GATHERS", "int > 0", None, "2", _positive_int, "limit_all_gathers"),
    Option("FLATSHARD_REDUCE_DTYPE", "fp32 | bf16 | fp16", None, "the mixed-precision dtype",
           _parser(lambda text: DTYPES[text.lower()], "expected one of fp32, bf16, fp16"), own_doc="Accelerator: "
           "dtype of the gradient reduction under mixed precision (`mixed_precision.reduce_dtype`; no effect "
           "without it)"),
    Option("FLATSHARD_GLOO_P2P", "bool", None, "1 on gloo, else 0", _bool, "gloo_p2p"),
    Option("FLATSHARD_REDUCE_SCATTER_VIA_ALL_REDUCE", "bool", False, "0", _bool, "reduce_scatter_via_all_reduce"),
    Option("FLATSHARD_TIMEOUT_S", "float > 0", 1800.0, "1800", _positive_float, "timeout_s"),
    Option("FLATSHARD_RANKS_PER_NODE", "int > 0", None, "`LOCAL_WORLD_SIZE`", _positive_int, "ranks_per_node"),
    Option("FLATSHARD_NODE_LOCAL_BACKWARD_GATHER", "bool", False, "0", _bool, "node_local_backward_gather"),
    Option("FLATSHARD_STATE_DICT_TIMEOUT_S", "float > 0", 5.0, "5", _positive_float, own_doc="seconds rank 0 waits "
           "for the other ranks when the unwrapped model's `state_dict()` (collective) gathers, before failing"),
    Option("FLATSHARD_PROFILE", "directory | bool", None, "off",  # None: off, "": the table only, else a directory
           lambda text: {True: "", False: None}.get(_BOOLS.get(text.strip().lower()), text.strip()),
           own_doc="profile every wrapped model with torch.profiler: a directory gets one Chrome trace and phase "
           "table per rank; `1`: print the phase table only"),
    Option("FLATSHARD_PROFILE_EVERY", "int > 0", 10, "10", _positive_int, own_doc="with `FLATSHARD_PROFILE`: "
           "write / print every N optimizer steps (the last N - 1 steps recorded)"),
    Option("FLATSHARD_GENERATION_MODE", "budget | full | per_unit", "budget", "budget",
           _parser(lambda text: text.lower().replace("-", "_"), "expected one of " + ", ".join(GENERATION_MODES),
                   GENERATION_MODES.__contains__), "generation_mode"),
    Option("FLATSHARD_GENERATION_BUDGET_MB", "auto | MiB >= 0", None, "auto",
           _parser(lambda text: None if text.lower() == "auto" else float(text),
                   "expected 'auto' or a size in MiB >= 0", lambda n: n is None or n >= 0), "generation_budget_mb"),
    Option("FLATSHARD_ASYNC_SAVE", "bool", False, "0", _bool, own_doc="`save_state` (Accelerator, Trainer) returns "
           "once the model and optimizer state is copied to host memory and writes the files in the background "
           "(docs/checkpoints.md); `save_state(..., async_save=...)` overrides it"),
    Option("FLATSHARD_KEEP_FROZEN_GATHERED", "bool", False, "0", _bool, "keep_frozen_gathered"),
    Option("FLATSHARD_PACK_ALL_GATHERS", "bool", True, "1", _bool, "pack_all_gathers"),
    Option("FLATSHARD_QUANTIZED_ALL_GATHER", "bool", False, "0", _bool, "quantized_all_gather"),
    Option("FLATSHARD_QUANTIZED_REDUCE", "bool", False, "0", _bool, "quantized_reduce"),
    Option("FLATSHARD_QUANT_BLOCK", "int > 0", 256, "256", _positive_int, "quant_block"),
)}


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
    """The option table of docs/accelerate.md (name | type | default | what it does), rendered from :data:`OPTIONS`."""
    rows = [f"| `{o.name}` | {o.type.replace('|', chr(92) + '|')} | {o.default_text} | {o.doc} |"
            for o in OPTIONS.values()]
    return "\n".join(["| variable | type | default | what it does |", "|---|---|---|---|", *rows])
