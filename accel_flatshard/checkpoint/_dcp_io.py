"""Saving and loading a dict of :class:`FlatRange`/tensor entries with DCP, atomically and checked.

``save_entries``: every rank writes its entries with DCP into ``<dir>.tmp-<random>``, checksums what it
wrote, rank 0 writes ``flatshard.json`` last (with every checksum and the ``.metadata`` checksum) and
renames the directory into place; every rank learns whether that worked.

``open_checkpoint`` + ``load_entries``: read ``flatshard.json``, check ``.metadata``'s checksum, unpickle
it through the allow-list, plan this rank's reads, check that the files it needs exist with their
recorded sizes, then let DCP read: each needed item is read once, its CRC32 checked, and only the
overlapping parts copied into the targets.  Errors name the file or key; every
rank raises when any rank fails (no rank is left waiting in a collective).

Example::

    save_entries(group, "ckpt", entries, {"kind": "model", "tensors": {...}})
    directory, meta, md = open_checkpoint("ckpt", "model")
    load_entries(group, directory, meta, md, targets)
"""
from __future__ import annotations

import os
import time
from typing import Any, Dict, Optional, Tuple

import torch

from .. import comm
from ..state_dict.types import CheckpointError, agree, dtype_to_str
from ._files import FORMAT, FORMAT_VERSION, META_FILE, crc32_of_range, describe_written, item_crcs, read_meta
from ._files import resolve_checkpoint_dir, verify_items
from .atomic import commit_dir, new_tmp_dir, remove_dir_quietly, write_json_atomic
from ._planner import Entry, FlatLoadPlanner, FlatSavePlanner, plan_reads
from ._torch_compat import (
    METADATA_FILE,
    Metadata,
    TensorStorageMetadata,
    dcp_load,
    dcp_save,
    load_metadata_safely,
    storage_records,
)


def _world(group) -> Optional[Any]:
    """The process group DCP coordinates over (None: single process without torch.distributed)."""
    return None if group is None else group.world_group


def save_entries(group, directory: str, entries: Dict[str, Entry], meta: Dict[str, Any]) -> None:
    """Collective: write ``entries`` (this rank's share) and ``meta`` as a complete checkpoint at ``directory``.

    ``group`` is the model's ShardGroup (its world group coordinates DCP).  ``meta`` is completed with
    format, world size and checksums and written by rank 0 as the last file.
    """
    world = _world(group)
    rank, size = (0, 1) if group is None else (group.world_rank, group.world_size)
    tmp = comm.broadcast_object(world, new_tmp_dir(directory) if rank == 0 else None)
    try:
        writer = dcp_save(entries, tmp, FlatSavePlanner(), world)
    except BaseException:
        if rank == 0:
            remove_dir_quietly(tmp)
        raise
    local_error, files = None, {}
    try:
        files = describe_written(tmp, writer.written)
    except OSError as e:
        local_error = f"rank {rank}: cannot stat what it wrote in {tmp}: {e}"
    gathered = comm.all_gather_object(world, (local_error, files))
    status = None
    if rank == 0:
        errors = [e for e, _ in gathered if e]
        if errors:
            status = "; ".join(errors)
        else:
            try:
                all_files: Dict[str, Any] = {}
                for _, f in gathered:
                    all_files.update(f)
                md_path = os.path.join(tmp, METADATA_FILE)
                md_size = os.path.getsize(md_path)
                full_meta = {
                    "format": FORMAT,
                    "format_version": FORMAT_VERSION,
                    **meta,
                    "world_size": size,
                    "shard_size": group.shard_size if group is not None else 1,
                    "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "torch_version": torch.__version__,
                    "files": all_files,
                    "dcp_metadata": {"file": METADATA_FILE, "size": md_size,
                                     "crc32": crc32_of_range(md_path, 0, md_size)},
                }
                write_json_atomic(os.path.join(tmp, META_FILE), full_meta)
                commit_dir(tmp, directory)
            except Exception as e:  # noqa: BLE001 - reported on every rank
                status = f"rank 0 could not finish {directory}: {type(e).__name__}: {e}"
        if status is not None:
            remove_dir_quietly(tmp)
    status = comm.broadcast_object(world, status)
    if status is not None:
        raise CheckpointError(f"saving {directory} failed (the previous checkpoint there is untouched): {status}")


def open_checkpoint(directory: str, kind: str) -> Tuple[str, Dict[str, Any], Metadata]:
    """Find the complete checkpoint, read ``flatshard.json`` and the checked, safely unpickled ``.metadata``."""
    directory = resolve_checkpoint_dir(directory)
    meta = read_meta(directory, kind)
    info = meta["dcp_metadata"]
    md_path = os.path.join(directory, METADATA_FILE)
    if not os.path.isfile(md_path):
        raise CheckpointError(f"{md_path}: DCP metadata file is missing")
    size = os.path.getsize(md_path)
    if size != info.get("size"):
        raise CheckpointError(f"{md_path}: size is {size} bytes, {META_FILE} expects {info.get('size')} (truncated or replaced)")
    if crc32_of_range(md_path, 0, size) != info.get("crc32"):
        raise CheckpointError(f"{md_path}: checksum mismatch (corrupt, or from another save)")
    md = load_metadata_safely(md_path)
    for key, desc in meta["tensors"].items():
        dcp_key = desc.get("dcp_key", key)
        if int(torch.Size(desc["shape"]).numel()) == 0:
            continue
        entry = md.state_dict_metadata.get(dcp_key)
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"{md_path}: has no tensor {dcp_key!r} that {META_FILE} lists")
        if list(entry.size) != list(desc["shape"]) or dtype_to_str(entry.properties.dtype) != desc["dtype"]:
            raise CheckpointError(
                f"{md_path}: {dcp_key!r} is {tuple(entry.size)} {entry.properties.dtype}, but {META_FILE} says "
                f"{tuple(desc['shape'])} {desc['dtype']} (files from different saves?)")
    return directory, meta, md


def load_entries(group, directory: str, meta: Dict[str, Any], md: Metadata, entries: Dict[str, Entry],
                 verify_checksums: bool = True, error: Optional[Exception] = None) -> None:
    """Collective: fill ``entries`` from the checkpoint; ``error`` (a problem found earlier on this
    rank) is raised on every rank instead of loading."""
    world = _world(group)
    if error is None:
        try:
            reads = plan_reads(entries, md)
            records = storage_records(md, directory)
            needed = sorted({records[r.storage_index] for r in reads})
            problems = verify_items(directory, meta["files"], needed)  # CRCs: checked while reading
            if problems:
                error = CheckpointError("checkpoint files are damaged:\n  " + "\n  ".join(problems))
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            error = e
    agree(world, error)
    dcp_load(entries, directory, md, FlatLoadPlanner(), world, item_crcs(meta["files"]) if verify_checksums else None)
