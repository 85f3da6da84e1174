"""DCP planners for flat-parameter shards: each rank's 1-D range written as chunks of the true shape.

The state dict handed to DCP maps a key (a parameter's name, or ``state.<name>.<key>`` for
optimizer state) to either

* a :class:`FlatRange` - elements ``[start, start + local.numel())`` of a tensor of ``shape`` flattened
  in row-major order, stored in the 1-D tensor ``local`` (a rank's piece of a flat parameter, or of
  its optimizer state);
* a plain ``torch.Tensor`` - a tensor that every rank has whole (a buffer, an optimizer ``step``).

On save each range becomes a few rectangular chunks (see ``_chunks.py``), so DCP's metadata holds an
ordinary tensor of the true shape for every key, whatever world size wrote it.  On load each rank
asks only for the saved chunks that intersect its own ranges - that is the resharding: a rank never
allocates more than its pieces (plus one saved chunk at a time inside DCP's reader).

Example (what ``save_sharded_model`` does)::

    entries = {"lm_head.weight": FlatRange(local_piece, start=piece.param_start, shape=(50257, 768))}
    dcp_save(entries, tmp_dir, FlatSavePlanner(), group)
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple, Union

import torch

from ._chunks import Chunk, check_tiling, flat_index, intersect, range_to_chunks
from ..state_dict.types import CheckpointError
from ._torch_compat import (
    ChunkStorageMetadata,
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    Metadata,
    MetadataIndex,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorProperties,
    TensorStorageMetadata,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)


@dataclass
class FlatRange:
    """Elements ``[start, start + local.numel())`` of a row-major tensor of ``shape``, held in ``local``."""

    local: torch.Tensor
    start: int
    shape: Tuple[int, ...]

    def chunks(self) -> List[Chunk]:
        return range_to_chunks(self.start, self.start + self.local.numel(), self.shape)

    def view(self, chunk: Chunk) -> torch.Tensor:
        lo = chunk.flat_start - self.start
        return self.local[lo : lo + chunk.numel].view(chunk.sizes)


Entry = Union[FlatRange, torch.Tensor]


def _entry_chunks(entry: Entry) -> List[Chunk]:
    if isinstance(entry, FlatRange):
        return entry.chunks()
    return [Chunk((0,) * entry.dim(), tuple(entry.shape), 0)] if entry.numel() else []


def _entry_view(entry: Entry, chunk: Chunk) -> torch.Tensor:
    return entry.view(chunk) if isinstance(entry, FlatRange) else entry


def _entry_shape_dtype(entry: Entry) -> Tuple[Tuple[int, ...], torch.dtype]:
    if isinstance(entry, FlatRange):
        return tuple(entry.shape), entry.local.dtype
    return tuple(entry.shape), entry.dtype


class FlatSavePlanner(SavePlanner):
    """Writes each :class:`FlatRange` as chunks of its true shape and each plain tensor once."""

    def set_up_planner(self, state_dict: Dict[str, Entry], storage_meta: Any = None, is_coordinator: bool = False) -> None:
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator
        self._views: Dict[Tuple[str, Tuple[int, ...]], Tuple[Entry, Chunk]] = {}

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, entry in self.state_dict.items():
            shape, dtype = _entry_shape_dtype(entry)
            kind = WriteItemType.SHARD if isinstance(entry, FlatRange) else WriteItemType.TENSOR
            for chunk in _entry_chunks(entry):
                self._views[(key, chunk.offsets)] = (entry, chunk)
                items.append(WriteItem(
                    index=MetadataIndex(key, chunk.offsets),
                    type=kind,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes)),
                        properties=TensorProperties(dtype=dtype),
                        size=torch.Size(shape),
                    ),
                ))
        return SavePlan(items)

    def create_global_plan(self, all_plans: List[SavePlan]) -> Tuple[List[SavePlan], Metadata]:
        """Drop duplicates (a plain tensor offered by several ranks is written by the first) and build
        the metadata; check that every key's chunks tile its shape exactly."""
        seen = set()
        md: Dict[str, TensorStorageMetadata] = {}
        new_plans = []
        for plan in all_plans:
            kept = []
            for item in plan.items:
                if item.index in seen:
                    continue
                seen.add(item.index)
                td = item.tensor_data
                entry = md.setdefault(item.index.fqn, TensorStorageMetadata(td.properties, td.size, []))
                if entry.size != td.size or entry.properties.dtype != td.properties.dtype:
                    raise CheckpointError(
                        f"{item.index.fqn}: ranks disagree on shape/dtype ({tuple(entry.size)}, {entry.properties.dtype}) "
                        f"vs ({tuple(td.size)}, {td.properties.dtype})")
                entry.chunks.append(td.chunk)
                kept.append(item)
            new_plans.append(SavePlan(kept, storage_data=plan.storage_data, planner_data=plan.planner_data))
        for key, entry in md.items():
            problem = check_tiling(entry.size, [(c.offsets, c.sizes) for c in entry.chunks])
            if problem:
                raise CheckpointError(f"{key}: the ranks' shards do not form the whole tensor: {problem}")
            entry.chunks.sort(key=lambda c: flat_index(c.offsets, entry.size))
        return new_plans, Metadata(state_dict_metadata=md)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        entry, chunk = self._views[(write_item.index.fqn, tuple(write_item.index.offset))]
        return _entry_view(entry, chunk).detach()


