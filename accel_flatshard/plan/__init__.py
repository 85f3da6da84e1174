"""The memory planner (``accel-flatshard plan``): each rank's peak memory in a training step, before the launch.

The model is built on the meta device and sharded on paper by ``prepare``'s own code (``wrap.select_units``,
``fully_sharded._assign_owners``, ``FlatParamLayout``, the options of ``integrations/config.py``).  Activations
are measured: one forward and backward of the model class on fake tensors at one rank's micro-batch, in the
compute dtype, with the engine's flat views, while a dispatch mode records the live storage bytes after every
op and hooks mark each unit's forward, backward and flat gradients (a trace; ``trace.py``).  :func:`_replay` holds the
engine's buffers over the trace by the rules of ``engine.py`` and ``unit.py``, on top of the shards, buffers
and optimizer state (two fake steps).  :func:`recommend` ranks what fits by :func:`step_time`; the command
line is ``__main__.py``.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import itertools
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .._compat import FakeTensorMode, fake_mode_with_scalars, map_tensors, tensors_in
from ..engine import Engine
from ..flat_param import FlatParameter, FlatParamLayout
from ..fully_sharded import _assign_owners
from ..integrations.config import FlatShardOptions
from ..wrap import backward_reads_parameters, checkpoint_units, select_units
from .trace import _as_call, _copy, _loss_of, _mark_unit, _Trace, _why_fake_failed

MAX_PENDING_REDUCTIONS = inspect.signature(Engine).parameters["max_pending_reductions"].default  # (the wrapper's)
# The cost model's hardware per GPU (it only ranks configurations): half-precision FLOP/s (fp32: a quarter), the
# links inside and between nodes, PCIe, the host's optimizer step (state bytes/s), one unit's pass per micro-step.
HARDWARE = {"flops": 300e12, "intra_node": 150e9, "inter_node": 25e9, "pcie": 25e9, "host_step": 4e9,
            "unit_pass_s": 50e-6}


@dataclasses.dataclass(frozen=True)
class Config:
    """The knobs of a run that change its memory (what the recommendation varies)."""

    reshard_after_forward: bool = True  # FULL_SHARD / HYBRID_SHARD; False: SHARD_GRAD_OP / _HYBRID_SHARD_ZERO2
    shard_size: int = 1  # ranks a parameter is sharded over (W, or the hybrid group size)
    forward_prefetch: bool = True
    backward_prefetch: Optional[str] = "BACKWARD_PRE"  # or "BACKWARD_POST", None
    limit_all_gathers: int = 2
    checkpointing: bool = False
    offload: bool = False
    micro_batch: int = 1
    accumulation: str = "none"  # micro-batch < batch: "no_sync" (accelerate's default) or "sync_each_batch"

    @classmethod
    def of(cls, opts: FlatShardOptions, world_size: int, micro_batch: int) -> "Config":
        prefetch = opts.backward_prefetch.name if opts.backward_prefetch else None
        return cls(opts.reshard_after_forward, opts.fsdp_group_size or world_size, opts.forward_prefetch, prefetch,
                   opts.limit_all_gathers, opts.activation_checkpointing, opts.offload_params, micro_batch)

    def strategy(self, world_size: int) -> str:
        if self.shard_size == 1 and world_size > 1:
            return "NO_SHARD"
        if self.shard_size < world_size:
            return "HYBRID_SHARD" if self.reshard_after_forward else "_HYBRID_SHARD_ZERO2"
        return "FULL_SHARD" if self.reshard_after_forward else "SHARD_GRAD_OP"

    def describe(self, world_size: int) -> str:
        prefetch = "+".join(filter(None, ["forward" if self.forward_prefetch else "", self.backward_prefetch])) or "off"
        onoff = lambda flag: "on" if flag else "off"  # noqa: E731
        accumulation = f" ({self.accumulation})" if self.accumulation != "none" else ""
        return (f"{self.strategy(world_size)} group {self.shard_size}, prefetch {prefetch}, limit_all_gathers "
                f"{self.limit_all_gathers}, AC {onoff(self.checkpointing)}, offload {onoff(self.offload)}, micro-batch "
                f"{self.micro_batch}{accumulation}")


@dataclasses.dataclass
class Prediction:
    peak_bytes: int
    where: str  # e.g. "backward of model.layers.3"
    parts: Dict[str, int]  # what is held at the peak, by kind


@dataclasses.dataclass(frozen=True)
class _Flat:
    """Bytes of one flat parameter on rank 0 (the fullest shard); those of its reduction are 0 when frozen."""

    gathered: int  # unsharded buffer, and the flat gradient (compute dtype)
    shard: int  # local shard (parameter dtype)
    copy: int  # the shard cast to the compute dtype for its all-gather (0 without mixed precision)
    full_reduce: int  # the flat gradient in the reduce dtype
    shard_reduce: int  # reduced shard (reduce dtype)
    convert: bool  # the reduced shard is cast to the parameter dtype at the end of backward
    trainable: bool
    dtype: torch.dtype
    pieces: Tuple[int, ...]  # elements of each parameter in the shard (the optimizer state's sizes)


class Planner:
    """One rank's peak for a model (``build()``: a fresh meta-device model), options and per-device batch.

    ``make_batch(n)``: the forward's inputs for ``n`` samples (a dict of keyword arguments, a tuple, or an
    ``(args, kwargs)`` pair; under fake tensors); the loss is the output's ``.loss``, else the output (summed).
    ``device``: "cuda", or "cpu" (gloo point-to-point, no stream lag); ``autocast``: accelerate's
    ``mixed_precision`` also autocasts the forward; ``optimizer``: a torch.optim class (foreach on CUDA)."""

    def __init__(self, build: Callable[[], nn.Module], options: FlatShardOptions, world_size: int, batch_size: int,
                 make_batch: Callable[[int], Any], device: str = "cuda", autocast: bool = False,
                 optimizer: type = torch.optim.AdamW, num_machines: int = 1, tokens: int = 1) -> None:
        self.build, self.options, self.world_size, self.batch_size = build, options, world_size, batch_size
        self.make_batch, self.device, self.autocast, self.optimizer = make_batch, device, autocast, optimizer
        self.num_machines, self.tokens = num_machines, tokens  # (tokens per sample: for the cost model)
        mp = options.mixed_precision
        self.param_dtype, self.buffer_dtype = (mp.param_dtype, mp.buffer_dtype) if mp else (None, None)
        self.reduce_dtype = mp.effective_reduce_dtype if mp else None
        model = build()
        self.class_name, self.numel = type(model).__name__, sum(p.numel() for p in model.parameters())
        self.buffer_bytes = sum(b.numel() * (self.buffer_dtype or b.dtype).itemsize if b.is_floating_point()
                                else b.nbytes for b in model.buffers())
        units, names = self._units(model), {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        self.names = [names[id(m)] or "<root>" for m in units]
        self.gathers_for_backward = [backward_reads_parameters(m) for m in units]  # (Unit.gathers_for_backward)
        # per unit (root first, as the wrapper builds them), its flat parameters: fqns, shapes, dtype, requires_grad
        self._groups = [[(fqns, [p.shape for p in ps], ps[0].dtype, ps[0].requires_grad) for ps, fqns, _ in groups]
                        for groups in _assign_owners(model, units)[0].values()]
        for name in ("layout", "trace", "optimizer_bytes"):  # computed once per planner and argument
            setattr(self, name, functools.lru_cache(maxsize=None)(getattr(self, name)))

    def _units(self, model: nn.Module) -> List[nn.Module]:
        return select_units(model, self.options.auto_wrap_policy(model))

    def layout(self, shard_size: int) -> List[List[_Flat]]:
        """Per unit, its flat parameters at this shard group size."""
        return [[self._flat(*group, shard_size) for group in groups] for groups in self._groups]

    def _flat(self, fqns: List[str], shapes: List[torch.Size], dtype: torch.dtype, trainable: bool,
              shard_size: int) -> _Flat:
        layout = FlatParamLayout(fqns, shapes, shard_size)
        compute = self.param_dtype or dtype
        reduce = self.reduce_dtype or compute
        n, s = layout.padded_numel, layout.shard_numel
        return _Flat(n * compute.itemsize, s * dtype.itemsize, s * compute.itemsize if compute != dtype else 0,
                     trainable * n * reduce.itemsize, trainable * s * reduce.itemsize, trainable and reduce != dtype,
                     trainable, dtype, tuple(p.length for p in layout.shard_pieces(0)))

    def _fake(self, t: torch.Tensor) -> torch.Tensor:
        """A fake CPU tensor for a meta parameter or buffer, in the dtype the wrapper computes in."""
        dtype = self.param_dtype if isinstance(t, nn.Parameter) else self.buffer_dtype
        return torch.empty(t.shape, dtype=dtype if dtype and t.is_floating_point() else t.dtype)

    def trace(self, checkpointing: bool, micro_batch: int) -> _Trace:
        """The activation trace of one forward and backward at this micro-batch.

        The batch is made for real (``make_batch``) and enters the model as fake copies, except an integer
        ``*attention_mask``: the real one, and the ops on it alone run for real.  So transformers takes the real
        run's path: it reads the mask, skips the 4-D causal mask when it is all ones, and attention with grouped
        K/V heads then does not repeat them (a fake mask looks like tracing to it, ``is_tracing``: it would build
        both)."""
        trace: Optional[_Trace] = None
        real = _as_call(self.make_batch(micro_batch))  # (held through the step, as by the caller)
        masks = [v for k, v in real[1].items() if k.endswith("attention_mask") and isinstance(v, torch.Tensor)
                 and not v.is_floating_point()]
        try:
            meta = self.build()
            with FakeTensorMode(allow_non_fake_inputs=True):
                model = _copy(meta, self._fake)
                units = self._units(model)
                owned, _ = _assign_owners(model, units)
                flats = [[FlatParameter(ps, fqns, users, 0, 1) for ps, fqns, users in owned[id(m)]] for m in units]
                if checkpointing:
                    checkpoint_units(model, units)
                unsharded = [f.alloc_unsharded() for fs in flats for f in fs]  # gathered for good, not counted
                trace = _Trace([*model.parameters(), *model.buffers(), *unsharded])
                for i, (m, fs) in enumerate(zip(units, flats)):  # (the hooks go with the model)
                    _mark_unit(trace, i, m, fs)
                trace.add_real(masks)
                with trace:
                    trace.hold(masks)
                    batch = map_tensors(lambda t: t if trace.is_real(t) else torch.empty_like(t), real)
                    args, kwargs = map_tensors(lambda t: t.to(self.param_dtype) if t.is_floating_point() else t, batch) \
                        if self.param_dtype and self.options.mixed_precision.cast_forward_inputs else batch  # as the root
                    with torch.autocast("cpu", self.param_dtype or torch.bfloat16, enabled=self.autocast):
                        out = model(*args, **kwargs)
                    del args, kwargs  # (the cast copies live as long as the forward keeps them)
                    if self.autocast:  # and converts the outputs to fp32 (convert_outputs_to_fp32)
                        from accelerate.utils import convert_to_fp32
                        out = convert_to_fp32(out)
                    loss = _loss_of(out)
                    del out
                    loss.backward()
                    trace.mark("end", 0)
        except Exception as exc:  # noqa: BLE001 - named for the user: the model, the op, and why fake tensors failed
            raise ValueError(f"{self.class_name}'s forward and backward did not run on fake tensors: "
                             f"{_why_fake_failed(trace and trace.failed, exc)}") from exc
        return trace

    def optimizer_bytes(self, shard_size: int) -> Tuple[int, int]:
        """(state, more during a step) of the optimizer on rank 0's shards, from two fake steps."""
        sizes = [(n, f.dtype) for unit in self.layout(shard_size) for f in unit if f.trainable for n in f.pieces]
        with fake_mode_with_scalars():
            params = [nn.Parameter(torch.empty(n, dtype=d)) for n, d in sizes]
            for p in params:
                p.grad = torch.empty_like(p)
            foreach = {"foreach": self.device == "cuda"} if "foreach" in inspect.signature(self.optimizer).parameters \
                else {}
            optimizer = self.optimizer(params, lr=1e-4, **foreach)  # (torch's default on CUDA: the fake step is on CPU)
            with _Trace(params + [p.grad for p in params]) as trace:
                optimizer.step()
                state, first = trace.live, len(trace.samples)
                optimizer.step()
        return state, max(trace.samples[first:], default=state) - state

    def predict(self, cfg: Config) -> Prediction:
        return _replay(self, cfg)


