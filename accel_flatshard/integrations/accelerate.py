"""The Accelerate backend: ``Accelerator``, a drop-in subclass of ``accelerate.Accelerator``.

Under an accelerate FSDP config (``fsdp_version`` 1 or 2) it shards with :class:`FullyShardedDataParallel` where
accelerate would use torch FSDP.  What differs from plain accelerate (docs/accelerate.md): on a host
without GPUs the process group is gloo over all launched processes and accelerate's MULTI_CPU state is switched to
``DistributedType.FSDP`` (accelerate would silently train unsharded; W > 1 processes still unsharded raise); an
FSDP2 plugin is presented as FSDP1 (``is_fsdp2`` False: the code paths this class implements); ``prepare_model``
wraps every model, keeping the ``nn.Parameter`` objects (an optimizer made before or after ``prepare`` works);
``clip_grad_norm_``, ``get_state_dict``, ``unwrap_model``, ``save_state`` / ``load_state`` (:mod:`.state_io`)
know the sharded layout; ``dynamo_backend`` compiles the sharded model; fp16 gets ``ShardedGradScaler``, also on
CPU.  :func:`register` makes ``accelerate.Accelerator`` this class for code imported afterwards (``python -m
accel_flatshard.run train.py`` calls it, so unmodified scripts work).
"""
from __future__ import annotations

import inspect
import logging
import warnings
from types import MethodType
from typing import Any, Iterable, Optional, Union

import accelerate
import accelerate.accelerator
import torch
import torch.distributed as dist
import torch.nn as nn
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import (convert_outputs_to_fp32, get_mixed_precision_context_manager, DistributedType,
                              DynamoBackend, FullyShardedDataParallelPlugin)

from ..core import options, registry
from . import patches
from ..core._compat import clamp_all_
from ..features.compilation import compile_model
from ..core.device import free_bytes
from ..core.fully_sharded import FullyShardedDataParallel, check_not_wrapped
from ..core.grad_norm import clip_grad_norm_
from ..core.model_state import find_wrapper, full_state_dict
from ..core.options import FlatShardOptions
from ..core.wrap import checkpoint_units, policy_of
from . import state_io
from .versions import check_versions
from .config import (build_plugin_without_device, fsdp_version, launched_world_size, normalize_plugin_to_fsdp1,
                     options_from_plugin, requested_parallelism_config, use_cpu_state_for_launch)

_BaseAccelerator = accelerate.accelerator.Accelerator
_BASE_SIGNATURE = inspect.signature(_BaseAccelerator.__init__)



