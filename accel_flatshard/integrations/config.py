"""Translate an accelerate FSDP configuration (fsdp_version 1 or 2) into accel_flatshard options.

Accelerate delivers the yaml's ``fsdp_config`` as ``FSDP_*`` environment variables and parses them
into a ``FullyShardedDataParallelPlugin`` whose fields are torch FSDP objects (``ShardingStrategy``,
``BackwardPrefetch``, torch wrap-policy functions, ``MixedPrecision``).  :func:`options_from_plugin`
maps those fields onto :class:`FullyShardedDataParallel` arguments; the few options accelerate has
no key for come from ``FLATSHARD_*`` environment variables (:data:`ENV_VARS`), validated up front so
that a typo fails loudly instead of being ignored.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional

import torch
import torch.nn as nn

from ..mixed_precision import MixedPrecision
from ..unit import BackwardPrefetch
from ..wrap import Policy, size_based_auto_wrap_policy, transformer_auto_wrap_policy

# Every FLATSHARD_* variable that accel_flatshard reads, with what it does.  Anything else that starts
# with FLATSHARD_ is an error (a misspelt option would otherwise silently do nothing).
ENV_VARS: Dict[str, str] = {
    "FLATSHARD_GROUP_SIZE": "ranks per shard group with fsdp_sharding_strategy HYBRID_SHARD / _HYBRID_SHARD_ZERO2 "
    "(default: processes per node, LOCAL_WORLD_SIZE)",
    "FLATSHARD_LIMIT_ALL_GATHERS": "most all-gathers in flight per model (default 2)",
    "FLATSHARD_REDUCE_DTYPE": "dtype of gradient reduction under mixed precision: fp32 | bf16 | fp16 "
    "(default: the mixed-precision dtype, as accelerate's FSDP policy)",
    "FLATSHARD_REDUCE_SCATTER_VIA_ALL_REDUCE": "1 | 0: reduce gradients with all-reduce + slice "
    "(default: 1 on gloo, 0 otherwise; read by accel_flatshard.comm)",
    "FLATSHARD_GLOO_P2P": "1 | 0: on gloo, all-gather and reduce-scatter by batched isend/irecv (default 1 on gloo)",
    "FLATSHARD_TIMEOUT_S": "timeout in seconds of the shard/replica process groups accel_flatshard creates "
    "(default 1800; read by accel_flatshard.comm)",
    "FLATSHARD_STATE_DICT_TIMEOUT_S": "seconds rank 0 waits for the other ranks when the unwrapped model's "
    "state_dict() / get_state_dict / save_model gathers (collective) before failing (default 5)",
    "FLATSHARD_PROFILE": "directory: switch the profiler on and write one Chrome trace per rank there "
    "(1: the table only)",
    "FLATSHARD_PROFILE_EVERY": "with FLATSHARD_PROFILE: print the profiler table every N steps (default 10)",
    # generation (read by accel_flatshard.generation)
    "FLATSHARD_GENERATION_MODE": "budget | full | per_unit: units kept gathered during generate() (default budget)",
    "FLATSHARD_GENERATION_BUDGET_MB": "auto | MiB: gathered bytes generation may hold per rank (default auto: half "
    "the free memory; the whole model fits -> one gather per generate())",
    "FLATSHARD_KEEP_FROZEN_GATHERED": "1 | 0: no-grad forwards (reference models) keep units gathered until the "
    "next optimizer step (default 0)",
}

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


def check_env(environ: Optional[Mapping[str, str]] = None) -> None:
    """Raise ``ValueError`` for a ``FLATSHARD_*`` variable that accel_flatshard does not know."""
    environ = os.environ if environ is None else environ
    unknown = sorted(k for k in environ if k.startswith("FLATSHARD_") and k not in ENV_VARS)
    if unknown:
        known = "\n".join(f"  {k}: {v}" for k, v in ENV_VARS.items())
        raise ValueError(f"unknown accel_flatshard environment variable(s) {unknown}; the known ones are:\n{known}")


def _env_int(environ: Mapping[str, str], name: str) -> Optional[int]:
    value = environ.get(name)
    if value is None or value == "":
        return None
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} must be a positive integer") from None
    if number < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return number


def fsdp_version_requested(plugin: Any, environ: Optional[Mapping[str, str]] = None) -> int:
    environ = os.environ if environ is None else environ
    if plugin is not None and getattr(plugin, "fsdp_version", None) is not None:
        return int(plugin.fsdp_version)
    return int(environ.get("FSDP_VERSION", "1") or 1)


def check_fsdp_version(version: int) -> None:
    if version not in (1, 2):
        raise ValueError(f"the accelerate config asks for fsdp_version {version}; accelerate knows 1 and 2, and "
                         "accel_flatshard accepts both (set `fsdp_version: 1` or `2` in fsdp_config)")


@dataclass
class FlatShardOptions:
    """Everything :class:`~accel_flatshard.integrations.accelerate.Accelerator` needs to wrap a model."""

    reshard_after_forward: bool = True
    fsdp_group_size: Optional[int] = None
    backward_prefetch: Optional[BackwardPrefetch] = None
    forward_prefetch: bool = False
    wrap: str = "none"  # "transformer" | "size" | "none" | "custom"
    layer_cls_names: Optional[List[str]] = None  # transformer: None -> the model's _no_split_modules
    min_num_params: int = 0
    custom_policy: Optional[Policy] = None
    state_dict_type: str = "FULL_STATE_DICT"
    activation_checkpointing: bool = False
    cpu_ram_efficient_loading: bool = False
    sync_module_states: bool = True
    mixed_precision: Optional[MixedPrecision] = None
    limit_all_gathers: int = 2

    def auto_wrap_policy(self, model: nn.Module) -> Optional[Policy]:
        """The policy for ``model``; an unknown layer class raises ``ValueError`` naming the classes present."""
        if self.wrap == "transformer":
            return transformer_auto_wrap_policy(model, self.layer_cls_names)
        if self.wrap == "size":
            return _size_policy_without_containers(self.min_num_params) if self.min_num_params > 0 else None
        if self.wrap == "custom":
            return self.custom_policy
        return None

    def wrapper_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments for :class:`FullyShardedDataParallel` (without the policy)."""
        return dict(
            reshard_after_forward=self.reshard_after_forward,
            backward_prefetch=self.backward_prefetch,
            forward_prefetch=self.forward_prefetch,
            fsdp_group_size=self.fsdp_group_size,
            mixed_precision=self.mixed_precision,
            sync_module_states=self.sync_module_states,
            limit_all_gathers=self.limit_all_gathers,
        )


