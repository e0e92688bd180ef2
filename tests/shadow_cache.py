"""An independent reference cache for exactness tests: keys are stored UN-rotated and rotated at use.

Each update un-rotates the incoming keys from the positions they were given (fp64, from scratch), each read rotates
all kept keys to positions 0..L-1 (fp64, from scratch). So after any number of evictions this cache holds exactly
"the originally computed keys/values of the kept tokens at in-cache positions", with no incremental arithmetic —
the thing the real cache's incremental re-rotation must reproduce.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


def rotate_at(k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate k [B, H, T, D] by angle positions[t]*inv_freq (rotate_half layout, partial rotary aware), in fp64."""
    r = 2 * inv_freq.numel()
    ang = positions.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None]  # [T, R/2]
    ang = torch.cat([ang, ang], dim=-1)  # [T, R]
    cos, sin = ang.cos(), ang.sin()
    kr = k[..., :r].to(torch.float64)
    half = r // 2
    rot = torch.cat([-kr[..., half:], kr[..., :half]], dim=-1)
    out = (kr * cos + rot * sin).to(k.dtype)
    return torch.cat([out, k[..., r:]], dim=-1) if r < k.shape[-1] else out


class ShadowLayer(CacheLayerMixin):
    is_compileable = False
    is_sliding = False

    def __init__(self, inv_freq: torch.Tensor) -> None:
        super().__init__()
        self.inv_freq = inv_freq
        self.raw_k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.raw_k is None else self.raw_k.shape[-2]

    def lazy_initialization(self, key_states, value_states):
        self.raw_k = key_states[:, :, :0].clone()
        self.v = value_states[:, :, :0].clone()
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        L, q = self.length, key_states.shape[-2]
        raw = rotate_at(key_states, -torch.arange(L, L + q), self.inv_freq)
        self.raw_k = torch.cat([self.raw_k, raw], dim=-2)
        self.v = torch.cat([self.v, value_states], dim=-2)
        return rotate_at(self.raw_k, torch.arange(self.length), self.inv_freq), self.v

    def get_mask_sizes(self, query_length):
        return self.length + query_length, 0

    def get_seq_length(self):
        return self.length

    def get_max_length(self):
        return -1

    def evict(self, start: int, count: int) -> None:
        keep = [i for i in range(self.length) if not (start <= i < start + count)]
        self.raw_k = self.raw_k[:, :, keep]
        self.v = self.v[:, :, keep]

    def truncate(self, length: int) -> None:
        if self.raw_k is not None:
            self.raw_k, self.v = self.raw_k[:, :, :length], self.v[:, :, :length]

    def rotated_keys(self) -> torch.Tensor:
        return rotate_at(self.raw_k, torch.arange(self.length), self.inv_freq)


class ShadowCache(Cache):
    """Drop-in for SinkKVCache inside an Engine (same evict/truncate/length interface)."""

    def __init__(self, num_layers: int, inv_freq: torch.Tensor, capacity: int) -> None:
        super().__init__(layers=[ShadowLayer(inv_freq) for _ in range(num_layers)])
        self.capacity = capacity

    @property
    def length(self) -> int:
        return self.layers[0].length

    def evict(self, ev) -> None:
        for layer in self.layers:
            layer.evict(ev.start, ev.count)

    def truncate(self, length: int) -> None:
        for layer in self.layers:
            layer.truncate(length)

    def reset(self) -> None:
        for layer in self.layers:
            layer.raw_k = layer.v = None
            layer.is_initialized = False
