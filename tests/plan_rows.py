"""The memory planner's accuracy matrix (tests/test_plan.py): configurations, the real step they describe, and
its measured peak.

Measured = torch's own dispatch-level tracker (``torch.distributed._tools.mem_tracker.MemTracker``) over one
steady-state step (the second: optimizer state exists, forward prefetch follows the recorded order) of the
real wrapped model: forward, backward, optimizer step, zero_grad, the micro-batches of an accumulated
batch included.  It sees every storage an op creates, the gathered buffers through ``resize_``, and the
tensors made before the step it is given (shards, optimizer state, buffers, inputs, offload's host
buffers); RSS would blur all of this in the allocator.  ``SimulatedOOM``: the same tracker raising as soon
as the memory in use exceeds a limit (a device of that size).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.distributed._tools.mem_tracker import MemTracker

from accel_flatshard import FullyShardedDataParallel, MixedPrecision
from accel_flatshard.core.options import FlatShardOptions
from accel_flatshard.plan import Config, Planner
from accel_flatshard.core.options import BackwardPrefetch
from accel_flatshard.core.wrap import checkpoint_units, policy_of

BATCH, SEQ = 4, 32
BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
BF16_REDUCE_BF16 = MixedPrecision(param_dtype=torch.bfloat16)


def llama() -> nn.Module:
    import models

    return models.llama(n_layer=3, hidden=64)


def llama_vocab() -> nn.Module:
    """Its untied embedding is larger than its blocks (as in Llama 3): the peak is at the end of backward."""
    import models

    return models.llama(n_layer=1, hidden=128, vocab=4096)


GQA_SEQ = 256


def llama_gqa() -> nn.Module:
    """Grouped-query attention (8 heads, 2 K/V heads) at 256 tokens, fed an all-ones attention mask as a
    tokenizer's batch without padding: transformers then skips the 4-D mask and SDPA reads the K/V heads as they
    are (a fake mask would make it build the mask and repeat K/V)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=4, hidden_size=128, intermediate_size=256, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=GQA_SEQ, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(config)


def gpt2() -> nn.Module:  # tied input/output embedding (in the root unit)
    import models

    return models.gpt2(n_layer=3, n_embd=64)


def toy() -> nn.Module:
    """A user's own module: a weight tied across units, a unit called twice, a parameter-less unit, frozen."""
    import toy as toy_module

    return toy_module.Toy(freeze_embed=True)


