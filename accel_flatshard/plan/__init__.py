"""The memory planner (``accel-flatshard plan``): each rank's peak memory in a training step, before the launch.

The model is built on the meta device and sharded on paper by ``prepare``'s own code for the cost model.  The peak
is measured, not derived: the real wrapper trains it for two steps on fake tensors (``run.py``, ``trace.py``).
:func:`recommend` ranks what fits by :func:`step_time`; the command line is ``tools/plan_cli.py``.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import warnings
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.nn as nn

from ..core._compat import map_tensors, tensors_in
from ..core.flat_param import FlatParamLayout
from ..core.fully_sharded import assign_owners
from ..core.options import BackwardPrefetch, FlatShardOptions, sharding_strategy
from ..core.wrap import policy_of, select_units
from . import run
from .run import Prediction
from .trace import copy_model

# The cost model's hardware per GPU (it only ranks configurations): half-precision FLOP/s (fp32: a quarter), the
# links inside and between nodes, PCIe, the host's optimizer step (state bytes/s), one unit's pass per micro-step.
HARDWARE = {"flops": 300e12, "intra_node": 150e9, "inter_node": 25e9, "pcie": 25e9, "host_step": 4e9,
            "unit_pass_s": 50e-6}


# the options the recommendation varies (the others stay the launch's)
VARIED = ("reshard_after_forward", "fsdp_group_size", "forward_prefetch", "backward_prefetch", "limit_all_gathers",
          "activation_checkpointing", "offload_params")


@dataclasses.dataclass(frozen=True)
class Config:
    """A run: the model's options (the recommendation varies ``reshard_after_forward``, ``fsdp_group_size``, the
    prefetches, ``limit_all_gathers``, ``activation_checkpointing`` and ``offload_params``, each a ``replace()`` of
    the launch's) and the per-device micro-batch with its accumulation ("none", "no_sync": accelerate's default,
    or "sync_each_batch")."""

    options: FlatShardOptions
    micro_batch: int = 1
    accumulation: str = "none"

    def replace(self, **settings: Any) -> "Config":
        """This run with some of its options changed."""
        return dataclasses.replace(self, options=dataclasses.replace(self.options, **settings))

    def knobs(self) -> Dict[str, Any]:
        """What the recommendation varies, by name (the options' and the batch's)."""
        o = self.options
        return {**{name: getattr(o, name) for name in VARIED}, "backward_prefetch": o.backward_prefetch and
                o.backward_prefetch.name, "micro_batch": self.micro_batch, "accumulation": self.accumulation}

    def shard_size(self, world_size: int) -> int:
        """Ranks a parameter is sharded over: the world, or the hybrid group size."""
        return self.options.fsdp_group_size or world_size

    def strategy(self, world_size: int) -> str:
        """The yaml's ``fsdp_sharding_strategy`` for this run (the one mapping, ``core.options``)."""
        return sharding_strategy(self.options.reshard_after_forward, self.options.fsdp_group_size, world_size)

    def describe(self, world_size: int) -> str:
        o = self.options
        backward = o.backward_prefetch.name if o.backward_prefetch else None
        prefetch = "+".join(filter(None, ["forward" if o.forward_prefetch else "", backward])) or "off"
        onoff = lambda flag: "on" if flag else "off"  # noqa: E731
        accumulation = f" ({self.accumulation})" if self.accumulation != "none" else ""
        return (f"{self.strategy(world_size)} group {self.shard_size(world_size)}, prefetch {prefetch}, "
                f"limit_all_gathers {o.limit_all_gathers}, AC {onoff(o.activation_checkpointing)}, offload "
                f"{onoff(o.offload_params)}, micro-batch {self.micro_batch}{accumulation}")


