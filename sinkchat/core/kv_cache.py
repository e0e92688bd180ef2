"""The attention-sink KV cache, built on transformers' public `Cache` / `CacheLayerMixin` API (deferred: see
`TransformersBase`).

Design (gpt-fast / mlx-lm style): each layer owns a preallocated `[B, H_kv, capacity, D]` buffer and a length. The
Engine evicts *between* forward calls, so during a forward `update` only appends, and `get_seq_length` /
`get_mask_sizes` (read by transformers before `update`) already describe the post-eviction state. Eviction removes a
block of slots and shifts the later slots down; because positions are in-cache (slot i = RoPE position i), the shifted
keys are re-rotated by -count in fp32 so the buffer equals what keys computed at their new positions would be.

Re-rotation error does not accumulate without bound: a key is rotated at most once per eviction it survives, i.e. at
most capacity / evict_chunk times before it leaves the cache, and sinks (slots < n_sink) are never rotated.
"""

from __future__ import annotations

import inspect
import logging
import mmap
import sys
from typing import Any

import torch

from sinkchat.kernels import native
from sinkchat.core.cache_policy import Eviction
from sinkchat.model.rope import Rope

log = logging.getLogger(__name__)


class TransformersBase:
    """transformers' `Cache` (`CacheLayerMixin` for a layer, `_transformers_base`) as this class's base, deferred
    until transformers is imported: an attribute this class does not define is transformers' own implementation
    (`update`, `get_seq_length`, `get_mask_sizes`, `is_sliding`, ... over `self.layers`), bound to this object, and
    the layer classes are registered as `CacheLayerMixin`s (an ABC: `Cache`'s methods check their layers with
    isinstance). Before transformers is imported nothing can call that API: a start on the native kernels
    (`gguf_light`) never imports transformers (1.1 s of a 3-6 s start on a busy 2-core box).

    Why not a plain subclass: `core/gauge.py` and the engine import these classes whatever the model, and a class's
    bases must exist when it is defined. A hybrid model's cache (always a transformers model) is a real `Cache`
    subclass (`hybrid_cache.make_cache`): transformers finds its first full-attention layer through `isinstance`."""

    _transformers_base = "Cache"

    def __getattr__(self, name: str) -> Any:
        base = transformers_class(type(self)._transformers_base) if not name.startswith("__") else None
        if base is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        try:
            attr = inspect.getattr_static(base, name)
        except AttributeError:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}") from None
        return attr.__get__(self, type(self)) if hasattr(attr, "__get__") else attr


LAYER_CLASSES: list[type] = []  # registered as transformers' CacheLayerMixin once transformers is imported


