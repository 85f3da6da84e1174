"""Matrix optimizers over flat shards: ``torch.optim.Muon``, unmodified, each 2-D parameter's step computed whole on
one rank of the shard group, its owner ("owner computes").

Muon orthogonalises each matrix's momentum (Newton-Schulz), which needs the matrix whole, while a rank holds a 1-D
slice that may cut it anywhere (``flat_param.py``).  A Muon over sharded parameters is found at its first step by
:func:`owner_computes_step`, run before every step by the registry's optimizer hook, whatever built or wrapped it
(``accelerator.prepare``, the Trainer's ``optimizers=``, a bare wrapper).  Then, at every step:

* each matrix has an owner, a rank of its shard group, balanced by size (:func:`balance_matrix_owners`);
* each rank's piece of every gradient and of every parameter goes to the matrix's owner by one all-to-all of
  point-to-point transfers, straight from the shards into the owner's buffer (``ShardGroup.all_to_all``);
* the owner steps an optimizer of the user's own class over full-shaped stand-ins of the matrices it owns (the
  user's hyperparameters copied in at every step), so the update is Muon's own code on the whole matrix: the
  momentum, Newton-Schulz, the decoupled weight decay and ``adjust_lr_fn``, exactly as in one process;
* the pieces of the new values go back into the shards by a second all-to-all;
* the user's Muon then steps over no parameters: its groups are emptied for its own step and restored by a
  post-hook, so ``zero_grad``, LR schedulers and checkpoints see its groups as built.

A matrix's momentum lives only on its owner, full-shaped, in the user's ``optimizer.state`` (the owner-side
optimizer shares each parameter's state dict), so a rank holds its shards plus the state of the matrices it owns.
``state/optim.py`` and ``state/sharded.py`` save such a "whole" entry from its holder; a load brings every
rank its piece (at any world size), and :meth:`OwnerComputes.adopt_state` moves the pieces to the owners.  Muon's
own errors (a parameter that is not 2-D, ``ns_steps >= 100``) come from a dry run of the same optimizer class on
meta-device stand-ins, on every rank, before anything is exchanged: every rank raises Muon's error.

On CUDA both exchanges run on the side stream "matrix_exchange" of the model's device adapter (``device.py``): it
waits for the compute stream (gradients reduced, shards last written there) and the compute stream waits for the
exchange's event (docs/architecture-details.md section 5).
"""
from __future__ import annotations

import dataclasses
import inspect
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..core import comm, registry
from ..core._compat import step_without_hooks
from ..core.comm import ShardGroup
from ..core.handles import wait_for as _wait
from ..core.spans import span

__all__ = ["owner_computes_step", "balance_matrix_owners", "owner_computes_of", "OwnerComputes", "hidden_matrices",
           "matrix_optimizer_and_adamw"]

# the user's optimizer -> its OwnerComputes (which holds the optimizer weakly: a dropped optimizer leaves nothing)
_OWNERS: "weakref.WeakKeyDictionary[torch.optim.Optimizer, OwnerComputes]" = weakref.WeakKeyDictionary()
# hyperparameters a scheduler changes every step: they cannot make Muon raise, so they do not re-run the dry run
_SCHEDULED = ("lr", "weight_decay", "momentum")


def matrix_optimizer_classes() -> Tuple[type, ...]:
    """The optimizer classes stepped owner-computes: ``torch.optim.Muon`` (torch >= 2.9) and its subclasses."""
    muon = getattr(torch.optim, "Muon", None)
    return (muon,) if isinstance(muon, type) else ()


@dataclasses.dataclass
class Matrix:
    """One 2-D parameter of the optimizer: where its pieces are and who owns it."""

    param: nn.Parameter  # the user's parameter: a 1-D view of this rank's piece
    fqn: str
    shape: torch.Size  # its original shape
    numel: int
    pieces: List[Tuple[int, int]]  # (first element, length) of the piece each shard rank holds
    owner: int = 0  # shard rank


