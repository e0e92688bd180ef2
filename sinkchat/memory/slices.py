"""Recalled blocks in RAM: an LRU of per-layer slices (keys at the recall position, and values) in one slab
allocated once, `--memory-ram` MB.

Why per layer: each layer chooses its own blocks, so a call touches up to layers x top-k (block, layer) pairs, not
whole blocks; caching whole blocks (all layers, ~1.5 MB each on the bundled model) fit 21 of them in 64 MB and a
decode step missed ~10 a token (measured: 4.9 tok/s against 58.5 without memory). A slice is ~49 KB there.
Why a slab: slices as tensors of their own came and went by the thousand, and the heap they left grew RSS past what
the cache counted (streaming 20k tokens: +42 MB with a 1 MB cache, more with 64 MB); slots of one preallocated
tensor are reused in place. A call asks for all its slices at once; a block missing from the cache has only the
layers asked for read (once).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

from sinkchat.memory.blocks import rotate

Reader = Callable[[int, list[int]], tuple[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]]


class SliceCache:
    """(block id, layer) -> a slot of `slab` [slots, 2, H_kv, n, D] (keys at `positions[slot]`, values), least
    recently used first; `limit_bytes` sizes the slab (at least `least` slots: one call's worth)."""

    def __init__(self, limit_bytes: int, inv_freqs: list[torch.Tensor], least: int = 1) -> None:
        self.limit, self.least = limit_bytes, least
        self.inv_freqs = inv_freqs
        self.items: OrderedDict[tuple[int, int], int] = OrderedDict()  # key -> slot
        self.positions: list[int] = []
        self.free: list[int] = []
        self.slab: torch.Tensor | None = None
        self.misses = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the slots in use (the slab itself is allocated once: `slab.nbytes`)."""
        return 0 if self.slab is None else len(self.items) * self.slab[0].nbytes

    def _ensure(self, like: torch.Tensor) -> None:
        """The slab, made at the first slice (its shape and dtype known then)."""
        if self.slab is not None and self.slab.shape[2:] == like.shape and self.slab.dtype == like.dtype:
            return
        slot = 2 * like.nbytes
        n = max(self.least, self.limit // slot)
        self.slab = torch.empty(n, 2, *like.shape, dtype=like.dtype)  # [slots, 2, H_kv, n, D]
        self.items.clear()
        self.positions, self.free = [0] * n, list(range(n - 1, -1, -1))

    def get_many(self, pairs: list[tuple[int, int]], position: int, dtype: torch.dtype, read: Reader
                 ) -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]:
        """Views (keys at `position`, values) of the (block id, memory layer) slices a call needs: hits from the
        slab, each missing block's needed layers read once (`read(bid, layers)` -> (position its keys sit at,
        {layer: (k, v)}); StoreError propagates). The views are valid until the next call (copy them at once)."""
        want = list(dict.fromkeys(pairs))
        missing: dict[int, list[int]] = {}
        for bid, layer in want:
            if (bid, layer) in self.items:
                self.items.move_to_end((bid, layer))
            else:
                missing.setdefault(bid, []).append(layer)
        for bid, layers in missing.items():
            self.misses += 1
            at, kv = read(bid, layers)
            for layer, (k, v) in kv.items():
                self._store((bid, layer), k.to(dtype), v.to(dtype), at, keep=want)
        out = {}
        for key in want:
            slot = self.items[key]
            if self.positions[slot] != position:  # the recall position moved (a prefix pinned since): re-rotate
                assert self.slab is not None
                k = self.slab[slot, 0]
                shift = torch.full((k.shape[1],), position - self.positions[slot], dtype=torch.int64)
                k.copy_(rotate(k, self.inv_freqs[key[1]], shift))
                self.positions[slot] = position
            assert self.slab is not None
            out[key] = (self.slab[slot, 0], self.slab[slot, 1])
        return out

    def _store(self, key: tuple[int, int], k: torch.Tensor, v: torch.Tensor, at: int,
               keep: list[tuple[int, int]]) -> None:
        """Put a slice in a free slot, or the least recently used one not wanted by this call."""
        self._ensure(k)
        assert self.slab is not None
        if not self.free:
            wanted = set(keep)
            old = next((key0 for key0 in self.items if key0 not in wanted), None)
            if old is None:
                raise RuntimeError("the recall memory's RAM cache is smaller than one call's slices")
            self.free.append(self.items.pop(old))
        slot = self.free.pop()
        self.slab[slot, 0].copy_(k)
        self.slab[slot, 1].copy_(v)
        self.positions[slot] = at
        self.items[key] = slot

    def drop(self, bid: int) -> None:
        for key in [key for key in self.items if key[0] == bid]:
            self.free.append(self.items.pop(key))

    def clear(self) -> None:
        self.free.extend(self.items.values())
        self.items.clear()
