"""Translate an accelerate FSDP configuration (fsdp_version 1 or 2) into accel_flatshard options.

Accelerate parses the yaml's ``fsdp_config`` (as ``FSDP_*`` variables) into a ``FullyShardedDataParallelPlugin``
of torch FSDP objects; :func:`options_from_plugin` maps its fields (and accelerate's ``parallelism_config``) onto
a frozen :class:`FlatShardOptions`, over the ``FLATSHARD_*`` variables (what accelerate has no
key for; validated in ``accel_flatshard.core.options``: a typo fails loudly).  Also here, as the one other reader of the
environment: the plugin built on a host without an accelerator device (:func:`build_plugin_without_device`, and
the ``__post_init__`` patch behind it), the launcher's world size, and :func:`options_from_launch_args` (what
``accel-flatshard plan`` wraps with).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional
from unittest import mock

import torch
from torch.distributed.fsdp import BackwardPrefetch as TorchPrefetch, CPUOffload as TorchCPUOffload
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import (size_based_auto_wrap_policy as torch_size_policy, transformer_auto_wrap_policy
                                         as torch_transformer_policy)

from ..core import options
from ..core.fully_sharded import wants_offload
from ..core.mixed_precision import MixedPrecision
from ..core.options import BackwardPrefetch, FlatShardOptions


def fsdp_version(plugin: Any, environ: Optional[Mapping[str, str]] = None) -> int:
    """The ``fsdp_version`` the plugin (else ``FSDP_VERSION``) asks for; anything but 1 or 2 raises."""
    environ = os.environ if environ is None else environ
    given = getattr(plugin, "fsdp_version", None)
    version = int(given if given is not None else environ.get("FSDP_VERSION", "1") or 1)
    if version not in (1, 2):
        raise ValueError(f"the accelerate config asks for fsdp_version {version}; accelerate knows 1 and 2, and "
                         "accel_flatshard accepts both (set `fsdp_version: 1` or `2` in fsdp_config)")
    return version


def options_from_plugin(
    plugin: Any, mixed_precision: str = "no", environ: Optional[Mapping[str, str]] = None, parallelism: Any = None
) -> FlatShardOptions:
    """Map a ``FullyShardedDataParallelPlugin`` (fsdp_version 1 or 2) and ``FLATSHARD_*`` variables to options.

    FSDP2: ``fsdp_reshard_after_forward`` true/false is FULL_SHARD / SHARD_GRAD_OP, the other keys mean what they
    mean for FSDP1, backward prefetch is always on (FSDP2's implicit prefetch).  Options that cannot be honoured
    raise naming the key (``fsdp_ignored_modules``, ...); ``parallelism`` sets the shard groups."""
    environ = os.environ if environ is None else environ
    # the FLATSHARD_* variables (an unknown name or a bad value raises there); the plugin's keys override
    given = FlatShardOptions.from_environment(environ)
    version = fsdp_version(plugin, environ)
    opts: Dict[str, Any] = {}

    strategy = _sharding_strategy(plugin, environ)
    fsdp_group_size = given.fsdp_group_size
    opts["reshard_after_forward"], sharded_over = options.SHARDING_STRATEGIES[strategy.name]
    hybrid = sharded_over == "groups"
    opts["fsdp_group_size"] = None
    if parallelism is not None:
        opts["fsdp_group_size"] = _layout_group_size(parallelism, strategy, fsdp_group_size)
        opts["reshard_after_forward"] &= opts["fsdp_group_size"] > 1
        fsdp_group_size = None  # checked against the layout
    elif hybrid:
        # torch FSDP's HYBRID_SHARD shards inside a node and replicates across nodes: same default here
        local = environ.get("LOCAL_WORLD_SIZE") or None  # set by the launcher
        if fsdp_group_size is None and local is not None and not (local.strip().isdigit() and int(local) >= 1):
            raise ValueError(f"LOCAL_WORLD_SIZE={local!r} must be a positive integer")
        opts["fsdp_group_size"] = fsdp_group_size or (None if local is None else int(local))
    elif sharded_over == "none":  # NO_SHARD
        opts["fsdp_group_size"] = 1  # every rank holds everything; gradients are all-reduced (DDP-like)
    if fsdp_group_size is not None and not hybrid:
        raise ValueError(
            f"FLATSHARD_FSDP_GROUP_SIZE={fsdp_group_size} is set but fsdp_sharding_strategy is {strategy.name}; "
            "it only applies to HYBRID_SHARD or _HYBRID_SHARD_ZERO2 (set the strategy or unset the variable)")

    # FSDP2 has no prefetch options (accelerate sets backward_prefetch to None and refuses forward_prefetch); it
    # always prefetches the next unit in backward: the same here.  FSDP1: None is the yaml's NO_PREFETCH (or no key)
    prefetch = TorchPrefetch.BACKWARD_PRE if version == 2 else getattr(plugin, "backward_prefetch", None)
    name = prefetch.name if isinstance(prefetch, (TorchPrefetch, BackwardPrefetch)) else str(prefetch).upper()
    opts["backward_prefetch"] = None if prefetch is None or name == "NO_PREFETCH" else BackwardPrefetch[name]
    opts["forward_prefetch"] = bool(getattr(plugin, "forward_prefetch", False))

    policy = getattr(plugin, "auto_wrap_policy", None)
    base = getattr(policy, "func", policy)  # set_auto_wrap_policy may already have made it a partial
    if base is torch_transformer_policy:
        opts["auto_wrap"] = "transformer"
        bound = getattr(policy, "keywords", {}).get("transformer_layer_cls")  # a partial made by hand
        names = [c.__name__ for c in bound] if bound else getattr(plugin, "transformer_cls_names_to_wrap", None)
        if isinstance(names, str):
            names = names.split(",")
        names = [n.strip() for n in names or [] if n and n.strip()]
        opts["layer_cls_names"] = names or None
    elif base is torch_size_policy:
        opts["auto_wrap"] = "size"
        bound = getattr(policy, "keywords", {}).get("min_num_params")
        opts["min_num_params"] = int(bound if bound is not None else getattr(plugin, "min_num_params", 0) or 0)
    elif callable(policy):
        opts["auto_wrap"], opts["custom_policy"] = "custom", policy  # torch-signature policies work unchanged
    elif policy is not None:  # (None: auto_wrap stays "none")
        raise ValueError(f"unsupported fsdp auto_wrap_policy {policy!r}")

    opts["state_dict_type"] = state_dict_type_name(plugin)

    # FSDP1: CPUOffload(offload_params=...); FSDP2: OffloadPolicy() (off) or CPUOffloadPolicy (on)
    opts["offload_params"] = wants_offload(getattr(plugin, "cpu_offload", None))
    if getattr(plugin, "ignored_modules", None):
        raise ValueError("fsdp_ignored_modules is not supported by accel_flatshard; remove it from fsdp_config")
    if getattr(plugin, "activation_checkpointing_offload", False):
        raise ValueError("fsdp_activation_checkpointing_offload is not supported by accel_flatshard (FSDP2 only)")
    opts["activation_checkpointing"] = bool(getattr(plugin, "activation_checkpointing", False))
    efficient = bool(getattr(plugin, "cpu_ram_efficient_loading", False))
    sync = getattr(plugin, "sync_module_states", None)
    # Ranks > 0 hold no real weights under cpu_ram_efficient_loading: rank 0 must broadcast them (what it means here:
    # transformers reads FSDP_CPU_RAM_EFFICIENT_LOADING when it loads the model).
    opts["sync_module_states"] = True if sync is None or efficient else bool(sync)
    opts["mixed_precision"] = _mixed_precision(plugin, mixed_precision, environ)
    return dataclasses.replace(given, **opts)


def requested_parallelism_config(params: Mapping[str, Any]) -> Any:
    """The ``ParallelismConfig`` accelerate would build from these ``Accelerator`` arguments (the argument,
    the deprecated ``torch_tp_plugin``, or the launcher's ``PARALLELISM_CONFIG_*`` variables from a yaml block
    or the flags); tensor / context / sequence parallelism raise here, before accelerate builds a mesh."""
    from accelerate import ParallelismConfig

    config = params.get("parallelism_config")
    if config is None and params.get("torch_tp_plugin") is not None:
        config = ParallelismConfig(tp_size=params["torch_tp_plugin"].tp_size)
    elif config is None and options.env_flag("ACCELERATE_USE_PARALLELISM_CONFIG"):
        config = ParallelismConfig()
    for dim, kind in (("tp", "tensor"), ("cp", "context"), ("sp", "sequence")):
        size = getattr(config, f"{dim}_size", None) or 1  # sp_size: accelerate >= 1.11
        if size > 1:
            raise ValueError(
                f"{kind} parallelism (parallelism_config_{dim}_size={size}) is not supported by accel_flatshard; "
                "remove it, or use dp_replicate/dp_shard only (docs/accelerate.md: composing with tensor parallelism "
                "on DTensor meshes is a later step)")
    return config


def _layout_group_size(parallelism: Any, strategy: Any, fsdp_group_size: Optional[int]) -> int:
    """dp_replicate x dp_shard as shard groups of ``dp_shard_size`` consecutive ranks: accelerate's mesh puts
    dp_shard innermost, so its groups are HYBRID_SHARD's with ``FLATSHARD_FSDP_GROUP_SIZE=dp_shard_size``."""
    shard = parallelism.dp_shard_size
    if fsdp_group_size is not None and fsdp_group_size != shard:
        raise ValueError(f"FLATSHARD_FSDP_GROUP_SIZE={fsdp_group_size} disagrees with "
                         f"parallelism_config_dp_shard_size={shard}; "
                         "unset FLATSHARD_FSDP_GROUP_SIZE (the parallelism_config sets the shard groups)")
    if strategy == ShardingStrategy.NO_SHARD and shard > 1:
        raise ValueError(f"fsdp_sharding_strategy NO_SHARD contradicts parallelism_config_dp_shard_size={shard}; "
                         "use FULL_SHARD (or dp_shard_size 1)")
    if shard == 1:
        warnings.warn(f"accel_flatshard: parallelism_config dp_shard_size 1 x dp_replicate_size "
                      f"{parallelism.dp_replicate_size}: every rank holds the whole model and gradients are "
                      "all-reduced (DDP semantics); set parallelism_config_dp_shard_size > 1 to shard", stacklevel=4)
    return shard


class _AsDataParallel:
    """An accel_flatshard Accelerator as accelerate's check should see it: data parallel, not torch FSDP2."""

    multi_device, is_fsdp2 = True, False

    def __init__(self, accelerator: Any) -> None:
        self._accelerator = accelerator

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)


