"""Auto-wrap policies and the choice of units.

A policy has torch's signature ``policy(module, recurse, nonwrapped_numel) -> bool`` (``recurse=True``: look
inside ``module``?; ``False``: make it a unit, given its parameters no inner unit claimed?), so torch's policy
partials (what accelerate builds) work here unchanged, and ours with torch FSDP.
"""
from __future__ import annotations

import collections
import functools
import logging
from typing import Any, Callable, Iterable, List, Optional, Sequence, Set, Type, Union

import torch.nn as nn

Policy = Callable[[nn.Module, bool, int], bool]

logger = logging.getLogger(__name__)
_LOGGED_CHOICES: Set[str] = set()  # one log line per distinct choice per process


def _transformer_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int, *, classes: tuple,
                        module_ids: frozenset = frozenset()) -> bool:
    return recurse or isinstance(module, classes) or id(module) in module_ids


# Containers have no forward of their own (a unit's gather runs in its forward hook) and
# MultiheadAttention reads its weights outside its submodules' forwards: never units, as in torch.
_EXCLUDED_FROM_SIZE_WRAP = (nn.ModuleList, nn.ModuleDict)
_SIZE_WRAP_LEAVES = (nn.MultiheadAttention,)


def _size_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int, *, min_num_params: int) -> bool:
    if recurse:
        return not isinstance(module, _SIZE_WRAP_LEAVES)
    return nonwrapped_numel >= min_num_params and not isinstance(module, _EXCLUDED_FROM_SIZE_WRAP)


def block_classes_of(model: nn.Module, names: Optional[Iterable[str]] = None) -> Set[Type[nn.Module]]:
    """Module classes in ``model`` named by ``names`` (default: the model's ``_no_split_modules``, else its
    :func:`repeated_block_classes`); ``ValueError`` when a name matches no submodule class."""
    if names is None:
        names = {n for m in model.modules() for n in getattr(m, "_no_split_modules", None) or []}
        if not names:
            return repeated_block_classes(model)
    wanted = {n if isinstance(n, str) else n.__name__ for n in names}
    found = {type(m) for m in model.modules() if type(m).__name__ in wanted}
    missing = wanted - {c.__name__ for c in found}
    if missing:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"layer class(es) {sorted(missing)} not found in {type(model).__name__}; "
            f"module classes present: {present}"
        )
    return found


def repeated_block_classes(model: nn.Module) -> Set[Type[nn.Module]]:
    """The classes of ``model``'s repeated blocks: two or more same-class children with parameters of an
    ``nn.ModuleList`` / ``nn.Sequential`` (outermost lists only).  None: the empty set (one root unit, as
    accelerate does).  Logged once per process with how to set the classes explicitly."""
    classes: Set[Type[nn.Module]] = set()
    inside: Set[int] = set()  # modules within an already chosen block
    for module in model.modules():
        if id(module) in inside or not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        counts = collections.Counter(type(c) for c in module.children() if any(True for _ in c.parameters()))
        repeated = {cls for cls, n in counts.items() if n >= 2 and cls not in (nn.ModuleList, nn.Sequential)}
        for child in module.children():
            if type(child) in repeated:
                inside.update(id(m) for m in child.modules())
        classes |= repeated
    names = sorted(c.__name__ for c in classes)
    if names:
        message = (f"accel_flatshard: {type(model).__name__} has no `_no_split_modules`; wrapping its repeated "
                   f"blocks {names} as units. To choose yourself, set fsdp_transformer_layer_cls_to_wrap: "
                   f"{','.join(names)} in the accelerate yaml (or transformer_auto_wrap_policy(model, {names})).")
    else:
        message = (f"accel_flatshard: {type(model).__name__} has no `_no_split_modules` and no repeated blocks "
                   "(same-class children of an nn.ModuleList/Sequential); one unit for the whole model. Set "
                   "fsdp_transformer_layer_cls_to_wrap in the accelerate yaml to shard it in several units.")
    if message not in _LOGGED_CHOICES:
        _LOGGED_CHOICES.add(message)
        logger.warning(message)
    return classes


