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
def _peers(group):
    """(shard-group rank, global rank) of every other member of the shard group."""
    pg = group.shard_group
    glob = (lambda r: r) if pg is dist.group.WORLD else (lambda r: dist.get_global_rank(pg, r))
    return [(r, glob(r)) for r in range(group.shard_size) if r != group.shard_rank]


def patch_ag_p2p(wrapped) -> None:
    """comm.ShardGroup.all_gather on gloo: send our shard to every peer and receive every peer's shard
    straight into its slot of the output (isend/irecv, no staging buffer, no waits in between).
    gloo's all_gather_single gathers into a temporary, copies out and runs a slower algorithm."""
    group = wrapped.shard_group
    if group.backend != "gloo" or group.shard_size == 1:
        return

    def all_gather(self, output, shard, async_op=True):
        self.bytes_gathered += shard.numel() * shard.element_size()
        chunks = output.chunk(self.shard_size)
        chunks[self.shard_rank].copy_(shard)
        ops = []
        for r, g in _peers(self):
            ops.append(dist.P2POp(dist.isend, shard, g, group=self.shard_group, tag=1))
            ops.append(dist.P2POp(dist.irecv, chunks[r], g, group=self.shard_group, tag=1))
        work = _Works(dist.batch_isend_irecv(ops))
        if not async_op:
            work.wait()
        return work

    group.all_gather = types.MethodType(all_gather, group)


def patch_rs_p2p(wrapped) -> None:
    """comm.ShardGroup.reduce_scatter on gloo: send chunk j of the full gradient to rank j, receive every
    peer's copy of our chunk into a temporary; wait() sums them into the output.  Moves (W-1)/W of the
    gradient per rank instead of all-reduce's 2(W-1)/W; take_reduced_shard becomes a no-op."""
    group = wrapped.shard_group
    if group.backend != "gloo" or group.shard_size == 1:
        return
    group.reduce_scatter_via_all_reduce = False

    def reduce_scatter(self, output, full, async_op=True):
        self.bytes_reduced += full.numel() * full.element_size()
        chunks = full.chunk(self.shard_size)
        peers = _peers(self)
        tmp = torch.empty(len(peers), output.numel(), dtype=full.dtype, device=full.device)
        ops = []
        for i, (r, g) in enumerate(peers):
            ops.append(dist.P2POp(dist.isend, chunks[r], g, group=self.shard_group, tag=2))
            ops.append(dist.P2POp(dist.irecv, tmp[i], g, group=self.shard_group, tag=2))
        own = chunks[self.shard_rank]

        def finish():
            torch.add(own, tmp[0], out=output)
            for i in range(1, len(peers)):
                output.add_(tmp[i])

        work = _Works(dist.batch_isend_irecv(ops), finish)
        if not async_op:
            work.wait()
        return work

    group.reduce_scatter = types.MethodType(reduce_scatter, group)


class _Works:
    """Several work handles (and an optional completion step) as one handle."""

    def __init__(self, works, then=None) -> None:
        self.works, self.then = works, then

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        self.works = []
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return True


OPTIONS: Dict[str, Callable] = {
    "noreshard": lambda: {"reshard_after_forward": False},
    "fpre": lambda: {"forward_prefetch": True},
    "bpre": _bpre,
    "bpost": _bpost,
    "limit1": lambda: {"limit_all_gathers": 1},
    "limit4": lambda: {"limit_all_gathers": 4},
    "agp2p": patch_ag_p2p,
    "rsp2p": patch_rs_p2p,
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