def validating_flatshard_layout(original: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    """``ParallelismConfig._validate_accelerator`` that runs accelerate's checks (the sizes multiply to the
    number of processes, ...) for accel_flatshard's Accelerator as for a multi-device state; accelerate
    would refuse it (MULTI_CPU on a CPU host, plugin presented as FSDP1).  Other calls are unchanged."""

    @functools.wraps(original)
    def _validate_accelerator(self: Any, accelerator: Any) -> None:
        if getattr(accelerator, "flatshard_parallelism_config", None) is self:
            accelerator = _AsDataParallel(accelerator)
        return original(self, accelerator)

    return _validate_accelerator


def _sharding_strategy(plugin: Any, environ: Mapping[str, str]) -> Any:
    """torch's ``ShardingStrategy`` the plugin asks for.  FSDP1: ``sharding_strategy``, else
    ``reshard_after_forward`` holding a strategy name (what ``accelerate config`` writes); FSDP2:
    ``reshard_after_forward`` true is FULL_SHARD (ZeRO-3), false SHARD_GRAD_OP (ZeRO-2).  An explicit
    ``reshard_after_forward`` strategy (transformers' ``fsdp="shard_grad_op"``, fsdp_config version 1) counts over
    the ``sharding_strategy`` FULL_SHARD accelerate defaults to without ``FSDP_SHARDING_STRATEGY``."""
    strategy = getattr(plugin, "sharding_strategy", None)
    asked = getattr(plugin, "reshard_after_forward", None)
    if (isinstance(asked, ShardingStrategy) and strategy == ShardingStrategy.FULL_SHARD
            and not environ.get("FSDP_SHARDING_STRATEGY")):
        return asked
    strategy = asked if strategy is None else strategy
    if isinstance(strategy, bool):
        return ShardingStrategy.FULL_SHARD if strategy else ShardingStrategy.SHARD_GRAD_OP
    if isinstance(strategy, str):
        return ShardingStrategy(int(strategy)) if strategy.isdigit() else ShardingStrategy[strategy.upper()]
    return strategy or ShardingStrategy.FULL_SHARD


def normalize_plugin_to_fsdp1(plugin: Any, opts: FlatShardOptions, world_size: Optional[int] = None) -> None:
    """Make an FSDP2-style plugin (``fsdp_version: 2``) look like the equivalent FSDP1 one, in place:
    accelerate and transformers branch on ``accelerator.is_fsdp2`` into torch-FSDP2-only code (``fully_shard``,
    DTensor state dicts); accel_flatshard implements the FSDP1 surface of those calls.  ``world_size`` (None: the
    launcher's) tells hybrid sharding (shard groups smaller than the world: HYBRID_SHARD) from FULL_SHARD."""
    if getattr(plugin, "fsdp_version", 1) != 2:
        return
    world_size = launched_world_size() if world_size is None else world_size
    strategy = ShardingStrategy[options.sharding_strategy(opts.reshard_after_forward, opts.fsdp_group_size,
                                                          world_size)]
    plugin.fsdp_version = 1
    plugin.sharding_strategy = plugin.reshard_after_forward = strategy
    prefetch = opts.backward_prefetch
    plugin.backward_prefetch = None if prefetch is None else TorchPrefetch[prefetch.name]
    plugin.forward_prefetch = opts.forward_prefetch
    plugin.sync_module_states = opts.sync_module_states
    plugin.use_orig_params = True
    plugin.cpu_offload = TorchCPUOffload(offload_params=opts.offload_params)


def _mixed_precision(plugin: Any, mixed_precision: str, environ: Mapping[str, str]) -> Optional[MixedPrecision]:
    """accelerate's policy (param = reduce = buffer dtype, or the plugin's own) as our MixedPrecision."""
    policy = getattr(plugin, "mixed_precision_policy", None)
    param_dtype = reduce_dtype = buffer_dtype = None
    if policy is not None and not isinstance(policy, (str, dict)):
        param_dtype, reduce_dtype, buffer_dtype = (getattr(policy, f"{kind}_dtype", None)
                                                   for kind in ("param", "reduce", "buffer"))
    elif mixed_precision in ("fp16", "bf16"):
        param_dtype = reduce_dtype = buffer_dtype = options.DTYPES[mixed_precision]
    elif mixed_precision not in ("no", None, "fp32"):
        raise ValueError(f"mixed_precision {mixed_precision!r} is not supported by accel_flatshard (no, bf16, fp16)")
    override = options.get("FLATSHARD_REDUCE_DTYPE", environ)
    if override is not None:
        reduce_dtype = override
        if param_dtype is None:
            warnings.warn("FLATSHARD_REDUCE_DTYPE has no effect without mixed precision", stacklevel=3)
            return None
    if param_dtype is None and reduce_dtype is None and buffer_dtype is None:
        return None
    return MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype, buffer_dtype=buffer_dtype)


