"""Tiny models and data shared by the tests (built from configs, never downloaded)."""
from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist
import torch.nn as nn

VOCAB = 128


def _quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()


def gpt2(seed: int = 0, n_layer: int = 2, n_embd: int = 32) -> nn.Module:
    """GPT-2 with tied input/output embeddings (wte is lm_head)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    _quiet_transformers()
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=2, vocab_size=VOCAB, n_positions=32,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def llama(seed: int = 0, n_layer: int = 2, hidden: int = 32, vocab: int = VOCAB) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    _quiet_transformers()
    torch.manual_seed(seed)
    config = LlamaConfig(num_hidden_layers=n_layer, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_attention_heads=2, num_key_value_heads=2, vocab_size=vocab,
                         max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(config)


MODELS = {"gpt2": gpt2, "llama": llama}


def llama_layer_class() -> type:
    """The decoder-layer class of :func:`llama` (one unit per layer in transformer auto-wrap)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def batches(steps: int, batch: int = 4, seq: int = 16, seed: int = 1) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(steps)]


def param_groups(model: nn.Module, weight_decay: float = 0.1):
    """Two groups by name, as HF scripts do: no decay for biases and norms (works on wrapped models)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if name.endswith("bias") or "norm" in name or ".ln_" in name else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def train(model: nn.Module, data: List[torch.Tensor], rank: int = 0, world_size: int = 1,
          optimizer=None, lr: float = 1e-3, clip: float = None) -> List[float]:
    """AdamW steps on this rank's slice of each global batch; returns the global-batch losses."""
    optimizer = optimizer or torch.optim.AdamW(param_groups(model), lr=lr)
    losses = []
    for x in data:
        local = x.chunk(world_size)[rank]
        loss = model(local, labels=local).loss
        loss.backward()
        if clip is not None:
            if hasattr(model, "clip_grad_norm_"):
                model.clip_grad_norm_(clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(global_mean(loss.detach(), world_size))
    return losses


def global_mean(value: torch.Tensor, world_size: int) -> float:
    value = value.detach().clone().float()
    if world_size > 1:
        dist.all_reduce(value)
        value /= world_size
    return value.item()


def full_params(wrapped) -> dict:
    with wrapped.summon_full_params():
        return {k: v.detach().clone() for k, v in wrapped.state_dict().items()}


def first_grads(model: nn.Module, x: torch.Tensor, rank: int = 0, world_size: int = 1) -> dict:
    """Full gradients (by parameter name) after one backward on this rank's slice of ``x``; grads are
    then cleared.  For a wrapped model the sharded gradients are gathered over the shard group."""
    local = x.chunk(world_size)[rank]
    model(local, labels=local).loss.backward()
    if not hasattr(model, "flat_params"):
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        return grads
    group = model.shard_group
    grads = {}
    for flat in model.flat_params:
        if flat.sharded_grad is None:
            continue
        full = torch.empty(flat.layout.padded_numel, dtype=flat.sharded_grad.dtype)
        dist.all_gather_into_tensor(full, flat.sharded_grad.contiguous(), group=group.shard_group)
        for slot in flat.layout.slots:
            grads[slot.fqn] = full[slot.offset: slot.offset + slot.numel].view(slot.shape).clone()
    model.zero_grad()
    return grads
