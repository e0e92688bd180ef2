"""The sink cache for hybrid models (Gemma 2 / 3): full-attention (global) layers and sliding-window (local) layers.

Global layers keep the sink policy's slots exactly as in `SinkKVCache`. A local layer with window W (a query sees
itself and the W - 1 tokens before it) keeps only what its window can still see:

- W < capacity: a `WindowLayer`, the last W - 1 tokens *of the stream* at their true distances from the current
  token. That is exactly what the trained model's local layers see at any length, and it costs W - 1 (+ one chunk)
  slots instead of `capacity`. The policy's evictions do not remove anything from it; they only shift positions.
- W >= capacity: the window cannot hide any slot of the cache, so the local layer simply holds the global policy's
  kept set (a `SinkLayer` that says it slides). A ring would hold at least as many slots as the cache and see
  tokens the global layers no longer hold; sharing the kept set is smaller and is the very treatment sinkchat
  already gives a model whose every layer slides (Mistral: the cache is capped at the window).

Whenever the local window lies inside the global window (the usual case: cache 2048, W 512 or 1024, a chunk
of at most 256), both readings agree with transformers' forward over the kept tokens at in-cache positions.

One position for the current token in every layer: the global cache's length. When the policy evicts `count`
slots, in-cache positions move down by `count`, so every layer's kept keys are re-rotated by -count, each with its
own RoPE (Gemma 3: local base 10k unscaled, global 1M with linear scaling): local layers keep exact relative
distances. A ring's position can go below the sinks' (even negative): RoPE only sees differences, and
transformers builds the sliding mask from `get_mask_sizes` offsets, which may be negative.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any

import torch

from sinkchat.core.kv_cache import LAYER_CLASSES, Scratch, SinkKVCache, SinkLayer, TransformersBase
from sinkchat.model.rope import Rope
from sinkchat.model.spec import ModelSpec
from sinkchat.textutil import plural

log = logging.getLogger(__name__)


class WindowLayer(TransformersBase):
    """A local layer's keys/values: the last `window - 1` tokens of the stream, in stream order. A transformers
    `CacheLayerMixin` (`TransformersBase`).

    The buffer holds slots [floor, end) valid; the visible ones (what the next query sees besides itself) are the
    last `keep` of them. Appends go at `end`; when the buffer is full the visible slots move to the front (one copy
    of `keep` slots every `slack` tokens). `length` is the in-cache position of the next token, the global cache's
    length: transformers reads it for the position ids and the mask's query offset."""

    _transformers_base = "CacheLayerMixin"
    is_compileable = False
    is_sliding = True
    is_croppable = False

    def __init__(self, window: int, dtype: torch.dtype | None = None, **kwargs: object) -> None:
        self.keys: torch.Tensor | None = None  # (what CacheLayerMixin.__init__ sets)
        self.values: torch.Tensor | None = None
        self.is_initialized = False
        self.window = window
        self.keep = window - 1
        self.slack = max(16, window // 4)  # appended slots between compactions
        self.store_dtype = dtype
        self.capacity = 0
        self.length = 0
        self.end = self.floor = 0
        self.dropped = 0  # stream tokens (since the last reset) no longer held: a rollback past them is not exact
        self.scratch: Scratch | None = None  # the cache's shared temporaries (HybridKVCache sets them)

    @property
    def visible(self) -> int:
        return min(self.end - self.floor, self.keep)

    @property
    def lo(self) -> int:
        """The first visible slot: the visible ones are [lo, end)."""
        return self.end - self.visible

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._alloc(key_states, value_states, self.keep + max(key_states.shape[-2], self.slack))
        self.is_initialized = True

    def _alloc(self, like_k: torch.Tensor, like_v: torch.Tensor, capacity: int) -> None:
        b, h, _, dk = like_k.shape
        dt = self.store_dtype or like_k.dtype
        self.keys = like_k.new_zeros(b, h, capacity, dk, dtype=dt)  # [B, H_kv, cap, D]
        self.values = like_v.new_zeros(b, h, capacity, like_v.shape[-1], dtype=dt)
        self.capacity = capacity

    def _make_room(self, q: int, scratch: Scratch) -> None:
        """Room for `q` more slots: move the visible ones to the front (or into a larger buffer)."""
        if self.end + q <= self.capacity:
            return
        n, src = self.visible, self.lo
        k, v = self.keys[:, :, src : self.end], self.values[:, :, src : self.end]  # [B, H_kv, n, D]
        if n + q > self.capacity:  # a chunk larger than any before: grow once
            old_k, old_v = k, v
            self._alloc(old_k, old_v, n + q + self.slack)
            self.keys[:, :, :n], self.values[:, :, :n] = old_k, old_v
        else:  # source and destination may overlap: via a copy
            self.keys[:, :, :n].copy_(scratch.take("ring", k).copy_(k))
            self.values[:, :, :n].copy_(scratch.take("ring", v).copy_(v))
        self.dropped += src - self.floor
        self.floor, self.end = 0, n

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k/v [B, H_kv, q, D]; return the visible slots plus the new ones [B, H_kv, visible + q, D]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        self._make_room(q, self.scratch or Scratch())
        lo = self.lo  # before the append: what the new tokens see besides each other
        self.keys[:, :, self.end : self.end + q] = key_states
        self.values[:, :, self.end : self.end + q] = value_states
        self.end += q
        self.length += q
        k, v = self.keys[:, :, lo : self.end], self.values[:, :, lo : self.end]
        if k.dtype != key_states.dtype:
            k, v = k.to(key_states.dtype), v.to(value_states.dtype)
        return k, v

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(keys returned by the next update, in-cache position of the first of them): the visible slots sit right
        before the current position."""
        n = self.visible
        return n + query_length, self.length - n

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.window

    def evict(self, start: int, count: int, rope: Rope | None, scratch: Scratch | None = None) -> None:
        """The global cache dropped `count` slots: positions move down by `count`. Nothing leaves the window; the
        visible keys are re-rotated by -count (with this layer's RoPE) so their distances to the next query stay
        exact. Slots before the visible ones are given up (they would need the same rotation)."""
        if count <= 0:
            return
        self.length -= count
        if not self.is_initialized:
            return
        lo = self.lo
        self.dropped += lo - self.floor
        self.floor = lo
        if rope is None or lo == self.end:
            return
        scratch = scratch or Scratch()
        k = self.keys[:, :, lo : self.end]  # [B, H_kv, n, D]
        k32 = k if k.dtype == torch.float32 else scratch.take("k32", k, torch.float32).copy_(k)
        k.copy_(rope.rotate_into(k32, -count, scratch.take("rot32", k, torch.float32)))

    def can_truncate(self, length: int) -> bool:
        """Whether dropping the tokens from position `length` on leaves exactly the window the layer had there."""
        removed = self.length - length
        held = self.end - removed - self.floor
        return removed <= 0 or (held >= 0 and (self.dropped == 0 or held >= self.keep))

    def truncate(self, length: int) -> None:
        """Forget the tokens from position `length` on (a rolled-back step)."""
        removed = self.length - length
        if removed > 0:
            self.end = max(self.floor, self.end - removed)
            self.length = length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        self.truncate(self.length + tokens_to_remove)

    def reset(self) -> None:
        self.length = self.end = self.floor = self.dropped = 0

    def live(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the visible keys and values [B, H_kv, visible, D]."""
        return self.keys[:, :, self.lo : self.end], self.values[:, :, self.lo : self.end]

    def next_slot_views(self, scratch: Scratch) -> tuple[torch.Tensor, torch.Tensor]:
        """For a token written in place (the native step): room for it, then views of the visible slots plus its
        own, last ([B, H_kv, visible + 1, D], always inside the buffer); `advance(1)` then counts it."""
        self._make_room(1, scratch)
        return self.keys[:, :, self.lo : self.end + 1], self.values[:, :, self.lo : self.end + 1]

    def advance(self, n: int) -> None:
        """Count `n` tokens written in place after the held ones (one, where `next_slot_views` made room)."""
        self.length += n
        self.end += n

    def restored(self, length: int) -> None:
        """After `load_state` wrote the saved visible slots: the current position is the global `length`, and a ring
        saved full may have dropped older tokens, so a rollback past its window is refused."""
        self.length = length
        self.dropped = int(self.visible >= self.keep)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes if self.is_initialized else 0

    @property
    def used_nbytes(self) -> int:
        return self.nbytes * self.visible // self.capacity if self.capacity else 0


LAYER_CLASSES.append(WindowLayer)


class HybridKVCache(SinkKVCache):
    """Global `SinkLayer`s plus local `WindowLayer`s (or sliding `SinkLayer`s, see the module doc), one RoPE per
    layer. The ledger and the eviction events describe the global layers; `length` is theirs."""

    def __init__(self, kinds: list[str], capacity: int, ropes: list[Rope], window: int, rerotate: bool = True,
                 dtype: torch.dtype | None = None) -> None:
        shared = window >= capacity
        layers: list[Any] = [
            SinkLayer(capacity, dtype) if kind == "full" else SinkLayer(capacity, dtype, sliding=True) if shared
            else WindowLayer(window, dtype) for kind in kinds]
        glob = [i for i, kind in enumerate(kinds) if kind == "full"]
        super().__init__(len(layers), capacity, ropes[glob[0]], rerotate, dtype, layers=layers, ropes=ropes)
        self.window = window
        self.global_idx = glob
        self.local_idx = [i for i, kind in enumerate(kinds) if kind != "full"]
        for layer in self.layers:
            if isinstance(layer, WindowLayer):
                layer.scratch = self.scratch  # one set of temporaries for every layer's compactions

    @property
    def length(self) -> int:
        return self.layers[self.global_idx[0]].length

    @property
    def rings(self) -> bool:
        """Whether the local layers keep windows of their own (else they share the global slots)."""
        return any(isinstance(layer, WindowLayer) for layer in self.layers)

    def can_truncate(self, length: int) -> bool:
        return all(layer.can_truncate(length) for layer in self.layers if isinstance(layer, WindowLayer))

    def buffers(self, n_kv: int, head_dim: int, device: torch.device, dtype: torch.dtype
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """For the native step's next token (`advance(1)` counts it): a global or shared layer's whole buffer
        [1, H_kv, cap, D] (the token writes slot `length` and attends to 0..length); a ring's view of the slots the
        token attends to, its own slot last ([1, H_kv, visible + 1, D], strided: always shorter than its buffer),
        after making room for it."""
        for layer in self.layers:
            if not layer.is_initialized:
                empty = torch.empty(1, n_kv, 0, head_dim, device=device, dtype=dtype)  # [B, H_kv, 0, D]
                layer.lazy_initialization(empty, empty)
        views = [layer.next_slot_views(self.scratch) if isinstance(layer, WindowLayer) else (layer.keys, layer.values)
                 for layer in self.layers]
        return [k for k, _ in views], [v for _, v in views]

    def advance(self, n: int) -> None:
        """Count `n` tokens written in place (one: only `buffers` made room in the rings)."""
        if n != 1 and self.rings:
            raise RuntimeError("a hybrid cache's rings take one token written in place at a time")
        super().advance(n)

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """`SinkKVCache.load_state`, then each ring learns the current position. A ring saved full may have
        dropped older tokens: it is marked so, and a rollback past its window is then refused."""
        super().load_state(state)
        for layer in self.layers:
            if isinstance(layer, WindowLayer):
                layer.restored(self.length)

    def layout(self, length: int | None = None, stream: int | None = None) -> str:
        """For status lines: "global 6 layers 1024/1024, local 20 layers 511/511" (a ring's held tokens out of
        window - 1), or "..., local 20 layers shared" when the window cannot bite inside the cache. `length` /
        `stream` (tokens in the cache / fed since the stream began) from a ledger reading: the layers' own lengths
        run ahead of the ledger while a chunk is computed, one layer after another."""
        def layers(n: int) -> str:
            return plural(n, 'layer')

        length = self.length if length is None else length
        g = f"global {layers(len(self.global_idx))} {length}/{self.capacity}"
        ring = next((layer for layer in self.layers if isinstance(layer, WindowLayer)), None)
        if ring is None:
            return f"{g}, local {layers(len(self.local_idx))} shared"
        seen = ring.visible if stream is None else min(ring.visible, stream)
        return f"{g}, local {layers(len(self.local_idx))} {min(seen, ring.keep)}/{ring.keep}"


def local_layout(spec: ModelSpec, capacity: int) -> str:
    """How a cache of `capacity` holds this model's local layers: "none" (not hybrid), "shared" or "ring"."""
    window = spec.local_window
    return "none" if window is None else "shared" if window >= capacity else "ring"


def make_cache(spec: ModelSpec, capacity: int, rerotate: bool = True, dtype: torch.dtype | None = None
               ) -> SinkKVCache:
    """The cache for this model: a `SinkKVCache`, or for a hybrid model a `HybridKVCache`."""
    ropes = spec.ropes()
    if not spec.hybrid:
        return SinkKVCache(spec.n_layers, capacity, ropes[0], rerotate, dtype, ropes=ropes)
    window = spec.local_window
    assert window is not None
    return _transformers_hybrid()([layer.attention for layer in spec.layers], capacity, ropes, window, rerotate, dtype)


@lru_cache(maxsize=1)
def _transformers_hybrid() -> type:
    """`HybridKVCache` with transformers' `Cache` as a real base: transformers' masks take the first full-attention
    layer's sizes only from a cache that `isinstance(cache, Cache)` (else layer 0, a local one here). Hybrid models
    (Gemma 2 / 3) always load through transformers, so importing it here costs nothing."""
    from transformers.cache_utils import Cache

    from sinkchat.core.kv_cache import transformers_class

    transformers_class("Cache")  # registers the layer classes as CacheLayerMixins
    return type("HybridKVCache", (HybridKVCache, Cache), {"__doc__": HybridKVCache.__doc__,
                                                          "__module__": HybridKVCache.__module__})