def _size_policy_without_containers(min_num_params: int) -> Policy:
    """Size-based wrapping that never makes a unit of ``nn.ModuleList`` / ``nn.ModuleDict``.

    Containers have no forward, so a unit made of one would never gather its parameters; torch's size
    policy (what accelerate uses for SIZE_BASED_WRAP) excludes them the same way (``exclude_wrap_modules``).
    """
    base = size_based_auto_wrap_policy(min_num_params)

    def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        if recurse:
            return True
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            return False
        return base(module=module, recurse=False, nonwrapped_numel=nonwrapped_numel)

    return policy


def options_from_plugin(
    plugin: Any, mixed_precision: str = "no", environ: Optional[Mapping[str, str]] = None
) -> FlatShardOptions:
    """Map a ``FullyShardedDataParallelPlugin`` (fsdp_version 1 or 2) and ``FLATSHARD_*`` variables to options.

    FSDP2 keys: ``fsdp_reshard_after_forward`` true/false (FULL_SHARD / SHARD_GRAD_OP), the same wrap
    policy, state dict type (default SHARDED_STATE_DICT), mixed precision, activation checkpointing and
    ``fsdp_cpu_ram_efficient_loading`` keys as FSDP1; backward prefetch is always on (FSDP2's implicit
    prefetch).  Options that cannot be honoured raise naming the key (``fsdp_offload_params``, ...).
    """
    from torch.distributed.fsdp import BackwardPrefetch as TorchPrefetch
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy as torch_size_policy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy as torch_transformer_policy

    environ = os.environ if environ is None else environ
    check_env(environ)
    check_fsdp_version(fsdp_version_requested(plugin, environ))
    opts = FlatShardOptions()

    strategy = _sharding_strategy(plugin)
    group_size = _env_int(environ, "FLATSHARD_GROUP_SIZE")
    hybrid = strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
    opts.reshard_after_forward = strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)
    if hybrid:
        # torch FSDP's HYBRID_SHARD shards inside a node and replicates across nodes: same default here
        opts.fsdp_group_size = group_size or _env_int(environ, "LOCAL_WORLD_SIZE")
    elif strategy == ShardingStrategy.NO_SHARD:
        opts.fsdp_group_size = 1  # every rank holds everything; gradients are all-reduced (DDP-like)
        opts.reshard_after_forward = False
    if group_size is not None and not hybrid:
        raise ValueError(
            f"FLATSHARD_GROUP_SIZE={group_size} is set but fsdp_sharding_strategy is {strategy.name}; "
            "it only applies to HYBRID_SHARD or _HYBRID_SHARD_ZERO2 (set the strategy or unset the variable)"
        )

    prefetch = getattr(plugin, "backward_prefetch", None)
    if fsdp_version_requested(plugin, environ) == 2:
        # FSDP2 has no prefetch options (accelerate sets backward_prefetch to None and refuses
        # forward_prefetch); it always prefetches the next unit in backward: the same here.
        prefetch = TorchPrefetch.BACKWARD_PRE
    if prefetch is not None:
        name = prefetch.name if isinstance(prefetch, (TorchPrefetch, BackwardPrefetch)) else str(prefetch).upper()
        opts.backward_prefetch = None if name == "NO_PREFETCH" else BackwardPrefetch[name]
    opts.forward_prefetch = bool(getattr(plugin, "forward_prefetch", False))

    policy = getattr(plugin, "auto_wrap_policy", None)
    base = getattr(policy, "func", policy)  # set_auto_wrap_policy may already have made it a partial
    if policy is None:
        opts.wrap = "none"
    elif base is torch_transformer_policy:
        opts.wrap = "transformer"
        bound = getattr(policy, "keywords", {}).get("transformer_layer_cls")  # a partial made by hand
        names = [c.__name__ for c in bound] if bound else getattr(plugin, "transformer_cls_names_to_wrap", None)
        if isinstance(names, str):
            names = names.split(",")
        names = [n.strip() for n in names or [] if n and n.strip()]
        opts.layer_cls_names = names or None
    elif base is torch_size_policy:
        opts.wrap = "size"
        bound = getattr(policy, "keywords", {}).get("min_num_params")
        opts.min_num_params = int(bound if bound is not None else getattr(plugin, "min_num_params", 0) or 0)
    elif callable(policy):
        opts.wrap, opts.custom_policy = "custom", policy  # torch-signature policies work unchanged
    else:
        raise ValueError(f"unsupported fsdp auto_wrap_policy {policy!r}")

    sdt = getattr(plugin, "state_dict_type", None)
    sdt_name = getattr(sdt, "name", None) or str(sdt or "FULL_STATE_DICT").upper()
    if sdt_name not in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        raise ValueError(
            f"fsdp_state_dict_type {sdt_name} is not supported by accel_flatshard; use FULL_STATE_DICT or "
            "SHARDED_STATE_DICT"
        )
    opts.state_dict_type = sdt_name

    offload = getattr(plugin, "cpu_offload", None)
    # FSDP1: CPUOffload(offload_params=...); FSDP2: OffloadPolicy() (off) or CPUOffloadPolicy (on)
    if getattr(offload, "offload_params", False) or type(offload).__name__ == "CPUOffloadPolicy":
        raise ValueError("fsdp_offload_params: true is not supported by accel_flatshard; set it to false")
    if getattr(plugin, "ignored_modules", None):
        raise ValueError("fsdp_ignored_modules is not supported by accel_flatshard; remove it from fsdp_config")
    if getattr(plugin, "activation_checkpointing_offload", False):
        raise ValueError("fsdp_activation_checkpointing_offload is not supported by accel_flatshard (FSDP2 only)")
    opts.activation_checkpointing = bool(getattr(plugin, "activation_checkpointing", False))
    opts.cpu_ram_efficient_loading = bool(getattr(plugin, "cpu_ram_efficient_loading", False))
    sync = getattr(plugin, "sync_module_states", None)
    # Ranks > 0 hold no real weights under cpu_ram_efficient_loading: rank 0 must broadcast them.
    opts.sync_module_states = True if sync is None or opts.cpu_ram_efficient_loading else bool(sync)

    opts.mixed_precision = _mixed_precision(plugin, mixed_precision, environ)
    limit = _env_int(environ, "FLATSHARD_LIMIT_ALL_GATHERS")
    if limit is not None:
        opts.limit_all_gathers = limit
    return opts


