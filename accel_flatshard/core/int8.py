"""Block-wise int8 quantization for communication (ZeRO++ style qwZ / qgZ): the math and the byte counts, no
collectives (those stay in ``comm.py``) and no schedule (``engine.py`` decides when to use it).

Layout.  A 1-D float tensor of ``n`` elements is cut into blocks of ``block`` consecutive elements, starting at
its first element; the last block holds the remainder when ``n`` is not a multiple of ``block``::

    element:   0 ............................................................ n
               | block 0 | block 1 | ... | block nb-2 | last block (n - (nb-1)*block, 1..block) |
    q:         int8, n elements, q[i] in [-127, 127] (-128 unused: the code is symmetric)
    scales:    float32, nb = ceil(n / block) elements, scales[b] = absmax(block b) / 127
    value:     x[i] ~= q[i] * scales[b]            (b = i // block)

Nothing is padded: the full blocks are one ``[nb_full, block]`` view and the last short block one more view, so
no operation loops over blocks in Python and no element is invented.  A 2-D ``[R, n]`` tensor is R such rows,
each with its own blocks (``scales`` is ``[R, nb]``): a block never spans two rows.

Applied to a flat parameter (``flat_param.py``: rank r owns ``[r * shard_numel, (r + 1) * shard_numel)``):

* weights (all-gather): each rank quantizes its own ``local_shard``, so blocks start at every shard's first
  element and cannot straddle two ranks' shards.  One rank sends ``wire_bytes(shard_numel, block)``; the
  gathered ``[W, shard_numel]`` int8 and ``[W, shard_blocks(shard_numel, block)]`` scales dequantize in one call
  of :func:`dequantize_blocks` into the unsharded buffer viewed as ``[W, shard_numel]``.
* gradients (reduction through one all-to-all): :func:`quantize_for_reduction` views the full gradient as
  ``[W, shard_numel]``; row r is the chunk rank r owns, quantized on its own.  One all-to-all of that int8
  ``[W, shard_numel]`` and float32 ``[W, shard_blocks]`` (row r to rank r) leaves on each rank every source's
  blocks of its own shard, row s from rank s; :func:`sum_dequantized` sums them in float32 in rank order.
  A rank's own row is quantized too, so the result does not depend on which rank holds a chunk.
  One rank sends ``reduction_wire_bytes(shard_numel, W, block)`` (its own row included, copied locally).
* padding (alignment gaps, the tail of the last shard) is zero: a zero never raises a block's absmax and
  dequantizes to exactly zero in any block, so no block boundary is needed at the padding.

Conventions and what holds (``absmax`` = the largest magnitude of the element's block, in float32; bf16 and fp16
inputs are converted to float32 exactly):

* error: ``|dequantized - x| <= absmax / 254 * (1 + 2**-14) + 2**-143`` for every element: half a quantization
  step, widened by float32 rounding of the scale, the quotient and the product (relative 2**-14 at most), plus an
  absolute floor that matters only when the scale is subnormal (``absmax < 127 * 2**-126``, about 1.5e-36).
* an all-zero block gets scale 0 and dequantizes to exact zeros; so does a block whose scale underflows to 0
  (``absmax < 63.5 * 2**-149``, subnormal values only): its elements become 0, within the floor above.
* the block's largest element (so every element of a constant block, a block of one element included)
  dequantizes to ``±127 * scale``: itself or a float32 neighbour when the scale is normal (float32 cannot always
  hold a scale that multiplies back exactly; measured: 99.4 % of Gaussian values and 98.7 % of values spread
  over 2**-120..2**120 round-trip exactly).  Zeros stay exact zeros.
* a block whose absmax is within an ulp of float32's largest value gets its scale rounded down one step so that
  ``127 * scale`` stays finite.
* output dtype: the value is computed in float32 and rounded once to the output dtype (bf16, fp16), adding that
  rounding: at most 2**-8 of the value for bf16, 2**-11 for fp16 (below fp16's normal range, 2**-14, at most
  2**-25 absolute; beyond its largest, 65504, inf: the caller keeps fp16 data in range).  For a bf16 or fp16
  input dequantized into its own dtype a constant block is exact.
* inf or nan anywhere raises ``ValueError`` naming ``what``: a scale of inf or nan would silently wipe out its
  whole block.  The check is one reduction over the scales (the block absmax propagates nan), which on CUDA is
  one device-to-host synchronisation per call.

Cost: the int8 result and the scales; on the CPU the passes run piece by piece (:data:`PIECE_ELEMENTS`) through
one float32 scratch buffer of a piece, elsewhere one float32 temporary of the input's size (the quotient).
Dequantization writes into ``out`` in place (any float dtype); :func:`sum_dequantized` adds the sources piece by
piece, so no dequantized copy of a whole row is made.  Pieces change no result: every element goes through the
same float32 operations, in the same order, as with the whole tensor at once.
"""
from __future__ import annotations

