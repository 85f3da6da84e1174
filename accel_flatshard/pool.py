"""Reuse of the engine's full-size host buffers (gathered parameters, full gradients) on gloo / CPU.

Every step gathers each unit twice and makes one full gradient per unit.  On CUDA the caching allocator reuses
the freed blocks; on the host glibc hands a freed block this large back to the kernel, and the next buffer faults
its pages in again (llama-40M, W=2: 34-47 ms of a 1.5 s step).  The pool keeps freed blocks and moves one into
the storage that needs memory (``swap_storage_memory``): a flat parameter's ``unsharded`` storage object stays
the same (its views and the tensors autograd saved keep pointing at it), only the memory behind it changes, as
with ``resize_``.  Full gradients are made in its blocks too (``flat_param._ParamViews``) and come back once
reduced, when nothing but the engine holds them.

The bound: at most ``max_free_blocks`` free blocks, the oldest freed first (the schedule's own bound:
``limit_all_gathers`` + root gathered units and ``max_pending_reductions`` full gradients alive at once).
"""
from __future__ import annotations

import collections
from typing import Callable, Deque, Optional

import torch

from ._compat import storage_use_count, swap_storage_memory


class BufferPool:
    """Free blocks, newest last; ``on_change(delta)`` hears every change of the free bytes (the memory planner)."""

    def __init__(self, max_free_blocks: int, on_change: Optional[Callable[[int], None]] = None) -> None:
        self._free: Deque[torch.UntypedStorage] = collections.deque()
        self.max_free_blocks, self.on_change = max_free_blocks, on_change
        self.requests = self.fresh_blocks = 0  # fills, and those no free block served (tests, benchmarks)

    @property
    def free_bytes(self) -> int:
        return sum(block.nbytes() for block in self._free)

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give the empty ``storage`` ``nbytes`` of memory: the newest free block of that size, else a new one."""
        self.requests += 1
        block = next((b for b in reversed(self._free) if b.nbytes() == nbytes), None)
        if block is None:
            self.fresh_blocks += 1
            storage.resize_(nbytes)
            return
        self._free.remove(block)
        swap_storage_memory(storage, block)
        self._changed(-nbytes)

    def tensor(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new 1-D tensor on a pooled block (it comes back by :meth:`give_back`)."""
        out = torch.empty(0, dtype=dtype, device=device)  # (its storage: a fake one under the planner's fake mode)
        self.fill(out.untyped_storage(), numel * dtype.itemsize)
        return out.resize_(numel)  # (the storage fits: no allocation; ``set_`` would leak it under fake mode)

    def release(self, storage: torch.UntypedStorage) -> None:
        """Take a storage's memory back; the storage is left empty, as after ``resize_(0)``."""
        block = torch.UntypedStorage(0, device=storage.device)
        swap_storage_memory(block, storage)
        self._free.append(block)
        self._changed(block.nbytes())
        self._drop(len(self._free) - self.max_free_blocks)

    def give_back(self, tensor: torch.Tensor) -> None:
        """A full gradient is reduced: its memory comes back if it is the only tensor on its whole storage (else
        it is left to its other holders)."""
        storage = tensor.untyped_storage()
        whole = tensor.storage_offset() == 0 and tensor.numel() * tensor.element_size() == storage.nbytes()
        if whole and storage_use_count(storage) == 2:  # (the tensor and ``storage``)
            self.release(storage)

    def _drop(self, count: int) -> None:
        """Free the ``count`` oldest free blocks."""
        for _ in range(max(count, 0)):
            self._changed(-self._free.popleft().nbytes())

    def _changed(self, delta: int) -> None:
        if self.on_change is not None:
            self.on_change(delta)