def _sharding_strategy(plugin: Any) -> Any:
    """torch's ``ShardingStrategy`` the plugin asks for, FSDP1 or FSDP2 style.

    FSDP1: ``sharding_strategy`` (accelerate falls back to ``reshard_after_forward`` holding a strategy
    name, which is what ``accelerate config`` writes).  FSDP2: ``reshard_after_forward`` is a bool:
    true is FULL_SHARD (ZeRO-3), false SHARD_GRAD_OP (parameters kept from forward to backward, ZeRO-2).
    """
    from torch.distributed.fsdp import ShardingStrategy

    strategy = getattr(plugin, "sharding_strategy", None)
    if strategy is None:
        strategy = getattr(plugin, "reshard_after_forward", None)
    if isinstance(strategy, bool):
        return ShardingStrategy.FULL_SHARD if strategy else ShardingStrategy.SHARD_GRAD_OP
    if isinstance(strategy, str):
        if strategy.isdigit():
            return ShardingStrategy(int(strategy))
        return ShardingStrategy[strategy.upper()]
    return strategy or ShardingStrategy.FULL_SHARD


def normalize_plugin_to_fsdp1(plugin: Any, options: FlatShardOptions) -> None:
    """Make an FSDP2-style plugin (``fsdp_version: 2``) look like the equivalent FSDP1 one, in place.

    After :func:`options_from_plugin` took what it asks for, nothing else reads the plugin to decide how
    to shard; but accelerate and transformers branch on ``fsdp_version == 2`` (``accelerator.is_fsdp2``)
    into torch-FSDP2-only code (``fully_shard``, DTensor state dicts, "model and optimizer in one
    prepare call", FSDP2 grad scaler).  accel_flatshard implements the FSDP1 surface of those calls, so
    the plugin says version 1 with the strategy that was asked for; everything else (state dict type,
    wrap policy, mixed precision, activation checkpointing) means the same in both versions.
    """
    from torch.distributed.fsdp import BackwardPrefetch as TorchPrefetch
    from torch.distributed.fsdp import ShardingStrategy

    if getattr(plugin, "fsdp_version", 1) != 2:
        return
    if options.fsdp_group_size == 1:
        strategy = ShardingStrategy.NO_SHARD
    else:
        strategy = ShardingStrategy.FULL_SHARD if options.reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP
    plugin.fsdp_version = 1
    plugin.sharding_strategy = strategy
    plugin.reshard_after_forward = strategy
    prefetch = options.backward_prefetch
    plugin.backward_prefetch = None if prefetch is None else TorchPrefetch[prefetch.name]
    plugin.forward_prefetch = options.forward_prefetch
    plugin.sync_module_states = options.sync_module_states
    plugin.use_orig_params = True