class Accelerator(_BaseAccelerator):
    """``accelerate.Accelerator`` (the same arguments) that shards with accel_flatshard under an FSDP config
    (``distributed_type: FSDP`` in the launch config, or an ``fsdp_plugin``); accelerate's own without one.  A
    plain accelerate training loop uses it unchanged (``examples/train_causal_lm.py``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # the process' FLATSHARD_* settings; an unknown FLATSHARD_* name or a bad value raises here, before accelerate
        settings = options.ProcessSettings.from_environment()
        # before accelerate makes the process group: a torchelastic restart's groups get a store prefix of their own
        patches.install("process_group")
        self.flatshard_async_save: bool = settings.async_save  # save_state's default
        bound = _BASE_SIGNATURE.bind(self, *args, **kwargs)
        params = {k: v for k, v in bound.arguments.items() if k != "self"}
        plugin = params.get("fsdp_plugin")
        self.flatshard_options: Optional[FlatShardOptions] = None  # what models are wrapped with; None: not sharding
        if not (options.env_flag("ACCELERATE_USE_FSDP") or isinstance(plugin, FullyShardedDataParallelPlugin)):
            super().__init__(**params)
            return
        fsdp_version(plugin)  # an unsupported version fails here, before accelerate sets anything up
        # accelerate's parallelism_config: tensor/context parallelism is refused; accelerate builds its mesh and
        # checks the sizes (patched to accept this class, before super().__init__), dp_shard sets the shard groups
        params["parallelism_config"] = self.flatshard_parallelism_config = requested_parallelism_config(params)
        if self.flatshard_parallelism_config is not None:
            patches.install()
        # Our engine runs on CUDA/nccl or CPU/gloo.  Without CUDA, accelerate would pick no backend at
        # all (and its plugin refuses sync_module_states): take its CPU path, then switch to FSDP.
        without_device = (bool(params.get("cpu")) or options.env_flag("ACCELERATE_USE_CPU")
                          or not torch.cuda.is_available())
        if without_device:
            if plugin is None:
                plugin = build_plugin_without_device(FullyShardedDataParallelPlugin)
            params["fsdp_plugin"], params["cpu"] = plugin, True
            _reset_state_set_up_without_backend()
        super().__init__(**params)
        if without_device and not self._switch_to_fsdp(plugin):
            return
        if self.distributed_type != DistributedType.FSDP:
            _refuse_unsharded_launch(self.state)
            return  # a single process without a launcher: nothing to shard
        self.flatshard_options = options_from_plugin(self.state.fsdp_plugin, self.state.mixed_precision,
                                                     parallelism=self.parallelism_config)
        normalize_plugin_to_fsdp1(self.state.fsdp_plugin, self.flatshard_options, self.num_processes)
        self._setup_grad_scaler()
        # the library functions that must know our wrapper (patches.PATCHES); modules imported since
        # register() (TRL's trainers, transformers.trainer) hold bindings it could not reach yet
        patches.install()

    # ------------------------------------------------------------------ setup
    def _switch_to_fsdp(self, plugin: FullyShardedDataParallelPlugin) -> bool:
        """Turn accelerate's MULTI_CPU state into FSDP (what AcceleratorState does for GPU types)."""
        state = self.state
        if state.distributed_type == DistributedType.FSDP and "fsdp_plugin" in state.__dict__:
            return True  # a second Accelerator in the same process: the shared state is switched already
        # FSDP without a plugin: AcceleratorState was reset (not PartialState, whose copy of the type stays FSDP, as
        # under accelerate's own FSDP) and set up again from PartialState: switch it again, as the first time
        if state.distributed_type not in (DistributedType.MULTI_CPU, DistributedType.FSDP) or not dist.is_initialized():
            _refuse_unsharded_launch(state)
            warnings.warn(
                "accel_flatshard: an FSDP config was given but this is a single process (WORLD_SIZE "
                f"{launched_world_size()}); nothing to shard, training as one process. To shard, launch "
                "several: `accelerate launch --config_file ... -m accel_flatshard.run script.py`.", stacklevel=3)
            return False
        if state.mixed_precision != "no" and getattr(plugin, "mixed_precision_policy", None) is None:
            plugin.set_mixed_precision(state.mixed_precision)
        state.fsdp_plugin, state.distributed_type = plugin, DistributedType.FSDP
        patches.install("fsdp_state")  # PartialState's own copy of the shared dict, which accelerate's helpers read
        return True

    def _setup_grad_scaler(self) -> None:
        """fp16 needs loss scaling; a sharded-aware scaler all-reduces "found inf" over every rank."""
        if self.state.mixed_precision != "fp16":
            return
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        if isinstance(self.scaler, ShardedGradScaler):
            return  # accelerate made one already (GPU host)
        kwargs = self.scaler_handler.to_kwargs() if self.scaler_handler is not None else {}
        # accelerate skips fp16 on CPU altogether (no autocast, no scaler): enable both.
        self.native_amp = True
        self.scaler = ShardedGradScaler(device=self.device.type, **kwargs)

    # ------------------------------------------------------------------ prepare
    def prepare_model(self, model: nn.Module, device_placement: Optional[bool] = None,
                      evaluation_mode: bool = False) -> nn.Module:
        """Shard ``model`` with its own wrapper and engine (under an FSDP config; accelerate's own path otherwise),
        however many models one Accelerator gets.  ``evaluation_mode=True`` (e.g. TRL's reference model) shards it
        too, without activation checkpointing; frozen parameters hold no gradient memory."""
        opts = self.flatshard_options
        if opts is None:
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        # prepared before, or wrapped by hand (as accelerate allows for torch FSDP)
        if getattr(model, "_is_accelerate_prepared", False) or isinstance(model, FullyShardedDataParallel):
            if model not in self._models:
                self._models.append(model)
            model._is_accelerate_prepared = True
            return model
        check_not_wrapped(model)
        policy = policy_of(opts, model)  # unknown layer classes fail here, before anything changes
        self._materialize_and_place(model)
        skeleton = None
        if not evaluation_mode and available_bytes(self.device) is not None:  # the planner's check (plan/), CUDA only
            from ..plan import meta_copy, warn_before_first_step

            skeleton = meta_copy(model)  # (the model's structure: the prediction at the first forward needs it)
        if self.native_amp:  # accelerate's autocast wrapping (the same attributes: unwrap_model undoes it)
            autocast = get_mixed_precision_context_manager(self.native_amp, self.autocast_handler)
            model._original_forward = forward = model.forward
            amp_forward = convert_outputs_to_fp32(autocast(getattr(forward, "__func__", forward)))
            model.forward = MethodType(amp_forward, model) if hasattr(forward, "__func__") else amp_forward
        wrapped = FullyShardedDataParallel(model, auto_wrap_policy=policy, options=opts)
        # accelerate's fsdp_activation_checkpointing: every inner unit, as for torch FSDP
        if opts.activation_checkpointing and not evaluation_mode and not checkpoint_units(
                wrapped.module, [u.module for u in wrapped.units if not u.is_root]):
            warnings.warn("fsdp_activation_checkpointing needs an auto-wrap policy that creates inner units "
                          "(e.g. TRANSFORMER_BASED_WRAP); nothing is checkpointed", stacklevel=2)
        if skeleton is not None:
            warn_before_first_step(wrapped, skeleton, opts, self.num_processes, self.native_amp, available_bytes)
        _compile_per_dynamo_plugin(wrapped, self.state.dynamo_plugin)  # after checkpointing, as accelerate does
        wrapped._is_accelerate_prepared = True
        self._models.append(wrapped)
        return wrapped

    def _materialize_and_place(self, model: nn.Module) -> None:
        """Check that meta parameters can be filled, keep fp32 masters; do NOT move the model: as accelerate does
        for torch FSDP, the wrapper materialises (meta) or copies (CPU) one unit at a time into its device buffer
        while sharding it, so the device never holds more than one unit unsharded (meta ranks get rank 0's)."""
        device, tensors = self.device, list(model.parameters()) + list(model.buffers())
        if any(t.is_meta for t in tensors) and not self.flatshard_options.sync_module_states:
            raise ValueError(
                "the model has parameters on the meta device (cpu_ram_efficient_loading) but "
                "fsdp_sync_module_states is false: nothing would fill them; set it to true")
        if self.state.mixed_precision != "no":
            low = [(n, p) for n, p in model.named_parameters()
                   if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32]
            if low:
                # as accelerate does for torch FSDP: the sharded master copy of what the optimizer updates is fp32,
                # compute stays in the mixed-precision dtype; upcast where each parameter is (host or meta).  Frozen
                # parameters keep their dtype (a QLoRA base's 4-bit weights are bit patterns in their storage dtype)
                warnings.warn(f"accel_flatshard: upcasting {len(low)} low-precision parameters to fp32 "
                              f"(e.g. {low[0][0]}) because mixed precision is on", stacklevel=4)
                for _, p in low:
                    p.data = p.data.float()
        on = {t.device for t in tensors if not t.is_meta}
        # already whole on a device: nothing to save by moving unit by unit
        if any(d.type not in ("cpu", "meta") and d != device for d in on) or (device.type == "cpu" and on - {device}):
            model.to(device)

    # ------------------------------------------------------------------ training-time calls
    def clip_grad_norm_(self, parameters: Union[torch.Tensor, Iterable[torch.Tensor]], max_norm: float,
                        norm_type: float = 2) -> torch.Tensor:
        """Global norm over all ranks' gradient shards (fp16: unscaled first), as for torch FSDP; over several
        prepared models (and unwrapped ones) the one norm torch's would give on the unsharded models, every gradient
        scaled by the same coefficient.  Collective over every model involved."""
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if self.flatshard_options is None or not any(registry.record_of_param(p) is not None for p in params):
            return super().clip_grad_norm_(params, max_norm, norm_type=norm_type)
        self.unscale_gradients()
        return clip_grad_norm_(params, max_norm, norm_type)  # (each model's part on its own group and device)

    def clip_grad_value_(self, parameters: Union[torch.Tensor, Iterable[torch.Tensor]], clip_value: float) -> None:
        """Elementwise, so clipping each rank's shard is exact (accelerate refuses this for torch FSDP)."""
        if self.flatshard_options is None:
            return super().clip_grad_value_(parameters, clip_value)
        self.unscale_gradients()
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        grads = [p.grad for p in params if p.grad is not None and p.grad.numel() > 0]
        if grads:  # a rank may hold no gradient elements at all; torch's version raises on an empty list
            clamp_all_(grads, -clip_value, clip_value)

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> nn.Module:
        """The user's model (its class, for ``save_pretrained``); its parameters stay sharded, its ``state_dict()``
        gathers the full one (collective: rank 0 gets it, the others ``{}``), so ``save_pretrained`` must run on
        every rank; called on the main process only it fails within seconds (``state_dict/model.py``)."""
        if isinstance(model, FullyShardedDataParallel):
            model = model.module
        return super().unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile)

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict:
        """Full state dict of ``model`` (plain keys and shapes, on CPU) on the main process, ``{}`` elsewhere;
        collective: every rank calls it (once per prepared model)."""
        wrapped = find_wrapper(model)
        if wrapped is None:
            if self.flatshard_options is not None:  # e.g. an evaluation-mode model: nothing is sharded
                return (self.unwrap_model(model) if unwrap else model).state_dict()
            return super().get_state_dict(model, unwrap=unwrap)
        return full_state_dict(wrapped, rank0_only=True, cpu_offload=True)

    # ------------------------------------------------------------------ checkpoints
    def save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any) -> str:
        """:func:`.state_io.save_state`; ``async_save=True`` (or ``FLATSHARD_ASYNC_SAVE=1``) writes model and
        optimizer in the background; an Accelerator that is not sharding saves synchronously and says so once."""
        async_save = save_model_func_kwargs.pop("async_save", None)
        if self.flatshard_options is not None:
            return state_io.save_state(self, output_dir, safe_serialization, async_save=async_save)
        if (self.flatshard_async_save if async_save is None else async_save) and not self.__dict__.get("_sync_said"):
            self._sync_said = True
            warnings.warn("accel_flatshard: async_save / FLATSHARD_ASYNC_SAVE writes in the background only the models "
                          "accel_flatshard shards; this Accelerator is not sharding (no FSDP config, or one process): "
                          "save_state writes synchronously", stacklevel=2)
        return super().save_state(output_dir, safe_serialization=safe_serialization, **save_model_func_kwargs)

    def load_state(self, input_dir: Optional[str] = None, load_kwargs: Optional[dict] = None,
                   **load_model_func_kwargs: Any) -> None:
        """Inverse of :meth:`save_state`; the layout (FULL or SHARDED) is detected from the directory."""
        if self.flatshard_options is None:
            return super().load_state(input_dir, load_kwargs=load_kwargs, **load_model_func_kwargs)
        state_io.load_state(self, input_dir, load_kwargs, **load_model_func_kwargs)

    def end_training(self) -> None:
        """accelerate's, after the asynchronous save in flight (if any) is written (its failure raises here)."""
        state_io.wait_for_saves()
        super().end_training()


