"""``ChainedOptimizer``: several torch optimizers stepped, zeroed, saved and loaded as one.

Muon is an optimizer for the hidden matrices only; torch's documentation pairs it with AdamW for the rest, as two
optimizers.  Code that takes one optimizer (the Trainer's ``optimizers=``, a loop written for one, a single
``accelerator.prepare`` argument) takes both chained::

    muon = torch.optim.Muon(hidden_matrices, lr=0.02, weight_decay=0.1)
    adamw = torch.optim.AdamW(other_parameters, lr=3e-4, weight_decay=0.01)
    trainer = Trainer(model=model, args=args, optimizers=(ChainedOptimizer([muon, adamw]), None), ...)

``param_groups`` are the optimizers' own group dicts in order (a scheduler's ``lr`` reaches them); ``state`` reads
and writes through to the optimizer of each parameter; ``step()`` steps each optimizer (each runs its own step
hooks, e.g. accel_flatshard's owner-computes Muon, ``matrix_optim.py``); ``state_dict()`` is torch's format over
the chained groups and ``load_state_dict()`` hands each optimizer its part (its own load hooks run).  Nothing here
knows about sharding.
"""
from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch

__all__ = ["ChainedOptimizer"]


class _ChainedState(MutableMapping):
    """The optimizers' ``state`` dicts as one mapping, by parameter."""

    def __init__(self, chained: "ChainedOptimizer") -> None:
        self.chained = chained

    def _optimizer_of(self, param: Any) -> torch.optim.Optimizer:
        for optimizer in self.chained.optimizers:
            if any(p is param for g in optimizer.param_groups for p in g["params"]):
                return optimizer
        raise KeyError(param)

    def __getitem__(self, param: Any) -> Any:
        for optimizer in self.chained.optimizers:
            if param in optimizer.state:
                return optimizer.state[param]
        return self._optimizer_of(param).state[param]  # (a defaultdict there: a new entry, as torch's)

    def __setitem__(self, param: Any, value: Any) -> None:
        self._optimizer_of(param).state[param] = value

    def __delitem__(self, param: Any) -> None:
        for optimizer in self.chained.optimizers:
            if param in optimizer.state:
                del optimizer.state[param]
                return
        raise KeyError(param)

    def __iter__(self) -> Iterator[Any]:
        return (p for optimizer in self.chained.optimizers for p in list(optimizer.state))

    def __len__(self) -> int:
        return sum(len(optimizer.state) for optimizer in self.chained.optimizers)


class ChainedOptimizer(torch.optim.Optimizer):
    """``optimizers`` (each over its own parameters) as one optimizer; see the module docstring."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        optimizers = list(optimizers)
        if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            raise TypeError(f"ChainedOptimizer takes a list of torch optimizers, got {optimizers!r}")
        owner: Dict[int, int] = {}
        for i, optimizer in enumerate(optimizers):
            for p in (p for g in optimizer.param_groups for p in g["params"]):
                if owner.setdefault(id(p), i) != i:
                    raise ValueError(f"a parameter of shape {tuple(p.shape)} is in optimizers {owner[id(p)]} and {i}")
        # torch's bookkeeping (hooks, the profiled step) over a placeholder; groups and state are the optimizers'
        super().__init__([torch.empty(0)], {})
        self.optimizers = optimizers
        self.param_groups = [g for o in optimizers for g in o.param_groups]

    @property
    def state(self) -> _ChainedState:  # type: ignore[override]
        """The optimizers' state, by parameter."""
        return _ChainedState(self)

    @state.setter
    def state(self, value: Any) -> None:
        """torch's constructor sets a dict of its own here: the state stays the optimizers'."""

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for optimizer in self.optimizers:
            optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if not hasattr(self, "optimizers"):  # (torch's constructor adds the placeholder's group)
            return super().add_param_group(param_group)
        raise NotImplementedError("add the group to one of the chained optimizers (ChainedOptimizer.optimizers)")

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """torch's format over the chained groups: each optimizer loads its groups and their parameters' state."""
        groups: List[Dict[str, Any]] = list(state_dict["param_groups"])
        if len(groups) != len(self.param_groups):
            raise ValueError(f"the state dict has {len(groups)} param groups, the chained optimizers "
                             f"{len(self.param_groups)}")
        start = 0
        for optimizer in self.optimizers:
            mine = groups[start : start + len(optimizer.param_groups)]
            start += len(mine)
            ids = {i for g in mine for i in g["params"]}
            optimizer.load_state_dict({"state": {i: v for i, v in state_dict["state"].items() if i in ids},
                                       "param_groups": mine})
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]  # (torch's load makes new dicts)

    def __repr__(self) -> str:
        return f"ChainedOptimizer({', '.join(type(o).__name__ for o in self.optimizers)})"