def post_init_without_device(original: Callable[[Any], None]) -> Callable[[Any], None]:
    """``FullyShardedDataParallelPlugin.__post_init__`` that works on a host without an accelerator device.

    accelerate's raises "no available devices" under ``sync_module_states`` (the launcher's default: it prepares a
    GPU ``param_init_fn`` accel_flatshard never uses).  On such a host (FSDP1 only) the plugin is initialised with
    ``sync_module_states`` and ``cpu_ram_efficient_loading`` off, then both fields and
    ``FSDP_CPU_RAM_EFFICIENT_LOADING`` (transformers reads it) get the values accelerate would set."""

    from accelerate.utils import imports

    # the devices accelerate's plugin looks for before it builds a GPU ``param_init_fn``
    devices = ("is_npu_available", "is_mlu_available", "is_musa_available", "is_cuda_available", "is_xpu_available",
               "is_hpu_available", "is_neuron_available")

    @functools.wraps(original)
    def __post_init__(self: Any) -> None:
        version = str(getattr(self, "fsdp_version", None) or os.environ.get("FSDP_VERSION", "1")).strip()
        if version == "2" or any(getattr(imports, name, lambda: False)() for name in devices):
            return original(self)
        efficient, sync = self.cpu_ram_efficient_loading, self.sync_module_states
        efficient = options.env_flag("FSDP_CPU_RAM_EFFICIENT_LOADING") if efficient is None else bool(efficient)
        sync = options.env_flag("FSDP_SYNC_MODULE_STATES") if sync is None else bool(sync)
        saved = os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING")
        self.cpu_ram_efficient_loading, self.sync_module_states = False, False
        try:
            original(self)
        finally:
            os.environ.pop("FSDP_CPU_RAM_EFFICIENT_LOADING", None)
            if saved is not None:
                os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = saved
        if efficient and not options.env_flag("FSDP_CPU_RAM_EFFICIENT_LOADING"):  # (a launcher's value stays)
            os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "True"  # what accelerate exports for from_pretrained
        self.cpu_ram_efficient_loading = efficient
        self.sync_module_states = sync or efficient

    return __post_init__


