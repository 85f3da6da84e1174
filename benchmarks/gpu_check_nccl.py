"""Real NCCL collectives of the engine on ONE GPU (part ``nccl-1gpu`` of gpu_check.py, run by gpu_check.sh).

At world size 1 the engine normally skips its collectives (a copy instead: ``ShardGroup.shard_size == 1``),
and NCCL refuses two ranks on one GPU.  So this part builds a 1-rank NCCL group and turns the skip off
(``ShardGroup.collectives_at_one_rank``); for the hybrid schedule it also gives the group a 1-rank NCCL replica
group, so the replica all-reduce is issued too.  Every training step then issues, on the engine's side
streams and with ``async_op=False`` inside ``torch.cuda.stream(side)`` (how the engine issues them):

* the all-gather of every flat parameter (``all_gather_into_tensor`` on torch 2.11, ``all_gather_single`` on
  2.13+: whichever ``accel_flatshard.comm`` picked, printed),
* the reduce-scatter of every gradient (``reduce_scatter_tensor`` / ``reduce_scatter_single``),
* under hybrid sharding the all-reduce over the replica group, on its own stream.

Checked: each call is counted and was issued on its side stream (not the compute stream), and losses and
final parameters equal a single-process run of the plain model (``--tol``) and the engine's own W=1 copy
path bitwise-or-within-tol, for the prefetch schedule (default), no prefetch, hybrid, and bf16 compute.

    python benchmarks/gpu_check.py --part nccl-1gpu          # one GPU
    python benchmarks/gpu_check.py --device cpu --part nccl-1gpu   # CPU smoke: gloo, the same calls
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist

from accel_flatshard import BackwardPrefetch, MixedPrecision, comm
from accel_flatshard import fully_sharded as _fully_sharded

SCHEDULES = {
    "prefetch": ({}, False),  # the defaults: forward prefetch + BACKWARD_PRE
    "no-prefetch": ({"forward_prefetch": False, "backward_prefetch": None}, False),
    "hybrid": ({}, True),
    "bf16": ({"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}, False),
}


@contextlib.contextmanager
def issuing_one_rank_groups(hybrid: bool) -> Iterator[List[comm.ShardGroup]]:
    """Models wrapped inside get a ShardGroup that issues real collectives at size 1 (and, with ``hybrid``, a
    1-rank replica group: the replica all-reduce is issued too).  Yields the groups made."""
    made: List[comm.ShardGroup] = []
    original = _fully_sharded.ShardGroup

    class IssuingShardGroup(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.collectives_at_one_rank = True
            self.via_p2p = False  # (gloo smoke: the collectives, not point-to-point)
            if hybrid:
                self.replica_group = dist.new_group([0])
            made.append(self)

    _fully_sharded.ShardGroup = IssuingShardGroup
    try:
        yield made
    finally:
        _fully_sharded.ShardGroup = original


@contextlib.contextmanager
def recording_collectives(device: torch.device) -> Iterator[List[Tuple[str, bool, object]]]:
    """Every all-gather / reduce-scatter / all-reduce the engine issues: (name, async_op, current stream)."""
    calls: List[Tuple[str, bool, object]] = []
    cuda = device.type == "cuda"

    def recorder(name, fn):
        def record(*args, async_op=False, **kwargs):
            calls.append((name, async_op, torch.cuda.current_stream(device) if cuda else None))
            return fn(*args, async_op=async_op, **kwargs)
        return record

    saved = (comm._all_gather_flat, comm._reduce_scatter_flat, comm.dist.all_reduce)
    comm._all_gather_flat = recorder("all_gather", saved[0])
    comm._reduce_scatter_flat = recorder("reduce_scatter", saved[1])
    comm.dist.all_reduce = recorder("all_reduce", saved[2])
    try:
        yield calls
    finally:
        comm._all_gather_flat, comm._reduce_scatter_flat, comm.dist.all_reduce = saved


def _train_wrapped(gpu_check, family: str, device, data, kwargs, hybrid: bool, issue: bool):
    """Train a wrapped model; returns (losses, full parameters, the calls recorded, the engine)."""
    with contextlib.ExitStack() as stack:
        if issue:
            stack.enter_context(issuing_one_rank_groups(hybrid))
        wrapped = gpu_check.wrap(gpu_check.small_model(family).to(device), **kwargs)
        calls = stack.enter_context(recording_collectives(device))
        losses = gpu_check.train(wrapped, data)
    with wrapped.summon_full_params():
        params = {n: p.detach().clone() for n, p in wrapped.named_parameters()}
    return losses, params, calls, wrapped._schedule.engine


def _max_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    return max((a[n].float() - b[n].float()).abs().max().item() for n in a)


def nccl_one_gpu(gpu_check, device: torch.device, steps: int, tol: float) -> bool:
    """See the module docstring.  ``gpu_check``: the gpu_check module (models, training loop)."""
    cuda = device.type == "cuda"
    print(f"  collectives: {comm._all_gather_flat.__name__}, {comm._reduce_scatter_flat.__name__} "
          f"(torch {torch.__version__}); backend {dist.get_backend()}", flush=True)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 1024, (4, 64), generator=g).to(device) for _ in range(steps)]
    ok = True
    for family in ("gpt2", "llama"):
        ref = gpu_check.small_model(family).to(device)
        ref_losses = gpu_check.train(ref, data)
        ref_params = {n: p.detach() for n, p in ref.named_parameters()}
        for name, (kwargs, hybrid) in SCHEDULES.items():
            if name == "bf16" and family == "gpt2":
                continue
            losses, params, calls, engine = _train_wrapped(gpu_check, family, device, data, kwargs, hybrid, True)
            copy_losses, copy_params, copy_calls, _ = _train_wrapped(gpu_check, family, device, data, kwargs, hybrid, False)
            counts = {k: sum(1 for c in calls if c[0] == k) for k in ("all_gather", "reduce_scatter", "all_reduce")}
            side = {"all_gather": engine.all_gather_stream, "reduce_scatter": engine.reduce_scatter_stream,
                    "all_reduce": engine.replica_stream}
            off_stream = [c for c in calls if cuda and c[2] != side[c[0]]]
            issued = counts["all_gather"] > 0 and counts["reduce_scatter"] > 0 and (counts["all_reduce"] > 0) == hybrid
            ref_tol = 0.05 if name == "bf16" else tol
            ldiff = max(abs(a - b) for a, b in zip(losses, ref_losses))
            pdiff = _max_diff(params, ref_params)
            copy_diff = max(_max_diff(params, copy_params), max(abs(a - b) for a, b in zip(losses, copy_losses)))
            good = (issued and not off_stream and not copy_calls and ldiff <= ref_tol and pdiff <= ref_tol
                    and copy_diff <= tol)
            ok &= good
            print(f"  {family:5s} {name:11s} issued {counts} ({'sync' if not any(c[1] for c in calls) else 'async'}, "
                  f"{len(off_stream)} off their side stream); vs plain max|dloss|={ldiff:.2e} max|dparam|={pdiff:.2e}; "
                  f"vs W=1 copy path {copy_diff:.2e}: {'PASS' if good else 'FAIL'}", flush=True)
    return ok
