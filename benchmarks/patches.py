"""Variants of our engine for benchmarks/bench.py: constructor options and per-instance monkeypatches.

A variant is ``ours`` followed by ``+option`` parts, e.g. ``ours+noreshard+bpre``.  Monkeypatches
replace methods on ONE wrapped model's objects only (its ShardGroup / Engine instance), so patched and
unpatched variants run side by side in the same processes.  Each patch is the measured form of a
change proposed for the engine (see the report / README for the exact code change).
"""
from __future__ import annotations

import types
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist


# ---------------------------------------------------------------------- constructor options
def _kw(**kw):
    return ("kw", kw)


def _bpre():
    from accel_flatshard import BackwardPrefetch

    return {"backward_prefetch": BackwardPrefetch.BACKWARD_PRE}


def _bpost():
    from accel_flatshard import BackwardPrefetch

    return {"backward_prefetch": BackwardPrefetch.BACKWARD_POST}


# ---------------------------------------------------------------------- monkeypatches
def patch_ag_p2p(wrapped) -> None:
    """comm.ShardGroup.all_gather on gloo: ring of isend/irecv straight into the output's slots
    (gloo's all_gather_into_tensor gathers into a temporary and copies; its ring is slower)."""
    group = wrapped.shard_group
    if group.backend != "gloo" or group.shard_size == 1:
        return
    original = group.all_gather

    def all_gather(self, output, shard, async_op=True):
        self.bytes_gathered += shard.numel() * shard.element_size()
        return p2p_all_gather(output, shard, self.shard_group, self.shard_rank, self.shard_size, async_op)

    group.all_gather = types.MethodType(all_gather, group)
    group._original_all_gather = original


def p2p_all_gather(output, shard, pg, rank, world, async_op=True):
    chunks = output.chunk(world)
    chunks[rank].copy_(shard)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    to_global = (lambda r: dist.get_global_rank(pg, r)) if pg is not dist.group.WORLD else (lambda r: r)
    pending = []
    for s in range(world - 1):
        send_idx, recv_idx = (rank - s) % world, (rank - s - 1) % world
        reqs = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, chunks[send_idx], to_global(nxt), group=pg),
            dist.P2POp(dist.irecv, chunks[recv_idx], to_global(prv), group=pg),
        ])
        if s < world - 2 or not async_op:
            for r in reqs:
                r.wait()
        else:
            pending = reqs
    return _Works(pending)


class _Works:
    def __init__(self, works) -> None:
        self.works = works

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        self.works = []
        return True


OPTIONS: Dict[str, Callable] = {
    "noreshard": lambda: {"reshard_after_forward": False},
    "fpre": lambda: {"forward_prefetch": True},
    "bpre": _bpre,
    "bpost": _bpost,
    "limit1": lambda: {"limit_all_gathers": 1},
    "limit4": lambda: {"limit_all_gathers": 4},
    "agp2p": patch_ag_p2p,
}
_KWARG_OPTIONS = {"noreshard", "fpre", "bpre", "bpost", "limit1", "limit4"}


def parse_variant(name: str) -> Tuple[dict, List[Callable]]:
    """``ours+a+b`` -> (constructor kwargs, post-wrap patch functions)."""
    parts = name.split("+")
    if parts[0] != "ours":
        raise ValueError(f"variant {name!r} must start with 'ours'")
    kwargs: dict = {}
    post: List[Callable] = []
    for opt in parts[1:]:
        if opt not in OPTIONS:
            raise ValueError(f"unknown option {opt!r} in {name!r}; choose from {', '.join(OPTIONS)}")
        if opt in _KWARG_OPTIONS:
            kwargs.update(OPTIONS[opt]())
        else:
            post.append(OPTIONS[opt])
    return kwargs, post
