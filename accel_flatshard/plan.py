"""The memory planner (``accel-flatshard plan``): each rank's peak memory in a training step, before the launch.

Nothing real is allocated.  The model is built on the meta device and sharded on paper by the code
``prepare`` runs: the units (``wrap.select_units`` with the yaml's policy), the owners of parameters
(``fully_sharded._assign_owners``), the flat layout (``FlatParamLayout``), the options
(``integrations/config.py``).  Then the step is replayed:

1. **Activations are measured.**  One forward and backward of the real model class runs under
   ``FakeTensorMode`` (shapes, no data) on one rank's micro-batch, in the compute dtype, checkpointed
   per unit when activation checkpointing is on; a dispatch mode counts the bytes of live storages
   after every op (a *trace*).  Hooks on the unit modules mark where each unit's forward and backward
   start and where its gradient is complete; the parameters' gradients are dropped there, as the
   engine replaces them by one flat gradient.
2. **The engine's buffers are replayed** over the trace by the rules of ``engine.py`` / ``unit.py``: the
   root stays gathered, the last unit stays from its forward into backward, the next unit is prefetched
   (forward and ``BACKWARD_PRE``), ``SHARD_GRAD_OP`` keeps each unit until its backward; a complete unit's
   flat gradient is concatenated next to its parameters' gradients, at most ``max_pending_reductions``
   of them wait for their reduce-scatter (gloo's point-to-point reduction also holds the received
   chunks), the reduced shards stay until the end of backward; mixed-precision and offload copies.  On
   CUDA the host runs ahead of the GPU: a freed gathered buffer is reusable only once the host
   synchronised on its free event, i.e. up to ``limit_all_gathers`` freed buffers are still held.
3. **Persistent per rank**: parameter shards, module buffers, the optimizer state (its steps measured
   the same way on fake shards), the host gradient buffers of offload on a CPU device, and during
   gradient accumulation the sharded (``sync_each_batch``) or full (``no_sync``) gradients.

The peak is the largest total over every op of the step, with the unit and phase where it occurs.
Recommendations rank the configurations that fit by the cost model of :func:`_step_time`.
"""
from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import importlib
import importlib.util
import json
import math
import sys
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ._compat import FakeTensorMode, TorchDispatchMode, fake_mode_with_scalars, inside_backward_pass, tensors_in
from .flat_param import FlatParamLayout
from .fully_sharded import _assign_owners
from .integrations.config import FlatShardOptions, options_from_launch_args
from .unit import BackwardPrefetch
from .wrap import checkpoint_units, select_units

MAX_PENDING_REDUCTIONS = 2  # the engine's default (Engine(max_pending_reductions=2)); the wrapper does not change it
GiB = 2**30


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
    accumulation: str = "none"  # with micro-batches < the batch: "no_sync" (accelerate's default) or "sync_each_batch"

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


@dataclasses.dataclass
class Prediction:
    peak_bytes: int
    where: str
    parts: Dict[str, int]  # what is held at the peak, by kind


@dataclasses.dataclass
class _Flat:
    gathered: int  # unsharded buffer (compute dtype)
    shard: int  # local shard (parameter dtype)
    copy: int  # the shard cast to the compute dtype for its all-gather (0 without mixed precision)
    trainable: bool
    full: int = 0  # flat gradient (compute dtype)
    full_reduce: int = 0  # ... cast to the reduce dtype
    shard_reduce: int = 0  # reduced shard (reduce dtype)
    pieces: Tuple[int, ...] = ()  # rank 0's element count of each parameter (optimizer state)
    dtype: torch.dtype = torch.float32
    convert: bool = False  # the reduced shard is cast to the parameter dtype at the end of backward