# ---------------------------------------------------------------------- helpers
def available_bytes(device: torch.device) -> Optional[int]:
    """What this process may hold on ``device``, which ``prepare``'s memory check holds the planner's prediction
    against: what it holds already plus what it can still allocate (``device.free_bytes``).  None off CUDA: a CPU
    "device" is host RAM shared with everything on the host (page cache, overcommit, swap), no budget, so nothing
    is checked there."""
    return torch.cuda.memory_allocated(device) + free_bytes(device) if device.type == "cuda" else None


def _reset_state_set_up_without_backend() -> None:
    """Undo a shared accelerate state set up without a backend although W > 1 processes run (``TrainingArguments``
    without ``ACCELERATE_USE_CPU`` on a host without CUDA records ``distributed_type NO``): accelerate then sets
    it up again on the CPU path, with gloo."""
    if launched_world_size() <= 1:
        return
    # accelerate without a backend has already called init_process_group(backend=None) (gloo on CPU):
    # the new state takes that process group over, as PartialState does for any existing one.
    shared = PartialState._shared_state
    if shared and shared.get("distributed_type") == DistributedType.NO:
        warnings.warn(
            f"accel_flatshard: accelerate's state was set up before this Accelerator without a backend "
            f"(distributed_type NO although {launched_world_size()} processes run); setting it up again on "
            "the CPU path with gloo, sharded. Values read from it before (e.g. TrainingArguments.world_size, "
            "hence batch and step counts) were for 1 process: run the script with `-m accel_flatshard.run` "
            "or call accel_flatshard.register() before creating TrainingArguments / PartialState", stacklevel=4)
        AcceleratorState._reset_state(reset_partial_state=True)


