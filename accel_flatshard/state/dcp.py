"""torch.distributed.checkpoint (DCP) for flat-parameter shards: planners, storage layer, and every DCP internal used.

The state dict handed to DCP maps a key (a parameter's name, or ``state.<name>.<key>``) to a :class:`FlatRange`
(a rank's piece of a flat parameter or of its optimizer state) or to a plain tensor every rank has whole (a
buffer, an optimizer ``step``).  On save each range becomes at most ``2 * ndim - 1`` rectangular chunks of the
true shape (:func:`range_to_chunks`), so DCP's metadata holds an ordinary tensor for every key, whatever world
size wrote it; on load each rank asks only for the saved chunks that intersect its own ranges (the resharding)::

    shape (4, 5), range [7, 18):        row 1, cols 2..4   -> offsets (1, 2) sizes (1, 3)
                                        rows 2..2, all     -> offsets (2, 0) sizes (1, 5)
                                        row 3, cols 0..2   -> offsets (3, 0) sizes (1, 3)

DCP internals (checked on torch 2.13; only this module touches them): ``filesystem._StorageInfo`` and
``DEFAULT_SUFFIX`` let our ``write_data`` / ``read_data`` replace DCP's loops yet keep its file format (stock
tools such as ``dcp_to_torch_save`` read our checkpoints): the writer copies no chunk (DCP 2.13 keeps a copy of
every one until the rank's file is done) and streams each through a file that checksums it (``atomic.py``); the
reader takes metadata we loaded through an allow-list (``FileSystemReader.read_metadata`` would ``pickle.load``
it) and reads each needed item once, checking its CRC32.  ``api.CheckpointException`` (every rank's errors)
becomes the failing rank's own.
"""
from __future__ import annotations

import bisect
import contextlib
import io
import itertools
import math
import os
import warnings
import zlib
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX as _DCP_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan,
                                                  SavePlanner, TensorWriteData, WriteItem, WriteItemType)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .atomic import ChecksummedFile
from ..core.state_errors import CheckpointError

METADATA_FILE = ".metadata"  # DCP's name for its metadata file
Shape = Tuple[int, ...]


# ---------------------------------------------------------------------- rectangle arithmetic
@dataclass(frozen=True)
class Chunk:
    """A rectangle of a tensor: ``offsets``/``sizes`` per dimension; ``flat_start`` is the flattened index of
    its first element (every chunk made here covers ``[flat_start, flat_start + numel)``)."""

    offsets: Shape
    sizes: Shape
    flat_start: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def range_to_chunks(start: int, end: int, shape: Sequence[int]) -> List[Chunk]:
    """Cut the flattened range ``[start, end)`` of a row-major tensor of ``shape`` into rectangles, in
    flattened order, disjoint, together exactly the range."""
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    if not 0 <= start <= end <= numel:
        raise ValueError(f"range [{start}, {end}) is outside a tensor of shape {shape} ({numel} elements)")
    if end == start:
        return []
    if not shape:
        return [Chunk((), (), 0)]
    return [Chunk(offsets, sizes, flat_index(offsets, shape)) for offsets, sizes in _rects(start, end, shape)]


def _rects(start: int, end: int, shape: Shape) -> Iterator[Tuple[Shape, Shape]]:
    if len(shape) == 1:
        yield (start,), (end - start,)
        return
    inner = math.prod(shape[1:])
    first_row, first_col = divmod(start, inner)
    last_row, last_col = divmod(end, inner)
    if first_row == last_row:  # inside one row
        for off, size in _rects(first_col, last_col, shape[1:]):
            yield (first_row,) + off, (1,) + size
        return
    if first_col:
        for off, size in _rects(first_col, inner, shape[1:]):
            yield (first_row,) + off, (1,) + size
        first_row += 1
    if last_row > first_row:
        yield (first_row,) + (0,) * (len(shape) - 1), (last_row - first_row,) + shape[1:]
    if last_col:
        for off, size in _rects(0, last_col, shape[1:]):
            yield (last_row,) + off, (1,) + size