# ---------------------------------------------------------------------- the replay
def _replay(planner: Planner, cfg: Config) -> Prediction:
    """One rank's memory over the step of ``cfg``: persistent state + the engine's buffers + the trace (gathers,
    prefetch, pending reductions, reduced shards, mixed-precision and offload copies; on CUDA the host runs
    ahead of the GPU, so a freed buffer is reusable once the host waited for a later free event)."""
    units, trace = planner.layout(cfg.shard_size), planner.trace(cfg.checkpointing, cfg.micro_batch)
    cuda = planner.device == "cuda"
    on_device = not (cfg.offload and cuda)  # offload onto a GPU: shards, gradients, optimizer state on the host
    trainable = [f for u in units for f in u if f.trainable]
    state, step_extra = planner.optimizer_bytes(cfg.shard_size)
    keep_grads = on_device and (cfg.accumulation == "sync_each_batch" or cfg.offload)  # (CPU offload: host buffers)
    convert = any(f.convert for f in trainable)
    base = {"parameter shards": sum(f.shard for u in units for f in u) if on_device else 0,
            "gradient shards": sum(f.shard for f in trainable) if keep_grads else 0,
            "optimizer state": state if on_device else 0, "module buffers": planner.buffer_bytes}
    held_full = ({i: sum(f.gathered for f in u if f.trainable) for i, u in enumerate(units)}
                 if cfg.accumulation == "no_sync" else {})  # accumulated full gradients (the last micro-step)
    order = list(dict.fromkeys(e[1] for e in trace.events if e[0] == "fwd"))
    pos = {u: i for i, u in enumerate(order)}
    last = order[-1] if len(order) > 1 else None
    gathered: Dict[int, int] = {}
    freed: collections.deque = collections.deque()  # CUDA: (bytes, free event number) the host did not see freed
    lingering = [0, 0]  # CUDA: dropped gradient shards (record_stream'ed), the free event number that covers them
    copies: Dict[int, int] = {}  # gloo: a prefetched gather's cast shard, until the gather is waited for
    pending: collections.deque = collections.deque()  # reductions in flight: full gradient (+ received chunks)
    held = {"reduced": 0, "sharded": 0, "events": 0}
    status: Dict[int, str] = {}
    stack: List[int] = []
    where = ["forward", 0]
    best = Prediction(0, "", {})

    def note(act: int, extra: int = 0, kind: str = "full gradients") -> None:
        parts = dict(base, **{
            "gradient shards": base["gradient shards"] + held["reduced"] + held["sharded"] + lingering[0],
            "gathered units": sum(gathered.values()) + sum(n for n, _ in freed) + sum(copies.values()),
            "full gradients": sum(pending) + sum(held_full.values()), "activations": act, "optimizer step": 0})
        parts[kind] += extra
        if sum(parts.values()) > best.peak_bytes:
            phase, unit = where
            best.peak_bytes, best.parts = sum(parts.values()), parts
            best.where = phase if phase in ("end of backward", "optimizer step") else f"{phase} of {planner.names[unit]}"

    def gather(u: int, act: int, keep: bool = False) -> None:
        if u in gathered:
            return
        while cuda and len(freed) >= cfg.limit_all_gathers:  # the host synchronises on the oldest free event
            if freed.popleft()[1] >= lingering[1]:
                lingering[0] = 0
        gathered[u] = sum(f.gathered for f in units[u])
        copy = sum(f.copy for f in units[u])
        note(act, copy + (0 if on_device else sum(f.shard for f in units[u])), "gathered units")
        if keep and not cuda:
            copies[u] = copy

    def free(u: int) -> None:
        nbytes = gathered.pop(u, 0)
        if nbytes and cuda:
            freed.append((nbytes, held["events"]))
            held["events"] += 1

    def drop(nbytes: int) -> None:
        lingering[:] = [lingering[0] + nbytes, held["events"]]

    def prefetch_before(u: int, act: int) -> None:
        i = pos.get(u, 0)
        if i and status.get(order[i - 1]) == "await" and planner.gathers_for_backward[order[i - 1]]:
            gather(order[i - 1], act, keep=True)

    for _ in range(2 if cuda else 1):  # CUDA: the second step starts with what the first left in flight
        best.peak_bytes = 0
        status.clear()
        if cuda and on_device and not (convert or keep_grads):
            drop(held["sharded"])  # the gradient shards are released at the next forward
        held["sharded"] = 0
        for event, piece in zip(trace.events, trace.pieces()):
            kind, u, _, live = event[:4]
            if kind == "fwd":
                copies.pop(u, None)
                first = u not in status  # (a unit called twice in one forward prefetches once)
                gather(u, live)
                status[u], where[:] = "fwd", ["forward", u]
                stack.append(u)
                if cfg.forward_prefetch and first and pos[u] + 1 < len(order):
                    gather(order[pos[u] + 1], live, keep=True)
            elif kind == "fwd_end":
                stack.pop()
                status[u] = "await"
                where[1] = stack[-1] if stack else u
                if u != 0 and u != last and cfg.reshard_after_forward:
                    free(u)
            elif kind in ("bwd", "recompute"):
                where[:] = ["backward", u]
                copies.pop(u, None)
                needs_params = kind == "recompute" or planner.gathers_for_backward[u]
                if kind == "bwd" and not (status.get(u) == "bwd" and u in gathered):
                    status[u] = "bwd"
                    if needs_params:
                        gather(u, live)
                    if cfg.backward_prefetch == "BACKWARD_PRE":
                        prefetch_before(u, live)
                if needs_params:
                    gather(u, live)  # (a recomputation gathers a unit that is not)
            elif kind == "grad":  # a flat gradient is complete (concatenated in the trace): reduce it
                f = units[u][event[4]]
                while len(pending) >= MAX_PENDING_REDUCTIONS:
                    pending.popleft()
                # cast to the reduce dtype; the compute-dtype one lives until reduce_grad returns (the caller's)
                cast = f.gathered if f.full_reduce != f.gathered else 0
                received = 0 if cuda else f.shard_reduce * (cfg.shard_size - 1)  # gloo point-to-point
                held_full.pop(u, None)
                note(live, cast + f.full_reduce + f.shard_reduce + received + (f.shard if not on_device and f.convert else 0))
                pending.append(f.full_reduce + received)
                held["reduced"] += f.shard_reduce if on_device else 0
            elif kind == "done":
                free(u)
                if cfg.backward_prefetch == "BACKWARD_POST":
                    prefetch_before(u, live)
            elif kind == "end":
                pending.clear()
                where[0] = "end of backward"
                if on_device:  # the reduced shards become the gradient shards (cast to the parameter dtype)
                    converted = [f.shard for f in trainable if f.convert]
                    note(live, max(converted, default=0) if keep_grads else sum(converted), "gradient shards")
                    held["reduced"], held["sharded"] = 0, 0 if keep_grads else sum(f.shard for f in trainable)
                    if cuda and (convert or keep_grads):
                        drop(sum(f.shard_reduce for f in trainable))  # the reduced shards, added or cast
                for g in list(gathered):
                    free(g)
                where[0] = "optimizer step"
                note(live, step_extra if on_device else 0, "optimizer step")
            note(max(piece, default=live))  # the ops until the next event
    return best