def transformer_auto_wrap_policy(model_or_classes: Union[nn.Module, Sequence[Union[str, Type[nn.Module]]]],
                                 layer_classes: Optional[Sequence[Union[str, Type[nn.Module]]]] = None) -> Policy:
    """Wrap every transformer block as its own unit: ``transformer_auto_wrap_policy(model)`` takes the classes
    from a Hugging Face model's ``_no_split_modules`` (else :func:`repeated_block_classes`);
    ``transformer_auto_wrap_policy(model, ["GPT2Block"])`` names them; ``transformer_auto_wrap_policy([MyBlock])``.

    A model's *untied* input embedding and output head (Llama) become units too: the head's gradient is then
    reduced right after its backward, not with the root's at the end (llama-40M step 1.20x -> 0.93x of DDP).
    Tied ones (GPT-2) stay in the root, which owns the shared weight.

    Example::

        model = FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy(model))
    """
    module_ids: frozenset = frozenset()
    if isinstance(model_or_classes, nn.Module):
        classes = block_classes_of(model_or_classes, layer_classes)
        module_ids = _untied_embedding_ids(model_or_classes)
    else:
        classes = set()
        for c in model_or_classes:
            if isinstance(c, str):
                raise ValueError(f"class name {c!r} needs the model: transformer_auto_wrap_policy(model, [{c!r}])")
            classes.add(c)
    return functools.partial(_transformer_policy, classes=tuple(classes), module_ids=module_ids)


def _untied_embedding_ids(model: nn.Module) -> frozenset:
    try:
        inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    except (NotImplementedError, AttributeError):  # not a Hugging Face model, or one without them
        return frozenset()
    if inp is None or out is None or getattr(out, "weight", None) is getattr(inp, "weight", None):
        return frozenset()
    return frozenset({id(inp), id(out)})


def backward_reads_parameters(module: nn.Module) -> bool:
    """Whether a unit made of ``module`` must be gathered again for its backward: not a plain ``nn.Embedding``,
    whose backward reads the indices and row count, never the weight (unless it has its own forward,
    ``max_norm`` or sparse gradients)."""
    return not (isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward
                and module.max_norm is None and not module.sparse)


def policy_of(options: Any, model: nn.Module) -> Optional[Policy]:
    """The auto-wrap policy a ``FlatShardOptions`` asks for (``auto_wrap``: "transformer", "size", "custom" or
    "none"); an unknown layer class raises ``ValueError`` naming the classes present."""
    if options.auto_wrap == "transformer":
        return transformer_auto_wrap_policy(model, options.layer_cls_names)
    if options.auto_wrap == "size":
        return size_based_auto_wrap_policy(options.min_num_params) if options.min_num_params > 0 else None
    return options.custom_policy if options.auto_wrap == "custom" else None


def size_based_auto_wrap_policy(min_num_params: int = int(1e8)) -> Policy:
    """Make a unit of every module whose not-yet-wrapped parameters number at least ``min_num_params``."""
    return functools.partial(_size_policy, min_num_params=int(min_num_params))


def select_units(root: nn.Module, policy: Optional[Policy]) -> List[nn.Module]:
    """The modules that become units: the root, then the policy's in pre-order (the usual forward order).
    As in torch's wrapper, children are decided first: a parent's ``nonwrapped_numel`` counts what they left."""
    units: List[nn.Module] = []
    seen: Set[int] = set()
    for child in root.children() if policy is not None else ():
        _select(child, policy, units, seen)
    chosen = {id(m) for m in units}
    return [root] + [m for m in root.modules() if id(m) in chosen]


def _select(module: nn.Module, policy: Policy, units: List[nn.Module], seen: Set[int]) -> int:
    """Decide units inside ``module``; returns the numel of its parameters not claimed by a unit."""
    # torch's size-based policy decides whether to recurse from the module's not-yet-wrapped size
    unclaimed = sum(p.numel() for p in module.parameters() if id(p) not in seen)
    if not policy(module=module, recurse=True, nonwrapped_numel=unclaimed):
        return _claim(module.parameters(), seen)  # not looked into: its parameters stay with the enclosing unit
    nonwrapped = sum(_select(child, policy, units, seen) for child in module.children())
    nonwrapped += _claim(module.parameters(recurse=False), seen)
    if policy(module=module, recurse=False, nonwrapped_numel=nonwrapped):
        units.append(module)
        return 0
    return nonwrapped


def _claim(params: Iterable[nn.Parameter], seen: Set[int]) -> int:
    """Mark ``params`` claimed; the numel of those not claimed before."""
    n = 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n


def checkpoint_units(root: nn.Module, unit_modules: Sequence[nn.Module]) -> bool:
    """Activation checkpointing of each of ``unit_modules`` (non-reentrant ``checkpoint_wrapper``, as accelerate's
    ``fsdp_activation_checkpointing``; False: none), outside the unit's module: recomputation runs its hooks."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)

    inner = {id(m) for m in unit_modules if m is not root}
    if inner:
        wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        apply_activation_checkpointing(root, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: id(m) in inner)
    return bool(inner)