def _refuse_unsharded_launch(state: Any) -> None:
    """Several processes were launched under an FSDP config but none is sharding: fail, never train unsharded."""
    world = launched_world_size()
    if world > 1 and not (state.distributed_type == DistributedType.FSDP and state.num_processes == world):
        raise RuntimeError(
            f"accel_flatshard: {world} processes were launched with an FSDP config, but accelerate's state is "
            f"distributed_type {state.distributed_type} with {state.num_processes} process(es): each would "
            "train an unsharded copy. Something set up accelerate's state before this Accelerator without a "
            "backend (e.g. PartialState() or TrainingArguments created with a process group already "
            "initialised another way); let accel_flatshard's Accelerator (or TrainingArguments, under "
            "`-m accel_flatshard.run`) set it up, or set ACCELERATE_USE_CPU=true on a host without GPUs")


def _compile_per_dynamo_plugin(wrapped: FullyShardedDataParallel, plugin: Any) -> None:
    """accelerate's ``dynamo_backend`` / ``dynamo_config`` (``compilation.py``): ``use_regional_compilation``
    compiles each inner unit's forward, else the whole model with graph breaks at the units' hooks."""
    if plugin.backend == DynamoBackend.NO:
        return
    kwargs = plugin.to_kwargs()
    if kwargs.get("fullgraph") and not plugin.use_regional_compilation:
        raise ValueError("dynamo_config: fullgraph=True cannot hold for a whole accel_flatshard model (its units' "
                         "gather/free hooks break the graph); set use_regional_compilation: true (one full "
                         "graph per block) or fullgraph: false")
    compile_model(wrapped, regional=bool(plugin.use_regional_compilation), **kwargs)


def register() -> None:
    """Make ``accelerate.Accelerator`` this class for code that looks the name up afterwards (modules that
    imported it before keep accelerate's), after :func:`.versions.check_versions`; applies the ``register`` and
    ``accelerator`` patches of :data:`.patches.PATCHES`.  Idempotent."""
    check_versions()
    use_cpu_state_for_launch()
    patches.install(register=True)


def register_for_launch_without_runner() -> None:
    """An FSDP launch of several processes without ``-m accel_flatshard.run`` (``accel_flatshard_autoload``): on a
    host without CUDA, where accelerate's own FSDP fails (FSDP1) or trains unsharded copies (FSDP2),
    :func:`register` as the runner does; with CUDA, nothing (accelerate's torch FSDP runs as configured)."""
    if torch.cuda.is_available():
        return
    logging.getLogger(__name__).warning(
        "accel_flatshard: an FSDP launch without `-m accel_flatshard.run` on a host without CUDA, where accelerate's "
        "own FSDP cannot shard: accelerate.Accelerator is accel_flatshard's here, as under the runner")
    register()