import math
import sys
from typing import Iterator, List, Optional, Tuple

import torch

from ._compat import is_fake

QMAX = 127  # symmetric int8 code: -127..127
SCALE_DTYPE = torch.float32
# what the bound holds for: float32, and the 16-bit types it holds exactly (float64 would lose bits in the scale)
QUANTIZABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# On the CPU every elementwise pass runs over pieces of about this many elements, reusing one float32 scratch
# buffer (2 MiB, in the core's L2 / the L3): a temporary of a whole shard (13.5M elements: 54 MB, above glibc's mmap
# threshold) is mapped and page-faulted in again by every call, and mixed-dtype ops (int8 * float32) make one such
# temporary of their own.  Smaller pieces cost more in per-op overhead than they gain in cache (one core, 13.5M
# elements, block 256: quantize 15 ms at 2**16, 11 at 2**18, 9.9 at 2**19; 2**20 pages a 4 MiB scratch in and out
# again on small shards).  Measured: quantize 64 -> 10 ms, dequantize into bf16 110 -> 8.5 ms (benchmarks/
# int8_micro.py, docs/communication.md).  Same ops on the same elements: the same results.
PIECE_ELEMENTS = 1 << 19
_WHOLE = sys.maxsize  # (a piece limit: the whole tensor at once)