def hidden_matrices(model: nn.Module) -> Tuple[List[nn.Parameter], List[nn.Parameter]]:
    """Muon's documented split of ``model``'s trainable parameters, before wrapping: the 2-D parameters of the
    hidden layers, and the rest (embeddings, the output head, norms, biases) for a standard optimizer."""
    outside = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    head = getattr(model, "get_output_embeddings", lambda: None)()
    outside.update(id(p) for p in (head.parameters() if isinstance(head, nn.Module) else ()))
    params = [p for p in model.parameters() if p.requires_grad]
    matrices = [p for p in params if p.ndim == 2 and id(p) not in outside]
    chosen = {id(p) for p in matrices}
    return matrices, [p for p in params if id(p) not in chosen]


def matrix_optimizer_and_adamw(cls: type, model: nn.Module, lr: float = 1e-4) -> torch.optim.Optimizer:
    """``cls`` (Muon) over ``model``'s hidden matrices and AdamW over the rest, chained (the planner's optimizer for
    ``--optimizer Muon``)."""
    from .chained_optimizer import ChainedOptimizer

    matrices, rest = hidden_matrices(model)
    return ChainedOptimizer([cls(matrices, lr=lr), torch.optim.AdamW(rest, lr=lr)])


def balance_matrix_owners(sizes: Sequence[int], ranks: int) -> List[int]:
    """The owner of each matrix: the largest first, each to the least-loaded rank (ties: the lowest rank), so each
    rank's Newton-Schulz work and held momentum are about 1/ranks of the whole."""
    load, owners = [0] * ranks, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owners[i] = min(range(ranks), key=lambda r: (load[r], r))
        load[owners[i]] += sizes[i]
    return owners


def owner_computes_of(optimizer: torch.optim.Optimizer) -> Optional["OwnerComputes"]:
    """The :class:`OwnerComputes` stepping ``optimizer`` (after its first step), else None."""
    return _OWNERS.get(optimizer)


def owner_computes_step(optimizer: torch.optim.Optimizer, records: List[Any]) -> None:
    """Before every optimizer step (``registry.on_step``): a Muon over sharded parameters steps owner-computes; any
    other optimizer, or a Muon over unsharded parameters, is left alone."""
    classes = matrix_optimizer_classes()
    if not classes or not isinstance(optimizer, classes):
        return
    owner = _OWNERS.get(optimizer)
    if owner is None or owner.stale():
        if owner is not None:
            owner.detach()
        owner = _attach(optimizer)
        if owner is None:
            return
    owner.step()


