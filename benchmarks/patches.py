"""Variants of our engine for benchmarks/bench.py: constructor options and per-instance monkeypatches.

A variant is ``ours`` followed by ``+option`` parts, e.g. ``ours+noreshard+bpre``.  Monkeypatches
replace methods on ONE wrapped model's objects only (its ShardGroup / Engine instance), so patched and
unpatched variants run side by side in the same processes.  Each patch is the measured form of a
change proposed for the engine (see the report / README for the exact code change).
"""
from __future__ import annotations

import os
import types
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist


# ---------------------------------------------------------------------- constructor options
def _bpre():
    from accel_flatshard import BackwardPrefetch

    return {"backward_prefetch": BackwardPrefetch.BACKWARD_PRE}


def _bpost():
    from accel_flatshard import BackwardPrefetch

    return {"backward_prefetch": BackwardPrefetch.BACKWARD_POST}


# ---------------------------------------------------------------------- monkeypatches
def _peers(group):
    """Shard-group ranks of every other member of the shard group."""
    return [r for r in range(group.shard_size) if r != group.shard_rank]


def patch_ag_p2p(wrapped) -> None:
    """comm.ShardGroup.all_gather on gloo: send our shard to every peer and receive every peer's shard
    straight into its slot of the output (isend/irecv, no staging buffer, no waits in between).
    gloo's all_gather_single gathers into a temporary, copies out and runs a slower algorithm."""
    group = wrapped.shard_group
    if group.backend != "gloo" or group.shard_size == 1:
        return

    def all_gather(self, outputs, shards, async_op=True, kind="", in_node=False):
        ops = []
        for output, shard in zip(outputs, shards):
            self.bytes_gathered += shard.numel() * shard.element_size()
            chunks = output.chunk(self.shard_size)
            chunks[self.shard_rank].copy_(shard)
            for r in _peers(self):
                ops.append(dist.P2POp(dist.isend, shard, group=self.shard_group, group_peer=r, tag=1))
                ops.append(dist.P2POp(dist.irecv, chunks[r], group=self.shard_group, group_peer=r, tag=1))
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
        for i, r in enumerate(peers):
            ops.append(dist.P2POp(dist.isend, chunks[r], group=self.shard_group, group_peer=r, tag=2))
            ops.append(dist.P2POp(dist.irecv, tmp[i], group=self.shard_group, group_peer=r, tag=2))
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


# one handle for several works (+ a completion step): the engine's own
from accel_flatshard.core.handles import Handle as _Works  # noqa: E402


def patch_bound_reduces(wrapped, max_inflight: int = 2) -> None:
    """Engine: at most ``max_inflight`` full gradients awaiting reduction (the engine now bounds them on
    every device; this only sets the bound, process-wide: ``engine.MAX_PENDING_REDUCTIONS``)."""
    from accel_flatshard.core import engine

    engine.MAX_PENDING_REDUCTIONS = max(1, max_inflight)


def patch_adopt_grad(wrapped) -> None:
    """flat_param.FlatParameter.accumulate_sharded_grad: when no gradient exists yet (after
    zero_grad(set_to_none=True)) adopt the freshly reduced shard as ``sharded_grad`` instead of
    allocating zeros and copying into them."""
    for flat in wrapped.flat_params:
        original = flat.accumulate_sharded_grad

        def accumulate(self, new_grad, _original=original):
            if new_grad.dtype == self.dtype and all(p.grad is None for p in self.params):
                self.sharded_grad = new_grad
                for p, view in self.grad_views():
                    p.grad = view
                return
            _original(new_grad)

        flat.accumulate_sharded_grad = types.MethodType(accumulate, flat)


def patch_keep_last(wrapped) -> None:
    """unit.Unit: do not reshard the last unit of the forward order after forward (backward starts
    with it at once, so FSDP2 keeps it too): one all-gather of one block less per step."""
    units = [u for u in wrapped.units if not u.is_root]
    if units:
        units[-1].reshard_after_forward = False


