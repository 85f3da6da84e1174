"""Auto-wrap policies choose units like torch's wrapper does (no process group needed)."""
import functools

import pytest
import torch.nn as nn
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy as torch_size_policy
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy as torch_transformer_policy

from accel_flatshard import size_based_auto_wrap_policy, transformer_auto_wrap_policy
from accel_flatshard.wrap import select_units
from models import gpt2, llama


def _names(model, policy):
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(m)] for m in select_units(model, policy)]


def test_transformer_policy_from_no_split_modules_wraps_every_block_and_untied_embeddings():
    model = llama(n_layer=3)
    assert _names(model, transformer_auto_wrap_policy(model)) == [
        "", "model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2", "lm_head"]


def test_transformer_policy_accepts_names_and_torch_partials():
    model = gpt2()
    ours = _names(model, transformer_auto_wrap_policy(model, ["GPT2Block"]))
    block = type(model.transformer.h[0])
    theirs = _names(model, functools.partial(torch_transformer_policy, transformer_layer_cls={block}))
    assert ours == theirs == ["", "transformer.h.0", "transformer.h.1"]


def test_size_policy_never_wraps_containers_and_matches_torch_recursion():
    model = gpt2(n_layer=2, n_embd=32)
    ours = _names(model, size_based_auto_wrap_policy(min_num_params=5000))
    assert "transformer.h" not in ours  # a ModuleList has no forward to gather in
    assert "transformer.h.0" in ours or "transformer.h.0.mlp" in ours
    theirs = _names(model, functools.partial(torch_size_policy, min_num_params=5000))
    assert "transformer.h.0" in theirs or "transformer.h.0.mlp" in theirs


def test_unknown_block_class_names_what_was_looked_for():
    with pytest.raises(ValueError, match="LlamaDecoderLayer.*GPT2Block"):
        transformer_auto_wrap_policy(gpt2(), ["LlamaDecoderLayer"])