def _attach(optimizer: torch.optim.Optimizer, streams: Any = None) -> Optional["OwnerComputes"]:
    """Plan ``optimizer``'s matrices (collective over the shard group when state must move); None when none of its
    parameters is sharded."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    records = [registry.record_of_param(p) for p in params]
    models = {id(r): r for r in records if r is not None}
    if not models:
        return None
    if len(models) > 1 or any(r is None for r in records):
        raise ValueError(f"{type(optimizer).__name__} steps parameters of {len(models)} sharded models"
                         f"{' and unsharded ones' if len(models) == 1 else ''}: accel_flatshard computes each matrix "
                         "on one rank of its model's shard group; build one optimizer per prepared model")
    record = records[0]
    group: ShardGroup = record.shard_group
    schedule = record.schedule
    where = schedule.slots()
    matrices = []
    for p in params:
        flat, i = where[id(p)]
        slot = flat.layout.slots[i]
        pieces = [(piece.param_start, piece.length) for piece in
                  (flat.layout.shard_pieces(r)[i] for r in range(group.shard_size))]
        matrices.append(Matrix(p, slot.fqn, slot.shape, slot.numel, pieces))
        if record.offload is not None and record.offload.streams.stream_ordered:
            raise NotImplementedError(f"{type(optimizer).__name__} with CPU offload onto {flat.device}: the shards are "
                                      "in host memory and the matrix exchange runs on the device; train without "
                                      "fsdp_offload_params")
    for m, owner in zip(matrices, balance_matrix_owners([m.numel for m in matrices], group.shard_size)):
        m.owner = owner
    if streams is None:  # the model's own adapter (the planner's, or the tests' simulator once attached)
        streams = schedule.adapter
    owner = OwnerComputes(optimizer, matrices, group, streams)
    owner.adopt_state()  # state loaded before the first step: every rank's piece
    return owner


class OwnerComputes:
    """The owner-computes step of one user optimizer (a Muon) over one model's shard group."""

    def __init__(self, optimizer: torch.optim.Optimizer, matrices: List[Matrix], group: ShardGroup,
                 streams: Any) -> None:
        self.optimizer_ref = weakref.ref(optimizer)
        self.matrices, self.group, self.streams = matrices, group, streams
        self.by_param = {id(m.param): m for m in matrices}
        self.side = streams.side_stream("matrix_exchange")
        self.layout = self._signature(optimizer)
        self.checked: Optional[tuple] = None  # the hyperparameters the last dry run passed with
        self.hidden: Optional[List[list]] = None  # the user's param lists, while its own step runs on none
        me = group.shard_rank
        # the owner-side optimizer: the user's class over full-shaped stand-ins of this rank's matrices, group by
        # group (their data and gradients are set for a step only)
        self.standins: Dict[int, nn.Parameter] = {}
        owned: List[List[nn.Parameter]] = []
        for g in optimizer.param_groups:
            owned.append([])
            for p in g["params"]:
                m = self.by_param[id(p)]
                if m.owner == me:
                    self.standins[id(p)] = standin = nn.Parameter(_empty(p.dtype, p.device))
                    owned[-1].append(standin)
        self.shadow = _like(optimizer, owned) if self.standins else None
        self.handles = [optimizer.register_step_post_hook(_restore_groups),
                        optimizer.register_load_state_dict_post_hook(_adopt_loaded_state)]
        _OWNERS[optimizer] = self

    # ------------------------------------------------------------------ bookkeeping
    @staticmethod
    def _signature(optimizer: torch.optim.Optimizer) -> tuple:
        return tuple(tuple(id(p) for p in g["params"]) for g in optimizer.param_groups)

    def stale(self) -> bool:
        """The optimizer's groups changed since the plan (``add_param_group``): plan again."""
        optimizer = self.optimizer_ref()
        if self.hidden is not None:  # a step that raised between our pre-hook and the post-hook
            _restore_groups(optimizer)
        return self._signature(optimizer) != self.layout

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        _OWNERS.pop(self.optimizer_ref(), None)

    # ------------------------------------------------------------------ the step
    def step(self) -> None:
        """Muon's step of every matrix with a gradient, on its owner; then the user's own step runs on nothing."""
        optimizer = self.optimizer_ref()
        self._dry_run(optimizer)
        active = [m for m in self.matrices if m.param.grad is not None]
        if active:
            self._exchange_and_update(optimizer, active)
        self.hidden = [g["params"] for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["params"] = []

    def _dry_run(self, optimizer: torch.optim.Optimizer) -> None:
        """Muon's own checks, raised on every rank: the user's class steps meta-device stand-ins of every matrix
        (no data, no communication) whenever a hyperparameter that can make it raise changed."""
        key = tuple(tuple(sorted((k, repr(v)) for k, v in g.items() if k not in ("params", "param_names", *_SCHEDULED)))
                    for g in optimizer.param_groups)
        if key == self.checked:
            return
        shapes = [[(self.by_param[id(p)].shape, p.dtype) for p in g["params"]] for g in optimizer.param_groups]
        groups = [[nn.Parameter(torch.empty(shape, dtype=dtype, device="meta")) for shape, dtype in g] for g in shapes]
        dry = _like(optimizer, groups)
        for standin in (p for g in groups for p in g):
            standin.grad = torch.empty_like(standin)
        step_without_hooks(dry)
        self.checked = key

    def _exchange_and_update(self, optimizer: torch.optim.Optimizer, active: List[Matrix]) -> None:
        s, group, me = self.streams, self.group, self.group.shard_rank
        compute, ranks = s.compute_stream(), range(group.shard_size)
        mine = [m for m in active if m.owner == me]
        # each owned matrix: one buffer of [gradient | values], allocated on the compute stream (before the side
        # stream waits for it), written by the exchange on the side stream, stepped on the compute stream
        work = [s.scratch(2 * m.numel, m.param.dtype, "matrix_work") for m in mine]
        inputs: List[List[torch.Tensor]] = [[] for _ in ranks]
        outputs: List[List[torch.Tensor]] = [[] for _ in ranks]
        for m in active:  # this rank's piece of the gradient and of the values, to the owner, in matrix order
            if m.pieces[me][1]:
                inputs[m.owner] += [m.param.grad.to(m.param.dtype), m.param.detach()]
        for m, buf in zip(mine, work):  # every rank's pieces into place (a rank's own: copied)
            for r, (start, length) in enumerate(m.pieces):
                if length:
                    outputs[r] += [buf[start : start + length], buf[m.numel + start : m.numel + start + length]]
        with span("matrix_exchange"):
            s.wait_stream(self.side, compute)  # the reduced gradients and the last update were written there
            handle = s.collective(self.side, lambda async_op: group.all_to_all(outputs, inputs, async_op=async_op))
            _wait(handle, "the gradient exchange to the matrices' owners", group)
        if mine:
            with span("matrix_update"):
                self._step_owned(optimizer, mine, work)
        back_in: List[List[torch.Tensor]] = [[] for _ in ranks]
        back_out: List[List[torch.Tensor]] = [[] for _ in ranks]
        for m, buf in zip(mine, work):  # the new values' pieces, to every rank
            for r, (start, length) in enumerate(m.pieces):
                if length:
                    back_in[r].append(buf[m.numel + start : m.numel + start + length])
        for m in active:  # straight into this rank's shards
            if m.pieces[me][1]:
                back_out[m.owner].append(m.param.detach())
        with span("matrix_exchange"):
            s.wait_stream(self.side, compute)  # the owners' new values were written there
            handle = s.collective(self.side, lambda async_op: group.all_to_all(back_out, back_in, async_op=async_op))
            _wait(handle, "the updated matrices' return to the shards", group)

    def _step_owned(self, optimizer: torch.optim.Optimizer, mine: List[Matrix], work: List[torch.Tensor]) -> None:
        """The user's optimizer class steps the owned matrices whole; their state is the user's state dicts."""
        shadow = self.shadow
        for sg, g in zip(shadow.param_groups, optimizer.param_groups):
            sg.update({k: v for k, v in g.items() if k not in ("params", "param_names")})
        stepped = []
        for m, buf in zip(mine, work):
            standin = self.standins[id(m.param)]
            standin.data = buf[m.numel :].view(m.shape)
            standin.grad = buf[: m.numel].view(m.shape)
            shadow.state[standin] = optimizer.state[m.param]  # one dict: the momentum is the user's state
            stepped.append(standin)
        try:
            step_without_hooks(shadow)
        finally:
            for standin in stepped:  # the buffers die with this step
                standin.grad, standin.data = None, _empty(standin.dtype, standin.device)
            shadow.state.clear()

    # ------------------------------------------------------------------ state
    def adopt_state(self) -> None:
        """Collective over the shard group: state held as every rank's piece (loaded at any world size, or from
        before the first step) or whole by a rank that does not own the matrix moves to the owner, whole."""
        optimizer, group, me = self.optimizer_ref(), self.group, self.group.shard_rank
        local: Dict[Tuple[int, str], Tuple[str, torch.dtype]] = {}
        for i, m in enumerate(self.matrices):
            for key, value in optimizer.state.get(m.param, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() >= 1:
                    whole = value.dim() >= 2 and tuple(value.shape) == tuple(m.shape)
                    if not whole and value.numel() != m.pieces[me][1]:
                        raise ValueError(f"optimizer state {m.fqn!r}[{key!r}] has shape {tuple(value.shape)}: "
                                         f"neither the parameter's {tuple(m.shape)} nor this rank's piece "
                                         f"({m.pieces[me][1]} elements)")
                    local[(i, key)] = ("whole" if whole else "piece", value.dtype)
        held = comm.all_gather_object(group.shard_group if group.shard_size > 1 else None, local)
        ranks = range(group.shard_size)
        inputs: List[List[torch.Tensor]] = [[] for _ in ranks]
        outputs: List[List[torch.Tensor]] = [[] for _ in ranks]
        moved: List[Tuple[Matrix, str, Optional[torch.Tensor]]] = []
        for i, key in sorted({k for inventory in held for k in inventory}):
            m = self.matrices[i]
            kinds = [inventory.get((i, key)) for inventory in held]
            whole = [r for r, kind in enumerate(kinds) if kind is not None and kind[0] == "whole"]
            if whole and whole[0] == m.owner and len(whole) == 1:
                continue  # where it belongs
            dtype = next(kind[1] for kind in kinds if kind is not None)
            mine = optimizer.state.get(m.param, {}).get(key)
            if mine is None and m.pieces[me][1]:
                raise ValueError(f"optimizer state {m.fqn!r}[{key!r}] is missing on shard rank {me} but held by others")
            full = torch.empty(m.numel, dtype=dtype, device=m.param.device) if me == m.owner else None
            if whole:  # one holder sends the whole tensor
                if me == whole[0]:
                    inputs[m.owner].append(mine.detach().reshape(-1))
                if full is not None:
                    outputs[whole[0]].append(full)
            else:  # every rank sends its piece
                if m.pieces[me][1]:
                    inputs[m.owner].append(mine.detach().reshape(-1).to(dtype))
                for r, (start, length) in enumerate(m.pieces) if full is not None else ():
                    if length:
                        outputs[r].append(full[start : start + length])
            moved.append((m, key, full))
        if not moved:
            return
        group.all_to_all(outputs, inputs, async_op=False)
        for m, key, full in moved:
            state = optimizer.state[m.param]
            if full is not None:
                state[key] = full.view(m.shape)
            else:
                state.pop(key, None)
                if not state:
                    del optimizer.state[m.param]


def _restore_groups(optimizer: torch.optim.Optimizer, *args: Any) -> None:
    """The user's optimizer's step post-hook: its param lists back after its own step ran on none."""
    owner = _OWNERS.get(optimizer)
    if owner is not None and owner.hidden is not None:
        for g, params in zip(optimizer.param_groups, owner.hidden):
            g["params"] = params
        owner.hidden = None


def _adopt_loaded_state(optimizer: torch.optim.Optimizer) -> None:
    """The user's optimizer's ``load_state_dict`` post-hook (collective: every rank loads): pieces to the owners."""
    owner = _OWNERS.get(optimizer)
    if owner is not None:
        owner.adopt_state()


def _like(optimizer: torch.optim.Optimizer, params: List[List[nn.Parameter]]) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class and defaults over ``params``, one group per group of ``optimizer``
    with its hyperparameters.  Groups are added after construction, as ``add_param_group`` adds them (Muon checks
    2-D parameters in its constructor only: a 1-D one added later raises at its step, here too)."""
    placeholder = nn.Parameter(torch.empty(1, 1, device="meta"))
    accepted = inspect.signature(type(optimizer).__init__).parameters  # (defaults may hold more: the groups have it)
    other = type(optimizer)([placeholder], **{k: v for k, v in optimizer.defaults.items() if k in accepted})
    other.param_groups.clear()
    for g, group_params in zip(optimizer.param_groups, params):
        other.add_param_group({**{k: v for k, v in g.items() if k not in ("params", "param_names")},
                               "params": group_params})
    return other


def _empty(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A stand-in's data between steps: no storage (made anew: one kept across calls could be a fake tensor of the
    planner's run that has ended)."""
    return torch.empty(0, dtype=dtype, device=device)


registry.on_step(pre=owner_computes_step)