def wrap_embeddings(model) -> dict:
    """wrap.transformer_auto_wrap_policy: also make the input embedding and an untied output head units
    of their own, so that the head's gradient is reduced right after its backward (it is the first
    gradient of backward) instead of with the root's at the very end."""
    import torch.nn as nn

    from accel_flatshard.core.wrap import block_classes_of

    blocks = tuple(block_classes_of(model))
    extra = set()
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    if out is not None and inp is not None and out.weight is not inp.weight:
        extra.update({id(inp), id(out)})

    def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return True if recurse else isinstance(module, blocks) or id(module) in extra

    return {"auto_wrap_policy": policy}


def head_in_root(model) -> dict:
    """Blocks as units, the untied embedding and head left in the root (the engine before the head
    became a unit: the simplest way to let a parent's forward read ``lm_head.weight``)."""
    from accel_flatshard.core.wrap import block_classes_of, transformer_auto_wrap_policy

    return {"auto_wrap_policy": transformer_auto_wrap_policy(list(block_classes_of(model)))}


def fused_head(model) -> dict:
    """Give the model a forward like TRL's ``add_fused_lm_head``: run the backbone, then multiply by
    ``lm_head.weight`` read directly, outside the head's own forward (outside_reads.py gathers it)."""
    import torch.nn.functional as F

    def forward(input_ids, labels=None, **kwargs):
        hidden = model.model(input_ids).last_hidden_state[:, :-1]
        logits = hidden @ model.get_output_embeddings().weight.t()
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))
        return type("Output", (), {"loss": loss})()

    model.forward = forward
    return {}


def no_outside_reads(wrapped) -> None:
    """Undo outside_reads.enable_outside_reads (the engine before that fix): modules get their own
    class back, so a parent's read of a unit's parameter sees the shard."""
    for module in wrapped.module.modules():
        if module.__dict__.pop("_flatshard_outside_reads", None) is not None:
            module.__class__ = module.__class__.__mro__[1]


def compile_regional(wrapped) -> None:
    """What prepare does for accelerate's use_regional_compilation (accel_flatshard.features.compilation): each
    block's forward compiled inside its unit's hooks (gather, views, free run eagerly around it)."""
    from accel_flatshard.features.compilation import compile_model

    compile_model(wrapped, regional=True)


def compile_blocks_call(wrapped) -> None:
    """The other placement: each block compiled whole, ``module.compile()`` in place, as accelerate does for
    FSDP2 and DeepSpeed (the same as compiling the blocks before wrapping): dynamo's frame is entered
    around the hooks, which ``unit.py`` disables for dynamo."""
    for unit in wrapped.units:
        if not unit.is_root:
            unit.module.compile()


def compile_whole(wrapped) -> None:
    """Whole-model compile in place (graph breaks at every unit's hooks)."""
    from accel_flatshard.features.compilation import compile_model

    compile_model(wrapped, regional=False)


def no_dynamo_disable(wrapped) -> None:
    """The engine before issue 24: unit hooks without ``torch.compiler.disable`` (eager cost of the wrapper)."""
    for unit in wrapped.units:
        for h in unit._handles[:2]:
            h.remove()
        unit._handles[:2] = [
            unit.module.register_forward_pre_hook(types.MethodType(type(unit)._pre_forward_hook.__wrapped__, unit),
                                                  prepend=True, with_kwargs=True),
            unit.module.register_forward_hook(types.MethodType(type(unit)._post_forward_hook.__wrapped__, unit)),
        ]


def gather_embedding_for_backward(wrapped) -> None:
    """unit.Unit.gathers_for_backward: the engine before it, every unit gathered again for its backward (also an
    untied input embedding, whose backward reads no weight)."""
    for unit in wrapped.units:
        unit.gathers_for_backward = True


