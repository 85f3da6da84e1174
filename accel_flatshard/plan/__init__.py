"""The memory planner (``accel-flatshard plan``): each rank's peak memory in a training step, before the launch.

The model is built on the meta device and sharded on paper by ``prepare``'s own code (``wrap.select_units``,
``fully_sharded._assign_owners``, ``FlatParamLayout``, the options of ``integrations/config.py``).  Activations
are measured: one forward and backward of the model class on fake tensors (no data) at one rank's
micro-batch, in the compute dtype, with the engine's flat views, while a dispatch mode records the live
storage bytes after every op and hooks mark each unit's forward, backward and flat gradients (a trace).
The engine's buffers are replayed over the trace by the rules of ``engine.py`` and ``unit.py`` (gathers,
prefetch, pending reductions, reduced shards, mixed-precision and offload copies; on CUDA the host runs
ahead of the GPU, so freed buffers wait for a free event), on top of the shards, buffers and optimizer
state (two fake steps).  The recommendation ranks what fits by :func:`step_time`; the command line is
``__main__.py``.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import itertools
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .._compat import FakeTensorMode, TorchDispatchMode, fake_mode_with_scalars, inside_backward_pass, map_tensors
from .._compat import tensors_in
from ..flat_param import FlatParameter, FlatParamLayout
from ..fully_sharded import _assign_owners
from ..integrations.config import FlatShardOptions
from ..wrap import checkpoint_units, select_units

MAX_PENDING_REDUCTIONS = 2  # the engine's (Engine(max_pending_reductions=2); the wrapper keeps the default)
GiB = 2**30
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


@dataclasses.dataclass
class Prediction:
    peak_bytes: int
    where: str  # e.g. "backward of model.layers.3"
    parts: Dict[str, int]  # what is held at the peak, by kind


@dataclasses.dataclass
class _Flat:
    """Bytes of one flat parameter on rank 0 (the fullest shard)."""

    gathered: int  # unsharded buffer (compute dtype)
    shard: int  # local shard (parameter dtype)
    copy: int  # the shard cast to the compute dtype for its all-gather (0 without mixed precision)
    trainable: bool
    dtype: torch.dtype
    pieces: Tuple[int, ...]  # elements of each parameter in the shard (the optimizer state's sizes)
    full: int = 0  # flat gradient (compute dtype)
    full_reduce: int = 0  # ... in the reduce dtype
    shard_reduce: int = 0  # reduced shard (reduce dtype)
    convert: bool = False  # the reduced shard is cast to the parameter dtype at the end of backward


class _Trace(TorchDispatchMode):
    """Bytes of the storages alive after every op (``samples``; storages of ``known`` tensors excluded) and
    marks between ops (``events``: ``(kind, unit, sample index, live bytes[, flat parameter index])``)."""

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

    def mark(self, kind: str, unit: int, *flat: int) -> None:
        self.events.append((kind, unit, len(self.samples), self.live, *flat))

    def pieces(self) -> List[List[int]]:
        """The samples between each event and the next."""
        bounds = [e[2] for e in self.events] + [len(self.samples)]
        return [self.samples[a:b] for a, b in zip(bounds, bounds[1:])]


def _interpolate(a: _Trace, b: _Trace, t: float) -> Optional[_Trace]:
    """The trace at ``a + t (b - a)``: every storage is affine in the micro-batch, so op by op where both have
    the same ops between two events; elsewhere the interpolated maximum (an upper bound: a maximum of
    affine functions is convex).  None when the units' events differ."""
    if [e[:2] for e in a.events] != [e[:2] for e in b.events]:
        return None
    out, lerp = _Trace(), lambda x, y: round(x + t * (y - x))
    for e, f, pa, pb in zip(a.events, b.events, a.pieces(), b.pieces()):
        out.events.append(e[:2] + (len(out.samples), lerp(e[3], f[3])) + e[4:])
        out.samples += [lerp(x, y) for x, y in zip(pa, pb)] if len(pa) == len(pb) else \
            [lerp(max(pa, default=e[3]), max(pb, default=f[3]))]
    return out