def flat_index(offsets: Sequence[int], shape: Sequence[int]) -> int:
    """Row-major flattened index of the element at ``offsets``."""
    index = 0
    for off, dim in zip(offsets, shape):
        index = index * dim + off
    return index


def intersect(a_offsets: Sequence[int], a_sizes: Sequence[int], b_offsets: Sequence[int],
              b_sizes: Sequence[int]) -> Optional[Tuple[Shape, Shape]]:
    """The intersection of two rectangles as ``(offsets, sizes)``, or None when it is empty."""
    lo = tuple(max(ao, bo) for ao, bo in zip(a_offsets, b_offsets))
    size = tuple(min(ao + asz, bo + bsz) - low
                 for ao, asz, bo, bsz, low in zip(a_offsets, a_sizes, b_offsets, b_sizes, lo))
    return None if any(n <= 0 for n in size) else (lo, size)


def _is_flat_run(sizes: Sequence[int], shape: Sequence[int]) -> bool:
    """True when a rectangle of ``sizes`` is one contiguous run of the flattened tensor: after the first
    dimension whose size exceeds 1, every later dimension is full."""
    partial = False
    for s, d in zip(sizes, shape):
        if partial and s != d:
            return False
        partial = partial or s > 1
    return True


def check_tiling(shape: Sequence[int], chunks: Sequence[Tuple[Sequence[int], Sequence[int]]]) -> Optional[str]:
    """None when ``chunks`` (offsets, sizes), contiguous runs of the flattened tensor (as every chunk this package
    writes), tile a tensor of ``shape`` exactly; otherwise what is wrong."""
    shape = tuple(int(s) for s in shape)
    runs = []
    for offsets, sizes in chunks:
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            return f"chunk at {tuple(offsets)} has rank {len(offsets)}, tensor has rank {len(shape)}"
        if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(offsets, sizes, shape)):
            return f"chunk at {tuple(offsets)} of size {tuple(sizes)} exceeds shape {shape}"
        runs.append((flat_index(offsets, shape), math.prod(sizes)))
    total = sum(n for _, n in runs)
    if total != math.prod(shape):
        return f"chunks cover {total} elements, tensor has {math.prod(shape)}"
    cursor = 0
    for start, n in sorted(runs):
        if start != cursor:
            return f"chunks overlap or leave a gap at flattened index {min(start, cursor)}"
        cursor += n
    return None


# ---------------------------------------------------------------------- planners
@dataclass
class FlatRange:
    """Elements ``[start, start + local.numel())`` of a row-major tensor of ``shape``, held in ``local``."""

    local: torch.Tensor
    start: int
    shape: Tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype


Entry = Union[FlatRange, torch.Tensor]


def _chunks_of(entry: Entry) -> List[Chunk]:
    if isinstance(entry, FlatRange):
        return range_to_chunks(entry.start, entry.start + entry.local.numel(), entry.shape)
    return [Chunk((0,) * entry.dim(), tuple(entry.shape), 0)] if entry.numel() else []


def _view(entry: Entry, chunk: Chunk) -> torch.Tensor:
    if not isinstance(entry, FlatRange):
        return entry
    lo = chunk.flat_start - entry.start
    return entry.local[lo : lo + chunk.numel].view(chunk.sizes)