class _Trace(TorchDispatchMode):
    """Bytes of the storages alive after every op (``samples``), and marks between ops (``events``:
    ``(kind, unit, sample index, live bytes)``; ``ready`` also has the live bytes after the drop)."""

    def __init__(self, known: Sequence[torch.Tensor] = ()) -> None:
        super().__init__()
        self.known = {t.untyped_storage()._cdata for t in known}
        self.live, self.samples, self.events = 0, [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tensors_in(out):
            storage = t.untyped_storage()
            key, nbytes = storage._cdata, storage.nbytes()
            if nbytes and key not in self.known:
                self.known.add(key)
                self.live += nbytes
                weakref.finalize(storage, self._died, key, nbytes)
        self.samples.append(self.live)
        return out

    def _died(self, key: int, nbytes: int) -> None:
        self.known.discard(key)
        self.live -= nbytes

    def mark(self, kind: str, unit: int, *extra: int) -> None:
        self.events.append((kind, unit, len(self.samples), self.live, *extra))

    def segments(self) -> List[int]:
        """The largest sample between each event and the next."""
        bounds = [e[2] for e in self.events] + [len(self.samples)]
        return [max(self.samples[a:b], default=e[3]) for e, a, b in zip(self.events, bounds, bounds[1:])]


def _interpolate(a: _Trace, b: _Trace, t: float) -> Optional[_Trace]:
    """The trace at ``a + t (b - a)``: every storage of a step is affine in the micro-batch when the op
    sequence is the same (None when it is not)."""
    if len(a.samples) != len(b.samples) or [e[:3] for e in a.events] != [e[:3] for e in b.events]:
        return None
    out = _Trace()
    out.samples = [round(x + t * (y - x)) for x, y in zip(a.samples, b.samples)]
    out.events = [e[:3] + tuple(round(x + t * (y - x)) for x, y in zip(e[3:], f[3:])) for e, f in zip(a.events, b.events)]
    return out


class Planner:
    """Predicts one rank's peak for a model (``build()`` -> a fresh meta-device model), options and batch.

    ``make_batch(micro_batch)`` returns the forward's keyword arguments (called under fake tensors); the
    loss is the output's ``.loss``, the output itself if it is a scalar, else its sum.  ``device``: the
    device the job runs on ("cuda" or "cpu": gloo point-to-point, no stream lag).  ``autocast``: the
    forward runs under autocast in the mixed-precision dtype (what accelerate's ``mixed_precision`` does).
    ``optimizer(params)`` builds the optimizer (default AdamW; ``foreach`` on CUDA as torch picks it)."""

    def __init__(self, build: Callable[[], nn.Module], options: FlatShardOptions, world_size: int, batch_size: int,
                 make_batch: Callable[[int], Any], device: str = "cuda", autocast: bool = False,
                 optimizer: Optional[Callable[[List[nn.Parameter]], torch.optim.Optimizer]] = None,
                 num_machines: int = 1) -> None:
        self.build, self.options, self.world_size, self.batch_size = build, options, world_size, batch_size
        self.make_batch, self.device, self.autocast, self.num_machines = make_batch, device, autocast, num_machines
        self.optimizer = optimizer or (lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=device == "cuda"))
        mp = options.mixed_precision
        self.param_dtype = mp.param_dtype if mp else None
        self.reduce_dtype = mp.effective_reduce_dtype if mp else None
        self.buffer_dtype = mp.buffer_dtype if mp else None
        model = build()
        self.class_name = type(model).__name__
        self.numel = sum(p.numel() for p in model.parameters())
        self.buffer_bytes = sum(b.numel() * (b.element_size() if not b.is_floating_point() or self.buffer_dtype is None
                                             else self.buffer_dtype.itemsize) for b in model.buffers())
        self.names = ["<root>" if not n else n for n in _unit_names(model, select_units(model, options.auto_wrap_policy(model)))]
        self._layouts: Dict[int, List[List[_Flat]]] = {}
        self._traces: Dict[Tuple[bool, int], _Trace] = {}
        self._optimizer: Dict[int, Tuple[int, int]] = {}

    # ------------------------------------------------------------------ the model on paper
    def layout(self, shard_size: int) -> List[List[_Flat]]:
        """Per unit (select order), its flat parameters' sizes at this shard group size (rank 0)."""
        if shard_size not in self._layouts:
            model = self.build()
            owned, _ = _assign_owners(model, select_units(model, self.options.auto_wrap_policy(model)))
            self._layouts[shard_size] = [[self._flat(params, fqns, shard_size) for params, fqns, _ in groups]
                                         for groups in owned.values()]
        return self._layouts[shard_size]

    def _flat(self, params: List[nn.Parameter], fqns: List[str], shard_size: int) -> _Flat:
        layout = FlatParamLayout(fqns, [p.shape for p in params], shard_size)
        dtype = params[0].dtype
        compute = self.param_dtype or dtype
        reduce = self.reduce_dtype or compute
        n, s = layout.padded_numel, layout.shard_numel
        flat = _Flat(n * compute.itemsize, s * dtype.itemsize, s * compute.itemsize if compute != dtype else 0,
                     params[0].requires_grad, dtype=dtype, pieces=tuple(p.length for p in layout.shard_pieces(0)))
        if flat.trainable:
            flat.full, flat.full_reduce, flat.shard_reduce = n * compute.itemsize, n * reduce.itemsize, s * reduce.itemsize
            flat.convert = reduce != dtype
        return flat

    def trace(self, checkpointing: bool, micro_batch: int) -> _Trace:
        """The activation trace at this micro-batch (measured at 1 and the full batch, interpolated between)."""
        key = (checkpointing, micro_batch)
        if key not in self._traces:
            if micro_batch in (1, self.batch_size):
                self._traces[key] = self._measure(*key)
            else:
                a, b = self.trace(checkpointing, 1), self.trace(checkpointing, self.batch_size)
                t = (micro_batch - 1) / (self.batch_size - 1)
                self._traces[key] = _interpolate(a, b, t) or self._measure(*key)
        return self._traces[key]

    def _measure(self, checkpointing: bool, micro_batch: int) -> _Trace:
        model = self.build()
        units = select_units(model, self.options.auto_wrap_policy(model))
        with FakeTensorMode(allow_non_fake_inputs=True):
            _to_fake(model, self.param_dtype, self.buffer_dtype)
            owned, _ = _assign_owners(model, units)
            if checkpointing:
                checkpoint_units(model, units)
            trace = _Trace(list(model.parameters()) + list(model.buffers()))
            handles = [h for i, m in enumerate(units) for h in
                       _mark_unit(trace, i, m, [p for ps, _, _ in owned[id(m)] for p in ps if p.requires_grad])]
            with trace:
                args, kwargs = _as_call(self.make_batch(micro_batch))
                with torch.autocast("cpu", self.param_dtype or torch.bfloat16, enabled=self.autocast):
                    out = model(*args, **kwargs)
                if self.autocast:  # accelerate converts the outputs to fp32 (convert_outputs_to_fp32)
                    from accelerate.utils import convert_to_fp32
                    out = convert_to_fp32(out)
                loss = _loss_of(out)
                del out
                loss.backward()
                trace.mark("end", 0)
            for h in handles:
                h.remove()
        return trace

    def optimizer_bytes(self, shard_size: int) -> Tuple[int, int]:
        """(state, extra during step) of the optimizer on rank 0's shards, from two fake steps."""
        if shard_size not in self._optimizer:
            sizes = [(n, f.dtype) for unit in self.layout(shard_size) for f in unit if f.trainable for n in f.pieces]
            with fake_mode_with_scalars():
                params = [nn.Parameter(torch.empty(n, dtype=d)) for n, d in sizes]
                for p in params:
                    p.grad = torch.empty_like(p)
                opt = self.optimizer(params)
                trace = _Trace(params + [p.grad for p in params])
                with trace:
                    opt.step()
                    state, first = trace.live, len(trace.samples)
                    opt.step()
            self._optimizer[shard_size] = (state, max(trace.samples[first:], default=state) - state)
        return self._optimizer[shard_size]

    # ------------------------------------------------------------------ the step, replayed
    def predict(self, cfg: Config) -> Prediction:
        return _replay(self, cfg)

    def configurations(self) -> List[Config]:
        """What the recommendation tries: strategies x group sizes x prefetch x limit x AC x offload x micro-batch."""
        W, per_node = self.world_size, max(1, self.world_size // self.num_machines)
        groups = sorted({W} | {g for g in (per_node, 1) if W % g == 0})
        out = []
        for g in groups:
            for reshard in (True, False) if g > 1 else (False,):
                for prefetch in (True, False):
                    for limit in (2, 1):
                        for ac in (False, True):
                            for offload in (False, True) if self.device == "cuda" else (False,):
                                for mb in [m for m in range(self.batch_size, 0, -1) if self.batch_size % m == 0]:
                                    for acc in ("none",) if mb == self.batch_size else ("no_sync", "sync_each_batch"):
                                        out.append(Config(reshard, g, prefetch, "BACKWARD_PRE" if prefetch else None,
                                                          limit, ac, offload, mb, acc))
        return out


def _to_fake(model: nn.Module, param_dtype: Optional[torch.dtype], buffer_dtype: Optional[torch.dtype]) -> None:
    """Replace a meta model's tensors by fake CPU tensors (under a FakeTensorMode), tied ones by one, in the
    dtypes the wrapper computes in (``to_empty`` would unite nothing and make new objects)."""
    memo: Dict[int, torch.Tensor] = {}
    for module in model.modules():
        for group, dtype in ((module._parameters, param_dtype), (module._buffers, buffer_dtype)):
            for name, t in group.items():
                if t is not None and id(t) not in memo:
                    new = torch.empty(t.shape, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)
                    memo[id(t)] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
                if t is not None:
                    group[name] = memo[id(t)]


def _unit_names(model: nn.Module, units: List[nn.Module]) -> List[str]:
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    return [names[id(m)] for m in units]


def _mark_unit(trace: _Trace, index: int, module: nn.Module, trainable: List[nn.Parameter]) -> List[Any]:
    """Hooks marking a unit's forward (or recomputation), the start of its backward (the first gradient
    at an output: the engine's pre-backward hook) and the completion of its gradient (``trainable``: the
    parameters it owns; a frozen unit: its inputs' gradients, as the engine's reshard-only hook)."""
    arrived: List[nn.Parameter] = []

    def pre(mod, args):
        trace.mark("recompute" if inside_backward_pass() else "fwd", index)

    def post(mod, args, out):
        if inside_backward_pass():
            return
        trace.mark("fwd_end", index)
        outs = [t for t in tensors_in(out) if t.requires_grad]
        if outs:
            torch.autograd.graph.register_multi_grad_hook(outs, lambda g: trace.mark("bwd", index), mode="any")
        ins = [t for t in tensors_in(args) if t.requires_grad]
        if not trainable and ins:
            torch.autograd.graph.register_multi_grad_hook(ins, lambda g: trace.mark("ready", index, trace.live), mode="all")

    def grad_arrived(p: nn.Parameter) -> None:
        arrived.append(p)
        if len(arrived) == len(trainable):  # the flat gradient is complete: it replaces the parameters' ones
            live = trace.live
            for q in arrived:
                q.grad = None
            arrived.clear()
            trace.events.append(("ready", index, len(trace.samples), live, trace.live))

    handles = [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    return handles + [p.register_post_accumulate_grad_hook(grad_arrived) for p in trainable]


def _as_call(batch: Any) -> Tuple[tuple, dict]:
    """A batch as (args, kwargs): a dict is keyword arguments, an (args, kwargs) pair both, else positional."""
    if isinstance(batch, dict):
        return (), batch
    if isinstance(batch, tuple) and len(batch) == 2 and isinstance(batch[1], dict):
        return tuple(batch[0]), batch[1]
    return (tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)), {}


def _loss_of(out: Any) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if loss is None:
        loss = out.to_tuple()[0] if hasattr(out, "to_tuple") else out[0] if isinstance(out, (tuple, list)) else out
    return loss if loss.dim() == 0 else loss.float().sum()


# ---------------------------------------------------------------------- the replay
def _replay(planner: Planner, cfg: Config) -> Prediction:
    """One rank's memory over the step of ``cfg``: persistent state + the engine's buffers + the trace."""
    units, trace = planner.layout(cfg.shard_size), planner.trace(cfg.checkpointing, cfg.micro_batch)
    cuda, names = planner.device == "cuda", planner.names
    on_device = not (cfg.offload and cuda)  # offload onto a GPU: shards, gradients, optimizer state on the host
    trainable = [f for u in units for f in u if f.trainable]
    state, step_extra = planner.optimizer_bytes(cfg.shard_size)
    keep_grads = on_device and (cfg.accumulation == "sync_each_batch" or cfg.offload)  # (CPU offload: host buffers)
    base = {"parameter shards": sum(f.shard for u in units for f in u) if on_device else 0,
            "gradient shards": sum(f.shard for f in trainable) if keep_grads else 0,
            "optimizer state": state if on_device else 0, "module buffers": planner.buffer_bytes}
    held_full = ({i: sum(f.full for f in u if f.trainable) for i, u in enumerate(units)}
                 if cfg.accumulation == "no_sync" else {})  # accumulated full gradients (the last micro-step)
    order = list(dict.fromkeys(e[1] for e in trace.events if e[0] == "fwd"))
    pos = {u: i for i, u in enumerate(order)}
    last = order[-1] if len(order) > 1 else None
    gathered: Dict[int, int] = {}
    freed: collections.deque = collections.deque()  # CUDA: freed but not yet known complete by the host
    copies: Dict[int, int] = {}  # gloo: a prefetched gather's cast shard, until it is waited for
    pending: collections.deque = collections.deque()  # reductions in flight: full gradient (+ received chunks)
    held = {"reduced": 0, "sharded": 0}
    status: Dict[int, str] = {}
    stack: List[int] = []
    where = ["forward", 0]
    best = Prediction(0, "", {})

    def note(act: int, extra: int = 0, kind: str = "gradients being reduced") -> None:
        gather_bytes = sum(gathered.values()) + sum(freed) + sum(copies.values())
        grads = sum(pending) + sum(held_full.values()) + held["reduced"]
        total = sum(base.values()) + held["sharded"] + gather_bytes + grads + act + extra
        if total > best.peak_bytes:
            phase, unit = where
            best.peak_bytes, best.where = total, phase if phase in ("end of backward", "optimizer step") else \
                f"{phase} of {names[unit]}"
            best.parts = dict(base, **{"gradient shards": base["gradient shards"] + held["sharded"],
                                       "gathered units": gather_bytes, "gradients being reduced": grads,
                                       "activations": act, "optimizer step": 0})
            best.parts[kind] += extra

    def gather(u: int, act: int, keep: bool = False) -> None:
        if u in gathered:
            return
        while cuda and len(freed) >= cfg.limit_all_gathers:
            freed.popleft()  # the host synchronised on the oldest free event
        gathered[u] = sum(f.gathered for f in units[u])
        copy = sum(f.copy for f in units[u])
        note(act, copy + (0 if on_device else sum(f.shard for f in units[u])), "gathered units")
        if keep and not cuda:
            copies[u] = copy

    def free(u: int) -> None:
        nbytes = gathered.pop(u, 0)
        if nbytes and cuda:
            freed.append(nbytes)

    def prefetch_before(u: int, act: int) -> None:
        i = pos.get(u, 0)
        if i and status.get(order[i - 1]) == "await":
            gather(order[i - 1], act, keep=True)

    for event, segment in zip(trace.events, trace.segments()):
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
            if kind == "bwd" and not (status.get(u) == "bwd" and u in gathered):
                status[u] = "bwd"
                gather(u, live)
                if cfg.backward_prefetch == "BACKWARD_PRE":
                    prefetch_before(u, live)
            gather(u, live)  # (a recomputation gathers a unit that is not)
        elif kind == "ready":
            for f in (f for f in units[u] if f.trainable):
                note(live, f.full)  # concatenated while the parameters' gradients still live
                live = event[4]
                while len(pending) >= MAX_PENDING_REDUCTIONS:
                    pending.popleft()
                full = f.full
                if f.full_reduce != f.full:
                    note(live, f.full + f.full_reduce)
                    full = f.full_reduce
                received = 0 if cuda else f.shard_reduce * (cfg.shard_size - 1)  # gloo point-to-point
                held_full.pop(u, None)
                note(live, full + f.shard_reduce + received + (f.shard if not on_device and f.convert else 0))
                pending.append(full + received)
                held["reduced"] += f.shard_reduce if on_device else 0
            free(u)
            if cfg.backward_prefetch == "BACKWARD_POST":
                prefetch_before(u, live)
        elif kind == "end":
            pending.clear()
            where[0] = "end of backward"
            if on_device:  # the reduced shards become the gradient shards (cast to the parameter dtype)
                converted = [f.shard for f in trainable if f.convert]
                note(live, max(converted, default=0) if keep_grads else sum(converted))
                held["reduced"], held["sharded"] = 0, 0 if keep_grads else sum(f.shard for f in trainable)
            for g in list(gathered):
                free(g)
            where[0] = "optimizer step"
            note(live, step_extra if on_device else 0, "optimizer step")
        note(segment)
    return best
