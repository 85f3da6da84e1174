"""The one place that touches torch.distributed.checkpoint (DCP) internals.

Everything else in ``accel_flatshard.checkpoint`` imports DCP names from here, so a torch upgrade
that moves them breaks one file.  Private pieces used (checked on torch 2.13):

* ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain ``pickle.load``; we replace it
  with :func:`load_metadata_safely` (an allow-list unpickler), and the loader is handed the metadata
  we already validated instead of reading it again.
* ``torch.distributed.checkpoint.filesystem._StorageInfo`` (``relative_path, offset, length``) is the
  per-item storage record in ``Metadata.storage_data``; we read it for file checks and checksums.
* ``FileSystemWriter.write_data`` returns the rank's ``WriteResult`` list; we keep it to checksum
  what this rank wrote.

Public DCP API used: ``save``/``load`` with a custom ``SavePlanner``/``LoadPlanner`` and the
``FileSystemWriter``/``FileSystemReader`` storage layer; the metadata dataclasses.
"""
from __future__ import annotations

import dataclasses
import io
import os
import pickle
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
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

from ._files import CheckpointError, UnsafeCheckpointError

__all__ = [
    "ChunkStorageMetadata", "LoadItemType", "LoadPlan", "LoadPlanner", "Metadata", "MetadataIndex",
    "ReadItem", "SavePlan", "SavePlanner", "TensorProperties", "TensorStorageMetadata", "TensorWriteData",
    "WriteItem", "WriteItemType", "METADATA_FILE", "load_metadata_safely", "storage_records", "dcp_save",
    "dcp_load", "RecordingWriter",
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
    """``FileSystemWriter`` that remembers this rank's write results (file, offset, length per item)."""

    def __init__(self, path: str) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
        self.written: List[Tuple[str, int, int]] = []

    def write_data(self, plan, planner):  # type: ignore[override]
        fut = super().write_data(plan, planner)
        self.written = [(r.storage_data.relative_path, r.storage_data.offset, r.storage_data.length) for r in fut.value()]
        return fut


class _PreloadedReader(FileSystemReader):
    """``FileSystemReader`` that uses metadata we already loaded safely, and names the file on errors."""

    def __init__(self, path: str, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError("rank-local DCP metadata is not supported")
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):
        records = storage_records(self._metadata)
        by_file: Dict[str, List[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(records[item.storage_index][0], []).append(item)
        fut = None
        for name, items in by_file.items():
            try:
                fut = super().read_data(dataclasses.replace(plan, items=items), planner)
                fut.wait()
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(f"{os.path.join(str(self.path), name)}: cannot read tensor data "
                                      f"({type(e).__name__}: {e}); the file is corrupt or truncated") from e
        return fut if fut is not None else super().read_data(dataclasses.replace(plan, items=[]), planner)


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
             group: Optional[dist.ProcessGroup]) -> None:
    """Run DCP's load with our planner and the already validated metadata (``group=None``: offline)."""
    reader = _PreloadedReader(directory, metadata)
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