def build_plugin_without_device(plugin_cls: type) -> Any:
    """accelerate's plugin built from the ``FSDP_*`` variables on any host: ``plugin_cls()`` initialised by
    :func:`post_init_without_device` (which the ``plugin_post_init`` patch installs only under ``register()``)."""
    post_init = post_init_without_device(plugin_cls.__post_init__)
    building = type(plugin_cls.__name__, (plugin_cls,), {"__post_init__": post_init})
    plugin = building()
    plugin.__class__ = plugin_cls
    return plugin


def options_from_launch_args(argv: List[str]) -> tuple:
    """``accelerate launch`` flags (``--config_file``, ``--num_processes``, ``--fsdp_*``, ...) -> ``(options,
    launch_args)``: what every launched process would wrap with, through accelerate's own parser, yaml merge and
    launcher environment, and the plugin built from it (``launch_args.num_processes``, ``.mixed_precision``...)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args([*argv, "train.py"])
    with contextlib.redirect_stdout(sys.stderr):  # accelerate prints the defaults it filled in
        _validate_launch_command(args)
        if not args.use_fsdp:
            raise ValueError("not an FSDP launch: give an accelerate yaml with `distributed_type: FSDP` "
                             "(--config_file) or --use_fsdp and the --fsdp_* flags")
        args.machine_rank, args.main_process_port = args.machine_rank or 0, 0  # (0: any free port; nothing starts)
        env = prepare_multi_gpu_env(args)
    env["LOCAL_WORLD_SIZE"] = str(max(1, args.num_processes // max(1, args.num_machines)))
    with mock.patch.dict(os.environ, env):  # accelerate's plugin reads its FSDP_* fields from the environment
        plugin = build_plugin_without_device(FullyShardedDataParallelPlugin)
        # the yaml's parallelism_config block / --parallelism_config_* flags, as the launched Accelerator builds it
        parallelism = requested_parallelism_config({})
        if parallelism is not None and parallelism.total_size != args.num_processes:
            raise ValueError(f"parallelism_config dp_replicate_size {parallelism.dp_replicate_size} x dp_shard_size "
                             f"{parallelism.dp_shard_size} is {parallelism.total_size} processes, but num_processes is "
                             f"{args.num_processes}: make them agree")
        return options_from_plugin(plugin, args.mixed_precision, env, parallelism), args


# ---------------------------------------------------------------------- the launcher's environment
def launched_world_size() -> int:
    """How many processes the launcher started (torchrun / accelerate launch set WORLD_SIZE)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        return 1


