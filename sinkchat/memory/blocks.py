"""A recall-memory block: B evicted tokens' keys and values in every memory layer, and the math on them.

Keys are kept as the cache held them when they were evicted: rotated at their in-cache slot (`slots`), so a block
is one rotation away from any position it is recalled at (`rotated_to`: one rounding to the cache dtype, as an
eviction's re-rotation). The index scores blocks with un-rotated representative keys (`representatives`).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np
import torch

MAGIC = b"SCMB"
HEADER = struct.Struct("<4sHHHHHBxQQI")  # magic, version, n, layers, H_kv, D, dtype, block id, payload bytes, crc32
VERSION = 1
DTYPES = {0: torch.float32, 1: torch.bfloat16, 2: torch.float64}  # fp64: a reference model's cache (tests)
CODES = {v: k for k, v in DTYPES.items()}


@dataclass
class Block:
    """`n` tokens (stream indices `abs_index`, token ids `ids`) and their keys / values [M, H_kv, n, D] in the M
    memory layers; `slots`: the in-cache position each key was rotated at when it left the window."""

    id: int
    abs_index: np.ndarray  # int64 [n]
    ids: np.ndarray  # int32 [n]
    slots: np.ndarray  # int32 [n]
    keys: torch.Tensor  # [M, H_kv, n, D], the cache's dtype
    values: torch.Tensor  # [M, H_kv, n, D]

    @property
    def n(self) -> int:
        return int(self.ids.shape[0])

    @property
    def first(self) -> int:
        return int(self.abs_index[0])

    @property
    def last(self) -> int:
        """One past the last stream index."""
        return int(self.abs_index[-1]) + 1

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def encode(self) -> bytes:
        """The on-disk record: a header with the payload's CRC32, then abs / ids / slots / keys / values."""
        m, h, n, d = self.keys.shape
        payload = b"".join([self.abs_index.astype("<i8").tobytes(), self.ids.astype("<i4").tobytes(),
                            self.slots.astype("<i4").tobytes(), _raw(self.keys), _raw(self.values)])
        head = HEADER.pack(MAGIC, VERSION, n, m, h, d, CODES[self.keys.dtype], self.id, len(payload),
                           zlib.crc32(payload))
        return head + payload

    @classmethod
    def decode(cls, head: bytes, payload: bytes) -> "Block":
        """Inverse of `encode`; ValueError when the header or the checksum does not hold."""
        magic, version, n, m, h, d, code, bid, size, crc = HEADER.unpack(head)
        if magic != MAGIC or version != VERSION or code not in DTYPES or size != len(payload):
            raise ValueError("not a memory block record")
        if zlib.crc32(payload) != crc:
            raise ValueError(f"block {bid} fails its checksum")
        dt = DTYPES[code]
        at = 0

        def take(nbytes: int) -> bytes:
            nonlocal at
            at += nbytes
            return payload[at - nbytes : at]

        abs_index = np.frombuffer(take(8 * n), "<i8").astype(np.int64)
        ids = np.frombuffer(take(4 * n), "<i4").astype(np.int32)
        slots = np.frombuffer(take(4 * n), "<i4").astype(np.int32)
        esz = {torch.float32: 4, torch.bfloat16: 2, torch.float64: 8}[dt]
        kv = [_tensor(take(m * h * n * d * esz), dt, (m, h, n, d)) for _ in range(2)]
        return cls(bid, abs_index, ids, slots, kv[0], kv[1])


def _raw(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


def _tensor(raw: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bfloat16:
        return torch.frombuffer(bytearray(raw), dtype=torch.int16).view(torch.bfloat16).reshape(shape)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)


def cos_sin(inv_freq: torch.Tensor, shifts: torch.Tensor, dtype: torch.dtype = torch.float32
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [n, R] (rotate_half layout) of shifts [n] x inv_freq [R/2], angles in fp64 as `Rope.cos_sin`."""
    ang = shifts.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None]  # [n, R/2]
    ang = torch.cat([ang, ang], dim=-1)  # [n, R]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rotate(k: torch.Tensor, inv_freq: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """Keys k [..., n, D] each rotated by its own shift [n] (rotate-half RoPE, partial rotary kept as is), in fp32
    (fp64 keys: in fp64)."""
    k = k if k.dtype == torch.float64 else k.float()
    cos, sin = cos_sin(inv_freq, shifts, k.dtype)  # [n, R]
    r, half = cos.shape[-1], cos.shape[-1] // 2
    x1, x2 = k[..., :half], k[..., half:r]
    out = k.clone()
    out[..., :half] = x1 * cos[:, :half] - x2 * sin[:, :half]
    out[..., half:r] = x2 * cos[:, half:] + x1 * sin[:, half:]
    return out


def rotated_to(block: Block, inv_freqs: list[torch.Tensor], position: int, dtype: torch.dtype, step: int = 0
               ) -> torch.Tensor:
    """The block's keys [M, H_kv, n, D] rotated from their slots to `position` + `step` x (their index in the
    block) (step 0: all at one position; 1: in order from `position` on), each layer with its own RoPE, rounded
    once to `dtype`."""
    target = position + step * np.arange(block.n, dtype=np.int64)
    shifts = torch.from_numpy(target - block.slots.astype(np.int64))  # [n]
    return torch.stack([rotate(block.keys[i], f, shifts) for i, f in enumerate(inv_freqs)]).to(dtype)


def representatives(block: Block, inv_freqs: list[torch.Tensor], r: int) -> torch.Tensor:
    """[M, H_kv, r, D] fp32 un-rotated keys that stand for the block in the index: per layer and KV head the r keys
    farthest from the block's mean key (the tokens that set the block apart from its neighbours: a needle's digits
    among filler; measured against InfLLM-style alternatives in docs/memory.md)."""
    shifts = torch.from_numpy(-block.slots.astype(np.int64))
    k = torch.stack([rotate(block.keys[i], f, shifts) for i, f in enumerate(inv_freqs)])  # [M, H, n, D] un-rotated
    r = min(r, k.shape[2])
    spread = (k - k.mean(dim=2, keepdim=True)).norm(dim=-1)  # [M, H, n]
    pick = spread.topk(r, dim=-1).indices.sort(dim=-1).values  # [M, H, r], in token order
    return torch.gather(k, 2, pick[..., None].expand(*pick.shape, k.shape[-1]))