class Planner:
    """One rank's peak for a model (``build()``: a fresh meta-device model), options and per-device batch.

    ``make_batch(n)``: the forward's inputs for ``n`` samples (a dict, a tuple, or an ``(args, kwargs)`` pair); the
    loss is the output's ``.loss``, else the output (summed).  ``device``: "cuda" or "cpu" (no stream lag)."""

    def __init__(self, build: Callable[[], nn.Module], options: FlatShardOptions, world_size: int, batch_size: int,
                 make_batch: Callable[[int], Any], device: str = "cuda", autocast: bool = False,
                 optimizer: type = torch.optim.AdamW, num_machines: int = 1, tokens: int = 1) -> None:
        self.build, self.options, self.world_size, self.batch_size = build, options, world_size, batch_size
        self.make_batch, self.device, self.autocast, self.optimizer = make_batch, device, autocast, optimizer
        self.num_machines, self.tokens = num_machines, tokens  # (tokens per sample: for the cost model)
        mp = options.mixed_precision
        self.param_dtype, self.reduce_dtype = (mp.param_dtype, mp.effective_reduce_dtype) if mp else (None, None)
        model = build()
        self.class_name, self.numel = type(model).__name__, sum(p.numel() for p in model.parameters())
        units = select_units(model, policy_of(options, model))
        names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        self.names = [names[id(m)] or "<root>" for m in units]
        # the flat parameters the wrapper builds: fqns, shapes, dtype, requires_grad
        self._flats = [(fqns, [p.shape for p in ps], ps[0].dtype, ps[0].requires_grad)
                       for groups in assign_owners(model, units)[0].values() for ps, fqns, _ in groups]
        for name in ("sizes", "predict"):  # computed once per planner and argument
            setattr(self, name, functools.lru_cache(maxsize=None)(getattr(self, name)))

    def sizes(self, shard_size: int) -> Dict[str, int]:
        """Bytes of rank 0's (the fullest) flat parameters at this group size, for the cost model: ``gathered``,
        ``shard``, ``trainable_shard``, and gradients in the reduce dtype, ``full_reduce`` and ``shard_reduce``."""
        out: Dict[str, int] = collections.Counter()
        for fqns, shapes, dtype, trainable in self._flats:
            layout, compute = FlatParamLayout(fqns, shapes, shard_size), self.param_dtype or dtype
            n, s, reduce = layout.padded_numel, layout.shard_numel, (self.reduce_dtype or compute).itemsize
            out.update(gathered=n * compute.itemsize, shard=s * dtype.itemsize, trainable_shard=trainable * s *
                       dtype.itemsize, full_reduce=trainable * n * reduce, shard_reduce=trainable * s * reduce)
        return out

    def predict(self, cfg: Config) -> Prediction:
        """One rank's peak in a step of ``cfg``: the real wrapper's step on fake tensors (``run.py``)."""
        return run.predict(self, cfg)


