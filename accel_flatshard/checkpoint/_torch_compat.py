"""The one place that touches torch.distributed.checkpoint (DCP) internals.

Everything else in ``accel_flatshard.checkpoint`` imports DCP names from here, so a torch upgrade
that moves them breaks one file.  Private pieces used (checked on torch 2.13):

* ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain ``pickle.load``; we replace it
  with :func:`load_metadata_safely` (an allow-list unpickler), and the loader is handed the metadata
  we already validated instead of reading it again.
* ``torch.distributed.checkpoint.filesystem._StorageInfo`` (``relative_path, offset, length``) is the
  per-item storage record in ``Metadata.storage_data``; with ``DEFAULT_SUFFIX`` it lets our writer's
  ``write_data`` and reader's ``read_data`` replace DCP's loops while keeping DCP's file format (stock
  DCP tools such as ``dcp_to_torch_save`` read our checkpoints).  DCP 2.13's writer keeps every chunk
  copy alive until the rank's file is done; ours holds one, checksums while writing, and our reader
  reads each needed item once, verifying its CRC32.
* ``torch.distributed.checkpoint.api.CheckpointException`` (a BaseException carrying every rank's
  error) is turned back into the failing rank's own exception.

Public DCP API used: ``save``/``load`` with a custom ``SavePlanner``/``LoadPlanner`` and the
``FileSystemWriter``/``FileSystemReader`` storage layer; the metadata dataclasses.
"""
from __future__ import annotations

import io
import os
import pickle
import warnings
import zlib
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX as _DCP_SUFFIX
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..state_dict.types import CheckpointError, UnsafeCheckpointError

__all__ = [
    "ChunkStorageMetadata", "LoadItemType", "LoadPlan", "LoadPlanner", "Metadata", "MetadataIndex",
    "ReadItem", "SavePlan", "SavePlanner", "TensorProperties", "TensorStorageMetadata", "TensorWriteData",
    "WriteItem", "WriteItemType", "METADATA_FILE", "load_metadata_safely", "storage_records", "dcp_save",
    "dcp_load",
]

METADATA_FILE = ".metadata"  # DCP's name for its metadata file

# ---------------------------------------------------------------------- safe metadata unpickling
_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS = {
    (_DCP_METADATA_MODULE, "Metadata"),
    (_DCP_METADATA_MODULE, "TensorStorageMetadata"),
    (_DCP_METADATA_MODULE, "BytesStorageMetadata"),
    (_DCP_METADATA_MODULE, "ChunkStorageMetadata"),
    (_DCP_METADATA_MODULE, "TensorProperties"),
    (_DCP_METADATA_MODULE, "MetadataIndex"),
    (_DCP_METADATA_MODULE, "StorageMeta"),
    (_DCP_METADATA_MODULE, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # called with a layout name, e.g. "torch.strided"
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("pathlib", "Path"),
}


class _AllowListUnpickler(pickle.Unpickler):
    """Admits only DCP's metadata classes, torch dtypes/Size/layout and paths; refuses anything else."""

    def __init__(self, file: Any, source: str) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self._source}: refusing to load global '{module}.{name}'; a DCP metadata file may only "
            "reference DCP's metadata classes and torch dtypes (the file may be crafted to run code)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self._source}: persistent ids are not allowed in DCP metadata")


