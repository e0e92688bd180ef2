"""Recalled blocks in RAM: an LRU of per-layer slices (keys rotated to the recall position, and values), bounded in
bytes (`--memory-ram`).

Why per layer: each layer chooses its own blocks, so a call touches up to layers x top-k (block, layer) pairs, not
whole blocks; caching whole blocks (all layers, ~1.5 MB each on the bundled model) fit 21 of them in 64 MB and a
decode step missed ~10 a token (measured: 4.9 tok/s against 58.5 without memory). A slice is ~49 KB there.
A miss reads the block once from the store and keeps every layer's slice (most layers recall the same blocks).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

from sinkchat.memory.blocks import Block, rotate


class SliceCache:
    """(block id, layer) -> (keys at `position` [H_kv, n, D], values [H_kv, n, D]), least recently used first."""

    def __init__(self, limit_bytes: int, inv_freqs: list[torch.Tensor]) -> None:
        self.limit = limit_bytes
        self.inv_freqs = inv_freqs
        self.items: OrderedDict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, int]] = OrderedDict()
        self.nbytes = 0
        self.misses = 0

    def get(self, bid: int, layer: int, position: int, dtype: torch.dtype, read: Callable[[int], Block]
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block `bid`'s slice of memory layer `layer`, keys rotated to `position`; `read` loads a block on a miss
        (StoreError propagates)."""
        hit = self.items.get((bid, layer))
        if hit is None:
            self.misses += 1
            block = read(bid)
            order = [i for i in range(block.keys.shape[0]) if i != layer] + [layer]  # the one asked for last: kept
            for i in order:  # every layer's slice, at the position the block was stored at
                self._put((bid, i), (block.keys[i].to(dtype), block.values[i].to(dtype), int(block.slots[0])))
            hit = self.items[(bid, layer)]
        self.items.move_to_end((bid, layer))
        k, v, at = hit
        if at != position:  # the recall position moved (a prefix pinned since): one uniform re-rotation
            n = k.shape[1]
            k = rotate(k, self.inv_freqs[layer], torch.full((n,), position - at, dtype=torch.int64)).to(dtype)
            self._put((bid, layer), (k, v, position))
        return k, v

    def _put(self, key: tuple[int, int], entry: tuple[torch.Tensor, torch.Tensor, int]) -> None:
        old = self.items.pop(key, None)
        if old is not None:
            self.nbytes -= old[0].nbytes + old[1].nbytes
        self.items[key] = entry
        self.nbytes += entry[0].nbytes + entry[1].nbytes
        while self.nbytes > self.limit and len(self.items) > 1:
            _, (k, v, _) = self.items.popitem(last=False)
            self.nbytes -= k.nbytes + v.nbytes

    def drop(self, bid: int) -> None:
        for key in [key for key in self.items if key[0] == bid]:
            k, v, _ = self.items.pop(key)
            self.nbytes -= k.nbytes + v.nbytes

    def clear(self) -> None:
        self.items.clear()
        self.nbytes = 0
