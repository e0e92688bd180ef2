"""A recall-memory block: B evicted tokens' keys and values in every memory layer, and the math on them.

Keys are stored rotated to the recall position (`slots`: where each key sits now), so a block recalled there needs
no rotation. The index scores blocks with rows made from their un-rotated keys (`representatives`, or `bounds` for
Quest's rule). On disk a block is
one record (`Block.encode`): a CRC32 over its token arrays and one per layer, so a call reads and checks only the
layers it recalls (a block is ~1.5 MB on the bundled model, one layer's part ~49 KB).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from sinkchat.memory import native

MAGIC = b"SCMB"
# magic, version, n, layers, H_kv, D, dtype, block id, payload bytes, crc32 of the layer table and the token arrays
HEADER = struct.Struct("<4sHHHHHBxQQI")
VERSION = 2  # 2: a CRC32 per layer, so one layer's keys and values are read (and checked) alone
# fp64: a reference model's cache (tests); int8: 8-bit storage (`encode(bits=8)`), each [H_kv, n, D] half of a
# layer's chunk int8 values then fp32 scales [H_kv, n] (absmax per token and head / 127)
DTYPES = {0: torch.float32, 1: torch.bfloat16, 2: torch.float64, 3: torch.int8}
CODES = {v: k for k, v in DTYPES.items()}
ESIZE = {torch.float32: 4, torch.bfloat16: 2, torch.float64: 8, torch.int8: 1}


@dataclass(frozen=True)
class Shape:
    """A record's shape from its header, and where its parts are (offsets from the record's start): the header,
    the layer CRC table (M x u32), the token arrays (abs i64, ids i32, slots i32: 16 bytes a token), then per
    layer its keys and values [H_kv, n, D]."""

    n: int
    m: int
    h: int
    d: int
    dtype: torch.dtype
    bid: int
    size: int
    crc: int

    @classmethod
    def of(cls, head: bytes) -> "Shape":
        magic, version, n, m, h, d, code, bid, size, crc = HEADER.unpack(head)
        if magic != MAGIC or version != VERSION or code not in DTYPES:
            raise ValueError("not a memory block record")
        return cls(n, m, h, d, DTYPES[code], bid, size, crc)

    @property
    def meta(self) -> int:
        """Bytes of the layer table and the token arrays (right after the header)."""
        return 4 * self.m + 16 * self.n

    @property
    def chunk(self) -> int:
        """Bytes of one layer's keys and values (8-bit: and their scales)."""
        scales = 4 * self.h * self.n if self.dtype == torch.int8 else 0
        return 2 * (self.h * self.n * self.d * ESIZE[self.dtype] + scales)

    def layer_at(self, layer: int) -> int:
        return HEADER.size + self.meta + layer * self.chunk


