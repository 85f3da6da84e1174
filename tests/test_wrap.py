"""Auto-wrap policies choose units like torch's wrapper does (no process group needed)."""
import functools
import logging

import pytest
import torch.nn as nn
from torch.distributed.fsdp.wrap import (size_based_auto_wrap_policy as torch_size_policy, transformer_auto_wrap_policy
                                         as torch_transformer_policy)

from accel_flatshard import size_based_auto_wrap_policy, transformer_auto_wrap_policy
from accel_flatshard.core.wrap import backward_reads_parameters, policy_of, select_units
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


def test_size_policy_of_an_accelerate_config_keeps_multihead_attention_whole_as_torch_does():
    """MultiheadAttention reads its out_proj's weight in its own forward, not through the submodule's: torch's
    size policy never looks inside it (FORCE_LEAF_MODULES).  The yaml's SIZE_BASED_WRAP maps to the same choice."""
    from accel_flatshard.core.options import FlatShardOptions

    model = nn.Sequential(*(nn.ModuleDict({"attn": nn.MultiheadAttention(64, 4), "mlp": nn.Linear(64, 64)})
                            for _ in range(2)))
    min_num_params = 4000  # an out_proj alone (64 * 64 + 64) would be a unit if looked into
    theirs = _names(model, functools.partial(torch_size_policy, min_num_params=min_num_params))
    assert theirs == ["", "0.mlp", "1.mlp"]  # (a module not looked into is no unit either: its parameters stay up)
    assert _names(model, policy_of(FlatShardOptions(auto_wrap="size", min_num_params=min_num_params), model)) == theirs
    assert _names(model, size_based_auto_wrap_policy(min_num_params)) == theirs


def test_unknown_block_class_names_what_was_looked_for():
    with pytest.raises(ValueError, match="LlamaDecoderLayer.*GPT2Block"):
        transformer_auto_wrap_policy(gpt2(), ["LlamaDecoderLayer"])


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.inner = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])  # repeats inside a block: stays in it


class _UserNet(nn.Module):  # no _no_split_modules
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([_Block() for _ in range(3)])
        self.acts = nn.ModuleList([nn.ReLU(), nn.ReLU()])  # repeated but without parameters: not units
        self.head = nn.Linear(4, 4)


def test_without_no_split_modules_the_repeated_blocks_become_units_and_are_logged_once(caplog):
    from accel_flatshard.core import wrap

    wrap._LOGGED_CHOICES.clear()
    model = _UserNet()
    with caplog.at_level(logging.WARNING, logger="accel_flatshard.core.wrap"):
        units = select_units(model, transformer_auto_wrap_policy(model))
        transformer_auto_wrap_policy(_UserNet())
    assert units == [model, *model.blocks]
    assert caplog.text.count("wrapping its repeated blocks ['_Block'] as units") == 1
    assert "fsdp_transformer_layer_cls_to_wrap: _Block" in caplog.text


def test_without_repeated_blocks_the_root_is_the_only_unit_and_that_is_logged(caplog):
    from accel_flatshard.core import wrap

    wrap._LOGGED_CHOICES.clear()
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.LayerNorm(8))  # nothing repeats
    with caplog.at_level(logging.WARNING, logger="accel_flatshard.core.wrap"):
        units = select_units(model, transformer_auto_wrap_policy(model))
    assert units == [model]
    assert "no repeated blocks" in caplog.text and "one unit for the whole model" in caplog.text


class _ScaledEmbedding(nn.Embedding):  # e.g. Gemma's: its own forward may read the weight in backward
    def forward(self, ids):
        return super().forward(ids) * 2.0


@pytest.mark.parametrize("module, gathered", [
    (nn.Embedding(8, 4), False),
    (nn.Embedding(8, 4, padding_idx=0), False),
    (nn.Embedding(8, 4, max_norm=1.0), True),  # renormalises the weight in forward
    (nn.Embedding(8, 4, sparse=True), True),
    (_ScaledEmbedding(8, 4), True),
    (nn.Linear(4, 4), True),
])
def test_only_a_plain_embedding_unit_is_not_gathered_for_backward(module, gathered):
    assert backward_reads_parameters(module) is gathered