class FlatSavePlanner(SavePlanner):
    """Writes each :class:`FlatRange` as chunks of its true shape and each plain tensor once."""

    def set_up_planner(self, state_dict: Dict[str, Entry], storage_meta: Any = None, is_coordinator: bool = False):
        self.state_dict = state_dict
        self._views: Dict[Tuple[str, Shape], Tuple[Entry, Chunk]] = {}

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, entry in self.state_dict.items():
            kind = WriteItemType.SHARD if isinstance(entry, FlatRange) else WriteItemType.TENSOR
            for chunk in _chunks_of(entry):
                self._views[(key, chunk.offsets)] = (entry, chunk)
                items.append(WriteItem(index=MetadataIndex(key, chunk.offsets), type=kind, tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes)),
                    properties=TensorProperties(dtype=entry.dtype), size=torch.Size(entry.shape))))
        return SavePlan(items)

    def create_global_plan(self, all_plans: List[SavePlan]) -> Tuple[List[SavePlan], Metadata]:
        """Drop duplicates (a plain tensor offered by several ranks is written by the first) and build the
        metadata; check that every key's chunks tile its shape exactly."""
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
                        f"{item.index.fqn}: ranks disagree on shape/dtype ({tuple(entry.size)}, "
                        f"{entry.properties.dtype}) vs ({tuple(td.size)}, {td.properties.dtype})")
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
        return _view(entry, chunk).detach()


class FlatLoadPlanner(LoadPlanner):
    """Reads, for every target range or tensor, exactly the parts of the saved chunks it overlaps."""

    def set_up_planner(self, state_dict: Dict[str, Entry], metadata: Metadata = None, is_coordinator: bool = False):
        self.state_dict = state_dict
        self.metadata = metadata
        self._targets: Dict[Tuple[str, Shape], torch.Tensor] = {}

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
        return view[tuple(slice(off, off + n) for off, n in zip(read_item.dest_offsets, read_item.lengths))]

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor returned a view of the destination: the data is already in place


def plan_reads(state_dict: Dict[str, Entry], metadata: Metadata,
               targets: Optional[Dict[Tuple[str, Shape], torch.Tensor]] = None) -> List[ReadItem]:
    """The read items that fill every entry of ``state_dict`` from ``metadata``'s chunks; ``targets``
    (optional) receives the destination view of each target chunk.  Raises :class:`CheckpointError` when a
    key is missing or its chunks do not cover a target."""
    items: List[ReadItem] = []
    for key, entry in state_dict.items():
        md = metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"{key}: not found as a tensor in the DCP metadata")
        shape = tuple(md.size)
        if shape != tuple(entry.shape):
            raise CheckpointError(f"{key}: checkpoint shape {shape}, expected {tuple(entry.shape)}")
        saved = [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
        # chunks that are contiguous runs (ours) are found by bisecting their sorted flat starts; others all tried
        order = sorted(range(len(saved)), key=lambda i: flat_index(saved[i][0], shape))
        starts = [flat_index(saved[i][0], shape) for i in order]
        runs = all(_is_flat_run(size, shape) for _, size in saved)
        for ti, target in enumerate(_chunks_of(entry)):
            if targets is not None:
                targets[(key, target.offsets)] = _view(entry, target)
            first = max(bisect.bisect_right(starts, target.flat_start) - 1, 0) if runs else 0
            end = bisect.bisect_left(starts, target.flat_start + target.numel) if runs else len(order)
            covered = 0
            for si in order[first:end]:
                s_off, s_size = saved[si]
                inter = intersect(target.offsets, target.sizes, s_off, s_size)
                if inter is None:
                    continue
                off, size = inter
                covered += math.prod(size)
                items.append(ReadItem(
                    type=LoadItemType.TENSOR, dest_index=MetadataIndex(key, target.offsets, ti),
                    dest_offsets=torch.Size(o - t for o, t in zip(off, target.offsets)),
                    storage_index=MetadataIndex(key, s_off, si),
                    storage_offsets=torch.Size(o - s for o, s in zip(off, s_off)), lengths=torch.Size(size)))
            if covered != target.numel:
                raise CheckpointError(
                    f"{key}: the checkpoint holds {covered} of the {target.numel} elements needed at "
                    f"offsets {target.offsets} (chunks missing or overlapping)")
    return items


# ---------------------------------------------------------------------- storage layer
def storage_records(md: Metadata, source: str = "checkpoint") -> Dict[MetadataIndex, Tuple[str, int, int]]:
    """``{storage index: (file name, byte offset, byte length)}`` from DCP's filesystem metadata."""
    if not isinstance(md.storage_data, dict):
        raise CheckpointError(f"{source}: metadata has no storage records")
    out = {}
    for index, info in md.storage_data.items():
        rel, off, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
        if not (isinstance(index, MetadataIndex) and isinstance(rel, str) and isinstance(off, int)
                and isinstance(length, int)):
            raise CheckpointError(f"{source}: malformed storage record {index!r}: {info!r}")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{source}: item {index.fqn!r} uses stream transforms "
                                  f"{info.transform_descriptors}, which this loader does not support")
        out[index] = (rel, off, length)
    return out


