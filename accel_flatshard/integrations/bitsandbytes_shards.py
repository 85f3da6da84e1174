"""bitsandbytes over flat shards: 8-bit optimizer state as one process keeps it, 4-bit (QLoRA) layers on gathered
views.

**8-bit optimizers.**  bitsandbytes keeps blockwise 8-bit state (blocks of 256 elements, each with its absmax) for a
parameter of at least ``min_8bit_size`` elements (4096 by default) and 32-bit state for smaller ones, deciding on
``p.numel()``.  Under sharding ``p`` is this rank's piece, so a parameter that one process keeps in 8 bits got 32-bit
state on the ranks holding a small piece of it: more than 1/W of the state, and other numerics than DDP's.
:func:`state_precision_of_full_parameters`, run before every step by the registry's optimizer hook, sets bitsandbytes'
own per-parameter override (``min_8bit_size`` in its ``GlobalOptimManager``) before the first step, so that every piece
follows its full parameter (overrides bitsandbytes applies later, such as the Trainer's 32-bit embeddings, win).

Blocks: each rank quantizes its own piece in 256-element blocks from the piece's first element, so no block
straddles two ranks.  Where a shard boundary cuts a parameter, the blocks after it are shifted against one
process's: lining them up would take a 256-element alignment of every parameter in the flat layout (up to 255
padded elements each, a change of ``flat_param.py``'s layout), not made here.  So a block's absmax, and bitsandbytes'
lookup tables, are state of this rank's piece, not of the parameter: checkpoints keep them rank by rank
(``state/optim.py``: "local" entries), and a resume is exact at the shard group size of the save.

**4-bit layers.**  A 4-bit weight (``Params4bit``, stored as ``bnb_4bit_quant_storage``: a floating dtype, bf16 for
QLoRA, so that it flattens with the frozen parameters) is sharded as its storage.  In forward the wrapper installs a
plain view of the gathered storage as the module's ``weight``; bitsandbytes' ``fix_4bit_weight_quant_state_from_module``
then *registers* a new ``Params4bit`` over that view (replacing the sharded parameter: state dicts and checkpoints would
lose it).  :func:`keeping_gathered_4bit_weights` (a ``patches.py`` entry, installed by :func:`install_for`, the
registry's before-wrap listener, when a wrapped model has 4-bit layers) gives the installed view the quantization state
instead, leaving the registered parameter alone, and turns off bitsandbytes' CPU packing path, which rewrites the
weight's data and its shared quantization state in an evaluation forward: the next gather brings the unpacked data back.
In eval mode, where bitsandbytes would run that packed AVX512-BF16 kernel, a sharded layer computes by dequantize +
matmul instead (about 1 bf16 ulp apart): :func:`keeping_gathered_4bit_weights` warns once, and training scripts should
call ``model.train()`` (docs/optimizers.md).
"""
from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.nn as nn

from ..core import registry
from . import patches

__all__ = ["state_precision_of_full_parameters", "is_bitsandbytes_blockwise", "keeping_gathered_4bit_weights",
           "install_for"]

_DONE: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()  # optimizers whose overrides are set
_EVAL_WARNED: List[bool] = []  # the eval-mode note, given once per process
_FOUR_BIT = ("Linear4bit", "Embedding4bit")


def is_bitsandbytes_blockwise(optimizer: torch.optim.Optimizer) -> bool:
    """A bitsandbytes 8-bit-capable optimizer (``bnb.optim.AdamW8bit``, ``PagedAdamW8bit``, ...), found by class
    without importing bitsandbytes."""
    return any(c.__name__ == "Optimizer8bit" and c.__module__.startswith("bitsandbytes")
               for c in type(optimizer).__mro__)


def state_precision_of_full_parameters(optimizer: torch.optim.Optimizer, records: List[Any]) -> None:
    """Before a bitsandbytes optimizer's first step over sharded parameters (``registry.on_step``), each piece
    whose full parameter gets 8-bit state in one process gets it too."""
    if optimizer in _DONE or not is_bitsandbytes_blockwise(optimizer):
        return
    _DONE.add(optimizer)
    slots: Dict[int, Dict[int, Tuple[Any, int]]] = {}  # per model: its parameters' flat parameter and slot
    for gindex, group in enumerate(optimizer.param_groups):
        for pindex, p in enumerate(group["params"]):
            record = registry.record_of_param(p)
            if record is None:
                continue
            if id(record) not in slots:
                slots[id(record)] = record.schedule.slots()
            flat, i = slots[id(record)][id(p)]
            full = flat.layout.slots[i].numel
            smallest = optimizer.get_config(gindex, pindex, group)["min_8bit_size"]
            if p.numel() < smallest <= full:
                optimizer.mng.pid2config.setdefault(id(p), {})["min_8bit_size"] = 0


def _is_4bit_layer(module: nn.Module) -> bool:
    return type(module).__name__ in _FOUR_BIT and type(module).__module__.startswith("bitsandbytes")


def install_for(module: nn.Module, options: Any = None) -> None:
    """Before a model is wrapped (``registry.on_wrap``): one with bitsandbytes 4-bit layers gets
    :func:`keeping_gathered_4bit_weights`."""
    if "quantized" not in patches.INSTALLED and any(_is_4bit_layer(m) for m in module.modules()):
        patches.install("quantized")


@functools.lru_cache(maxsize=None)
def keeping_gathered_4bit_weights(original: Callable[[nn.Module], None]) -> Callable[[nn.Module], None]:
    """bitsandbytes' ``fix_4bit_weight_quant_state_from_module`` (called at the start of a 4-bit layer's forward)
    that, for a sharded weight, gives the gathered view installed as ``module.weight`` the layer's quantization
    state: the registered (sharded) parameter stays."""
    @functools.wraps(original)
    def fix_4bit_weight_quant_state_from_module(module: nn.Module) -> None:
        registered, installed = module._parameters.get("weight"), module.__dict__.get("weight")
        if registry.record_of_param(registered) is None or installed is None:
            return original(module)  # not sharded, or inside summon_full_params (the parameter is the full weight)
        module.support_avx512bf16_for_cpu = False  # (its packing path rewrites data the next gather brings back)
        if not module.training and not _EVAL_WARNED:
            _EVAL_WARNED.append(True)
            warnings.warn(
                f"accel_flatshard: a sharded bitsandbytes 4-bit layer ({type(module).__name__}) runs in eval mode: "
                "bitsandbytes would use its eval-only packed AVX512-BF16 kernel there, which rewrites the gathered "
                "weight; sharded layers compute by dequantize + matmul instead (about 1 bf16 ulp apart). Call "
                "model.train() before training (docs/optimizers.md).", RuntimeWarning, stacklevel=2)
        if getattr(installed, "quant_state", None) is None:
            installed.quant_state = module.quant_state  # (a fresh view at every gather; the planner's is fake)

    return fix_4bit_weight_quant_state_from_module


registry.on_step(pre=state_precision_of_full_parameters)
registry.on_wrap(before=install_for)