@dataclass
class Block:
    """`n` tokens (stream indices `abs_index`, token ids `ids`) and their keys / values [M, H_kv, n, D] in the M
    memory layers; `slots`: the in-cache position each key was rotated at."""

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

    def encode(self, bits: int = 16) -> bytes | bytearray:
        """The on-disk record (`Shape`): header, layer CRC table, token arrays, each layer's keys and values: as the
        cache holds them (bits 16), or int8 with an fp32 scale per token and head (bits 8: half the bytes)."""
        if bits != 8:
            return self._encode_raw()
        m, h, n, d = self.keys.shape
        chunks = [_q8(self.keys[i]) + _q8(self.values[i]) for i in range(m)]
        table = struct.pack(f"<{m}I", *[zlib.crc32(c) for c in chunks])
        meta = table + self._tokens()
        payload = meta + b"".join(chunks)
        head = HEADER.pack(MAGIC, VERSION, n, m, h, d, CODES[torch.int8], self.id, len(payload), zlib.crc32(meta))
        return head + payload

    def _tokens(self) -> bytes:
        return self.abs_index.astype("<i8").tobytes() + self.ids.astype("<i4").tobytes() + \
            self.slots.astype("<i4").tobytes()

    def _encode_raw(self) -> bytearray:
        """`encode` of the cache's own bytes, built in one buffer: the keys and values copied once into their
        places, each CRC taken on the buffer itself. Why: joining per-layer byte strings copied every byte four
        times (3.4 ms of a block's ~14 ms of memory work at 8k tokens, 1 thread); the same bytes
        (tests/test_memory_cost.py)."""
        m, h, n, d = self.keys.shape
        kv = [_as_bytes(self.keys), _as_bytes(self.values)]  # [M, H_kv * n * D * size] each
        half = kv[0].shape[1]
        meta_at, toks = HEADER.size + 4 * m, self._tokens()
        body = meta_at + len(toks)
        out = bytearray(body + 2 * half * m)
        arr = np.frombuffer(out, np.uint8)
        layers = arr[body:].reshape(m, 2, half)
        layers[:, 0], layers[:, 1] = kv
        arr[meta_at:body] = np.frombuffer(toks, np.uint8)
        struct.pack_into(f"<{m}I", out, HEADER.size, *[zlib.crc32(layers[i]) for i in range(m)])
        crc = zlib.crc32(arr[HEADER.size : body])
        HEADER.pack_into(out, 0, MAGIC, VERSION, n, m, h, d, CODES[self.keys.dtype], self.id, len(out) - HEADER.size,
                         crc)
        return out

    @classmethod
    def decode(cls, head: bytes, payload: bytes) -> "Block":
        """Inverse of `encode` (every layer checked); ValueError when the header or a checksum does not hold."""
        sh = Shape.of(head)
        if sh.size != len(payload):
            raise ValueError("not a memory block record")
        meta = payload[: sh.meta]
        abs_index, ids, slots, crcs = tokens_of(sh, meta)
        kv = [layer_of(sh, payload[sh.meta + i * sh.chunk : sh.meta + (i + 1) * sh.chunk], crcs[i], i)
              for i in range(sh.m)]
        return cls(sh.bid, abs_index, ids, slots, torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv]))


def tokens_of(sh: Shape, meta: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, ...]]:
    """(abs, ids, slots, layer CRCs) from a record's meta bytes, checked against the header's CRC."""
    if len(meta) != sh.meta or zlib.crc32(meta) != sh.crc:
        raise ValueError(f"block {sh.bid} fails its checksum")
    crcs = struct.unpack(f"<{sh.m}I", meta[: 4 * sh.m])
    at, n = 4 * sh.m, sh.n
    abs_index = np.frombuffer(meta[at : at + 8 * n], "<i8").astype(np.int64)
    ids = np.frombuffer(meta[at + 8 * n : at + 12 * n], "<i4").astype(np.int32)
    slots = np.frombuffer(meta[at + 12 * n : at + 16 * n], "<i4").astype(np.int32)
    return abs_index, ids, slots, crcs