def load_metadata_safely(path: str) -> Metadata:
    """Read DCP's ``.metadata`` pickle through the allow-list unpickler and check its structure.

    Example::

        md = load_metadata_safely("ckpt/.metadata")
        md.state_dict_metadata["lm_head.weight"].size
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: DCP metadata file is missing (the checkpoint is incomplete)") from None
    try:
        md = _AllowListUnpickler(io.BytesIO(data), path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # truncated or corrupt pickle
        raise CheckpointError(f"{path}: cannot read DCP metadata ({type(e).__name__}: {e}); the file is corrupt or truncated") from None
    _check_metadata_structure(md, path)
    return md


def _check_metadata_structure(md: Any, path: str) -> None:
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{path}: expected a DCP Metadata object, found {type(md).__name__}")
    if not isinstance(md.state_dict_metadata, dict):
        raise CheckpointError(f"{path}: state_dict_metadata is {type(md.state_dict_metadata).__name__}, expected dict")
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(entry, (TensorStorageMetadata, BytesStorageMetadata)):
            raise CheckpointError(f"{path}: bad metadata entry {key!r}: {type(entry).__name__}")
        if isinstance(entry, TensorStorageMetadata):
            if not isinstance(entry.properties, TensorProperties) or not isinstance(entry.properties.dtype, torch.dtype):
                raise CheckpointError(f"{path}: entry {key!r} has no valid dtype")
            if not all(isinstance(c, ChunkStorageMetadata) for c in entry.chunks):
                raise CheckpointError(f"{path}: entry {key!r} has malformed chunks")
    for index, info in storage_records(md, path).items():
        rel = info[0]
        if os.path.basename(rel) != rel or rel in ("", ".", ".."):
            raise CheckpointError(f"{path}: storage record for {index.fqn!r} points outside the checkpoint: {rel!r}")


def storage_records(md: Metadata, source: str = "checkpoint") -> Dict[MetadataIndex, Tuple[str, int, int]]:
    """``{storage index: (file name, byte offset, byte length)}`` from DCP's filesystem metadata."""
    if not isinstance(md.storage_data, dict):
        raise CheckpointError(f"{source}: metadata has no storage records")
    out = {}
    for index, info in md.storage_data.items():
        rel, off, length = (getattr(info, "relative_path", None), getattr(info, "offset", None), getattr(info, "length", None))
        if not isinstance(index, MetadataIndex) or not isinstance(rel, str) or not isinstance(off, int) or not isinstance(length, int):
            raise CheckpointError(f"{source}: malformed storage record {index!r}: {info!r}")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{source}: item {index.fqn!r} uses stream transforms {info.transform_descriptors}, which this loader does not support")
        out[index] = (rel, off, length)
    return out


# ---------------------------------------------------------------------- storage layer
class RecordingWriter(FileSystemWriter):
    """``FileSystemWriter`` whose ``write_data`` writes this rank's items one at a time.

    DCP 2.13's own loop keeps every copied chunk alive until the rank's file is finished (a second
    copy of the whole shard in RAM); this one holds one chunk at a time, computes each item's CRC32
    while writing (no re-read) and fsyncs.  The file format is DCP's: one ``torch.save`` record per
    item at the offset recorded in ``_StorageInfo``, so stock DCP readers read it.
    ``written`` lists ``(file, offset, length, crc32)`` per item afterwards.
    """

    def __init__(self, path: str) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
        self.written: List[Tuple[str, int, int, int]] = []

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:  # type: ignore[override]
        name = f"{plan.storage_data.prefix}0{_DCP_SUFFIX}"
        results, self.written = [], []
        with open(os.path.join(str(self.path), name), "wb") as f:
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    raise CheckpointError(f"{item.index.fqn}: only tensors are written to checkpoints")
                tensor = planner.resolve_data(item).detach().cpu()
                if tensor.untyped_storage().nbytes() != tensor.nbytes:
                    tensor = tensor.clone()  # torch.save would write the whole underlying storage
                buf = io.BytesIO()
                torch.save(tensor, buf)
                del tensor
                data = buf.getbuffer()
                offset = f.tell()
                f.write(data)
                results.append(WriteResult(index=item.index, size_in_bytes=len(data),
                                           storage_data=_StorageInfo(name, offset, len(data))))
                self.written.append((name, offset, len(data), zlib.crc32(data)))
                del data, buf
            f.flush()
            os.fsync(f.fileno())
        fut: Future = Future()
        fut.set_result(results)
        return fut


