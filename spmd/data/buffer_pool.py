"""Batch buffers that are used again once nothing refers to them.

Why: a batch buffer goes to XLA without a copy (it aliases 64-byte aligned host arrays), so
it cannot be reused on a fixed schedule. But a fresh buffer of a MiB or more per step, made
in a read thread, takes a page fault for each of its 4 KiB pages on every step (glibc gives
the freed memory of a thread's arena back to the kernel): measured 80-160 faults and
150-300 µs per 1 MiB step on a 2-core VM, a third of reading the step. The pool keeps the
memory of its buffers and hands a buffer out again only when no array refers to it.

Invariants:
- A buffer still referred to (by a view of it, or by an array built on it without a copy,
  e.g. a jax.Array that aliases it) is never handed out: CPython's reference count of the
  buffer's owner is back to the pool's own only when every such array is gone.
- Every buffer is `align`-byte aligned and C-contiguous; its contents are undefined.
- At most `spare` unused buffers of a size are kept, and at most `sizes` sizes (the least
  recently asked for go first): the pool holds what its callers use at their peak plus
  that.
"""

from __future__ import annotations

import collections
import sys
import threading
from typing import Any

import numpy as np

__all__ = ["BufferPool"]


class BufferPool:
    """`empty(shape, dtype)` like `np.empty`, aligned, from memory used before."""

    def __init__(self, align: int = 64, spare: int = 2, sizes: int = 16):
        self.align, self.spare, self.sizes = int(align), int(spare), int(sizes)
        self._lock = threading.Lock()
        self._owners: collections.OrderedDict[int, list[np.ndarray]] = \
            collections.OrderedDict()           # bytes -> the buffers' owning arrays
        self.made = self.reused = 0

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        with self._lock:
            owners = self._owners.get(nbytes)
            if owners is None:
                owners = self._owners[nbytes] = []
                while len(self._owners) > self.sizes:
                    self._owners.popitem(last=False)
            else:
                self._owners.move_to_end(nbytes)
            free = [i for i in range(len(owners)) if sys.getrefcount(owners[i]) == 2]
            for i in reversed(free[1 + self.spare:]):      # too many unused: let them go
                del owners[i]
            if free:
                owner = owners[free[0]]
                self.reused += 1
            else:
                owner = np.empty(nbytes + self.align, np.uint8)
                owners.append(owner)
                self.made += 1
        start = -owner.ctypes.data % self.align
        return owner[start:start + nbytes].view(dtype).reshape(shape)