# ---------------------------------------------------------------------- the recommendation
def step_time(planner: Planner, cfg: Config) -> float:
    """Seconds per optimizer step by a stated cost model (``HARDWARE``): compute 6 x parameters x
    tokens FLOPs (8 with activation checkpointing: one more forward); per micro-step the all-gathers
    (forward, and backward again when resharding) and the reduce-scatter (only the last micro-step's
    under no_sync) over the shard group's link, the replicas' all-reduce between nodes, offload's copies
    over PCIe, and a fixed cost per unit and pass; the optimizer step on the host with offload.  Prefetch
    hides communication behind compute (limit_all_gathers 1: half of it).  Under no_sync,
    ``keep_gathered_across_micro_batches`` gathers once per step (forward), and ``defer_cross_machine_reduce``
    reduces inside the shard group every micro-step and all-reduces the replicas once."""
    hw, o, W = HARDWARE, cfg.options, planner.world_size
    G, steps, checkpointing = cfg.shard_size(W), planner.batch_size // cfg.micro_batch, o.activation_checkpointing
    size = planner.sizes(G)
    rate = hw["flops"] / (4 if (planner.param_dtype or torch.float32) == torch.float32 else 1)
    compute = (6 + 2 * checkpointing) * planner.numel * cfg.micro_batch * planner.tokens / rate
    link = hw["intra_node"] if G <= max(1, W // planner.num_machines) else hw["inter_node"]
    passes = 2 if o.reshard_after_forward else 1
    no_sync = cfg.accumulation == "no_sync"
    gathers = 1 if no_sync and o.keep_gathered_across_micro_batches and steps > 1 else steps * passes  # per step
    gather = gathers * size["gathered"] * (G - 1) / G / link
    in_group = size["full_reduce"] * (G - 1) / G / link
    replicas = 2 * size["shard_reduce"] * (1 - G / W) / hw["inter_node"]
    deferred = no_sync and o.defer_cross_machine_reduce
    reduce = steps * in_group + replicas if deferred else (1 if no_sync else steps) * (in_group + replicas)
    copies = (passes + 1) * size["shard"] / hw["pcie"] if o.offload_params else 0
    overlap = (1.0 if o.limit_all_gathers > 1 else 0.5) if o.forward_prefetch or o.backward_prefetch else 0.0
    comm = gather + steps * copies + reduce
    host = 2 * size["trainable_shard"] / hw["host_step"] if o.offload_params else 0  # (AdamW's state: two moments)
    fixed = steps * 3 * len(planner.names) * hw["unit_pass_s"] * (1 + checkpointing / 3)
    return steps * compute + max(0.0, comm - overlap * steps * compute) + host + fixed


def recommend(planner: Planner, device_memory: int, limit: int = 8) -> List[Tuple[Config, Prediction, float]]:
    """Up to ``limit`` configurations whose predicted peak fits ``device_memory``, fastest first, one per kind (of
    those differing only in prefetch or limit_all_gathers, the fastest): strategies and group sizes (W, a node, 1)
    x prefetch x limit_all_gathers x AC x offload (CUDA) x micro-batches (either kind of accumulation)."""
    W, B = planner.world_size, planner.batch_size
    groups = sorted({W} | {g for g in (max(1, W // planner.num_machines), 1) if W % g == 0})
    batches = [(m, acc) for m in range(B, 0, -1) if B % m == 0
               for acc in (("none",) if m == B else ("no_sync", "sync_each_batch"))]
    knobs = itertools.product(groups, (True, False), (True, False), (2, 1), (False, True),
                              (False, True) if planner.device == "cuda" else (False,), batches)
    launched = Config(planner.options)
    defer, launched_group = planner.options.defer_cross_machine_reduce, launched.shard_size(W)
    tried = [dataclasses.replace(launched.replace(
        # (deferring needs a reduction across shard groups, or the launch's own hpZ layout)
        defer_cross_machine_reduce=defer and (g < W or g == launched_group),
        reshard_after_forward=reshard, fsdp_group_size=g if g < W else None, forward_prefetch=prefetch,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE if prefetch else None, limit_all_gathers=limit,
        activation_checkpointing=ac, offload_params=offload), micro_batch=mb, accumulation=acc)
        for g, reshard, prefetch, limit, ac, offload, (mb, acc) in knobs if g > 1 or not reshard]
    fits: Dict[Config, Tuple[Config, Prediction, float]] = {}
    for t, c in sorted(((step_time(planner, c), c) for c in tried), key=lambda r: r[0]):
        kind = c.replace(forward_prefetch=True, backward_prefetch=None, limit_all_gathers=1)
        # (prefetch and more gathers in flight only add buffers: when a kind's leanest form does not fit, none does)
        leanest = c.replace(forward_prefetch=False, backward_prefetch=None, limit_all_gathers=1)
        if kind not in fits and len(fits) < limit and planner.predict(leanest).peak_bytes <= device_memory \
                and planner.predict(c).peak_bytes <= device_memory:
            fits[kind] = (c, planner.predict(c), t)
    return list(fits.values())


def settings(cfg: Config, world_size: int, batch_size: int) -> List[str]:
    """What to set for ``cfg``: the yaml's fsdp_config keys, FLATSHARD_* variables, batch and accumulation."""
    o, G = cfg.options, cfg.shard_size(world_size)
    out = [f"fsdp_sharding_strategy: {cfg.strategy(world_size)}",
           f"fsdp_backward_prefetch: {o.backward_prefetch.name if o.backward_prefetch else 'NO_PREFETCH'}",
           f"fsdp_forward_prefetch: {str(o.forward_prefetch).lower()}",
           f"fsdp_activation_checkpointing: {str(o.activation_checkpointing).lower()}",
           f"fsdp_offload_params: {str(o.offload_params).lower()}",
           f"FLATSHARD_LIMIT_ALL_GATHERS={o.limit_all_gathers}"]
    if 1 < G < world_size:
        out.append(f"FLATSHARD_FSDP_GROUP_SIZE={G}")
    out += [f"{variable}=1" for variable, on in (
        ("FLATSHARD_KEEP_GATHERED_ACROSS_MICRO_BATCHES", o.keep_gathered_across_micro_batches),
        ("FLATSHARD_DEFER_CROSS_MACHINE_REDUCE", o.defer_cross_machine_reduce)) if on]
    steps = batch_size // cfg.micro_batch
    sync = ("GradientAccumulationPlugin(num_steps=..., sync_each_batch=True)" if cfg.accumulation == "sync_each_batch"
            else "accelerate's default no_sync until the last micro-step")
    accumulate = f", gradient_accumulation_steps {steps} ({sync})" if steps > 1 else ""
    return out + [f"per-device batch {cfg.micro_batch}{accumulate}"]


# ---------------------------------------------------------------------- the check at prepare
def meta_copy(model: nn.Module) -> nn.Module:
    """``model``'s structure on the meta device (ties kept); no data is copied."""
    return copy_model(model, lambda t: t.detach().to("meta"))


def warn_before_first_step(wrapped: nn.Module, skeleton: nn.Module, options: FlatShardOptions, world_size: int,
                           autocast: bool, available_bytes: Callable[[torch.device], int]) -> None:
    """``prepare`` (CUDA): at the first forward (its inputs give the batch), warn once if this rank's predicted peak
    (``skeleton``: :func:`meta_copy` before wrapping) exceeds ``available_bytes(device)``, naming what fits.  Not an
    error: the prediction may be pessimistic."""
    device = wrapped.schedule.device

    def check(module: nn.Module, args: Any, kwargs: Any) -> None:
        handle.remove()
        try:
            tensors = tensors_in((args, kwargs))
            rows = tensors[0].shape[0] if tensors and tensors[0].dim() else 1

            def batch(n: int) -> Tuple[tuple, dict]:  # the inputs with n rows: zeros, the attention masks' values
                like = lambda t: torch.zeros((n, *t.shape[1:]) if t.dim() and t.shape[0] == rows else t.shape,  # noqa
                                             dtype=t.dtype)
                masks = {k: v[:n].cpu() for k, v in kwargs.items() if k.endswith("attention_mask") and isinstance(
                    v, torch.Tensor) and not v.is_floating_point() and v.dim() and v.shape[0] == rows}
                return map_tensors(like, tuple(args)), {**map_tensors(like, kwargs), **masks}
            planner = Planner(lambda: meta_copy(skeleton), options, world_size, rows, batch, device.type, autocast,
                              tokens=tensors[0].numel() // rows if tensors else 1)
            predicted, available = planner.predict(Config(options, rows)), available_bytes(device)
            if predicted.peak_bytes <= available:
                return
            fits = recommend(planner, available, limit=1)
            advice = "; ".join(settings(fits[0][0], world_size, rows)) if fits else "none of the configurations tried"
        except Exception as exc:  # noqa: BLE001 - advice only: training goes on
            warnings.warn(f"accel_flatshard: the memory prediction before the first step failed ({exc!r})")
            return
        warnings.warn(f"accel_flatshard: predicted peak {predicted.peak_bytes / 2**30:.2f} GiB per rank (in the "
                      f"{predicted.where}) exceeds the {available / 2**30:.2f} GiB available on {device}. Fastest "
                      f"configuration predicted to fit: {advice}. `accel-flatshard plan` prints the breakdown "
                      "(the prediction may be pessimistic: on CUDA it assumes the host runs ahead of the GPU).")

    handle = wrapped.register_forward_pre_hook(check, with_kwargs=True)
