"""The file a rank's checkpoint tensor data streams into: each item's CRC32 taken as its bytes pass, the bytes
written past the page cache (``O_DIRECT``) where the file system allows it.

``RecordingWriter`` (``dcp.py``) runs ``torch.save`` of one item after another straight into a
:class:`ChecksummedFile`.  Why it is built this way (issue 40: a background save must stay out of the training
step's way; numbers in README "Asynchronous save"):

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
import mmap
import os
import zlib
from typing import Any

import numpy  # (accelerate's dependency)

__all__ = ["ChecksummedFile"]

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