class Planner:
    """One rank's peak for a model (``build()``: a fresh meta-device model), options and per-device batch.

    ``make_batch(n)``: the forward's inputs for ``n`` samples (a dict of keyword arguments, a tuple, or an
    ``(args, kwargs)`` pair; under fake tensors); the loss is the output's ``.loss``, else the output (summed).
    ``device``: "cuda", or "cpu" (gloo point-to-point, no stream lag); ``autocast``: accelerate's
    ``mixed_precision`` also autocasts the forward; ``optimizer(params)``: default AdamW (foreach on CUDA)."""

    def __init__(self, build: Callable[[], nn.Module], options: FlatShardOptions, world_size: int, batch_size: int,
                 make_batch: Callable[[int], Any], device: str = "cuda", autocast: bool = False,
                 optimizer: Optional[Callable[[List[nn.Parameter]], torch.optim.Optimizer]] = None,
                 num_machines: int = 1, tokens: int = 1) -> None:
        self.build, self.options, self.world_size, self.batch_size = build, options, world_size, batch_size
        self.make_batch, self.device, self.autocast, self.num_machines = make_batch, device, autocast, num_machines
        self.tokens = tokens  # per sample, for the cost model
        self.optimizer = optimizer or (lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=device == "cuda"))
        mp = options.mixed_precision
        self.param_dtype, self.buffer_dtype = (mp.param_dtype, mp.buffer_dtype) if mp else (None, None)
        self.reduce_dtype = mp.effective_reduce_dtype if mp else None
        model = build()
        self.class_name, self.numel = type(model).__name__, sum(p.numel() for p in model.parameters())
        self.buffer_bytes = sum(b.numel() * (self.buffer_dtype or b.dtype).itemsize if b.is_floating_point()
                                else b.nbytes for b in model.buffers())
        names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        self.names = [names[id(m)] or "<root>" for m in self._units(model)]
        self._layouts: Dict[int, List[List[_Flat]]] = {}
        self._traces: Dict[Tuple[bool, int], _Trace] = {}
        self._optimizer: Dict[int, Tuple[int, int]] = {}

    def _units(self, model: nn.Module) -> List[nn.Module]:
        return select_units(model, self.options.auto_wrap_policy(model))

    def layout(self, shard_size: int) -> List[List[_Flat]]:
        """Per unit (root first, as the wrapper builds them), its flat parameters at this shard group size."""
        if shard_size not in self._layouts:
            model = self.build()
            owned, _ = _assign_owners(model, self._units(model))
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
                     params[0].requires_grad, dtype, tuple(p.length for p in layout.shard_pieces(0)))
        if flat.trainable:
            flat.full, flat.full_reduce, flat.shard_reduce = n * compute.itemsize, n * reduce.itemsize, s * reduce.itemsize
            flat.convert = reduce != dtype
        return flat

    def trace(self, checkpointing: bool, micro_batch: int) -> _Trace:
        """The activation trace at this micro-batch (measured at 1 and at the batch, interpolated between)."""
        key = (checkpointing, micro_batch)
        if key not in self._traces:
            ends = (self.trace(checkpointing, 1), self.trace(checkpointing, self.batch_size)) \
                if micro_batch not in (1, self.batch_size) else None
            t = (micro_batch - 1) / max(1, self.batch_size - 1)
            self._traces[key] = (ends and _interpolate(*ends, t)) or self._measure(*key)
        return self._traces[key]

    def _measure(self, checkpointing: bool, micro_batch: int) -> _Trace:
        model = self.build()
        units = self._units(model)
        try:
            with FakeTensorMode(allow_non_fake_inputs=True):
                _to_fake(model, self.param_dtype, self.buffer_dtype)
                owned, _ = _assign_owners(model, units)
                flats = {id(m): [FlatParameter(ps, fqns, users, 0, 1) for ps, fqns, users in owned[id(m)]] for m in units}
                if checkpointing:
                    checkpoint_units(model, units)
                unsharded = [f.alloc_unsharded() for fs in flats.values() for f in fs]  # gathered for good, not counted
                trace = _Trace([*model.parameters(), *model.buffers(), *unsharded])
                for i, m in enumerate(units):  # (the hooks go with the model)
                    _mark_unit(trace, i, m, flats[id(m)])
                with trace:
                    batch = _as_call(self.make_batch(micro_batch))
                    mp = self.options.mixed_precision
                    args, kwargs = map_tensors(lambda t: t.to(self.param_dtype) if t.is_floating_point() else t, batch) \
                        if self.param_dtype and mp.cast_forward_inputs else batch  # as the root's pre-forward does
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
        except Exception as exc:  # noqa: BLE001 - named for the user: the model, and why fake tensors failed
            raise ValueError(f"{self.class_name}'s forward and backward did not run on fake tensors (shapes, no data: "
                             f"Python branching on tensor values, e.g. .item(), cannot run there): {exc}") from exc
        return trace

    def optimizer_bytes(self, shard_size: int) -> Tuple[int, int]:
        """(state, more during a step) of the optimizer on rank 0's shards, from two fake steps."""
        if shard_size not in self._optimizer:
            sizes = [(n, f.dtype) for unit in self.layout(shard_size) for f in unit if f.trainable for n in f.pieces]
            with fake_mode_with_scalars():
                params = [nn.Parameter(torch.empty(n, dtype=d)) for n, d in sizes]
                for p in params:
                    p.grad = torch.empty_like(p)
                optimizer = self.optimizer(params)
                with _Trace(params + [p.grad for p in params]) as trace:
                    optimizer.step()
                    state, first = trace.live, len(trace.samples)
                    optimizer.step()
            self._optimizer[shard_size] = (state, max(trace.samples[first:], default=state) - state)
        return self._optimizer[shard_size]

    def predict(self, cfg: Config) -> Prediction:
        return _replay(self, cfg)

    def configurations(self) -> List[Config]:
        """Strategies and group sizes (W, a node, 1) x prefetch x limit_all_gathers x AC x offload (CUDA) x
        micro-batches (divisors of the batch, with either kind of accumulation)."""
        W, B = self.world_size, self.batch_size
        groups = sorted({W} | {g for g in (max(1, W // self.num_machines), 1) if W % g == 0})
        batches = [(m, acc) for m in range(B, 0, -1) if B % m == 0
                   for acc in (("none",) if m == B else ("no_sync", "sync_each_batch"))]
        knobs = itertools.product(groups, (True, False), (True, False), (2, 1), (False, True),
                                  (False, True) if self.device == "cuda" else (False,), batches)
        return [Config(reshard, g, prefetch, "BACKWARD_PRE" if prefetch else None, limit, ac, offload, mb, acc)
                for g, reshard, prefetch, limit, ac, offload, (mb, acc) in knobs if g > 1 or not reshard]


def _to_fake(model: nn.Module, param_dtype: Optional[torch.dtype], buffer_dtype: Optional[torch.dtype]) -> None:
    """A meta model's tensors -> fake CPU tensors (under a FakeTensorMode) in the dtypes the wrapper computes in,
    tied ones to one (``to_empty`` would make new, untied objects)."""
    memo: Dict[int, torch.Tensor] = {}
    for module in model.modules():
        for group, dtype in ((module._parameters, param_dtype), (module._buffers, buffer_dtype)):
            for name, t in group.items():
                if t is not None and id(t) not in memo:
                    new = torch.empty(t.shape, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)
                    memo[id(t)] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
                if t is not None:
                    group[name] = memo[id(t)]


def _mark_unit(trace: _Trace, index: int, module: nn.Module, flats: List[FlatParameter]) -> None:
    """The engine's view handling for one unit (``unit.py``: views of the flat buffer installed for its forward
    and again, with grad, from its backward's start; one flat gradient per flat parameter, so autograd runs
    the same nodes in the same order), with marks: forward (or recomputation), the start of backward (the
    first gradient at an output), each flat gradient (dropped there: the replay holds it) and the end of
    the unit's backward (its last gradient; a frozen unit: its inputs' gradients, the reshard-only hook)."""
    trainable = [f for f in flats if f.requires_grad]
    arrived: List[FlatParameter] = []

    def install() -> None:
        for f in flats:
            f.install_views(f.unsharded_views())

    def done(*_: Any) -> None:
        for f in flats:
            f.uninstall_views()
        trace.mark("done", index)

    def pre(mod: nn.Module, args: Any) -> None:
        trace.mark("recompute" if inside_backward_pass() else "fwd", index)
        if not inside_backward_pass():
            install()

    def post(mod: nn.Module, args: Any, out: Any) -> None:
        if inside_backward_pass():
            return
        for f in flats:
            f.uninstall_views()
        trace.mark("fwd_end", index)
        outs, ins = [t for t in tensors_in(out) if t.requires_grad], [t for t in tensors_in(args) if t.requires_grad]
        if outs:
            torch.autograd.graph.register_multi_grad_hook(outs, backward, mode="any")
        if flats and not trainable and ins:
            torch.autograd.graph.register_multi_grad_hook(ins, done)

    def backward(grad: Any) -> None:
        trace.mark("bwd", index)
        with torch.enable_grad():
            install()

    def grad_arrived(flat: FlatParameter) -> None:
        flat.unsharded.grad = None
        trace.mark("grad", index, flats.index(flat))
        arrived.append(flat)
        if len(arrived) == len(trainable):
            arrived.clear()
            done()

    module.register_forward_pre_hook(pre, prepend=True)
    module.register_forward_hook(post)
    for f in trainable:
        f.unsharded.register_post_accumulate_grad_hook(lambda t, f=f: grad_arrived(f))


def _as_call(batch: Any) -> Tuple[tuple, dict]:
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
    cuda = planner.device == "cuda"
    on_device = not (cfg.offload and cuda)  # offload onto a GPU: shards, gradients, optimizer state on the host
    trainable = [f for u in units for f in u if f.trainable]
    state, step_extra = planner.optimizer_bytes(cfg.shard_size)
    keep_grads = on_device and (cfg.accumulation == "sync_each_batch" or cfg.offload)  # (CPU offload: host buffers)
    convert = any(f.convert for f in trainable)
    base = {"parameter shards": sum(f.shard for u in units for f in u) if on_device else 0,
            "gradient shards": sum(f.shard for f in trainable) if keep_grads else 0,
            "optimizer state": state if on_device else 0, "module buffers": planner.buffer_bytes}
    held_full = ({i: sum(f.full for f in u if f.trainable) for i, u in enumerate(units)}
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
        gathers = sum(gathered.values()) + sum(n for n, _ in freed) + sum(copies.values())
        grads = sum(pending) + sum(held_full.values())
        shards = base["gradient shards"] + held["reduced"] + held["sharded"] + lingering[0]
        total = sum(base.values()) - base["gradient shards"] + shards + gathers + grads + act + extra
        if total > best.peak_bytes:
            phase, unit = where
            best.peak_bytes = total
            best.where = phase if phase in ("end of backward", "optimizer step") else f"{phase} of {planner.names[unit]}"
            best.parts = dict(base, **{"gradient shards": shards, "gathered units": gathers, "full gradients": grads,
                                       "activations": act, "optimizer step": 0})
            best.parts[kind] += extra

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
        if i and status.get(order[i - 1]) == "await":
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
                if kind == "bwd" and not (status.get(u) == "bwd" and u in gathered):
                    status[u] = "bwd"
                    gather(u, live)
                    if cfg.backward_prefetch == "BACKWARD_PRE":
                        prefetch_before(u, live)
                gather(u, live)  # (a recomputation gathers a unit that is not)
            elif kind == "grad":  # a flat gradient is complete (concatenated in the trace): reduce it
                f = units[u][event[4]]
                while len(pending) >= MAX_PENDING_REDUCTIONS:
                    pending.popleft()
                # cast to the reduce dtype; the compute-dtype one lives until reduce_grad returns (the caller's)
                cast = f.full if f.full_reduce != f.full else 0
                full = f.full_reduce
                received = 0 if cuda else f.shard_reduce * (cfg.shard_size - 1)  # gloo point-to-point
                held_full.pop(u, None)
                note(live, cast + full + f.shard_reduce + received + (f.shard if not on_device and f.convert else 0))
                pending.append(full + received)
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
    those differing only in prefetch or limit_all_gathers, the fastest."""
    rows = ((c, planner.predict(c)) for c in planner.configurations())
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
def available_bytes(device: torch.device) -> Optional[int]:
    """What this process may hold on ``device``: CUDA's free memory plus what torch's allocator reserved.
    None on other devices: a CPU "device" is host RAM shared with everything else on the host (page cache,
    overcommit, swap), no budget to hold a prediction against, so ``prepare`` checks nothing there."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)


def meta_copy(model: nn.Module) -> nn.Module:
    """``model``'s structure on the meta device (ties kept); no data is copied."""
    memo: Dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        meta = t.detach().to("meta")
        memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def warn_before_first_step(wrapped: nn.Module, skeleton: nn.Module, options: FlatShardOptions, world_size: int,
                           autocast: bool) -> None:
    """``prepare``: at the prepared model's first forward (its inputs give the batch), predict this rank's
    peak (``skeleton``: :func:`meta_copy` of the model before wrapping) and warn once if it exceeds
    :func:`available_bytes`, with the fastest configuration predicted to fit.  A warning, not an error:
    the prediction may be pessimistic (it assumes the host runs ahead of the GPU)."""
    device = wrapped._schedule.engine.device

    def check(module: nn.Module, args: Any, kwargs: Any) -> None:
        handle.remove()
        try:
            tensors = tensors_in((args, kwargs))
            rows = tensors[0].shape[0] if tensors and tensors[0].dim() else 1
            batch = lambda n: map_tensors(lambda t: torch.zeros(  # noqa: E731 - the inputs, with n rows
                (n, *t.shape[1:]) if t.dim() and t.shape[0] == rows else t.shape, dtype=t.dtype), (args, kwargs))
            planner = Planner(lambda: meta_copy(skeleton), options, world_size, rows, batch, device.type, autocast,
                              tokens=tensors[0].numel() // rows if tensors else 1)
            predicted, available = planner.predict(Config.of(options, world_size, rows)), available_bytes(device)
            if available is None or predicted.peak_bytes <= available:
                return
            fits = recommend(planner, available, limit=1)
            advice = "; ".join(settings(fits[0][0], world_size, rows)) if fits else "none of the configurations tried"
        except Exception as exc:  # noqa: BLE001 - advice only: training goes on
            warnings.warn(f"accel_flatshard: the memory prediction before the first step failed ({exc!r})")
            return
        warnings.warn(f"accel_flatshard: predicted peak {predicted.peak_bytes / GiB:.2f} GiB per rank (in the "
                      f"{predicted.where}) exceeds the {available / GiB:.2f} GiB available on {device}. Fastest "
                      f"configuration predicted to fit: {advice}. `accel-flatshard plan` prints the breakdown "
                      "(the prediction may be pessimistic: on CUDA it assumes the host runs ahead of the GPU).")

    handle = wrapped.register_forward_pre_hook(check, with_kwargs=True)
