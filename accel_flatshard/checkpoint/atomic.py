"""The one way this project writes files: atomically and durably (a leaf module: the profiler writes with it too).

:func:`write_atomic` writes a temporary file in the target's directory, fsyncs it, renames it over the target with
``os.replace`` and fsyncs the directory: after a crash the target is the old file or the new one, never a truncated
mix.  :func:`commit_dir` does the same for a directory built at :func:`new_tmp_dir` (``<dir>.tmp-<random>``): a
previous ``<dir>`` is renamed to ``<dir>.old-<random>`` before the new one is renamed in and deleted after, so a
crash between the two renames leaves it complete under that name (``sharded.resolve_checkpoint_dir`` finds it).
:func:`remove_dir` deletes a directory the same way round: renamed to ``<dir>.deleting-<random>`` first, so a deletion
cut short never leaves a half-emptied ``<dir>``.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Dict



def fsync_dir(path: str) -> None:
    """Make renames and new entries in directory ``path`` durable (a no-op where directories cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
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
    write_atomic(path, lambda tmp: Path(tmp).write_text(text))


def write_json_atomic(path: str, obj: Dict[str, Any], indent: int = 1) -> None:
    write_text_atomic(path, json.dumps(obj, indent=indent))


def new_tmp_dir(final: str) -> str:
    """A fresh sibling path ``<final>.tmp-<random>`` (not created)."""
    return f"{os.path.normpath(final)}.tmp-{uuid.uuid4().hex[:8]}"


def commit_dir(tmp: str, final: str) -> None:
    """Move the finished directory ``tmp`` to ``final``, replacing a previous checkpoint there (module doc)."""
    final = os.path.normpath(final)
    fsync_dir(tmp)
    if os.path.lexists(final):
        os.rename(final, f"{final}.old-{uuid.uuid4().hex[:8]}")
    os.rename(tmp, final)
    fsync_dir(os.path.dirname(os.path.abspath(final)))
    for leftover in glob.glob(glob.escape(final) + ".old-*"):  # the one just renamed and earlier interrupted ones
        shutil.rmtree(leftover, ignore_errors=True)


def remove_dir(path: str) -> None:
    """Delete the directory ``path`` (and what earlier interrupted deletions of it left): renamed out of the way
    first, so that a process killed while deleting leaves no half-emptied ``path`` (one whose manifest went first
    would read as a complete checkpoint written before the commit marker existed)."""
    path = os.path.normpath(path)
    if os.path.lexists(path):
        os.rename(path, f"{path}.deleting-{uuid.uuid4().hex[:8]}")
    for leftover in glob.glob(glob.escape(path) + ".deleting-*"):
        shutil.rmtree(leftover, ignore_errors=True)