def mixtral(experts_implementation: Optional[str] = None) -> nn.Module:
    """A mixture of experts (4 experts, 2 per token) whose experts run through ``aten._grouped_mm`` (transformers'
    default), in fp32 here: the op's fake kernel accepts only bf16.  ``"eager"``: its data-dependent path."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=128, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if experts_implementation:
        config._experts_implementation = experts_implementation
    return MixtralForCausalLM(config)


def qlora() -> nn.Module:
    """A tiny Llama whose blocks' linear layers are 4-bit (nf4, bf16 storage, as tests/test_qlora.py loads them),
    with LoRA adapters; quantized in memory on the host, whatever the device in use."""
    import bitsandbytes as bnb
    import models
    from peft import LoraConfig, get_peft_model
    from test_qlora import TARGETS

    with torch.device("cpu"):
        model = models.llama(n_layer=2, hidden=64).to(torch.bfloat16)
        for block in model.model.layers:
            for parent in (block.self_attn, block.mlp):
                for name, linear in [(n, c) for n, c in parent.named_children() if isinstance(c, nn.Linear)]:
                    quantized = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=False,
                                                  compute_dtype=torch.bfloat16, quant_type="nf4",
                                                  quant_storage=torch.bfloat16)
                    quantized.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, quant_type="nf4",
                                                         quant_storage=torch.bfloat16, module=quantized)
                    setattr(parent, name, quantized.to("cpu"))  # (quantizes)
        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0))
    model.train()
    return model


MODELS: Dict[str, Tuple[Callable[[], nn.Module], Optional[List[str]]]] = {
    "llama": (llama, None), "llama-vocab": (llama_vocab, None), "gpt2": (gpt2, None), "toy": (toy, ["Block", "Scale"]),
    "mixtral": (mixtral, None), "mixtral-eager": (lambda: mixtral("eager"), None), "llama-gqa": (llama_gqa, None),
    "qlora": (qlora, ["LlamaDecoderLayer"])}


def make_batch(name: str) -> Callable[[int], Any]:
    if name == "toy":
        return lambda n: (torch.ones(n * 8, 12),)  # (8 rows per sample: a "sample" of the toy model)
    if name == "llama-gqa":
        return lambda n: {"input_ids": torch.zeros(n, GQA_SEQ, dtype=torch.long), "attention_mask": torch.ones(
            n, GQA_SEQ, dtype=torch.long), "labels": torch.zeros(n, GQA_SEQ, dtype=torch.long)}
    return lambda n: {"input_ids": torch.zeros(n, SEQ, dtype=torch.long), "labels": torch.zeros(n, SEQ, dtype=torch.long)}


@dataclasses.dataclass(frozen=True)
class Row:
    model: str
    world_size: int
    cfg: Config
    label: str = ""
    optimizer: str = "adamw"  # or "muon": torch.optim.Muon over the hidden matrices, AdamW over the rest

    def options(self) -> FlatShardOptions:
        return self.cfg.options

    def planner(self, device: str = "cpu") -> Planner:
        def build() -> nn.Module:
            with torch.device("meta"):
                return MODELS[self.model][0]()
        optimizer = torch.optim.Muon if self.optimizer == "muon" else torch.optim.AdamW
        return Planner(build, self.options(), self.world_size, BATCH, make_batch(self.model), device, optimizer=optimizer)


def adamw(device: str) -> Callable[[List[nn.Parameter]], torch.optim.Optimizer]:
    return lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=device == "cuda")


def row(model: str, world_size: int, label: str = "", mixed_precision=None, micro_batch: int = BATCH,
        accumulation: str = "none", options: Optional[FlatShardOptions] = None, optimizer: str = "adamw",
        **settings: Any) -> Row:
    """A planner row: the model's blocks as units, ``settings`` (FlatShardOptions fields) over ``options``."""
    options = options or FlatShardOptions(auto_wrap="transformer", layer_cls_names=MODELS[model][1],
                                          mixed_precision=mixed_precision)
    return Row(model, world_size, Config(dataclasses.replace(options, **settings), micro_batch, accumulation), label,
               optimizer)


class SimulatedOOM(RuntimeError):
    pass


class _LimitedTracker(MemTracker):
    """MemTracker that raises :class:`SimulatedOOM` when the memory in use exceeds ``limit`` bytes."""

    def __init__(self, limit: Optional[int]) -> None:
        super().__init__()
        self.limit = limit
        self.curve: Optional[List[int]] = None  # a list: the bytes in use after every op (plan --plot --measured)

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True):
        # its gradient hooks fail on frozen parameters; gradients are op outputs, counted anyway
        return super()._track_module_params_and_buffers(module, install_grad_hooks=False)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        used = sum(snap["Total"] for snap in self._curr_mem_snap.values())
        if self.curve is not None:
            self.curve.append(used)
        if self.limit is not None and used > self.limit:
            raise SimulatedOOM(f"{used} bytes in use > {self.limit} at {func}")
        return out


def wrap(r: Row, before: Callable[[nn.Module], Any] = lambda model: None) -> FullyShardedDataParallel:
    """``r``'s model wrapped (``before(model)``: called on the plain model first)."""
    torch.manual_seed(0)
    model = MODELS[r.model][0]()
    before(model)
    opts = r.options()
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=policy_of(opts, model), options=opts)
    if opts.activation_checkpointing:
        checkpoint_units(wrapped.module, [u.module for u in wrapped.units if not u.is_root])
    return wrapped


