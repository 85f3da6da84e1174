"""The one way this project writes files: atomically and durably (a leaf module: the profiler writes with it too).

:func:`write_atomic` writes a temporary file in the target's directory, fsyncs it, renames it over the target with
``os.replace`` and fsyncs the directory: after a crash the target is the old file or the new one, never a truncated
mix.  :func:`commit_dir` does the same for a directory built at :func:`new_tmp_dir` (``<dir>.tmp-<random>``): a
previous ``<dir>`` is renamed to ``<dir>.old-<random>`` before the new one is renamed in and deleted after, so a
crash between the two renames leaves it complete under that name (``sharded.resolve_checkpoint_dir`` finds it).
:func:`remove_dir` deletes a directory the same way round: renamed to ``<dir>.deleting-<random>`` first, so a deletion
cut short never leaves a half-emptied ``<dir>``.

:class:`ChecksummedFile` is the file a rank's checkpoint tensor data streams into: ``dcp.RecordingWriter`` runs
``torch.save`` of one item after another straight into it, it takes each item's CRC32 as the bytes pass, and writes
them past the page cache (``O_DIRECT``) where the file system allows it (the directory it writes in is committed
with :func:`commit_dir`).  Why it is built this way (issue 40: a background save must stay out of the training
step's way; numbers in docs/checkpoints.md):

* no in-memory copy of an item: ``torch.save`` writes into this file object, not into a ``BytesIO`` that is then
  copied out (which held the GIL for every byte of it);
* the CRC32 runs in native code that releases the GIL (``zlib.crc32`` over more than 5 KiB), piece by piece just
  after the piece was copied into the staging buffer, while it is still in the CPU cache;
* ``O_DIRECT``: the device reads the staging buffer itself, so the kernel neither copies every byte into the page
  cache nor fills memory with pages of a file nobody reads back soon.  That copy, and the fresh pages it took, cost
  the training ranks more than everything else the writer did.  ``O_DIRECT`` wants the buffer address, the file
  offset and the length aligned to the device's block size: the staging buffer is page-aligned (``mmap``), full
  blocks are multiples of 4 KiB, and the last, partial block is padded, written and cut back with ``ftruncate``.
  Where the file system refuses ``O_DIRECT`` (tmpfs, some network and FUSE file systems, platforms without it) the
  same bytes go through ordinary buffered writes;
* the copies into the staging buffer run in numpy, which releases the GIL while it copies, in 1 MiB pieces: the
  training thread's Python never waits long for the writer's.

The bytes on disk are exactly what ``torch.save`` wrote: DCP's format does not change.
"""
from __future__ import annotations

import contextlib
import errno
import glob
import json
import mmap
import os
import shutil
import uuid
import zlib
from pathlib import Path
from typing import Any, Callable, Dict

import numpy  # (accelerate's dependency; torch imports it already)

__all__ = ["write_atomic", "write_text_atomic", "write_json_atomic", "new_tmp_dir", "commit_dir", "remove_dir",
           "ChecksummedFile"]


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


# ---------------------------------------------------------------------- checkpoint tensor data
_ALIGN = 4096  # O_DIRECT alignment: a multiple of every common logical block size (512, 4096)
_BLOCK = 8 << 20  # the staging buffer: one write system call per 8 MiB
_PIECE = 1 << 20  # copied into it and checksummed at once (fits the CPU cache)


class ChecksummedFile:
    """A write-only binary file for ``torch.save``: :attr:`pos` counts the bytes written, :attr:`crc` is the
    CRC32 of the bytes since the caller last set it to 0.  Writes are staged in an aligned buffer and leave it in
    8 MiB blocks, with ``O_DIRECT`` when ``direct`` and the file system allow.  Use it as a context manager:
    leaving it normally writes the rest and fsyncs; leaving it on an exception only closes the file."""

    def __init__(self, path: str, direct: bool = True) -> None:
        self.path = path
        self.pos = 0  # bytes handed to write(): the file offset of the next byte
        self.crc = 0
        self._stored = 0  # bytes already written to the file (the offset of the staging buffer's first byte)
        self._fill = 0  # bytes waiting in the staging buffer
        self._buffer = mmap.mmap(-1, _BLOCK)  # anonymous: page-aligned, as O_DIRECT needs
        self._staging = memoryview(self._buffer)
        self._staged = numpy.frombuffer(self._buffer, dtype=numpy.uint8)  # the same bytes, for copies into it
        self.direct = direct and hasattr(os, "O_DIRECT")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0)
        try:
            self._fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o666)
        except OSError as exc:
            if not self.direct or exc.errno != errno.EINVAL:
                self._release()
                raise
            self.direct = False  # this file system does not do O_DIRECT
            self._fd = os.open(path, flags, 0o666)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n, done = view.nbytes, 0
        source = numpy.frombuffer(view, dtype=numpy.uint8)
        while done < n:
            k = min(n - done, _PIECE, _BLOCK - self._fill)
            self._staged[self._fill:self._fill + k] = source[done:done + k]  # numpy copies without the GIL
            self.crc = zlib.crc32(self._staging[self._fill:self._fill + k], self.crc)  # while it is in the CPU cache
            self._fill += k
            done += k
            if self._fill == _BLOCK:
                self._store(_BLOCK)
        self.pos += n
        return n

    def flush(self) -> None:
        """(``torch.save`` calls it after each item: a partial block must wait for the next bytes, or for close)"""

    def _store(self, length: int) -> None:
        """Write the first ``length`` bytes of the staging buffer to the file."""
        written = 0
        while written < length:
            try:
                written += os.write(self._fd, self._staging[written:length])
            except OSError as exc:
                if not (self.direct and exc.errno == errno.EINVAL):
                    raise
                self._reopen_buffered(self._stored + written)  # a block size O_DIRECT does not accept
        self._stored += written
        self._fill = 0

    def _reopen_buffered(self, offset: int) -> None:
        os.close(self._fd)
        self.direct = False
        self._fd = os.open(self.path, os.O_WRONLY | getattr(os, "O_BINARY", 0))
        os.lseek(self._fd, offset, os.SEEK_SET)

    def close(self) -> None:
        """Write what is staged, cut the file to :attr:`pos` bytes, fsync and close."""
        try:
            if self._fill:
                length = self._fill
                if self.direct:  # O_DIRECT writes whole blocks: pad the last one, cut the file back below
                    length = -(-self._fill // _ALIGN) * _ALIGN
                    self._staging[self._fill:length] = bytes(length - self._fill)
                self._store(length)
            if self._stored != self.pos:
                os.ftruncate(self._fd, self.pos)
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._release()

    def _release(self) -> None:
        self._staged = None
        with contextlib.suppress(BufferError):  # a slice still held (by an exception's traceback): freed with it
            self._staging.release()
            self._buffer.close()

    def __enter__(self) -> "ChecksummedFile":
        return self

    def __exit__(self, kind: Any, *rest: Any) -> None:
        if kind is None:
            self.close()
        else:
            os.close(self._fd)
            self._release()
