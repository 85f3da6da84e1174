"""The planner's step (``Planner.predict``), as docs/architecture-details.md section 8 tells it.  This process is rank 0
(the fullest shard); on ``"cuda"`` the GPU lags arbitrarily: a ``record_stream``'ed block is free once the host
waited for a later event.  Of the last step, measured, micro-steps after the second repeat the second, except with
``defer_cross_machine_reduce``: a middle micro-step holds the carried partial sums from its start (and, with
``keep_gathered_across_micro_batches``, every unit gathered), so three are run.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..core import options as environment
from ..core._compat import FakeTensorMode, fake_world, map_tensors, storage_key, tensors_in
from ..state.commit import snapshot_bytes
from ..state.sharded import model_entries, optimizer_entries
from ..core.device import ADAPTER, CudaStreams, HostAdapter
from ..core.fully_sharded import FullyShardedDataParallel
from ..features.matrix_optim import matrix_optimizer_and_adamw, matrix_optimizer_classes
from ..core.model_state import full_state_dict
from ..state.optim import full_optim_state_dict
from ..core.unit import UnitState
from ..core.wrap import checkpoint_units, policy_of
from .trace import _as_call, copy_model, _loss_of, _Trace, _why_fake_failed


@dataclasses.dataclass
class Prediction:
    peak_bytes: int
    where: str  # e.g. "backward of model.layers.3"
    parts: Dict[str, int]  # what is held at the peak, by kind
    saved: int = 0  # activations (and inputs) held at the end of the forward, for backward
    snapshot: int = 0  # host memory: an asynchronous save's snapshot (FLATSHARD_ASYNC_SAVE=1)
    # predict(curve=True): after every op of the measured step, (where the step is, bytes held by kind of PARTS)
    curve: List[Tuple[str, Dict[str, int]]] = dataclasses.field(default_factory=list)
    # per micro-step of the measured step: the bytes this rank sent, by (kind, "intra" | "inter" machine), as the
    # engine's ShardGroup counts them (``sent``), and how many collectives sent bytes across machines (the link
    # model's latency term, ``link.py``); machines are blocks of ``options.ranks_per_node`` ranks
    sent: List[Dict[Tuple[str, str], int]] = dataclasses.field(default_factory=list)
    crossings: List[int] = dataclasses.field(default_factory=list)


class _Gloo(HostAdapter):
    """Gloo's adapter; the lifetimes of gathered buffers (grown and freed, not made by ops) and the full gradients
    handed to reductions go to the trace."""

    def __init__(self, device: torch.device, trace: _Trace, **kwargs: Any) -> None:
        self.trace = trace
        super().__init__(device, **kwargs)

    def alloc_gathered(self, flat: Any) -> torch.Tensor:
        out = super().alloc_gathered(flat)
        self.trace.note_alloc(out, "unsharded")
        return out

    def release(self, flat: Any) -> None:
        super().release(flat)
        self.trace.note_free(flat)

    def reduction_input(self, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        full = super().reduction_input(grad, dtype)
        self.trace.note_alloc(full, "full_grad")
        return full

    def secondary_copy(self, part: torch.Tensor) -> torch.Tensor:
        copy = super().secondary_copy(part)
        self.trace.relabel(copy, "secondary shards")
        return copy


class _Numbered:
    """A stream or an event of :class:`_Cuda`."""

    def __init__(self, trace: _Trace) -> None:
        self.trace, self.number = trace, -1

    wait_event = wait_stream = HostAdapter._nothing

    def record(self, stream: Any = None) -> None:
        self.number, self.trace.events = self.trace.events, self.trace.events + 1

    def synchronize(self) -> None:
        self.trace.synchronized(self.number)


class _Cuda(_Gloo, CudaStreams):
    """``CudaStreams`` with itself as ``torch.cuda``; host buffers and copies as on a GPU."""

    def __init__(self, device: torch.device, trace: _Trace) -> None:
        self.compute = _Numbered(trace)
        super().__init__(device, trace, api=self)

    def current_stream(self, device: Any = None) -> _Numbered:
        return self.compute

    def Stream(self, *args: Any, **kwargs: Any) -> _Numbered:  # noqa: N802 - torch.cuda's names
        return _Numbered(self.trace)

    Event = Stream
    stream = HostAdapter.on  # (a null context)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        self.trace.recorded.add(storage_key(tensor))

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.trace.place_on_host(torch.empty(numel, dtype=dtype))

    def to_device(self, host: torch.Tensor) -> torch.Tensor:  # (a copy: the fake device is the host's)
        return torch.empty(host.shape, dtype=host.dtype).copy_(host)


# what is held at the peak, by kind (activations: and transient buffers; secondary shards: node_local_backward_gather)
PARTS = ("parameter shards", "gradient shards", "optimizer state", "module buffers", "gathered units", "full gradients",
         "secondary shards", "activations", "optimizer step")
PERSISTENT = ("parameter shards", "optimizer state", "module buffers")  # (the rest: "... at the peak")


def predict(planner: Any, cfg: Any, curve: bool = False) -> Prediction:  # (a Planner, a Config)
    """One rank's peak in the last of two training steps of ``cfg``, what is held at it, and where (``curve``: also
    what is held after every op of that step, ``Prediction.curve``)."""
    cuda = planner.device == "cuda"
    trace, best = _Trace(cuda=cuda), Prediction(0, "", {})
    group = cfg.shard_size(planner.world_size)
    opts = dataclasses.replace(cfg.options, fsdp_group_size=group if group < planner.world_size else None,
                               sync_module_states=False)
    real = _as_call(planner.make_batch(cfg.micro_batch))  # (held through the step, as by the caller)
    trace.add_real([v for k, v in real[1].items() if k.endswith("attention_mask") and isinstance(v, torch.Tensor)
                    and not v.is_floating_point()])
    adapter = ADAPTER.set(lambda device: (_Cuda if cuda else _Gloo)(device, trace))
    try:
        meta = planner.build()
        with fake_world(planner.world_size, "fake_nccl_gloo" if cuda else "fake_gloo"), \
                FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")  # (flat_param's check)
            model = copy_model(meta, lambda t: torch.empty(t.shape, dtype=t.dtype))
            # a matrix optimizer (Muon) takes the 2-D matrices before the wrapper makes them 1-D views, AdamW the rest
            chained = matrix_optimizer_and_adamw(planner.optimizer, model) if issubclass(
                planner.optimizer, matrix_optimizer_classes() or ()) else None
            wrapped = FullyShardedDataParallel(model, auto_wrap_policy=policy_of(opts, model), device_id="cpu",
                                               options=opts)
            if opts.activation_checkpointing:
                checkpoint_units(wrapped.module, [u.module for u in wrapped.units if not u.is_root])
            trace.known.update(storage_key(f.unsharded) for f in wrapped.flat_params)
            trace.hold([f.local_shard for f in wrapped.flat_params] + list(wrapped.buffers()))
            foreach = {"foreach": cuda} if "foreach" in inspect.signature(planner.optimizer).parameters else {}
            optimizer = chained or planner.optimizer(list(wrapped.parameters()), lr=1e-4, **foreach)
            with trace:
                repeating = 3 if opts.defer_cross_machine_reduce else 2  # (a middle micro-step: the module docstring)
                for micro_steps, measured in ((1, None), (min(planner.batch_size // cfg.micro_batch, repeating),
                                                          best)):
                    _step(planner, cfg, wrapped, optimizer, trace, real, micro_steps, measured, curve)
            if environment.get("FLATSHARD_ASYNC_SAVE"):
                best.snapshot = _snapshot(wrapped, optimizer, "SHARDED" in planner.options.state_dict_type)
    except Exception as exc:  # noqa: BLE001 - named for the user: the model, the op, and why fake tensors failed
        raise ValueError(f"{planner.class_name}'s training step did not run on fake tensors: "
                         f"{_why_fake_failed(trace.failed, exc)}") from exc
    finally:
        ADAPTER.reset(adapter)
    return best


def _step(planner: Any, cfg: Any, wrapped: FullyShardedDataParallel, optimizer: torch.optim.Optimizer,
          trace: _Trace, batch: Any, micro_steps: int, best: Optional[Prediction] = None, curve: bool = False) -> None:
    """One optimizer step of ``micro_steps`` forwards and backwards (``best``: measured into it, with its curve)."""
    if best is not None:  # what persists is known by now
        for tensor, kind in [(f.local_shard, "parameter shards") for f in wrapped.flat_params] + [
                (b, "module buffers") for b in wrapped.buffers()] + [
                (t, "optimizer state") for state in optimizer.state.values() for t in state.values()
                if isinstance(t, torch.Tensor)]:
            trace.relabel(tensor, kind)
        trace.peak, trace.on_peak = 0, lambda: _held(trace, wrapped, best)
        if curve:
            trace.on_op = lambda: best.curve.append(_sample(trace, wrapped))
        saved = wrapped.register_forward_hook(lambda *_: setattr(best, "saved", max(best.saved,
                                                                                     trace.kinds["activations"])))
    group = wrapped.shard_group
    for i in range(micro_steps):
        sent_before, crossings_before = collections.Counter(group.sent), _crossings(group)
        quiet = cfg.accumulation == "no_sync" and i < micro_steps - 1
        with wrapped.no_sync() if quiet else contextlib.nullcontext():
            args, kwargs = map_tensors(lambda t: t if trace.is_real(t) else torch.empty_like(t), batch)
            with torch.autocast("cpu", planner.param_dtype or torch.bfloat16, enabled=planner.autocast):
                out = wrapped(*args, **kwargs)  # (the inputs live through the micro-step, as the caller's)
            if planner.autocast:  # accelerate's convert_outputs_to_fp32
                from accelerate.utils import convert_to_fp32
                out = convert_to_fp32(out)
            loss = _loss_of(out)
            del out
            loss.backward()
        if i == micro_steps - 1:  # (the optimizer step's collectives, if any, count in the last micro-step)
            trace.kind = "optimizer step"
            optimizer.step()
            optimizer.zero_grad()
        if best is not None:
            best.sent.append(dict(collections.Counter(group.sent) - sent_before))
            best.crossings.append(_crossings(group) - crossings_before)
    trace.kind = "activations"
    if best is not None:
        saved.remove()
        trace.on_op = None


def _crossings(group: Any) -> int:
    """Collectives so far that sent bytes across machines: the planner's own count, kept on the group by wrapping its
    ``_count`` once (the engine itself needs only the bytes)."""
    if not hasattr(group, "planned_crossings"):
        count = group._count

        def counting(kind: str, members: Any, per_peer: int) -> None:
            group.planned_crossings += per_peer > 0 and members.size - 1 - members.on_node > 0
            count(kind, members, per_peer)
        group.planned_crossings, group._count = 0, counting
    return group.planned_crossings


def _held(trace: _Trace, wrapped: FullyShardedDataParallel, best: Prediction) -> None:
    """A new peak: what is held, by kind, and where the step is."""
    best.where, parts = _sample(trace, wrapped)
    best.peak_bytes, best.parts = trace.peak, parts


def _sample(trace: _Trace, wrapped: FullyShardedDataParallel) -> Tuple[str, Dict[str, int]]:
    """Where the step is and what is held now, by kind of :data:`PARTS` (gradients labelled as such first)."""
    for f in wrapped.flat_params:
        trace.relabel(f.sharded_grad, "gradient shards"), trace.relabel(f.unsharded.grad, "full gradients")
    schedule = wrapped.schedule  # (the innermost unit running: the first of the order in backward, last in forward)
    phase, state = ("backward", UnitState.BACKWARD) if schedule.in_backward else ("forward", UnitState.FORWARD)
    busy = [u.name for u in (schedule.recorded_order or schedule.units) if not u.is_root and u.state is state]
    where = trace.kind if trace.kind == "optimizer step" else \
        f"{phase} of {(busy[0] if phase == 'backward' else busy[-1]) if busy else '<root>'}"
    return where, {kind: trace.kinds[kind] for kind in PARTS}


def _snapshot(wrapped: FullyShardedDataParallel, optimizer: torch.optim.Optimizer, sharded: bool) -> int:
    """Host bytes of the asynchronous save's snapshot on this rank, by the save's own code: SHARDED, the entries it
    copies; FULL, the model and optimizer state gathered to rank 0."""
    if sharded:
        return sum(snapshot_bytes(entries) for _, entries, _ in (model_entries(wrapped),
                                                                 optimizer_entries(wrapped, optimizer)))
    full = tensors_in((full_state_dict(wrapped), full_optim_state_dict(wrapped, optimizer)))
    return sum({storage_key(t): t.untyped_storage().nbytes() for t in full}.values())
