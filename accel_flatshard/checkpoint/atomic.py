"""The one way this project writes files: atomically and durably (a leaf module: the profiler writes with it too).

* :func:`write_atomic` - a temporary file in the target's directory, written, flushed and fsynced, renamed over the
  target with ``os.replace``, then the directory fsynced: after a crash the target is the old file or the new one,
  never a truncated mix.
* :func:`commit_dir` - the same for a directory built as ``<dir>.tmp-<random>`` (:func:`new_tmp_dir`): its entries
  are fsynced, a previous ``<dir>`` is renamed to ``<dir>.old-<random>``, the new one renamed in, the parent
  fsynced, the old one deleted.  A crash between the two renames leaves the previous checkpoint complete under the
  ``.old-`` name (``sharded.resolve_checkpoint_dir`` finds it).

Example::

    write_atomic("out/model.safetensors", lambda tmp: save_file(tensors, tmp))
    write_text_atomic("out/phases.md", table)
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import uuid
from typing import Any, Callable, Dict

__all__ = ["write_atomic", "write_text_atomic", "write_json_atomic", "new_tmp_dir", "commit_dir"]


def fsync_dir(path: str) -> None:
    """Make renames and new entries in directory ``path`` durable (a no-op where directories cannot be opened)."""
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


def write_atomic(path: str, write: Callable[[str], None]) -> None:
    """``write(tmp_path)`` creates the file; it is then fsynced and renamed to ``path`` (see module doc)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_dir(directory)


def write_text_atomic(path: str, text: str) -> None:
    def dump(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)

    write_atomic(path, dump)


def write_json_atomic(path: str, obj: Dict[str, Any], indent: int = 1) -> None:
    write_text_atomic(path, json.dumps(obj, indent=indent))


def new_tmp_dir(final: str) -> str:
    """A fresh sibling path ``<final>.tmp-<random>`` (not created)."""
    return f"{os.path.normpath(final)}.tmp-{uuid.uuid4().hex[:8]}"


def commit_dir(tmp: str, final: str) -> None:
    """Move the finished directory ``tmp`` to ``final``, replacing a previous checkpoint there (module doc)."""
    final = os.path.normpath(final)
    fsync_dir(tmp)
    old = None
    if os.path.lexists(final):
        old = f"{final}.old-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(os.path.dirname(os.path.abspath(final)))
    for leftover in ([old] if old else []) + glob.glob(glob.escape(final) + ".old-*"):  # also earlier interrupted ones
        shutil.rmtree(leftover, ignore_errors=True)
