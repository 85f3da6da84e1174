"""Files: errors, atomic directory commits, our JSON metadata, checksums.

A checkpoint directory is written as ``<dir>.tmp-<random>`` and renamed into place only after every
file, DCP's ``.metadata`` and finally our ``flatshard.json`` are on disk (fsynced).  Replacing an
existing checkpoint renames it to ``<dir>.old-<random>`` first, renames the new one in, then deletes
the old one; a crash between those two renames leaves the previous checkpoint complete under the
``.old-`` name, and :func:`resolve_checkpoint_dir` finds it.  A crash at any earlier point leaves only
a ``.tmp-`` directory next to the untouched previous checkpoint.

Example::

    tmp = new_tmp_dir("ckpt/step100")          # "ckpt/step100.tmp-3f9a1c2b"
    ...write files into tmp, then the JSON last...
    commit_dir(tmp, "ckpt/step100")
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import uuid
import warnings
import zlib
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

META_FILE = "flatshard.json"
FORMAT = "accel_flatshard.sharded"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message names the key or file and what differs."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file asks to run code (e.g. a pickle referencing a non-allowed global)."""


# ---------------------------------------------------------------------- dtypes
def dtype_to_str(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def str_to_dtype(name: str, source: str = "checkpoint") -> torch.dtype:
    value = getattr(torch, str(name), None)
    if not isinstance(value, torch.dtype):
        raise CheckpointError(f"{source}: unknown dtype {name!r}")
    return value


# ---------------------------------------------------------------------- atomic directories
def new_tmp_dir(final: str) -> str:
    """A fresh sibling path ``<final>.tmp-<random>`` (not created)."""
    return f"{os.path.normpath(final)}.tmp-{uuid.uuid4().hex[:8]}"


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def commit_dir(tmp: str, final: str) -> None:
    """Move the finished directory ``tmp`` to ``final``, replacing a previous checkpoint there."""
    final = os.path.normpath(final)
    parent = os.path.dirname(os.path.abspath(final))
    old = None
    if os.path.lexists(final):
        old = f"{final}.old-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    for leftover in glob.glob(glob.escape(final) + ".old-*"):  # from an earlier interrupted replace
        shutil.rmtree(leftover, ignore_errors=True)


def remove_dir_quietly(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def resolve_checkpoint_dir(path: str) -> str:
    """``path`` if it holds a complete checkpoint; else a complete ``<path>.old-*`` left by a crash
    between the two renames of :func:`commit_dir` (with a warning); else an error saying what is there."""
    path = os.path.normpath(path)
    if os.path.isfile(os.path.join(path, META_FILE)):
        return path
    if os.path.isdir(path):
        names = sorted(os.listdir(path))
        held = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "") if names else "nothing"
        if any(n.endswith(".safetensors") for n in names) and "config.json" in names:
            kind = "a Hugging Face model directory: load it with from_pretrained"
        else:
            kind = "a save may have been interrupted, or this is not a sharded checkpoint"
        raise CheckpointError(f"{path}: not a complete accel_flatshard checkpoint ({META_FILE} is missing; it holds "
                              f"{held}: {kind})")
    leftovers = sorted(d for d in glob.glob(glob.escape(path) + ".old-*") if os.path.isfile(os.path.join(d, META_FILE)))
    if leftovers:
        warnings.warn(f"{path} is missing but a complete previous checkpoint is at {leftovers[-1]} "
                      "(a save was interrupted while replacing it); loading that", stacklevel=3)
        return leftovers[-1]
    tmps = glob.glob(glob.escape(path) + ".tmp-*")
    hint = f"; incomplete saves found: {tmps}" if tmps else ""
    raise CheckpointError(f"{path}: checkpoint directory does not exist{hint}")


# ---------------------------------------------------------------------- JSON metadata
def write_json_atomic(path: str, obj: Dict[str, Any]) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def read_meta(directory: str, kind: Optional[str] = None) -> Dict[str, Any]:
    """Read and sanity-check ``flatshard.json``; ``kind`` ("model"/"optimizer") must match when given."""
    path = os.path.join(directory, META_FILE)
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; {directory} is not a complete accel_flatshard checkpoint") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an accel_flatshard checkpoint (format={meta.get('format') if isinstance(meta, dict) else None!r}, expected {FORMAT!r})")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version {meta.get('format_version')!r}, this version reads {FORMAT_VERSION}")
    for field in ("kind", "world_size", "tensors", "files", "dcp_metadata"):
        if field not in meta:
            raise CheckpointError(f"{path}: field {field!r} is missing")
    if kind is not None and meta["kind"] != kind:
        raise CheckpointError(f"{directory}: this is a checkpoint of kind {meta['kind']!r}, expected kind {kind!r}")
    return meta


# ---------------------------------------------------------------------- checksums
def crc32_of_range(path: str, offset: int, length: int, block: int = 16 << 20) -> int:
    crc = 0
    with open(path, "rb") as f:
        f.seek(offset)
        left = length
        while left > 0:
            data = f.read(min(block, left))
            if not data:
                break
            crc = zlib.crc32(data, crc)
            left -= len(data)
    return crc


def describe_written(directory: str, written: Iterable[Tuple[str, int, int, int]]) -> Dict[str, Dict[str, Any]]:
    """``{file: {"size": bytes, "items": [[offset, length, crc32], ...]}}`` for what a rank wrote."""
    out: Dict[str, Dict[str, Any]] = {}
    for name, offset, length, crc in written:
        entry = out.setdefault(name, {"size": os.path.getsize(os.path.join(directory, name)), "items": []})
        entry["items"].append([offset, length, crc])
    return out


def item_crcs(files: Dict[str, Any]) -> Dict[Tuple[str, int, int], int]:
    """``{(file, offset, length): crc32}`` from the ``files`` section of ``flatshard.json``."""
    return {(name, o, n): c for name, entry in files.items() for o, n, c in entry.get("items", [])}


def verify_items(directory: str, files: Dict[str, Any], needed: Iterable[Tuple[str, int, int]],
                 check_crc: bool = True) -> List[str]:
    """Check size (and checksum) of every needed ``(file, offset, length)``; returns problems found."""
    problems: List[str] = []
    crcs = {name: {(o, n): c for o, n, c in entry.get("items", [])} for name, entry in files.items()}
    seen_size = set()
    for name, offset, length in needed:
        path = os.path.join(directory, name)
        if name not in files:
            problems.append(f"{path}: not listed in {META_FILE} (the checkpoint was modified)")
            continue
        if name not in seen_size:
            seen_size.add(name)
            if not os.path.isfile(path):
                problems.append(f"{path}: missing")
                continue
            size = os.path.getsize(path)
            if size != files[name]["size"]:
                problems.append(f"{path}: size is {size} bytes, expected {files[name]['size']} (truncated or modified)")
                continue
        expected = crcs[name].get((offset, length))
        if expected is None:
            problems.append(f"{path}: no checksum recorded for bytes [{offset}, {offset + length})")
        elif check_crc and os.path.isfile(path) and crc32_of_range(path, offset, length) != expected:
            problems.append(f"{path}: checksum mismatch in bytes [{offset}, {offset + length}) (corrupt file)")
    return problems