# ---------------------------------------------------------------------- the recommendation
def step_time(planner: Planner, cfg: Config) -> float:
    """Seconds per optimizer step by a stated cost model (``HARDWARE``): compute 6 x parameters x
    tokens FLOPs (8 with activation checkpointing: one more forward); per micro-step the all-gathers
    (forward, and backward again when resharding) and the reduce-scatter (only the last micro-step's
    under no_sync) over the shard group's link, the replicas' all-reduce between nodes, offload's copies
    over PCIe, and a fixed cost per unit and pass; the optimizer step on the host with offload.  Prefetch
    hides communication behind compute (limit_all_gathers 1: half of it)."""
    hw, flats = HARDWARE, [f for u in planner.layout(cfg.shard_size) for f in u]
    G, W, steps = cfg.shard_size, planner.world_size, planner.batch_size // cfg.micro_batch
    rate = hw["flops"] / (4 if (planner.param_dtype or torch.float32) == torch.float32 else 1)
    compute = (6 + 2 * cfg.checkpointing) * planner.numel * cfg.micro_batch * planner.tokens / rate
    link = hw["intra_node"] if G <= max(1, W // planner.num_machines) else hw["inter_node"]
    passes = 2 if cfg.reshard_after_forward else 1
    gather = passes * sum(f.gathered for f in flats) * (G - 1) / G / link
    reduce = sum(f.full_reduce for f in flats) * (G - 1) / G / link
    reduce += 2 * sum(f.shard_reduce for f in flats) * (1 - G / W) / hw["inter_node"]
    copies = (passes + 1) * sum(f.shard for f in flats) / hw["pcie"] if cfg.offload else 0
    overlap = (1.0 if cfg.limit_all_gathers > 1 else 0.5) if cfg.forward_prefetch or cfg.backward_prefetch else 0.0
    comm = steps * (gather + copies) + (1 if cfg.accumulation == "no_sync" else steps) * reduce
    host = planner.optimizer_bytes(G)[0] / hw["host_step"] if cfg.offload else 0
    fixed = steps * 3 * len(planner.names) * hw["unit_pass_s"] * (1 + cfg.checkpointing / 3)
    return steps * compute + max(0.0, comm - overlap * steps * compute) + host + fixed


def recommend(planner: Planner, device_memory: int, limit: int = 8) -> List[Tuple[Config, Prediction, float]]:
    """The configurations whose predicted peak fits ``device_memory``, fastest first (:func:`step_time`); of
    those differing only in prefetch or limit_all_gathers, the fastest.  Tried: the strategies and group sizes
    (W, a node, 1) x prefetch x limit_all_gathers x AC x offload (CUDA) x micro-batches (the divisors of the
    batch, with either kind of accumulation)."""
    W, B = planner.world_size, planner.batch_size
    groups = sorted({W} | {g for g in (max(1, W // planner.num_machines), 1) if W % g == 0})
    batches = [(m, acc) for m in range(B, 0, -1) if B % m == 0
               for acc in (("none",) if m == B else ("no_sync", "sync_each_batch"))]
    knobs = itertools.product(groups, (True, False), (True, False), (2, 1), (False, True),
                              (False, True) if planner.device == "cuda" else (False,), batches)
    tried = [Config(reshard, g, prefetch, "BACKWARD_PRE" if prefetch else None, limit, ac, offload, mb, acc)
             for g, reshard, prefetch, limit, ac, offload, (mb, acc) in knobs if g > 1 or not reshard]
    rows = ((c, planner.predict(c)) for c in tried)
    fits = sorted(((c, p, step_time(planner, c)) for c, p in rows if p.peak_bytes <= device_memory), key=lambda r: r[2])
    kinds = {}
    for c, p, t in fits:
        kinds.setdefault(dataclasses.replace(c, forward_prefetch=True, backward_prefetch=None, limit_all_gathers=0), (c, p, t))
    return list(kinds.values())[:limit]


def settings(cfg: Config, world_size: int, batch_size: int) -> List[str]:
    """What to set for ``cfg``: the yaml's fsdp_config keys, FLATSHARD_* variables, batch and accumulation."""
    out = [f"fsdp_sharding_strategy: {cfg.strategy(world_size)}",
           f"fsdp_backward_prefetch: {cfg.backward_prefetch or 'NO_PREFETCH'}",
           f"fsdp_forward_prefetch: {str(cfg.forward_prefetch).lower()}",
           f"fsdp_activation_checkpointing: {str(cfg.checkpointing).lower()}",
           f"fsdp_offload_params: {str(cfg.offload).lower()}", f"FLATSHARD_LIMIT_ALL_GATHERS={cfg.limit_all_gathers}"]
    if 1 < cfg.shard_size < world_size:
        out.append(f"FLATSHARD_GROUP_SIZE={cfg.shard_size}")
    steps = batch_size // cfg.micro_batch
    sync = ("GradientAccumulationPlugin(num_steps=..., sync_each_batch=True)" if cfg.accumulation == "sync_each_batch"
            else "accelerate's default no_sync until the last micro-step")
    return out + [f"per-device batch {cfg.micro_batch}" + (f", gradient_accumulation_steps {steps} ({sync})" if steps > 1 else "")]


# ---------------------------------------------------------------------- the check at prepare
def meta_copy(model: nn.Module) -> nn.Module:
    """``model``'s structure on the meta device (ties kept); no data is copied."""
    return _copy(model, lambda t: t.detach().to("meta"))


def warn_before_first_step(wrapped: nn.Module, skeleton: nn.Module, options: FlatShardOptions, world_size: int,
                           autocast: bool, available_bytes: Callable[[torch.device], int]) -> None:
    """``prepare`` (CUDA): at the prepared model's first forward (its inputs give the batch), predict this rank's
    peak (``skeleton``: :func:`meta_copy` of the model before wrapping) and warn once if it exceeds
    ``available_bytes(device)``, with the fastest configuration predicted to fit.  A warning, not an error:
    the prediction may be pessimistic (it assumes the host runs ahead of the GPU)."""
    device = wrapped._schedule.engine.device

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
            predicted, available = planner.predict(Config.of(options, world_size, rows)), available_bytes(device)
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