def transformers_class(name: str) -> type | None:
    """transformers' `cache_utils.<name>` if transformers is imported (never imports it first), else None."""
    if "transformers" not in sys.modules:
        return None
    from transformers import cache_utils

    for cls in LAYER_CLASSES:
        if not issubclass(cls, cache_utils.CacheLayerMixin):
            cache_utils.CacheLayerMixin.register(cls)
    return getattr(cache_utils, name)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.zeros(shape)`, on the CPU in fresh anonymous pages (a private mmap) that the kernel zeroes and maps
    when first touched, so nothing is written now: every slot still reads 0, as from `torch.zeros`.

    Why: `torch.zeros` writes every byte at once, and a cache is written slot by slot as the stream grows. The
    bundled model's 2,048-slot cache is 45 MiB in 60 buffers; zero-filling them was 0.26 s of a piped chat's first
    reply on the busy 2-core box (cProfile: `new_zeros`), for slots a short chat never reaches. The pages come into
    RSS as the cache fills (all of them once it is full, as before). Off the CPU, or empty: `torch.zeros`."""
    size = torch.Size(shape)
    nbytes = size.numel() * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(size, dtype=dtype, device=device)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype, count=size.numel()).view(size)  # (holds `pages` while it lives)


class Scratch:
    """Temporaries for evictions, kept between them: one flat buffer per role, viewed to the shape needed."""

    def __init__(self) -> None:
        self.bufs: dict[str, torch.Tensor] = {}

    def take(self, role: str, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or like.dtype
        buf = self.bufs.get(role)
        if buf is None or buf.numel() < like.numel() or buf.dtype != dtype or buf.device != like.device:
            buf = self.bufs[role] = torch.empty(like.numel(), dtype=dtype, device=like.device)
        return buf[: like.numel()].view(like.shape)


class SinkLayer(TransformersBase):
    """One layer's keys/values in a fixed buffer of `capacity` slots; `length` slots are live. A transformers
    `CacheLayerMixin` (`TransformersBase`)."""

    _transformers_base = "CacheLayerMixin"
    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, capacity: int, dtype: torch.dtype | None = None, sliding: bool = False, **kwargs: object
                 ) -> None:
        """`dtype`: what the buffers store (None: whatever the model computes in). `sliding`: a local layer of a
        hybrid model whose window is no smaller than the cache (so it never bites inside it): it holds the same
        slots as the global layers, and says it slides so transformers sizes its sliding mask from it."""
        self.keys: torch.Tensor | None = None  # (what CacheLayerMixin.__init__ sets)
        self.values: torch.Tensor | None = None
        self.is_initialized = False
        self.is_sliding = sliding
        self.capacity = capacity
        self.length = 0
        self.store_dtype = dtype
        self.base = 0  # slots reserved in front of the stream for recalled memory (`reserve`); slot i is at base + i
        self.used = 0  # of those, how many (the last `used` before the stream) the next forward attends to

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        b, h, _, dk = key_states.shape
        dv = value_states.shape[-1]
        dt = self.store_dtype or key_states.dtype
        self.keys = lazy_zeros((b, h, self.base + self.capacity, dk), dt, key_states.device)  # [B, H_kv, base+cap, D]
        self.values = lazy_zeros((b, h, self.base + self.capacity, dv), dt, value_states.device)
        self.is_initialized = True

    def reserve(self, slots: int) -> None:
        """Keep `slots` in front of the stream for recalled memory (before the buffers exist: a fresh cache)."""
        if self.is_initialized:
            raise RuntimeError("reserve memory slots before the cache is first written")
        self.base = slots

    def region(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The recalled-memory slots the next forward attends to: views [B, H_kv, used, D] just before the stream."""
        return self.keys[:, :, self.base - self.used : self.base], self.values[:, :, self.base - self.used : self.base]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k/v [B, H_kv, q, D]; return views of all live slots [B, H_kv, length, D]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        end = self.length + q
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow ({end} > {self.capacity}): evict before the forward pass")
        b0 = self.base
        self.keys[:, :, b0 + self.length : b0 + end] = key_states
        self.values[:, :, b0 + self.length : b0 + end] = value_states
        self.length = end
        k, v = self.keys[:, :, b0 - self.used : b0 + end], self.values[:, :, b0 - self.used : b0 + end]
        if k.dtype != key_states.dtype:  # a bf16 cache under an fp32 model: attention computes in the model's dtype
            k, v = k.to(key_states.dtype), v.to(value_states.dtype)
        return k, v

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Recalled slots come first in what `update` returns, at mask indices -used..-1: before every query."""
        return self.used + self.length + query_length, -self.used

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def evict(self, start: int, count: int, rope: Rope | None, scratch: "Scratch | None" = None) -> None:
        """Drop slots [start, start+count); move the later ones down and re-rotate their keys by -count.

        `scratch`: reusable buffers (the cache passes one set for all its layers): fresh temporaries of a whole
        layer would be new pages each time, and faulting them in doubled an eviction's pause at cache 2048."""
        if not self.is_initialized or count <= 0:
            return
        src, n = start + count, self.length - start - count
        if n < 0:
            raise ValueError(f"cannot evict {count} slots from {start} with {self.length} live")
        start, src = start + self.base, src + self.base
        cs = None if rope is None else rope.cos_sin(-count, self.keys.device)
        if n and not native.kv_evict(self.keys, self.values, start, count, n, cs):  # type: ignore[arg-type]
            scratch = scratch or Scratch()
            k = self.keys[:, :, src : src + n]  # [B, H_kv, n, D]
            dest = self.keys[:, :, start : start + n]
            if rope is None:
                dest.copy_(scratch.take("same", k).copy_(k))  # source and destination overlap: via a copy
            else:  # rotate in fp32 (a bf16 cache rounds once, on the way back)
                k32 = k if k.dtype == torch.float32 else scratch.take("k32", k, torch.float32).copy_(k)
                dest.copy_(rope.rotate_into(k32, -count, scratch.take("rot32", k, torch.float32)))
            v = self.values[:, :, src : src + n]
            self.values[:, :, start : start + n].copy_(scratch.take("same", v).copy_(v))
        self.length -= count

    def advance(self, n: int) -> None:
        """Count `n` slots written in place after the live ones (the cache checked the room)."""
        self.length += n

    def truncate(self, length: int) -> None:
        """Forget slots >= length (stale data past `length` is overwritten by the next update)."""
        self.length = min(self.length, length)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        self.truncate(self.length + tokens_to_remove)

    def reset(self) -> None:
        self.length = 0

    @property
    def nbytes(self) -> int:
        """Bytes allocated for this layer (constant once initialised)."""
        if not self.is_initialized:
            return 0
        return self.keys.nbytes + self.values.nbytes

    @property
    def used_nbytes(self) -> int:
        """Bytes of the live slots only (recalled slots in use included)."""
        total = self.base + self.capacity
        return self.nbytes * (self.used + self.length) // total if total else 0

    def live(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the live keys and values [B, H_kv, length, D]."""
        b0 = self.base
        return self.keys[:, :, b0 : b0 + self.length], self.values[:, :, b0 : b0 + self.length]


LAYER_CLASSES.append(SinkLayer)


class SinkKVCache(TransformersBase):
    """The one persistent cache: a transformers `Cache` (`TransformersBase`) of `SinkLayer`s plus the RoPE needed
    to re-rotate on eviction.

    `rerotate=False` gives the naive absolute-position variant (used only to measure what in-cache positions buy).
    `layers` / `ropes`: prebuilt layers and one RoPE per layer (a hybrid model's, see `hybrid_cache.py`); by default
    `num_layers` SinkLayers that all rotate with `rope`.
    """

    def __init__(
        self, num_layers: int, capacity: int, rope: Rope | None, rerotate: bool = True, dtype: torch.dtype | None = None,
        layers: list[Any] | None = None, ropes: list[Rope] | None = None,
    ) -> None:
        # what Cache.__init__(layers=...) sets
        self.layers: list[Any] = layers if layers is not None else [SinkLayer(capacity, dtype)
                                                                    for _ in range(num_layers)]
        self.layer_class_to_replicate = None
        self.offloading = False
        transformers_class("Cache")  # the layer classes registered as CacheLayerMixins, if transformers is imported
        self.capacity = capacity
        self.rope = rope if rerotate else None
        per_layer: list[Rope | None] = list(ropes) if ropes is not None else [rope] * len(self.layers)
        self.ropes = per_layer if rerotate else [None] * len(self.layers)
        self.scratch = Scratch()

    def __len__(self) -> int:  # Cache.__len__ (a dunder: looked up on the class, never deferred)
        return len(self.layers)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(layers={self.layers})"

    def evict(self, ev: Eviction) -> None:
        """Every layer drops (or, a local ring, just re-rotates for) the block of `ev` with its own RoPE."""
        for layer, rope in zip(self.layers, self.ropes):
            layer.evict(ev.start, ev.count, rope, self.scratch)

    def can_truncate(self, length: int) -> bool:
        """Whether `truncate(length)` restores exactly the state the cache had at `length` (always, here)."""
        return True

    def truncate(self, length: int) -> None:
        for layer in self.layers:
            layer.truncate(length)

    def buffers(self, n_kv: int, head_dim: int, device: torch.device, dtype: torch.dtype
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every layer's full key and value buffers [B, H_kv, cap, D], allocated if not yet (the fast decode step
        writes into them directly; `advance` then counts the new slots)."""
        for layer in self.layers:
            if not layer.is_initialized:
                empty = torch.empty(1, n_kv, 0, head_dim, device=device, dtype=dtype)  # [B, H_kv, 0, D]
                layer.lazy_initialization(empty, empty)
        return [layer.keys for layer in self.layers], [layer.values for layer in self.layers]

    def advance(self, n: int) -> None:
        """Count `n` slots written in place after the live ones."""
        if self.length + n > self.capacity:
            raise RuntimeError(f"KV cache overflow ({self.length + n} > {self.capacity}): evict first")
        for layer in self.layers:
            layer.advance(n)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache tensors (allocated, i.e. at capacity: this is what RSS sees)."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def used_nbytes(self) -> int:
        """Bytes of the live slots only."""
        return sum(layer.used_nbytes for layer in self.layers)

    def state(self) -> dict[str, torch.Tensor]:
        """Live slots as flat tensors {'k.{i}': [B, H_kv, L, D], 'v.{i}': ...} (safetensors-ready copies)."""
        out: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if layer.is_initialized:
                k, v = layer.live()
                out[f"k.{i}"], out[f"v.{i}"] = k.contiguous().clone(), v.contiguous().clone()
        return out

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Inverse of `state`; shapes must match this cache (checked: a mismatch raises ValueError)."""
        for i, layer in enumerate(self.layers):
            k, v = state.get(f"k.{i}"), state.get(f"v.{i}")
            if k is None or v is None:
                raise ValueError(f"snapshot lacks layer {i}")
            if k.shape[-2] > self.capacity:
                raise ValueError("snapshot holds more tokens than this cache's capacity")
            if not layer.is_initialized:
                layer.lazy_initialization(k, v)
            if layer.keys.shape[:2] != k.shape[:2] or layer.keys.shape[-1] != k.shape[-1]:
                raise ValueError(f"snapshot layer {i} has shape {tuple(k.shape)}, cache expects {tuple(layer.keys.shape)}")
            layer.reset()
            layer.update(k.to(layer.keys.dtype), v.to(layer.values.dtype))


def resolve_kv_dtype(name: str, fast: bool, model: Any) -> torch.dtype:
    """What the cache buffers store. auto: bf16 with the fast step (half the bytes attention reads per token; the
    ppl cost is in the README), else the model's own floating dtype."""
    if name == "auto" and not fast:
        return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return {"auto": torch.bfloat16, "float32": torch.float32, "bfloat16": torch.bfloat16}[name]