def _completed(value: Any) -> Future:
    """A future already holding ``value`` (our storage layer writes and reads synchronously)."""
    fut: Future = Future()
    fut.set_result(value)
    return fut


class RecordingWriter(FileSystemWriter):
    """``FileSystemWriter`` whose ``write_data`` writes this rank's items one at a time, in DCP's format (one
    ``torch.save`` record per item at the offset recorded in ``_StorageInfo``), streaming each into a
    :class:`~accel_flatshard.state.atomic.ChecksummedFile` that takes its CRC32 on the way, then fsyncs.
    ``files`` is then ``{file: {"size": bytes, "items": [[offset, length, crc32], ...]}}`` (what ``flatshard.json``
    lists; a rank with no item writes no file)."""

    def __init__(self, path: str) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
        self.files: Dict[str, Dict[str, Any]] = {}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:  # type: ignore[override]
        if not plan.items:  # (a hybrid save's other replicas): no empty file beside the ones flatshard.json lists
            return _completed([])
        name = f"{plan.storage_data.prefix}0{_DCP_SUFFIX}"
        results, items = [], []
        with ChecksummedFile(os.path.join(str(self.path), name)) as f:
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    raise CheckpointError(f"{item.index.fqn}: only tensors are written to checkpoints")
                tensor = planner.resolve_data(item).detach().cpu()
                tensor = _own_storage(tensor)
                offset, f.crc = f.pos, 0
                torch.save(tensor, f)
                del tensor
                results.append(WriteResult(index=item.index, size_in_bytes=f.pos - offset,
                                           storage_data=_StorageInfo(name, offset, f.pos - offset)))
                items.append([offset, f.pos - offset, f.crc])
        self.files = {name: {"size": f.pos, "items": items}}
        return _completed(results)


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on a storage of exactly its bytes (``torch.save`` writes a tensor's whole storage, and a chunk is
    a view into a larger one): a contiguous view gets a slice of its storage, which shares the memory (no copy, and
    no intra-op threads taken from training); anything else is copied."""
    storage = tensor.untyped_storage()
    if storage.nbytes() == tensor.nbytes:
        return tensor
    if not tensor.is_contiguous():
        return tensor.contiguous()
    start = tensor.storage_offset() * tensor.element_size()
    return torch.empty(0, dtype=tensor.dtype).set_(storage[start:start + tensor.nbytes]).view(tensor.shape)


class _PreloadedReader(FileSystemReader):
    """``FileSystemReader`` that uses metadata we already loaded safely and reads each needed item once: checks
    its length and CRC32, ``torch.load(weights_only=True)``, checks dtype and shape, then copies the requested
    parts into the targets.  Errors name the file and the tensor."""

    def __init__(self, path: str, metadata: Metadata, crcs: Optional[Dict[Tuple[str, int, int], int]] = None) -> None:
        super().__init__(path)
        self._metadata = metadata
        self._crcs = crcs

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError("rank-local DCP metadata is not supported")
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        records = storage_records(self._metadata)
        by_item: Dict[MetadataIndex, List[ReadItem]] = {}
        for req in plan.items:
            by_item.setdefault(req.storage_index, []).append(req)
        in_file_order = sorted(by_item, key=lambda sidx: records[sidx][:2])
        for name, sidxs in itertools.groupby(in_file_order, key=lambda sidx: records[sidx][0]):
            path = os.path.join(str(self.path), name)
            with open(path, "rb") as f:
                for sidx in sidxs:
                    tensor = self._read_item(f, path, *records[sidx], sidx)
                    for req in by_item[sidx]:
                        # (both are req.lengths: _read_item checked the item's shape, plan_reads cut within it)
                        src = tensor[tuple(slice(o, o + n) for o, n in zip(req.storage_offsets, req.lengths))]
                        dst = planner.resolve_tensor(req).detach()
                        dst.copy_(src)
                        planner.commit_tensor(req, dst)
                    del tensor
        return _completed(None)

    def _read_item(self, f, path: str, name: str, off: int, length: int, sidx: MetadataIndex) -> torch.Tensor:
        where = f"{path}: {sidx.fqn!r} at offsets {tuple(sidx.offset or ())}"
        f.seek(off)
        data = f.read(length)
        if len(data) != length:
            raise CheckpointError(f"{where}: only {len(data)} of {length} bytes at byte {off} (truncated file)")
        # (an item without a recorded checksum was refused before reading: sharded._verify_items)
        if self._crcs is not None and zlib.crc32(data) != self._crcs.get((name, off, length)):
            raise CheckpointError(
                f"{path}: checksum mismatch in bytes [{off}, {off + length}) holding {sidx.fqn!r} (corrupt file)")
        try:
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(f"{where}: cannot read tensor data ({type(e).__name__}: {e}); corrupt file") from None
        md = self._metadata.state_dict_metadata[sidx.fqn]  # a TensorStorageMetadata (plan_reads planned the read)
        saved, sizes = md.properties.dtype, tuple(md.chunks[sidx.index].sizes)
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != saved or tuple(tensor.shape) != sizes:
            got = f"{type(tensor).__name__} {getattr(tensor, 'dtype', '')} {tuple(getattr(tensor, 'shape', ()))}"
            raise CheckpointError(f"{where}: holds {got}, the metadata says {saved} {sizes}")
        return tensor


def dcp_save(state_dict: Dict[str, Entry], directory: str, planner: SavePlanner,
             group: Optional[dist.ProcessGroup]) -> Dict[str, Dict[str, Any]]:
    """DCP's save with ``planner`` and our writer (``group=None``: one process); returns the writer's ``files``."""
    writer = RecordingWriter(directory)
    with _plain_dcp("save", directory):
        dcp.save(state_dict, storage_writer=writer, planner=planner, process_group=group, no_dist=group is None)
    return writer.files


def dcp_load(state_dict: Dict[str, Entry], directory: str, metadata: Metadata, planner: LoadPlanner,
             group: Optional[dist.ProcessGroup], crcs: Optional[Dict[Tuple[str, int, int], int]] = None) -> None:
    """Run DCP's load with ``planner`` and the already validated metadata (``group=None``: offline);
    ``crcs`` maps ``(file, offset, length)`` to the CRC32 every item read must have (None: no check)."""
    reader = _PreloadedReader(directory, metadata, crcs)
    with _plain_dcp("load", directory):
        dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=group, no_dist=group is None)


@contextlib.contextmanager
def _plain_dcp(what: str, directory: str) -> Iterator[None]:
    """Silence DCP's warnings about what we chose (overwrite, no process group), and turn its
    ``CheckpointException`` (a BaseException carrying every rank's error) into the first rank's own exception
    when it is ours, else a :class:`CheckpointError` that names the ranks."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Detected an existing checkpoint.*")
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        try:
            yield
        except CheckpointException as exc:
            failures = exc.failures
            first_rank = min(failures)
            inner = failures[first_rank][0] if isinstance(failures[first_rank], tuple) else failures[first_rank]
            if isinstance(inner, CheckpointError):
                raise type(inner)(str(inner)) from exc
            raise CheckpointError(
                f"DCP {what} of {directory} failed on ranks {sorted(failures)}; rank {first_rank}: "
                f"{type(inner).__name__}: {inner}") from exc
