"""What ``accel-flatshard plan`` does with each ``accelerate launch`` flag and yaml key (``plan_cli.py`` asks).

Each launch parser destination and yaml attribute is in exactly one table: :data:`PLANNED` (reaches the plan),
:data:`INERT` (no change to a step's memory) or :data:`REFUSED` (set off its default, the plan stops naming it and
why); tests/test_plan.py checks the tables cover the installed accelerate's parser.
"""
from __future__ import annotations

import argparse
from typing import Any, Dict

_PARALLEL = "parallelism_config_"
PLANNED: Dict[str, str] = {
    "config_file": "the yaml: its keys are merged as accelerate merges them",
    "num_processes": "the ranks the model is sharded over",
    "num_machines": "HYBRID_SHARD's default group (a node) and the cost model's links",
    "mixed_precision": "compute, reduce and buffer dtypes and autocast (fp8 is refused)",
    "use_fsdp": "an FSDP launch (the only kind planned)",
    "fsdp_version": "FSDP1 or FSDP2 keys",
    "fsdp_sharding_strategy": "FULL_SHARD / SHARD_GRAD_OP / HYBRID_SHARD / NO_SHARD",
    "fsdp_reshard_after_forward": "FSDP2's FULL_SHARD (true) or SHARD_GRAD_OP (false)",
    "fsdp_offload_params": "shards, gradients and optimizer state in host memory",
    "fsdp_auto_wrap_policy": "the units",
    "fsdp_transformer_layer_cls_to_wrap": "the units",
    "fsdp_min_num_params": "the units (SIZE_BASED_WRAP)",
    "fsdp_backward_prefetch": "backward prefetch",
    "fsdp_forward_prefetch": "forward prefetch",
    "fsdp_activation_checkpointing": "activation checkpointing per unit",
    "use_parallelism_config": "the parallelism_config block",
    _PARALLEL + "dp_replicate_size": "replicas (HSDP)",
    _PARALLEL + "dp_shard_size": "the shard group size (HSDP)",
    "gradient_accumulation_steps": "micro-steps per optimizer step (with --accumulation: the script's choice)",
}

_LAUNCHER = "the launcher's, not a rank's memory"
_LOADING = "model loading, not the training step"
_TPU = "TPU / SageMaker launches only"
INERT: Dict[str, str] = {
    **dict.fromkeys(("quiet", "debug", "num_cpu_threads_per_process", "enable_cpu_affinity", "gpu_ids",
                     "same_network", "machine_rank", "main_process_ip", "main_process_port", "tee", "log_dir", "role",
                     "rdzv_backend", "rdzv_conf", "max_restarts", "monitor_interval", "module", "no_python",
                     "main_training_function", "mpirun_hostfile", "training_script", "training_script_args",
                     "nondefault", "help", "nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port",
                     "rdzv_endpoint"), _LAUNCHER),  # (the last six: torchrun's, which accelerate derives)
    **dict.fromkeys(("tpu_use_cluster", "tpu_use_sudo", "vm", "env", "downcast_bf16", "tpu_env", "tpu_name",
                     "tpu_vm", "tpu_zone", "commands", "command_file", "aws_access_key_id",
                     "aws_secret_access_key"), _TPU),
    "fsdp_state_dict_type": "the checkpoint format, not the training step",
    "fsdp_use_orig_params": "always true in accel_flatshard",
    "fsdp_cpu_ram_efficient_loading": _LOADING,
    "fsdp_sync_module_states": _LOADING,
    **dict.fromkeys(("dynamo_mode", "dynamo_use_fullgraph", "dynamo_use_dynamic",
                     "dynamo_use_regional_compilation"), "only with dynamo_backend, which is refused"),
    **dict.fromkeys((_PARALLEL + k for k in ("cp_backend", "cp_comm_strategy", "sp_backend", "sp_seq_length",
                                               "sp_seq_length_is_variable", "sp_attn_implementation")),
                    "only with cp_size / sp_size > 1, which are refused"),
    **dict.fromkeys(("fp8_backend", "fp8_use_autocast_during_eval", "fp8_margin", "fp8_interval", "fp8_format",
                     "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_override_linear_precision",
                     "fp8_enable_fsdp_float8_all_gather", "fp8_pad_inner_dim"),
                    "only with mixed_precision fp8, which is refused"),
}

_MEGATRON = "Megatron-LM's (an FSDP launch does not pass it to the script)"
REFUSED: Dict[str, str] = {
    **dict.fromkeys(("cpu", "use_cpu"), "accelerate then ignores the FSDP section (no sharding)"),
    **dict.fromkeys(("multi_gpu", "tpu", "use_deepspeed", "use_megatron_lm"), "not an FSDP launch"),
    "dynamo_backend": "the plan measures the eager step; a compiled step saves other activations (plan with "
                      "--dynamo_backend no for the eager step)",
    "fsdp_activation_checkpointing_offload": "not supported by accel_flatshard",
    **{_PARALLEL + k: "not supported by accel_flatshard (tensor / context / sequence parallelism)"
       for k in ("tp_size", "cp_size", "sp_size")},
    **dict.fromkeys(("deepspeed_config_file", "zero_stage", "offload_optimizer_device", "offload_param_device",
                     "offload_optimizer_nvme_path", "offload_param_nvme_path", "gradient_clipping", "zero3_init_flag",
                     "zero3_save_16bit_model", "deepspeed_hostfile", "deepspeed_exclusion_filter",
                     "deepspeed_inclusion_filter", "deepspeed_multinode_launcher", "deepspeed_moe_layer_cls_names"),
                    "DeepSpeed's (an FSDP launch does not pass it to the script)"),
}

_UNSET = (None, False, "", "no", "none", "false", "[]")  # values that ask for nothing (as strings, lowercased)


def _is_set(value: Any, default: Any) -> bool:
    if value == default or (isinstance(value, (list, tuple)) and not value):
        return False
    return str(value).strip().lower() not in [str(v).lower() for v in _UNSET]


def check_launch_args(args: argparse.Namespace) -> None:
    """Refuse, naming it, a :data:`REFUSED` setting off the parser's default, or one in no table (a key this
    accelerate added, or a misspelt yaml key accelerate copied without a check)."""
    from accelerate.commands.launch import launch_command_parser

    defaults = vars(launch_command_parser().parse_args(["train.py"]))
    for name, value in sorted(vars(args).items()):
        if name in PLANNED or name in INERT:
            continue
        reason = _MEGATRON if name.startswith("megatron_lm_") else REFUSED.get(name)
        if reason is None:
            raise ValueError(f"launch setting {name!r} (flag --{name} or its yaml key) is unknown to the planner: it "
                             "cannot say what it does to memory (remove it to plan, or report it)")
        if _is_set(value, defaults.get(name)):
            raise ValueError(f"launch setting {name}={value!r} (flag --{name} or its yaml key): {reason}")