class _SavedChunks:
    """The saved chunks of one key, searchable by flattened range when they are contiguous runs."""

    def __init__(self, key: str, md: TensorStorageMetadata) -> None:
        self.key, self.md = key, md
        self.shape = tuple(md.size)
        self.chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
        runs = []
        for i, (off, size) in enumerate(self.chunks):
            start = flat_index(off, self.shape)
            runs.append((start, start + math.prod(size), i))
        runs.sort()
        self._starts = [r[0] for r in runs]
        self._runs = runs
        self._contiguous = check_tiling(self.shape, self.chunks) is None

    def overlapping(self, target: Chunk) -> List[int]:
        if not self._contiguous:
            return list(range(len(self.chunks)))
        lo, hi = target.flat_start, target.flat_start + target.numel
        i = max(bisect.bisect_right(self._starts, lo) - 1, 0)
        out = []
        while i < len(self._runs) and self._runs[i][0] < hi:
            if self._runs[i][1] > lo:
                out.append(self._runs[i][2])
            i += 1
        return out


class FlatLoadPlanner(LoadPlanner):
    """Reads, for every target range or tensor, exactly the parts of the saved chunks it overlaps."""

    def set_up_planner(self, state_dict: Dict[str, Entry], metadata: Metadata = None, is_coordinator: bool = False) -> None:
        self.state_dict = state_dict
        self.metadata = metadata
        self._targets: Dict[Tuple[str, Tuple[int, ...]], torch.Tensor] = {}

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan(plan_reads(self.state_dict, self.metadata, self._targets))

    def create_global_plan(self, global_plan: List[LoadPlan]) -> List[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise CheckpointError(f"{read_item.dest_index.fqn}: pickled objects are never loaded from a checkpoint")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        view = self._targets[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        for dim, (off, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, off, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor returned a view of the destination: the data is already in place


def plan_reads(state_dict: Dict[str, Entry], metadata: Metadata,
               targets: Dict[Tuple[str, Tuple[int, ...]], torch.Tensor] = None) -> List[ReadItem]:
    """The read items that fill every entry of ``state_dict`` from ``metadata``'s chunks.

    Raises :class:`CheckpointError` when a key is missing or its chunks do not cover a target.
    ``targets`` (optional) receives the destination view of each target chunk.
    """
    items: List[ReadItem] = []
    for key, entry in state_dict.items():
        md = metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"{key}: not found as a tensor in the DCP metadata")
        shape, _ = _entry_shape_dtype(entry)
        if tuple(md.size) != shape:
            raise CheckpointError(f"{key}: checkpoint shape {tuple(md.size)}, expected {shape}")
        saved = _SavedChunks(key, md)
        for ti, target in enumerate(_entry_chunks(entry)):
            if targets is not None:
                targets[(key, target.offsets)] = _entry_view(entry, target)
            covered = 0
            for si in saved.overlapping(target):
                s_off, s_size = saved.chunks[si]
                inter = intersect(target.offsets, target.sizes, s_off, s_size)
                if inter is None:
                    continue
                off, size = inter
                covered += math.prod(size)
                items.append(ReadItem(
                    type=LoadItemType.TENSOR,
                    dest_index=MetadataIndex(key, target.offsets, ti),
                    dest_offsets=torch.Size(o - t for o, t in zip(off, target.offsets)),
                    storage_index=MetadataIndex(key, s_off, si),
                    storage_offsets=torch.Size(o - s for o, s in zip(off, s_off)),
                    lengths=torch.Size(size),
                ))
            if covered != target.numel:
                raise CheckpointError(
                    f"{key}: the checkpoint holds {covered} of the {target.numel} elements needed at "
                    f"offsets {target.offsets} (chunks missing or overlapping)")
    return items
