"""Rectangle arithmetic: a 1-D range of a flattened tensor as a few chunks of the tensor's true shape.

A rank holds ``[start, end)`` of a parameter flattened in row-major order.  Checkpoints describe data
as rectangular chunks (offsets and sizes per dimension) of the real shape, so the range is cut into at
most ``2 * ndim - 1`` chunks, each of which is itself a contiguous run of the flattened tensor::

    shape (4, 5), range [7, 18):        row 1, cols 2..4   -> offsets (1, 2) sizes (1, 3)
                                        rows 2..2, all     -> offsets (2, 0) sizes (1, 5)
                                        row 3, cols 0..2   -> offsets (3, 0) sizes (1, 3)

Pure functions, no torch.distributed.

Example::

    >>> [(c.offsets, c.sizes, c.flat_start) for c in range_to_chunks(7, 18, (4, 5))]
    [((1, 2), (1, 3), 7), ((2, 0), (1, 5), 10), ((3, 0), (1, 3), 15)]
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

Shape = Tuple[int, ...]


@dataclass(frozen=True)
class Chunk:
    """A rectangle of a tensor: ``offsets``/``sizes`` per dimension; ``flat_start`` is the flattened
    index of its first element (every chunk made here covers ``[flat_start, flat_start + numel)``)."""

    offsets: Shape
    sizes: Shape
    flat_start: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def range_to_chunks(start: int, end: int, shape: Sequence[int]) -> List[Chunk]:
    """Cut the flattened range ``[start, end)`` of a row-major tensor of ``shape`` into rectangles.

    The chunks are in flattened order, disjoint, and together cover exactly the range.
    """
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    if not 0 <= start <= end <= numel:
        raise ValueError(f"range [{start}, {end}) is outside a tensor of shape {shape} ({numel} elements)")
    if end == start:
        return []
    if not shape:
        return [Chunk((), (), 0)]
    out = []
    flat = start
    for offsets, sizes in _rects(start, end, shape):
        out.append(Chunk(offsets, sizes, flat))
        flat += math.prod(sizes)
    return out


def _rects(start: int, end: int, shape: Shape) -> Iterator[Tuple[Shape, Shape]]:
    if len(shape) == 1:
        yield (start,), (end - start,)
        return
    inner = math.prod(shape[1:])
    rest_zero = (0,) * (len(shape) - 1)
    first_row, first_col = divmod(start, inner)
    last_row, last_col = divmod(end, inner)
    if first_row == last_row:  # inside one row
        for off, size in _rects(first_col, last_col, shape[1:]):
            yield (first_row,) + off, (1,) + size
        return
    if first_col:
        for off, size in _rects(first_col, inner, shape[1:]):
            yield (first_row,) + off, (1,) + size
        first_row += 1
    if last_row > first_row:
        yield (first_row,) + rest_zero, (last_row - first_row,) + shape[1:]
    if last_col:
        for off, size in _rects(0, last_col, shape[1:]):
            yield (last_row,) + off, (1,) + size


def flat_index(offsets: Sequence[int], shape: Sequence[int]) -> int:
    """Row-major flattened index of the element at ``offsets``."""
    index = 0
    for off, dim in zip(offsets, shape):
        index = index * dim + off
    return index


def intersect(
    a_offsets: Sequence[int], a_sizes: Sequence[int], b_offsets: Sequence[int], b_sizes: Sequence[int]
) -> Optional[Tuple[Shape, Shape]]:
    """The intersection of two rectangles as ``(offsets, sizes)``, or None when it is empty."""
    lo, size = [], []
    for ao, asz, bo, bsz in zip(a_offsets, a_sizes, b_offsets, b_sizes):
        low = max(ao, bo)
        high = min(ao + asz, bo + bsz)
        if high <= low:
            return None
        lo.append(low)
        size.append(high - low)
    return tuple(lo), tuple(size)


def check_tiling(shape: Sequence[int], chunks: Sequence[Tuple[Sequence[int], Sequence[int]]]) -> Optional[str]:
    """None when ``chunks`` (offsets, sizes) tile a tensor of ``shape`` exactly; otherwise what is wrong.

    Exact for chunks that are contiguous runs of the flattened tensor (every chunk this package
    writes); for other rectangles it checks bounds and total volume only.
    """
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    runs = []
    for offsets, sizes in chunks:
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            return f"chunk at {tuple(offsets)} has rank {len(offsets)}, tensor has rank {len(shape)}"
        for o, s, d in zip(offsets, sizes, shape):
            if o < 0 or s < 0 or o + s > d:
                return f"chunk at {tuple(offsets)} of size {tuple(sizes)} exceeds shape {shape}"
        runs.append((flat_index(offsets, shape), math.prod(sizes), _is_flat_contiguous(sizes, shape)))
    total = sum(n for _, n, _ in runs)
    if total != numel:
        return f"chunks cover {total} elements, tensor has {numel}"
    if all(c for _, _, c in runs):
        cursor = 0
        for start, n, _ in sorted(runs):
            if start != cursor:
                return f"chunks overlap or leave a gap at flattened index {min(start, cursor)}"
            cursor += n
    return None


def _is_flat_contiguous(sizes: Sequence[int], shape: Sequence[int]) -> bool:
    """True when a rectangle of ``sizes`` is one contiguous run of the flattened tensor."""
    # Contiguous iff, after the first dimension whose size exceeds 1, every later dimension is full.
    seen_partial = False
    for s, d in zip(sizes, shape):
        if seen_partial and s != d:
            return False
        if s > 1:
            seen_partial = True
    return True