def _mixed_precision(plugin: Any, mixed_precision: str, environ: Mapping[str, str]) -> Optional[MixedPrecision]:
    """accelerate's policy (param = reduce = buffer dtype, or the plugin's own) as our MixedPrecision."""
    policy = getattr(plugin, "mixed_precision_policy", None)
    param_dtype = reduce_dtype = buffer_dtype = None
    if policy is not None and not isinstance(policy, (str, dict)):
        param_dtype = getattr(policy, "param_dtype", None)
        reduce_dtype = getattr(policy, "reduce_dtype", None)
        buffer_dtype = getattr(policy, "buffer_dtype", None)
    elif mixed_precision in ("fp16", "bf16"):
        param_dtype = reduce_dtype = buffer_dtype = _DTYPES[mixed_precision]
    elif mixed_precision not in ("no", None, "fp32"):
        raise ValueError(f"mixed_precision {mixed_precision!r} is not supported by accel_flatshard (no, bf16, fp16)")
    override = environ.get("FLATSHARD_REDUCE_DTYPE")
    if override:
        if override.lower() not in _DTYPES:
            raise ValueError(f"FLATSHARD_REDUCE_DTYPE={override!r}: expected one of fp32, bf16, fp16")
        reduce_dtype = _DTYPES[override.lower()]
        if param_dtype is None:
            warnings.warn("FLATSHARD_REDUCE_DTYPE has no effect without mixed precision", stacklevel=3)
            return None
    if param_dtype is None and reduce_dtype is None and buffer_dtype is None:
        return None
    return MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype, buffer_dtype=buffer_dtype)


def build_plugin_without_device(plugin_cls: type, environ: Optional[Dict[str, str]] = None) -> Any:
    """Build accelerate's plugin from ``FSDP_*`` variables on a host without an accelerator device.

    ``FullyShardedDataParallelPlugin.__post_init__`` raises "no available devices" whenever
    ``sync_module_states`` is on (it prepares a ``param_init_fn`` for torch FSDP that targets a GPU), and
    the launcher turns it on by default.  accel_flatshard does not use ``param_init_fn``, so build the
    plugin with both flags off, then restore the two fields and the environment variable that
    ``__post_init__`` overwrote (transformers reads ``FSDP_CPU_RAM_EFFICIENT_LOADING``).
    """
    environ = os.environ if environ is None else environ

    def flag(name: str) -> bool:
        return str(environ.get(name, "false")).strip().lower() in ("1", "true", "yes", "y", "on")

    efficient = flag("FSDP_CPU_RAM_EFFICIENT_LOADING")
    sync = flag("FSDP_SYNC_MODULE_STATES")
    saved = environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING")
    # FSDP2 has no sync_module_states (accelerate warns if it is given at all) and never needs a device
    kwargs = {} if str(environ.get("FSDP_VERSION", "1")).strip() == "2" else {"sync_module_states": False}
    try:
        plugin = plugin_cls(cpu_ram_efficient_loading=False, **kwargs)
    finally:
        if saved is None:
            environ.pop("FSDP_CPU_RAM_EFFICIENT_LOADING", None)
        else:
            environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = saved
    plugin.cpu_ram_efficient_loading = efficient
    plugin.sync_module_states = sync or efficient
    return plugin