class _PreloadedReader(FileSystemReader):
    """``FileSystemReader`` that uses metadata we already loaded safely and reads each needed item
    once: checks its length and CRC32, ``torch.load(weights_only=True)``, checks dtype and shape, then
    copies the requested parts into the targets.  Errors name the file and the tensor."""

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
        per_file: Dict[str, List[Tuple[int, int, MetadataIndex]]] = {}
        for sidx in by_item:
            name, off, length = records[sidx]
            per_file.setdefault(name, []).append((off, length, sidx))
        for name, items in per_file.items():
            path = os.path.join(str(self.path), name)
            with open(path, "rb") as f:
                for off, length, sidx in sorted(items, key=lambda t: t[0]):
                    tensor = self._read_item(f, path, name, off, length, sidx)
                    for req in by_item[sidx]:
                        src = tensor
                        for dim, (o, n) in enumerate(zip(req.storage_offsets, req.lengths)):
                            src = src.narrow(dim, o, n)
                        dst = planner.resolve_tensor(req).detach()
                        if dst.shape != src.shape:
                            raise CheckpointError(f"{path}: {sidx.fqn!r} read {tuple(src.shape)} for a target of {tuple(dst.shape)}")
                        dst.copy_(src)
                        planner.commit_tensor(req, dst)
                    del tensor
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_item(self, f, path: str, name: str, off: int, length: int, sidx: MetadataIndex) -> torch.Tensor:
        where = f"{path}: {sidx.fqn!r} at offsets {tuple(sidx.offset or ())}"
        f.seek(off)
        data = f.read(length)
        if len(data) != length:
            raise CheckpointError(f"{where}: only {len(data)} of {length} bytes at byte {off} (truncated file)")
        if self._crcs is not None:
            expected = self._crcs.get((name, off, length))
            if expected is None:
                raise CheckpointError(f"{where}: no checksum recorded for bytes [{off}, {off + length})")
            if zlib.crc32(data) != expected:
                raise CheckpointError(f"{path}: checksum mismatch in bytes [{off}, {off + length}) holding {sidx.fqn!r} (corrupt file)")
        try:
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(f"{where}: cannot read tensor data ({type(e).__name__}: {e}); the file is corrupt") from None
        md = self._metadata.state_dict_metadata.get(sidx.fqn)
        chunk = None
        if isinstance(md, TensorStorageMetadata) and sidx.index is not None and sidx.index < len(md.chunks):
            chunk = md.chunks[sidx.index]
        if not isinstance(tensor, torch.Tensor) or (isinstance(md, TensorStorageMetadata) and tensor.dtype != md.properties.dtype) \
                or (chunk is not None and tuple(tensor.shape) != tuple(chunk.sizes)):
            got = f"{type(tensor).__name__} {getattr(tensor, 'dtype', '')} {tuple(getattr(tensor, 'shape', ()))}"
            raise CheckpointError(f"{where}: holds {got}, the metadata says {getattr(getattr(md, 'properties', None), 'dtype', '?')} "
                                  f"{tuple(chunk.sizes) if chunk is not None else ''}")
        return tensor


def dcp_save(state_dict: Dict[str, Any], directory: str, planner: SavePlanner,
             group: Optional[dist.ProcessGroup]) -> RecordingWriter:
    """Run DCP's save with our planner; returns the writer (its ``written`` lists this rank's items)."""
    writer = RecordingWriter(directory)
    with warnings.catch_warnings(), _reraise_plainly("save", directory):
        warnings.filterwarnings("ignore", message=".*Detected an existing checkpoint.*")
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.save(state_dict, storage_writer=writer, planner=planner, process_group=group,
                 no_dist=group is None)
    return writer


def dcp_load(state_dict: Dict[str, Any], directory: str, metadata: Metadata, planner: LoadPlanner,
             group: Optional[dist.ProcessGroup], crcs: Optional[Dict[Tuple[str, int, int], int]] = None) -> None:
    """Run DCP's load with our planner and the already validated metadata (``group=None``: offline);
    ``crcs`` maps ``(file, offset, length)`` to the CRC32 every item read must have (None: no check)."""
    reader = _PreloadedReader(directory, metadata, crcs)
    with warnings.catch_warnings(), _reraise_plainly("load", directory):
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=group, no_dist=group is None)


class _reraise_plainly:
    """Turn DCP's ``CheckpointException`` (a BaseException carrying every rank's error) into the first
    rank's own exception when it is ours, else a :class:`CheckpointError` that names the ranks."""

    def __init__(self, what: str, directory: str) -> None:
        self.what, self.directory = what, directory

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None or not isinstance(exc, CheckpointException):
            return False
        failures = exc.failures
        first_rank = min(failures)
        inner = failures[first_rank][0] if isinstance(failures[first_rank], tuple) else failures[first_rank]
        if isinstance(inner, CheckpointError):
            raise type(inner)(str(inner)) from exc
        raise CheckpointError(
            f"DCP {self.what} of {self.directory} failed on ranks {sorted(failures)}; rank {first_rank}: "
            f"{type(inner).__name__}: {inner}") from exc
