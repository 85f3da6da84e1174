"""Flat-parameter layout and storage: how one unit's parameters live in one padded, sharded buffer.

Layout (world size W of the shard group, alignment A elements)::

    flat index:  0 ........................................................ padded_numel
                 | p0 | pad | p1 ........ | pad | p2 | pad ...... | tail pad |
    shards:      |<- rank 0: shard_numel ->|<- rank 1 ->| ...  |<- rank W-1 ->|

* Every parameter starts at a multiple of A (aligned views); ``padded_numel`` is a multiple of ``W * A``, so
  every shard has the same length ``shard_numel`` and starts aligned.
* Rank r owns ``[r * shard_numel, (r + 1) * shard_numel)``, its ``local_shard``; a parameter may be split
  between ranks, lie on one, or be absent from a rank (empty slice).
* Padding is never visible: parameters view their own slices only, so a padding element's gradient is zero.

Storage held by a :class:`FlatParameter` (per rank):

* ``local_shard`` - this rank's slice (the fp32 master under mixed precision); each ``nn.Parameter`` keeps its
  identity, its ``.data`` the 1-D view of its part, so optimizers update the shard in place with 1/W of the state.
* ``unsharded`` - a leaf of ``padded_numel`` elements in compute dtype, viewed by the modules while the unit runs;
  freed by resizing its storage to 0 bytes and re-grown in place: views (and tensors autograd saved) stay valid.
  A unit of several flat parameters (frozen and trainable, several dtypes) packs them into one byte storage
  (:func:`pack_gathered`): each ``unsharded`` is a typed view at an aligned byte offset, one all-gather fills them
  all, and the unit's first flat parameter (``storage_owner``) grows and frees the storage for every one::

      gathered storage (bytes):  | flat 0 (bf16, W shards) | pad | flat 1 (fp32, W shards) | pad | ...
* ``sharded_grad`` - this rank's slice of the reduced gradient; each parameter's ``.grad`` views its part.

No process group is held here: collectives live in ``comm.py`` and are scheduled by ``engine.py``, except the
blocking :func:`gather_full` outside the step (summon, full state dicts).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ._compat import can_set_data

DEFAULT_ALIGNMENT = 16  # elements; 64 bytes in fp32, 32 in bf16


@dataclass(frozen=True)
class ParamSlot:
    """Where one original parameter lives in the flat buffer."""

    fqn: str  # the name it is reported under (first module that registers it)
    shape: torch.Size
    numel: int
    offset: int  # start in the flat buffer (aligned)


@dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter that lies in one rank's shard."""

    slot_index: int
    param_start: int  # first element of the parameter covered (in flattened parameter order)
    shard_start: int  # where that element sits in the rank's local shard
    length: int


class FlatParamLayout:
    """Pure-data layout: offsets, padding and per-rank shard pieces for a list of shapes."""

    def __init__(self, fqns: Sequence[str], shapes: Sequence[torch.Size], world_size: int,
                 alignment: int = DEFAULT_ALIGNMENT) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if alignment < 1:
            raise ValueError(f"alignment must be >= 1, got {alignment}")
        self.world_size, self.alignment = world_size, alignment
        slots: List[ParamSlot] = []
        # Every view comes from one split into [gap, p0, gap, p1, ..., tail]: autograd gets one backward node that
        # concatenates the gradients (O(N)) instead of one full-size scatter per parameter.
        self.split_sizes: List[int] = []
        self.split_param_index: List[int] = []
        cursor = 0
        for fqn, shape in zip(fqns, shapes):
            shape = torch.Size(shape)
            offset, numel = _round_up(cursor, alignment), math.prod(shape)
            slots.append(ParamSlot(fqn, shape, numel, offset))
            self.split_sizes.append(offset - cursor)
            self.split_param_index.append(len(self.split_sizes))
            self.split_sizes.append(numel)
            cursor = offset + numel
        self.slots: Tuple[ParamSlot, ...] = tuple(slots)
        self.unpadded_numel = cursor
        self.padded_numel = max(_round_up(cursor, world_size * alignment), world_size * alignment)
        self.shard_numel = self.padded_numel // world_size
        self.split_sizes.append(self.padded_numel - cursor)

    def shard_pieces(self, rank: int) -> List[ShardPiece]:
        """The pieces of each parameter that rank ``rank`` holds, in slot order (empty ones included)."""
        lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        pieces = []
        for i, slot in enumerate(self.slots):
            start = min(max(slot.offset, lo), hi)
            end = max(min(slot.offset + slot.numel, hi), lo)
            length = max(end - start, 0)
            pieces.append(ShardPiece(i, start - slot.offset if length else 0, start - lo if length else 0, length))
        return pieces

    def __repr__(self) -> str:
        return (f"FlatParamLayout({len(self.slots)} params, numel={self.unpadded_numel}, "
                f"padded={self.padded_numel}, W={self.world_size}, shard={self.shard_numel})")


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