def use_cpu_state_for_launch() -> None:
    """Under a launch of W > 1 processes on a host without CUDA, make accelerate's CPU path the default
    (``ACCELERATE_USE_CPU``: gloo over all processes); else ``TrainingArguments`` / ``PartialState()``, made before
    any Accelerator, would set up ``distributed_type NO`` and ``world_size`` 1.  Not only under
    ``ACCELERATE_USE_FSDP``: ``TrainingArguments(fsdp=...)`` builds its plugin after it has set up the state."""
    if "ACCELERATE_USE_CPU" not in os.environ and not torch.cuda.is_available() and launched_world_size() > 1:
        os.environ["ACCELERATE_USE_CPU"] = "true"


def partial_state_reading_use_cpu(original: Callable[..., None]) -> Callable[..., None]:
    """``PartialState.__init__`` that reads ``ACCELERATE_USE_CPU`` as ``AcceleratorState`` does: a script's
    ``PartialState()`` (TRL's scripts make one first) then sets up the same gloo state the Accelerator will."""

    @functools.wraps(original)
    def __init__(self: Any, cpu: bool = False, **kwargs: Any) -> None:
        return original(self, cpu=bool(cpu) or options.env_flag("ACCELERATE_USE_CPU"), **kwargs)

    return __init__


def state_dict_type_name(plugin: Any) -> str:
    """The plugin's ``state_dict_type`` as "FULL_STATE_DICT" or "SHARDED_STATE_DICT" (unset: FULL); others raise."""
    sdt = getattr(plugin, "state_dict_type", None)
    name = getattr(sdt, "name", None) or str(sdt or "FULL_STATE_DICT").upper()
    if name not in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        raise ValueError(
            f"fsdp_state_dict_type {name} is not supported for accel_flatshard models; use FULL_STATE_DICT or "
            "SHARDED_STATE_DICT (fsdp_config in the accelerate yaml, or fsdp_plugin.set_state_dict_type(...))"
        )
    return name
