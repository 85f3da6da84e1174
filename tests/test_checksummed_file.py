"""The file checkpoint tensor data streams into (``checkpoint/atomic.py``) and the writer that uses it: the bytes
and CRC32s it records, its fallback to buffered writes where ``O_DIRECT`` is refused, and a DCP format that stock
``torch.distributed.checkpoint`` still reads."""
from __future__ import annotations

import errno
import io
import os
import random
import warnings
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp

from accel_flatshard.state import atomic
from accel_flatshard.state.atomic import ChecksummedFile
from accel_flatshard.state.dcp import FlatRange, FlatSavePlanner, _own_storage, dcp_save

MiB = 1 << 20
# items as torch.save hands them over: small headers, data that ends mid-block, spans blocks, fills one exactly
ITEMS = [[30, 16, 0, 5 * MiB + 3, 7], [9 * MiB + 1], [1], [8 * MiB - 8 * MiB // 3 - 37, 8 * MiB], [4096, 100]]


def _write_items(f: ChecksummedFile, rng: random.Random):
    expected, records = bytearray(), []
    for pieces in ITEMS:
        offset, f.crc = f.pos, 0
        for n in pieces:
            data = rng.randbytes(n)
            assert f.write(memoryview(data)) == n
            f.flush()  # as torch.save does after each item: nothing may be written out early
            expected += data
        records.append((offset, f.pos - offset, f.crc))
    return bytes(expected), records


@pytest.mark.parametrize("direct", [True, False])
def test_the_file_holds_every_byte_and_each_item_its_crc32(tmp_path, direct):
    path = str(tmp_path / "data")
    with ChecksummedFile(path, direct=direct) as f:
        expected, records = _write_items(f, random.Random(0))
    got = open(path, "rb").read()
    assert got == expected and f.pos == len(expected)
    assert [(o, n, zlib.crc32(got[o:o + n])) for o, n, _ in records] == records


def test_a_file_system_that_refuses_o_direct_gets_buffered_writes(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(atomic.os, "open", no_direct)
    path = str(tmp_path / "data")
    with ChecksummedFile(path) as f:
        expected, _ = _write_items(f, random.Random(1))
        assert not f.direct
    assert open(path, "rb").read() == expected


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_a_block_that_o_direct_refuses_mid_file_is_written_buffered_from_there(tmp_path, monkeypatch):
    real_write, calls = os.write, []

    def refuse_second(fd, data):
        calls.append(len(data))
        if len(calls) == 2:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(atomic.os, "write", refuse_second)
    path = str(tmp_path / "data")
    with ChecksummedFile(path) as f:
        direct_at_start = f.direct
        expected, _ = _write_items(f, random.Random(2))
    if not direct_at_start:
        pytest.skip("this file system refuses O_DIRECT at open")
    assert not f.direct and open(path, "rb").read() == expected


def test_an_error_while_writing_closes_the_file_and_raises_it(tmp_path):
    with pytest.raises(RuntimeError, match="torch.save failed"):
        with ChecksummedFile(str(tmp_path / "data")) as f:
            f.write(b"x" * 10_000)
            raise RuntimeError("torch.save failed")
    with pytest.raises(OSError):
        os.fstat(f._fd)


def test_a_chunk_view_is_saved_from_a_slice_of_its_storage_with_a_copys_bytes():
    flat = torch.randn(1000)
    view = flat[123:123 + 60].view(6, 10)
    own = _own_storage(view)
    assert own.data_ptr() == view.data_ptr() and own.untyped_storage().nbytes() == view.nbytes  # no copy
    a, b = io.BytesIO(), io.BytesIO()
    torch.save(own, a)
    torch.save(view.clone(), b)
    assert a.getvalue() == b.getvalue()
    strided = flat[:40].view(4, 10).t()
    assert torch.equal(_own_storage(strided), strided) and _own_storage(strided).is_contiguous()


def test_the_writer_keeps_dcps_format_stock_dcp_reads_it_and_the_crcs_match(tmp_path):
    full = torch.randn(40, 30)
    entries = {"w": FlatRange(full.reshape(-1).clone(), 0, (40, 30)),
               "h": FlatRange(torch.randn(7).bfloat16(), 0, (7,)), "step": torch.tensor(5.0)}
    files = dcp_save(entries, str(tmp_path / "c"), FlatSavePlanner(), None)
    (name, info), = files.items()
    data = open(tmp_path / "c" / name, "rb").read()
    assert len(data) == info["size"]
    assert all(zlib.crc32(data[o:o + n]) == crc for o, n, crc in info["items"])
    out = {"w": torch.zeros(40, 30), "h": torch.zeros(7, dtype=torch.bfloat16), "step": torch.tensor(0.0)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no process group: DCP says it loads in one process)
        dcp.load(out, storage_reader=dcp.FileSystemReader(str(tmp_path / "c")), no_dist=True)
    assert torch.equal(out["w"], full) and torch.equal(out["h"], entries["h"].local) and out["step"].item() == 5.0