# name -> ("kw", fn(model) -> constructor kwargs) or ("post", fn(wrapped) -> None)
OPTIONS: Dict[str, Tuple[str, Callable]] = {
    "noreshard": ("kw", lambda m: {"reshard_after_forward": False}),
    "fpre": ("kw", lambda m: {"forward_prefetch": True}),
    "noprefetch": ("kw", lambda m: {"forward_prefetch": False, "backward_prefetch": None}),  # the old defaults
    "bpre": ("kw", lambda m: _bpre()),
    "bpost": ("kw", lambda m: _bpost()),
    "limit1": ("kw", lambda m: {"limit_all_gathers": 1}),
    "limit4": ("kw", lambda m: {"limit_all_gathers": 4}),
    "wrapemb": ("kw", wrap_embeddings),
    "agp2p": ("post", patch_ag_p2p),
    "rsp2p": ("post", patch_rs_p2p),
    "boundrs": ("post", patch_bound_reduces),
    "adopt": ("post", patch_adopt_grad),
    "keeplast": ("post", patch_keep_last),
    "headinroot": ("kw", head_in_root),
    "fusedhead": ("kw", fused_head),
    "noreads": ("post", no_outside_reads),
    "compile": ("post", compile_regional),
    "compilecall": ("post", compile_blocks_call),
    "compilewhole": ("post", compile_whole),
    "nodisable": ("post", no_dynamo_disable),
    "embbwd": ("post", gather_embedding_for_backward),
    "nopack": ("kw", lambda m: {"pack_all_gathers": False}),  # one all-gather per flat parameter (before issue 42)
    # hpZ with one rank per "machine": each unit keeps its gathered copy and its backward gather is a local copy
    "hpz1": ("kw", lambda m: {"node_local_backward_gather": True, "ranks_per_node": 1}),
    # int8 weights and int8 gradients on the wire (qwZ + qgZ, issue 43; lossy)
    "int8": ("kw", lambda m: {"quantized_all_gather": True, "quantized_reduce": True}),
    # across machines (benchmarks/link_bench.py; LOCAL_WORLD_SIZE = ranks per machine): HYBRID_SHARD with a shard
    # group per machine, and hpZ (backward gathers inside the machine)
    "hybrid": ("kw", lambda m: {"fsdp_group_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1"))}),
    "hpz": ("kw", lambda m: {"node_local_backward_gather": True}),
    # accumulation over slow links (with link_bench.py --accumulate K): units gathered once per step, and the
    # cross-machine stage of the reduction (replica all-reduce / hpZ's second stage) once per step
    "keep": ("kw", lambda m: {"keep_gathered_across_micro_batches": True}),
    "defer": ("kw", lambda m: {"defer_cross_machine_reduce": True}),
}


# ``ours+proposed``: changes measured here and not (yet) in the engine.  agp2p, boundrs, adopt, keeplast
# and wrapemb were adopted by the engine itself (comm.py, engine.py, flat_param.py, unit.py, wrap.py) and
# are kept as options only to compare against their patch form; embbwd restores what the engine did before.
PROPOSED = ["rsp2p"]  # fpre + bpre became the defaults (docs/performance.md)


def parse_variant(name: str, model=None) -> Tuple[dict, List[Callable]]:
    """``ours+a+b`` -> (constructor kwargs, post-wrap patch functions); ``model`` is needed for options
    that depend on it (validation only when None)."""
    parts = name.split("+")
    if parts[0] != "ours":
        raise ValueError(f"variant {name!r} must start with 'ours'")
    kwargs: dict = {}
    post: List[Callable] = []
    opts = [o for part in parts[1:] for o in (PROPOSED if part == "proposed" else [part])]
    for opt in opts:
        if opt not in OPTIONS:
            raise ValueError(f"unknown option {opt!r} in {name!r}; choose from {', '.join(OPTIONS)}")
        kind, fn = OPTIONS[opt]
        if kind == "post":
            post.append(fn)
        elif model is not None:
            kwargs.update(fn(model))
    return kwargs, post