def shard_blocks(shard_numel: int, block: int) -> int:
    """Blocks of one shard (each shard is quantized on its own, its last block may be short)."""
    _check_block(block)
    return -(-shard_numel // block)


def wire_bytes(numel: int, block: int) -> int:
    """Bytes of ``numel`` elements quantized in blocks of ``block``: int8 data plus one float32 scale a block.
    What one rank sends to each peer in a quantized all-gather of a ``numel``-element shard."""
    return numel + SCALE_DTYPE.itemsize * shard_blocks(numel, block)


def reduction_wire_bytes(shard_numel: int, world_size: int, block: int) -> int:
    """Bytes of one rank's quantized gradient send buffer for the all-to-all: ``world_size`` rows of a shard's
    int8 data and scales (the row for this rank itself is copied locally, the rest go over the wire)."""
    return world_size * wire_bytes(shard_numel, block)


def quantize_blocks(x: torch.Tensor, block: int, what: str,
                    out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                    propagate_non_finite: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize the 1-D float tensor ``x`` in blocks of ``block``: ``(q, scales)``, int8 of ``x.numel()`` and
    float32 of ``shard_blocks(x.numel(), block)`` elements (module docstring).  ``what`` names the data in the
    error raised for inf or nan (e.g. ``"unit model.layers.3 weights"``); ``propagate_non_finite``: such a block gets
    a nan scale instead (the receivers raise, every rank alike: see ``comm.py``).  ``out=(q, scales)`` writes into
    given buffers (e.g. a send buffer's slices) instead of new ones."""
    _check_block(block)
    if x.dim() != 1 or x.dtype not in QUANTIZABLE_DTYPES:
        raise ValueError(f"quantize_blocks({what}): expected a 1-D float32, bfloat16 or float16 tensor, got "
                         f"{x.dtype} of shape {tuple(x.shape)}")
    q, scales = _outputs(out, (1, x.numel()), (1, shard_blocks(x.numel(), block)), x.device, what)
    _quantize_rows(x.reshape(1, -1), block, q, scales, what, propagate_non_finite)
    return q.view(-1), scales.view(-1)


def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor, block: int, out: Optional[torch.Tensor] = None,
                      dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``q * scale`` of each block, into ``out`` (any float dtype, written in place) or a new tensor of ``dtype``
    (default float32).  ``q`` is 1-D with 1-D ``scales``, or ``[R, n]`` with ``[R, nb]`` scales (R rows quantized
    on their own, e.g. the W gathered shards); ``out`` has the same number of elements (any contiguous shape,
    e.g. the whole unsharded flat buffer).  Returns ``out``."""
    _check_block(block)
    if q.dtype != torch.int8:
        raise ValueError(f"dequantize_blocks: q must be int8, got {q.dtype}")
    if q.dim() not in (1, 2):
        raise ValueError(f"dequantize_blocks: q must be 1-D or [rows, n], got shape {tuple(q.shape)}")
    q2 = q.reshape(1, -1) if q.dim() == 1 else q
    rows, n = q2.shape
    if scales.dtype != SCALE_DTYPE or scales.numel() != rows * shard_blocks(n, block):
        raise ValueError(f"dequantize_blocks: expected {rows} x {shard_blocks(n, block)} float32 scales for "
                         f"{tuple(q.shape)} int8 in blocks of {block}, got {scales.dtype} of shape "
                         f"{tuple(scales.shape)}")
    if out is None:
        out = torch.empty(q.shape, dtype=dtype or torch.float32, device=q.device)
    elif dtype is not None and out.dtype != dtype:
        raise ValueError(f"dequantize_blocks: out is {out.dtype} but dtype={dtype} was asked")
    if not out.is_floating_point() or out.numel() != q.numel() or not out.is_contiguous():
        raise ValueError(f"dequantize_blocks: out must be a contiguous float tensor of {q.numel()} elements, got "
                         f"{out.dtype} of shape {tuple(out.shape)}")
    _dequantize_rows(q2, scales.reshape(rows, -1), block, out.view(rows, n))
    return out


def quantize_for_reduction(full_grad: torch.Tensor, world_size: int, block: int, what: str,
                           out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None, propagate_non_finite: bool = False
                           ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The send buffers of a quantized gradient reduction: ``full_grad`` (1-D, ``world_size * chunk``
    elements: a padded flat buffer) as int8 ``[W, chunk]`` and float32 ``[W, shard_blocks(chunk, block)]``,
    row r being the chunk rank r owns, quantized on its own.  An all-to-all of both (row r to rank r) gives
    every rank the inputs of :func:`sum_dequantized`.  ``out=(q, scales)`` writes into given buffers.
    ``propagate_non_finite``: a block holding inf or nan gets a nan scale instead of the error, so it arrives as nan
    (fp16 loss scaling: the grad scaler sees it on every rank and skips the step, as after an exact reduction)."""
    _check_block(block)
    if full_grad.dim() != 1 or full_grad.dtype not in QUANTIZABLE_DTYPES:
        raise ValueError(f"quantize_for_reduction({what}): expected a 1-D float32, bfloat16 or float16 tensor, got "
                         f"{full_grad.dtype} of shape {tuple(full_grad.shape)}")
    if world_size < 1 or full_grad.numel() % world_size:
        raise ValueError(f"quantize_for_reduction({what}): {full_grad.numel()} elements do not split into "
                         f"{world_size} equal chunks (a flat parameter's padded_numel does)")
    chunk = full_grad.numel() // world_size
    q, scales = _outputs(out, (world_size, chunk), (world_size, shard_blocks(chunk, block)), full_grad.device, what)
    _quantize_rows(full_grad.reshape(world_size, chunk), block, q, scales, what, propagate_non_finite)
    return q, scales


def sum_dequantized(received_q: torch.Tensor, received_scales: torch.Tensor, block: int,
                    out_fp32: torch.Tensor) -> torch.Tensor:
    """Sum the W sources' quantized chunks (``[W, chunk]`` int8, ``[W, chunk_blocks]`` float32, row s from rank
    s) into ``out_fp32`` (float32, ``chunk`` elements): each row dequantized in float32 and added in rank order,
    so the result is deterministic.  The division by W (or the post-divide) is the caller's, as on the exact
    path.  Returns ``out_fp32``."""
    if received_q.dim() != 2 or received_scales.dim() != 2 or received_scales.shape[0] != received_q.shape[0]:
        raise ValueError(f"sum_dequantized: expected [W, chunk] int8 and [W, chunk_blocks] scales, got "
                         f"{tuple(received_q.shape)} and {tuple(received_scales.shape)}")
    if out_fp32.dtype != torch.float32:
        raise ValueError(f"sum_dequantized: the sum is kept in float32, got out of {out_fp32.dtype}")
    sources, chunk = received_q.shape
    if sources == 1:
        return dequantize_blocks(received_q[0], received_scales[0], block, out=out_fp32)
    _check_block(block)
    if (received_q.dtype != torch.int8 or received_scales.dtype != SCALE_DTYPE
            or received_scales.shape[1] != shard_blocks(chunk, block)):
        raise ValueError(f"sum_dequantized: expected int8 and {shard_blocks(chunk, block)} float32 scales a row in "
                         f"blocks of {block}, got {received_q.dtype} and {received_scales.dtype} "
                         f"{tuple(received_scales.shape)}")
    if out_fp32.numel() != chunk or not out_fp32.is_contiguous():
        raise ValueError(f"sum_dequantized: out must be a contiguous float32 tensor of {chunk} elements, got shape "
                         f"{tuple(out_fp32.shape)}")
    if chunk == 0:
        return out_fp32
    # Piece by piece of the output, every source in rank order: the same float32 products and additions as
    # dequantizing each row whole and adding it, without W - 1 dequantized copies of the chunk.
    scratch, limit = _Scratch(out_fp32.device), _piece_limit(received_q)
    for codes, scales, target in zip(_block_views(received_q, block), _scale_views(received_scales, chunk, block),
                                     _block_views(out_fp32.view(1, chunk), block)):
        for index in _piece_indices(target.shape, limit):
            piece = target[index]
            _product(codes[0:1][index], scales[0:1][index], piece, limit)
            for source in range(1, sources):  # (a loop over ranks, not blocks, in rank order)
                product = scratch.take(piece.shape)
                _product(codes[source : source + 1][index], scales[source : source + 1][index], product, limit)
                piece.add_(product)
    return out_fp32


# ---------------------------------------------------------------------- the vectorised core
def _check_block(block: int) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")


def _outputs(out: Optional[Tuple[torch.Tensor, torch.Tensor]], q_shape: Tuple[int, int],
             scales_shape: Tuple[int, int], device: torch.device, what: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``[R, n]`` int8 and ``[R, nb]`` float32 result buffers: new ones, or ``out`` viewed in those shapes."""
    if out is None:
        return (torch.empty(q_shape, dtype=torch.int8, device=device),
                torch.empty(scales_shape, dtype=SCALE_DTYPE, device=device))
    q, scales = out
    rows, n = q_shape
    if (q.dtype != torch.int8 or scales.dtype != SCALE_DTYPE or q.numel() != rows * n
            or scales.numel() != scales_shape[0] * scales_shape[1]
            or not (q.is_contiguous() and scales.is_contiguous())):
        raise ValueError(f"quantizing {what}: out must be contiguous int8 of {rows * n} and float32 of "
                         f"{scales_shape[0] * scales_shape[1]} elements, got {q.dtype} {tuple(q.shape)} and "
                         f"{scales.dtype} {tuple(scales.shape)}")
    return q.view(q_shape), scales.view(scales_shape)


def _block_views(rows_2d: torch.Tensor, block: int) -> List[torch.Tensor]:
    """``[R, n]`` as at most two ``[R, blocks, length]`` views: the full blocks, then the short last block."""
    rows, n = rows_2d.shape
    full = n // block
    views = []
    if full:
        views.append(rows_2d[:, : full * block].unflatten(1, (full, block)))
    if n - full * block:
        views.append(rows_2d[:, full * block:].unsqueeze(1))
    return views


def _scale_views(scales_2d: torch.Tensor, n: int, block: int) -> List[torch.Tensor]:
    """The ``[R, blocks]`` scales matching :func:`_block_views`'s parts."""
    full = n // block
    return [part for part, present in ((scales_2d[:, :full], full > 0), (scales_2d[:, full:], n - full * block > 0))
            if present]


def _piece_limit(t: torch.Tensor) -> int:
    """Elements per piece of the elementwise passes over ``t``: :data:`PIECE_ELEMENTS` on the CPU; on other devices
    (one kernel a pass is best) and for fake tensors (no data), the whole tensor."""
    return PIECE_ELEMENTS if t.device.type == "cpu" and not is_fake(t) else _WHOLE


def _piece_indices(shape: torch.Size, limit: int) -> Iterator[Tuple[slice, slice]]:
    """Indexes ``(rows, blocks)`` cutting a ``[R, blocks, length]`` view into pieces of whole blocks of about
    ``limit`` elements (at least one block): several rows a piece when rows are short, else parts of one row."""
    rows, blocks, length = shape
    if rows * blocks * length <= limit:
        yield slice(None), slice(None)
        return
    row_elements = blocks * length
    if row_elements >= limit:
        step = max(1, limit // length)
        for row in range(rows):
            for first in range(0, blocks, step):
                yield slice(row, row + 1), slice(first, first + step)
    else:
        step = limit // row_elements
        for first in range(0, rows, step):
            yield slice(first, first + step), slice(None)


class _Scratch:
    """One float32 buffer reused by every piece of a call (grown to the largest piece)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.buffer = device, None

    def take(self, shape: torch.Size) -> torch.Tensor:
        numel = math.prod(shape)
        if self.buffer is None or self.buffer.numel() < numel:
            self.buffer = torch.empty(numel, dtype=torch.float32, device=self.device)
        return self.buffer[:numel].view(shape)


def _quantize_rows(x2: torch.Tensor, block: int, q2: torch.Tensor, scales2: torch.Tensor, what: str,
                   propagate_non_finite: bool = False) -> None:
    """Quantize each row of ``x2`` ([R, n]) on its own into ``q2`` ([R, n] int8) and ``scales2`` ([R, nb])."""
    n = x2.shape[1]
    if n == 0:
        return
    limit = _piece_limit(x2)
    x_parts, q_parts = _block_views(x2, block), _block_views(q2, block)
    for values, scale in zip(x_parts, _scale_views(scales2, n, block)):  # (full blocks, the short last one)
        for index in _piece_indices(values.shape, limit):
            # no |x| temporary; both propagate nan; on the CPU amax and amin over [blocks, 256] beat aminmax 9x, on
            # other devices aminmax reads the data once
            piece = values[index]
            smallest, largest = (piece.amin(dim=-1), piece.amax(dim=-1)) if limit != _WHOLE else torch.aminmax(
                piece, dim=-1)
            torch.maximum(largest, smallest.neg_(), out=scale[index])  # the block's absmax (exact in float32)
    scales2.div_(QMAX)
    # the one check: a block's absmax is inf or nan iff it holds one (fake tensors, the planner's: no data to check)
    if not is_fake(scales2) and not bool(torch.isfinite(scales2).all()):
        if not propagate_non_finite:
            _raise_non_finite(x2, scales2, block, what)
        scales2.copy_(torch.where(torch.isfinite(scales2), scales2, torch.full_like(scales2, float("nan"))))
    # A block at float32's largest magnitude: round its scale down one step so that 127 * scale stays finite.
    overflows = torch.isinf(scales2 * QMAX)
    scales2.copy_(torch.where(overflows, torch.nextafter(scales2, torch.zeros_like(scales2)), scales2))
    # Zero scale (an all-zero block, or a subnormal one whose scale underflows): divide by 1, so q = round(x) = 0.
    divisors = torch.where(scales2 > 0, scales2, torch.ones_like(scales2))
    scratch = _Scratch(x2.device)
    for values, codes, divisor in zip(x_parts, q_parts, _scale_views(divisors, n, block)):
        for index in _piece_indices(values.shape, limit):
            quotient = scratch.take(values[index].shape)  # float32 (also for bf16 / fp16 values)
            if limit == _WHOLE:  # (one kernel converts on the fly)
                torch.div(values[index], divisor[index].unsqueeze(-1), out=quotient)
            else:  # (converted exactly first: the division makes no mixed-dtype temporary of its own)
                quotient.copy_(values[index])
                quotient.div_(divisor[index].unsqueeze(-1))
            codes[index].copy_(quotient.round_().clamp_(-QMAX, QMAX))


def _dequantize_rows(q2: torch.Tensor, scales2: torch.Tensor, block: int, out2: torch.Tensor) -> None:
    """``out2[r, i] = q2[r, i] * scales2[r, i // block]``, computed in float32, rounded once to ``out2``'s dtype."""
    n = q2.shape[1]
    if n == 0:
        return
    limit = _piece_limit(q2)
    # (CPU, another dtype than float32: the float32 product goes through the piece-sized scratch, then is rounded
    # into out2; on other devices one kernel computes in float32 and rounds on the fly)
    direct = out2.dtype == torch.float32 or limit == _WHOLE
    scratch = _Scratch(q2.device)
    for codes, scale, target in zip(_block_views(q2, block), _scale_views(scales2, n, block),
                                    _block_views(out2, block)):
        for index in _piece_indices(codes.shape, limit):
            piece = target[index]
            product = piece if direct else scratch.take(piece.shape)
            _product(codes[index], scale[index], product, limit)
            if not direct:
                piece.copy_(product)


def _product(codes: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, limit: int) -> None:
    """``out = codes * scale`` (``[.., blocks, length]`` int8, ``[.., blocks]`` float32), computed in float32.  In
    pieces (the CPU; ``out`` float32): two same-dtype steps, the codes converted exactly, then multiplied in float32,
    which is what ``torch.mul`` of int8 and float32 computes; on the CPU that mixed-dtype op converts into a
    temporary of its own, here ``out`` holds it.  Else ``torch.mul`` (one kernel converts on the fly)."""
    if limit == _WHOLE:
        torch.mul(codes, scale.unsqueeze(-1), out=out)
        return
    out.copy_(codes)
    out.mul_(scale.unsqueeze(-1))


def _raise_non_finite(x2: torch.Tensor, scales2: torch.Tensor, block: int, what: str) -> None:
    """The error for inf or nan in the data (its cost is paid only when raising)."""
    rows, n = x2.shape
    row, first_block = (int(i) for i in (~torch.isfinite(scales2)).nonzero()[0])
    lo = row * n + first_block * block
    hi = min(lo + block, (row + 1) * n)
    bad = int((~torch.isfinite(x2)).sum())
    raise ValueError(f"accel_flatshard int8 quantization of {what}: {bad} non-finite value(s) (inf or nan), the "
                     f"first block holding one is elements {lo}..{hi - 1} of {rows * n}; an int8 block cannot carry "
                     f"them (its scale would be inf or nan and wipe out the whole block)")
