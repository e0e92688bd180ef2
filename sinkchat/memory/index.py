"""The recall memory's index: per block, layer and KV head a few representative keys, in one growing buffer.

Why a buffer with room to grow (capacity doubling) and a moving front: blocks arrive one at a time and the budget
removes the oldest, so appending by `torch.cat` would copy the whole index at every block (at 100k tokens ~70 MB
per 64 tokens fed), and removing from the front is the common removal.
"""

from __future__ import annotations

import torch


class Index:
    """Rows [NB, M, H_kv, r, D] (`rows()`), one per block id in `ids`, oldest first."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.lo = self.hi = 0
        self.ids: list[int] = []

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def nbytes(self) -> int:
        """Bytes allocated (what RSS sees)."""
        return 0 if self.buf is None else self.buf.nbytes

    def rows(self) -> torch.Tensor:
        assert self.buf is not None
        return self.buf[self.lo : self.hi]

    def add(self, bid: int, reps: torch.Tensor) -> None:
        """Append block `bid`'s representatives [M, H_kv, r, D]."""
        n = self.hi - self.lo
        if self.buf is None or self.buf.shape[1:] != reps.shape or self.buf.dtype != reps.dtype:
            self.buf, self.lo, self.hi, n = reps.new_empty(16, *reps.shape), 0, 0, 0
        elif self.hi == self.buf.shape[0]:  # full: compact to the front, doubling when more than half is live
            size = self.buf.shape[0] * (2 if n > self.buf.shape[0] // 2 else 1)
            new = reps.new_empty(size, *reps.shape)
            new[:n] = self.buf[self.lo : self.hi]
            self.buf, self.lo, self.hi = new, 0, n
        self.buf[self.hi] = reps
        self.hi += 1
        self.ids.append(bid)

    def remove(self, bid: int) -> None:
        """Drop block `bid` (the oldest: the front moves; any other: the rows after it move up)."""
        if bid not in self.ids:
            return
        row = self.ids.index(bid)
        if row and self.buf is not None:
            self.buf[self.lo + row : self.hi - 1] = self.buf[self.lo + row + 1 : self.hi].clone()
            self.hi -= 1
        else:
            self.lo += 1
        self.ids.pop(row)
        if not self.ids:
            self.lo = self.hi = 0

    def clear(self) -> None:
        self.buf, self.lo, self.hi, self.ids = None, 0, 0, []