def layer_of(sh: Shape, chunk: bytes, crc: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's keys and values [H_kv, n, D] from its bytes, checked against its CRC."""
    if len(chunk) != sh.chunk or zlib.crc32(chunk) != crc:
        raise ValueError(f"block {sh.bid} layer {layer} fails its checksum")
    half, shape = sh.chunk // 2, (sh.h, sh.n, sh.d)
    if sh.dtype == torch.int8:
        return _dq8(chunk[:half], shape), _dq8(chunk[half:], shape)
    return _tensor(chunk[:half], sh.dtype, shape), _tensor(chunk[half:], sh.dtype, shape)


def _q8(t: torch.Tensor) -> bytes:
    """[H, n, D] as int8 values then fp32 scales [H, n]: absmax per token and head over D, / 127."""
    t = t.float()
    scale = t.abs().amax(-1) / 127.0  # [H, n]
    q = torch.round(t / scale.clamp_min(1e-30)[..., None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous().numpy().tobytes() + scale.contiguous().numpy().astype("<f4").tobytes()


def _dq8(raw: bytes, shape: tuple[int, int, int]) -> torch.Tensor:
    """The fp32 [H, n, D] an `_q8` half stands for."""
    h, n, d = shape
    q = torch.frombuffer(bytearray(raw[: h * n * d]), dtype=torch.int8).reshape(shape)
    scale = torch.frombuffer(bytearray(raw[h * n * d :]), dtype=torch.float32).reshape(h, n)
    return q.float() * scale[..., None]


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """[M, ...] as a uint8 view [M, bytes of one layer] (the tensor's own memory where it is contiguous)."""
    t = t.contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().view(np.uint8).reshape(t.shape[0], -1)


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


def rotate(k: torch.Tensor, inv_freq: torch.Tensor, shifts: torch.Tensor, dtype: torch.dtype | None = None
           ) -> torch.Tensor:
    """Keys k [..., n, D] each rotated by its own shift [n] (rotate-half RoPE, partial rotary kept as is), in fp32
    (fp64 keys: in fp64), then `.to(dtype)` when given. Bf16 / fp32 keys go through the memory's C library
    (native.py: the same roundings, 0.5-0.6 ms of CPU instead of 2.1-2.5 ms for a block's 30 x 3 x 64 keys, 1
    thread) where it runs; `rotate_torch` is the reference it is held to."""
    if k.dtype != torch.float64:
        cos, sin = cos_sin(inv_freq, shifts, torch.float32)  # [n, R]
        out = native.rotate(k, cos, sin, dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32)
        if out is not None:
            return out if dtype is None else out.to(dtype)
    out = rotate_torch(k, inv_freq, shifts)
    return out if dtype is None else out.to(dtype)


def rotate_torch(k: torch.Tensor, inv_freq: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """`rotate` in torch ops: fp32 (fp64 keys: fp64), each half written in place as (a * c) -/+ (b * s)."""
    k = k if k.dtype == torch.float64 else k.float()
    cos, sin = cos_sin(inv_freq, shifts, k.dtype)  # [n, R]
    r, half = cos.shape[-1], cos.shape[-1] // 2
    x1, x2 = k[..., :half], k[..., half:r]
    out = torch.empty_like(k)  # each half written in place: the same products, rounded as (a * c) -/+ (b * s)
    if r < k.shape[-1]:
        out[..., r:] = k[..., r:]
    o1, o2 = out[..., :half], out[..., half:r]
    torch.mul(x1, cos[:, :half], out=o1)
    o1.sub_(x2 * sin[:, :half])
    torch.mul(x2, cos[:, half:], out=o2)
    o2.add_(x1 * sin[:, half:])
    return out


def representatives(keys: torch.Tensor, r: int) -> torch.Tensor:
    """[M, H_kv, r, D] of a block's un-rotated keys [M, H_kv, n, D] that stand for it in the index (rules "mass",
    the default, and "far"): per layer and KV head the r keys farthest from the block's mean key (the tokens that
    set the block apart from its neighbours: a needle's digits among filler). Measured against InfLLM-like keys
    (the ones the last queries attend most: Retrieve.Number 6/10 against 8/10 with "mass", passkey in filler 2/10
    against 4/10) and against Quest's bounds (`bounds`), 4k tokens, 10 trials (docs/memory.md "Choosing blocks").
    In real prose no few rows do much better: the exact attention mass of the question's queries over every key
    ranks the needle's block top-4 in a median of ~6 of 30 layers, these 4 keys in 4-4.5."""
    r = min(r, keys.shape[2])
    spread = (keys - keys.mean(dim=2, keepdim=True)).norm(dim=-1)  # [M, H, n]
    pick = spread.topk(r, dim=-1).indices.sort(dim=-1).values  # [M, H, r], in token order
    return torch.gather(keys, 2, pick[..., None].expand(*pick.shape, keys.shape[-1]))


def bounds(keys: torch.Tensor) -> torch.Tensor:
    """[M, H_kv, 1, 2D]: a block's un-rotated keys [M, H_kv, n, D] as one index row per layer and KV head, the
    elementwise max of its keys then their min (Quest's page bounds, rule "bound"). With `bound_queries` a row's dot
    is sum_d max(q_d * max_d, q_d * min_d), an upper bound of q . k over every key of the block."""
    return torch.cat([keys.amax(dim=2), keys.amin(dim=2)], dim=-1)[:, :, None]  # [M, H_kv, 1, 2D]


def bound_queries(q: torch.Tensor) -> torch.Tensor:
    """[..., 2D] of queries q [..., D]: their positive parts then their negative parts, so a dot with a `bounds`
    row [max | min] takes max_d where q_d > 0 and min_d where q_d < 0."""
    return torch.cat([q.clamp_min(0), q.clamp_max(0)], dim=-1)
