"""Our checkpoint metadata on disk: ``flatshard.json`` (format, tensors, per-item CRC32s), finding a
complete checkpoint directory (also one left as ``<dir>.old-*`` by a crash during :func:`atomic.commit_dir`),
and checking the files a load needs before reading them.

Example::

    directory = resolve_checkpoint_dir("ckpt/step100")
    meta = read_meta(directory, "model")
"""
from __future__ import annotations

import glob
import json
import os
import warnings
import zlib
from typing import Any, Dict, Iterable, List, Optional, Tuple

from ..state_dict.types import CheckpointError

META_FILE = "flatshard.json"
FORMAT = "accel_flatshard.sharded"
FORMAT_VERSION = 1


def resolve_checkpoint_dir(path: str) -> str:
    """``path`` if it holds a complete checkpoint; else a complete ``<path>.old-*`` left by a crash
    between the two renames of ``atomic.commit_dir`` (with a warning); else an error saying what is there."""
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


def verify_items(directory: str, files: Dict[str, Any], needed: Iterable[Tuple[str, int, int]]) -> List[str]:
    """Check that every needed ``(file, offset, length)`` is listed, its file has the recorded size and a
    checksum is recorded for it; returns the problems found.  (The CRC itself is checked while reading.)"""
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
    return problems