class FlatParameter:
    """The storage of one flat parameter: ``params[i]`` is the ``nn.Parameter`` of slot ``i``; ``users[i]``
    every ``(module, attribute name)`` that registers it (several when tied)."""

    def __init__(self, params: Sequence[nn.Parameter], fqns: Sequence[str],
                 users: Sequence[Sequence[Tuple[nn.Module, str]]], rank: int, world_size: int,
                 compute_dtype: Optional[torch.dtype] = None, alignment: int = DEFAULT_ALIGNMENT,
                 device: Optional[torch.device] = None) -> None:
        if not params:
            raise ValueError("a FlatParameter needs at least one parameter")
        dtypes, devices = {p.dtype for p in params}, {p.device for p in params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"parameters of one FlatParameter must share dtype and device, got {dtypes}, {devices}")
        self.params, self.users = list(params), [list(u) for u in users]
        self.dtype = params[0].dtype
        # ``device``: where the shard lives when the parameters are elsewhere (a CPU model wrapped for CUDA:
        # each unit is copied straight into its device buffer, never moved whole)
        self.device = torch.device(device) if device is not None else params[0].device
        self.compute_dtype = compute_dtype or self.dtype
        self.requires_grad, self.rank = params[0].requires_grad, rank
        self.layout = FlatParamLayout(fqns, [p.shape for p in params], world_size, alignment)
        self.pieces = self.layout.shard_pieces(rank)

        self.local_shard = torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=self.device)
        self.sharded_grad: Optional[torch.Tensor] = None
        self.keep_grad_buffer = False  # offload.py: sharded_grad is a reused host buffer
        self.unsharded = torch.empty(self.layout.padded_numel, dtype=self.compute_dtype, device=self.device)
        self.unsharded.requires_grad_(self.requires_grad)
        # Collectives write through this alias of the same storage.  It has its own version counter, so
        # re-gathering does not look like an in-place change of the views that autograd saved.
        self.gather_target = torch.empty(0, dtype=self.compute_dtype, device=self.device)
        self.gather_target.set_(self.unsharded.untyped_storage(), 0, self.unsharded.shape)
        self._full_bytes = self.unsharded.untyped_storage().nbytes()
        self.storage_owner: FlatParameter = self  # the flat parameter that grows and frees the gathered storage
        self.free_unsharded()

    def full_flat_from_params(self) -> torch.Tensor:
        """A full flat buffer holding the original parameters' current values (zero padding)."""
        out = torch.zeros(self.layout.padded_numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for slot, p in zip(self.layout.slots, self.params):
                out[slot.offset : slot.offset + slot.numel].copy_(p.detach().reshape(-1))
        return out

    def set_local_shard_from_full(self, full: torch.Tensor) -> None:
        lo = self.rank * self.layout.shard_numel
        with torch.no_grad():
            self.local_shard.copy_(full[lo : lo + self.layout.shard_numel])

    def alloc_unsharded(self) -> torch.Tensor:
        """Grow the unsharded storage back in place; returns the alias to gather into."""
        storage = self.unsharded.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self._full_bytes)
        return self.gather_target

    def free_unsharded(self) -> None:
        self.unsharded.untyped_storage().resize_(0)

    def unsharded_views(self) -> List[torch.Tensor]:
        """Views of ``unsharded`` shaped like the original parameters (autograd-tracked when enabled)."""
        pieces = torch.split(self.unsharded, self.layout.split_sizes)
        return [pieces[i].view(s.shape) for i, s in zip(self.layout.split_param_index, self.layout.slots)]

    def install_views(self, views: Sequence[torch.Tensor]) -> None:
        """Make every user module's attribute resolve to the given view: written into the module's instance
        ``__dict__``, it is found before ``nn.Module.__getattr__`` consults ``_parameters``, so the original
        Parameter stays registered (names, order, ``named_parameters()``) while forward computes with the view."""
        for view, users in zip(views, self.users):
            for module, name in users:
                module.__dict__[name] = view

    def uninstall_views(self) -> None:
        for users in self.users:
            for module, name in users:
                module.__dict__.pop(name, None)

    def point_params_at_shard(self) -> None:
        """Original parameters become 1-D views of their slices of ``local_shard``."""
        for piece, p in zip(self.pieces, self.params):
            _set_data(p, self.local_shard.narrow(0, piece.shard_start, piece.length))
        self._shard_ptrs = [p.data_ptr() for p in self.params]

    def check_params_are_shard_views(self) -> None:
        """Raise if a parameter no longer views its slice of the shard (``p.data = ...``, ``model.to``,
        ``resize_``): the engine would silently gather stale values."""
        for piece, p, ptr in zip(self.pieces, self.params, self._shard_ptrs):
            if p.data_ptr() != ptr or p.shape != (piece.length,) or p.dtype != self.dtype:
                fqn = self.layout.slots[piece.slot_index].fqn
                raise RuntimeError(
                    f"parameter {fqn!r} was replaced or changed behind accel_flatshard's back (now "
                    f"{tuple(p.shape)} {p.dtype}, expected a 1-D view of {piece.length} {self.dtype} elements of "
                    "its shard). Change dtype/device/values before wrapping, or inside summon_full_params()."
                )

    def point_params_at_full(self, full: torch.Tensor) -> None:
        """Original parameters become full-shaped views of ``full`` (used by summon_full_params)."""
        for slot, p in zip(self.layout.slots, self.params):
            p.data = full[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def grad_views(self) -> Iterator[Tuple[nn.Parameter, torch.Tensor]]:
        assert self.sharded_grad is not None
        for piece, p in zip(self.pieces, self.params):
            yield p, self.sharded_grad.narrow(0, piece.shard_start, piece.length)

    def accumulate_sharded_grad(self, new_grad: torch.Tensor) -> None:
        """Add a freshly reduced shard gradient to the parameters' ``.grad`` (None counts as zero, a tensor the
        user set as its value); afterwards every ``.grad`` is again a view of ``sharded_grad``."""
        new_grad = new_grad.to(self.dtype)
        if self.sharded_grad is None:
            self.sharded_grad = new_grad  # take ownership of the reduced buffer: no copy
        elif all(p.grad is None for p in self.params):
            self.sharded_grad.copy_(new_grad)
        else:
            for p, view in self.grad_views():
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr() or p.grad.shape != view.shape:
                    view.copy_(p.grad.reshape(-1))
            self.sharded_grad.add_(new_grad)
        for p, view in self.grad_views():
            p.grad = view

    def release_grad_if_unused(self) -> None:
        """Drop ``sharded_grad`` once every ``.grad`` is None (``zero_grad()``): free for the next forward.  Kept
        when offloaded (``keep_grad_buffer``): a pinned host buffer is reused, not pinned again."""
        if self.sharded_grad is not None and not self.keep_grad_buffer and all(p.grad is None for p in self.params):
            self.sharded_grad = None

    def numel_bytes(self) -> int:
        """Bytes this rank holds for the shard and its gradient."""
        held = [self.local_shard] + ([self.sharded_grad] if self.sharded_grad is not None else [])
        return sum(t.numel() * t.element_size() for t in held)


GATHERED_ALIGNMENT = 64  # bytes: where each flat parameter's view of a packed gathered storage starts


def pack_gathered(flats: Sequence[FlatParameter]) -> None:
    """Make one unit's flat parameters share one gathered storage (see the module docstring), before anything holds
    their ``unsharded`` (the schedule's gradient hooks are registered afterwards)."""
    offsets, total = [], 0
    for flat in flats:
        total = _round_up(total, GATHERED_ALIGNMENT)
        offsets.append(total)
        total += flat._full_bytes
    storage = torch.empty(total, dtype=torch.uint8, device=flats[0].device).untyped_storage()
    for flat, offset in zip(flats, offsets):
        start, shape = offset // flat.compute_dtype.itemsize, flat.unsharded.shape
        flat.unsharded = torch.empty(0, dtype=flat.compute_dtype, device=flat.device).set_(storage, start, shape)
        flat.unsharded.requires_grad_(flat.requires_grad)
        flat.gather_target = torch.empty(0, dtype=flat.compute_dtype, device=flat.device).set_(storage, start, shape)
        flat._full_bytes, flat.storage_owner = total, flats[0]
    flats[0].free_unsharded()


def gather_full(flat: FlatParameter, group: Any, shard: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The padded full tensor of ``flat`` from every rank's ``shard`` (default: its parameter shard; any shard of
    the same layout works), on ``flat.device``: a blocking collective over ``group``, the model's ShardGroup."""
    shard = flat.local_shard if shard is None else shard
    full = torch.empty(flat.layout.padded_numel, dtype=shard.dtype, device=flat.device)
    group.all_gather([full], [shard.to(flat.device)], async_op=False)  # (.to: under offload the shard is on the host)
    return full


def _set_data(p: nn.Parameter, value: torch.Tensor) -> None:
    """``p.data = value``, also from a device whose tensors cannot take ``value``'s in place (e.g. meta):
    then the contents are swapped, which keeps the Parameter object (optimizers and ties hold it)."""
    if can_set_data(p, value):
        p.data = value
    else:
        torch.utils.swap_tensors(p, nn.Parameter(value, requires_grad=p.requires_grad))