def measure(r: Row, limit: Optional[int] = None, steps: int = 2, sim: Any = None, wrapped=None) -> int:
    """The measured peak of the last of ``steps`` optimizer steps (``sim``: the CUDA simulator's device peak)."""
    if r.optimizer == "muon":  # built on the plain model (the matrices are 2-D there), as the planner does
        from accel_flatshard.features.matrix_optim import matrix_optimizer_and_adamw

        made = []
        wrapped = wrap(r, lambda model: made.append(matrix_optimizer_and_adamw(torch.optim.Muon, model, lr=1e-3)))
        optimizer = made[0]
    else:
        wrapped = wrapped or wrap(r)
        optimizer = adamw("cuda" if sim is not None else "cpu")(list(wrapped.parameters()))
    batch = make_batch(r.model)(BATCH)
    chunks = [_split(batch, i, r.cfg.micro_batch) for i in range(0, BATCH, r.cfg.micro_batch)]
    peak = 0
    for step in range(steps):
        tracker = _LimitedTracker(limit) if step == steps - 1 and sim is None else None
        if tracker is not None:
            engine = wrapped.schedule.engine
            tensors = [f.unsharded for f in wrapped.flat_params] + (engine.offload.host_buffers if engine.offload else [])
            tracker.track_external(wrapped, optimizer, *tensors, *[t for c in chunks for t in _tensors(c)])
        if sim is not None:
            sim.peak_bytes = {}
        with tracker if tracker is not None else sim if sim is not None else contextlib.nullcontext():
            for i, chunk in enumerate(chunks):
                quiet = r.cfg.accumulation == "no_sync" and i < len(chunks) - 1
                with wrapped.no_sync() if quiet else contextlib.nullcontext():
                    args, kwargs = (chunk, {}) if isinstance(chunk, tuple) else ((), chunk)
                    out = wrapped(*args, **kwargs)
                    loss = getattr(out, "loss", out)
                    del out
                    loss.backward()
                if tracker is not None:
                    tracker.reset_mod_stats()  # (it refuses a second forward of the root otherwise)
            optimizer.step()
            optimizer.zero_grad()
        if tracker is not None:
            peak = max(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    return sim.peak_bytes["device"] if sim is not None else peak


def _split(batch: Any, start: int, n: int) -> Any:
    if isinstance(batch, tuple):
        return tuple(t[start * 8:(start + n) * 8] for t in batch)  # (toy: 8 rows per sample)
    return {k: v[start:start + n].clone() for k, v in batch.items()}


def _tensors(chunk: Any) -> List[torch.Tensor]:
    return list(chunk) if isinstance(chunk, tuple) else list(chunk.values())


def measure_rows(rank: int, world_size: int, rows: List[Row], limits: List[Optional[int]]) -> List[Any]:
    """On each of ``world_size`` gloo ranks (dist_helpers.spawn): every row's measured peak, or the
    SimulatedOOM message when the row's limit was exceeded."""
    out = []
    for r, limit in zip(rows, limits):
        try:
            out.append(measure(r, limit))
        except SimulatedOOM as exc:
            out.append(str(exc))
    return out


def toy_cli_batch(batch_size: int, seq_len: Any) -> tuple:
    """``--make_batch`` for the toy model (the command line's signature)."""
    return make_batch("toy")(batch_size)


def snapshot_bytes(rank: int, world_size: int, r: Row) -> Dict[str, int]:
    """On each gloo rank, after one step of ``r``'s model: the host bytes the asynchronous save's snapshot really
    holds, SHARDED (``commit.snapshot_entries``' copies of the model's and optimizer's entries) and FULL (the
    model and optimizer state gathered to rank 0, which is its snapshot)."""
    from accel_flatshard.state import commit
    from accel_flatshard.state.dcp import FlatRange
    from accel_flatshard.state.sharded import model_entries, optimizer_entries
    from accel_flatshard.core.model_state import full_state_dict
    from accel_flatshard.state.optim import full_optim_state_dict

    wrapped = wrap(r)
    optimizer = adamw("cpu")(list(wrapped.parameters()))
    wrapped(**make_batch(r.model)(BATCH)).loss.backward()
    optimizer.step()
    copies = [commit.snapshot_entries(entries)[0] for _, entries, _ in (model_entries(wrapped),
                                                                        optimizer_entries(wrapped, optimizer))]
    sharded = [e.local if isinstance(e, FlatRange) else e for copy in copies for e in copy.values()]
    full = [t for state in (full_state_dict(wrapped), full_optim_state_dict(wrapped, optimizer))
            for t in torch.utils._pytree.tree_leaves(state) if isinstance(t, torch.Tensor)]
    return {kind: sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())
            for kind, tensors in (("SHARDED_STATE_DICT", sharded), ("FULL_STATE_DICT", full))}
