"""llama.cpp's quant blocks taken apart into the integers and scales sinkchat's kernels compute with, without
ever forming the weights in float.

| GGUF type | values | per | w = | kernel layout (module) | exact? |
|---|---|---|---|---|---|
| Q4_0 | 0..15 | 32 | d·(q−8) | q40 (`Int4Q0Linear`; torch's: q4, m = −8d): d alone | yes (fp16 d; −8d exact) |
| Q4_1 | 0..15 | 32 | d·q + m | q4: d, m | yes |
| Q4_K | 0..15 | 32 of 256 | (d·sc)·q − dmin·mn | q4k (`Int4KLinear`): fp16 d, dmin, 6-bit sc, mn (the file's 144 B) | yes |
| Q8_0 | −127..127 | 32 | d·q | q80 (`Int8Q0Linear`: the file's 34 bytes; torch's: q4), else q8g: d, 0 per 16 | yes |
| Q5_0 | −16..15 | 32 | d·q | q50 (`int5.Int5Q0Linear`: the file's 22 bytes), else q8g: d, 0 per 16 | yes |
| Q5_1 | 0..31 | 32 | d·q + m | q51 (`int5.Int5Q1Linear`: the file's 24 bytes), else q8g: d, m per 16 | yes |
| Q5_K | 0..31 | 32 of 256 | (d·sc)·q − dmin·mn | q5k (`int5.Int5KLinear`: the file's 176 bytes), else q8k | yes |
| Q6_K | −32..31 | 16 of 256 | (d·sc)·q | q6k (`Int6KLinear`: the file's bytes), else q8k | yes |
| F32 / F16 / BF16 | float | | w | q8g, absmax per 16 | no: within half a step (max abs w / 254 per 16) |

The K-quants keep their super-blocks (`unpack_k`: the file's integer scales and fp16 d, dmin; the kernels form
d·sc in fp32, which is exact). `unpack` also gives them as per-sub-block products (`Parts`, taken from the same
`KParts`: one parser of the super-block; the kernel rounds d·sc to fp16, within 2⁻¹² relative of the file's
scale), the form q4 / q8g hold where the K layouts cannot run (torch's kernels). `to_float` (norms, float tables,
the float model) is gguf-py's own `dequantize`, bit for bit, signed zeros included.
`tests/test_gguf_blocks.py` and `tests/test_qk.py` hold every type to `gguf.quants.dequantize` on real blocks.

Each function takes the raw blocks of whole rows, uint8 [rows, bytes per row], and returns numpy arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import Q4_K, dequantize as gguf_dequantize

QK = 256  # weights per K-quant super-block


@dataclass(frozen=True)
class Parts:
    """A tensor's rows as the kernels hold them: w[r, k] = d[r, k // g]·q[r, k] + m[r, k // g]."""

    layout: str  # "q4" (q uint8 0..15, g = 32) or "q8g" (q int8, g = 16)
    q: np.ndarray  # [rows, K]
    d: np.ndarray  # fp32 [rows, K/g]
    m: np.ndarray  # fp32 [rows, K/g]

    @property
    def group(self) -> int:
        return 32 if self.layout == "q4" else 16

    def dequantize(self) -> np.ndarray:
        """fp32 [rows, K] with d and m as the kernel rounds them (fp16): the weights the kernels compute with."""
        rows, k = self.q.shape
        d = self.d.astype(np.float16).astype(np.float32)[..., None]
        m = self.m.astype(np.float16).astype(np.float32)[..., None]
        q = self.q.astype(np.float32).reshape(rows, k // self.group, self.group)
        return (d * q + m).reshape(rows, k)


def _blocks(raw: np.ndarray, size: int) -> tuple[np.ndarray, int]:
    """uint8 [rows, bytes] -> ([rows * blocks per row, size], rows)."""
    rows = raw.shape[0]
    return raw.reshape(-1, size), rows


def _f16(b: np.ndarray) -> np.ndarray:  # [n, 2] uint8 -> fp32 [n, 1]
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, half: int) -> np.ndarray:
    """[n, j*half] packed bytes -> [n, j*2*half]: per run of `half` bytes, the low nibbles then the high ones."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, half) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(n, -1)


def _q4_0(raw: np.ndarray) -> Parts:
    b, rows = _blocks(raw, 18)
    d = _f16(b[:, :2])  # [n, 1]
    q = _nibbles(b[:, 2:], 16)
    return Parts("q4", q.reshape(rows, -1), d.reshape(rows, -1), (-8 * d).reshape(rows, -1))


def _q4_1(raw: np.ndarray) -> Parts:
    b, rows = _blocks(raw, 20)
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:], 16)
    return Parts("q4", q.reshape(rows, -1), d.reshape(rows, -1), m.reshape(rows, -1))


def q4_tiles(raw: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0 (`block` 18) / Q4_1 (20) rows, uint8 [rows, bytes per row], straight into the native q4 kernels' layout
    (kernels/layouts.py), byte for byte what `_q4_0` / `_q4_1` then `pack_q40` / `pack_q4_dm` give: (qw uint8
    [rows/16, K/32, 4, 16, 4], sc_q4_blocks: byte (s, r, t) holds weight 8s+t low, 8s+4+t high) and the scales
    as the file's fp16 bits, [rows/16, K/32, n, 16] (n: d, or d and m). rows % 16 == 0.

    Why: that path unpacks each nibble to a byte and packs it again, in numpy and in torch (1.5 s of 2.2 s of the
    bundled model's packing under cProfile at a first start); a file byte j holds weights j (low) and j + 16 (high),
    a tile byte two weights four apart, so each tile byte is one mask-and-or of two file bytes (four at a time in a
    uint32). The scales are the file's fp16 bits unchanged (the old path's fp16 -> fp32 -> fp16 is exact for every
    non-NaN value; a NaN scale, which no working file has, may differ in its payload bits).
    `tests/test_startup_pack.py` holds both paths equal."""
    rows, nbytes = raw.shape
    nb, g = nbytes // block, rows // 16
    b = raw.reshape(g, 16, nb, block)
    # four bytes t at a time, as one uint32 (masks keep every nibble in its own byte, whatever the byte order):
    # file word 2s' + h holds bytes 8s' + 4h + t, i.e. weights (8s' + 4h + t) low and (16 + 8s' + 4h + t) high
    qs = np.ascontiguousarray(b[..., block - 16:]).view(np.uint32)  # [g, r, b, 4]
    first, second = qs[..., 0::2], qs[..., 1::2]  # h = 0, 1: [g, r, b, s']
    low = np.uint32(0x0F0F0F0F)
    words = np.empty((g, nb, 4, 16), dtype=np.uint32)  # [g, b, s, r]: bytes t of tile (s, r)
    tiles = words.transpose(0, 3, 1, 2)  # [g, r, b, s], a view written in place
    np.bitwise_or(first & low, (second & low) << np.uint32(4), out=tiles[..., :2])  # s = s': weights < 16
    np.bitwise_or((first >> np.uint32(4)) & low, second & ~low, out=tiles[..., 2:])  # s = 2 + s': the rest
    qw = words.view(np.uint8).reshape(g, nb, 4, 16, 4)
    n = (block - 16) // 2
    scales = np.ascontiguousarray(b[..., : 2 * n]).view(np.uint16).reshape(g, 16, nb, n)
    return qw, np.ascontiguousarray(scales.transpose(0, 2, 3, 1)).view(np.float16)


def _halves(x: np.ndarray) -> np.ndarray:
    """Per-32 scales [n, j] -> the same value for each 16-weight half [n, 2j]."""
    return np.repeat(x, 2, axis=1)


def _q8_0(raw: np.ndarray) -> Parts:
    b, rows = _blocks(raw, 34)
    d = _halves(_f16(b[:, :2]))
    q = np.ascontiguousarray(b[:, 2:]).view(np.int8)
    return Parts("q8g", q.reshape(rows, -1), d.reshape(rows, -1), np.zeros_like(d).reshape(rows, -1))


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1: uint8 [n, 4] (one little-endian uint32) -> the fifth bit of each weight, uint8 [n, 32]."""
    bits = np.ascontiguousarray(qh).view(np.uint32) >> np.arange(32, dtype=np.uint32)[None]
    return (bits & 1).astype(np.uint8)


def _q5_0(raw: np.ndarray) -> Parts:
    b, rows = _blocks(raw, 22)
    d = _halves(_f16(b[:, :2]))
    q = (_nibbles(b[:, 6:], 16) | (_high_bits32(b[:, 2:6]) << 4)).astype(np.int8) - np.int8(16)
    return Parts("q8g", q.reshape(rows, -1), d.reshape(rows, -1), np.zeros_like(d).reshape(rows, -1))


def _q5_1(raw: np.ndarray) -> Parts:
    b, rows = _blocks(raw, 24)
    d, m = _halves(_f16(b[:, :2])), _halves(_f16(b[:, 2:4]))
    q = (_nibbles(b[:, 8:], 16) | (_high_bits32(b[:, 4:8]) << 4)).astype(np.int8)
    return Parts("q8g", q.reshape(rows, -1), d.reshape(rows, -1), m.reshape(rows, -1))


# ---- the K-quants in their super-block form (layouts "q4k" / "q8k": the file's own integers, nothing rounded) ------
@dataclass(frozen=True)
class KParts:
    """A K-quant tensor's rows as `Int4KLinear` / `Int8KLinear` hold them: per super-block of 256 along K, fp16 d and
    dmin (given as fp32), and per sub-block j (32 weights for "q4k", 16 for "q8k") integer sc_j and mn_j:
    w = (d·sc_j)·q − (dmin·mn_j). Unlike `Parts` (products rounded to fp16) this is the file exactly."""

    layout: str  # "q4k" (q uint8 0..15, sc / mn uint8 per 32) or "q8k" (q int8, sc int8 / mn uint8 per 16)
    q: np.ndarray  # [rows, K]
    d: np.ndarray  # fp32 [rows, K/256]
    dmin: np.ndarray  # fp32 [rows, K/256]
    sc: np.ndarray  # [rows, K/sub]
    mn: np.ndarray  # [rows, K/sub]

    @property
    def sub(self) -> int:
        return 32 if self.layout == "q4k" else 16

    def products(self) -> tuple[np.ndarray, np.ndarray]:
        """Per sub-block d·sc_j and dmin·mn_j, fp32 [rows, K/sub] (exact: an fp16 times a 6- or 8-bit integer)."""
        per = QK // self.sub
        ds = np.repeat(self.d, per, axis=1) * self.sc.astype(np.float32)
        dm = np.repeat(self.dmin, per, axis=1) * self.mn.astype(np.float32)
        return ds, dm

    def dequantize(self) -> np.ndarray:
        """fp32 [rows, K] as gguf-py computes it: (d·sc)·q − (dmin·mn), each step fp32 (bit-exact to its dequantize)."""
        rows, k = self.q.shape
        ds, dm = self.products()
        q = self.q.astype(np.float32).reshape(rows, -1, self.sub)
        return (ds[..., None] * q - dm[..., None]).reshape(rows, k)


def _k_head(b: np.ndarray, rows: int) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K super-block head (d, dmin fp16; 12 bytes of 6-bit sc, mn) -> d, dmin [rows, S], sc, mn uint8
    [rows, 8S]. The one parser of that head: the `Parts` forms are taken from the `KParts` it gives."""
    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))  # [n, 8] each
    return (_f16(b[:, :2]).reshape(rows, -1), _f16(b[:, 2:4]).reshape(rows, -1), sc.reshape(rows, -1),
            mn.reshape(rows, -1))


def _q4_k_super(raw: np.ndarray) -> KParts:
    b, rows = _blocks(raw, 144)
    d, dmin, sc, mn = _k_head(b, rows)
    q = _nibbles(b[:, 16:], 32)  # [n, 256]: sub-blocks in order
    return KParts("q4k", q.reshape(rows, -1), d, dmin, sc, mn)


def _q5_k_super(raw: np.ndarray) -> KParts:
    b, rows = _blocks(raw, 176)
    d, dmin, sc, mn = _k_head(b, rows)
    n = b.shape[0]
    ql = _nibbles(b[:, 48:], 32).reshape(n, 8, 32)  # sub-block s: low nibbles of run s // 2
    qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)  # bit s of qh[l]
    q = (ql | ((qh & np.uint8(1)) << np.uint8(4))).astype(np.int8)
    return KParts("q8k", q.reshape(rows, -1), d, dmin, _halves(sc).astype(np.int8), _halves(mn))  # sc <= 63: int8


def _q6_k_super(raw: np.ndarray) -> KParts:
    b, rows = _blocks(raw, 210)
    n = b.shape[0]
    ql = _nibbles(b[:, :128], 64).reshape(n, 8, 32)
    qh = b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & np.uint8(3)).reshape(n, 8, 32)
    q = (ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(32)
    d = _f16(b[:, 208:210]).reshape(rows, -1)
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).reshape(rows, -1)  # [rows, K/16]
    return KParts("q8k", q.reshape(rows, -1), d, np.zeros_like(d), sc, np.zeros(sc.shape, dtype=np.uint8))


def _per_sub_block(k: KParts, offset: bool = True) -> Parts:
    """A K-quant as q4 ("q4k": per 32) / q8g ("q8k": per 16) `Parts`: d = d·sc_j, m = −dmin·mn_j, both fp32 (the
    kernel rounds them to fp16). Q6_K has no offset (`offset=False`): its m is +0, as the kernels have always held."""
    ds, dm = k.products()
    return Parts("q4" if k.layout == "q4k" else "q8g", k.q, ds, -dm if offset else np.zeros_like(ds))


def _q4_k(raw: np.ndarray) -> Parts:
    return _per_sub_block(_q4_k_super(raw))


def _q5_k(raw: np.ndarray) -> Parts:
    return _per_sub_block(_q5_k_super(raw))


def _q6_k(raw: np.ndarray) -> Parts:
    return _per_sub_block(_q6_k_super(raw), offset=False)


def _float(raw: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return np.ascontiguousarray(raw).view(dtype).astype(np.float32)


def absmax_q8g(w: np.ndarray) -> Parts:
    """A float weight [rows, K] to q8g with one absmax scale per 16 (round to nearest): for F32 / F16 / BF16 files,
    whose linears the native step still runs in 8 bits. Not exact: within half a step, max|w|/254 per 16 weights."""
    rows, k = w.shape
    g = w.reshape(rows, k // 16, 16).astype(np.float32)
    d = np.abs(g).max(-1) / 127  # [rows, K/16]
    d = d.astype(np.float16).astype(np.float32)  # the kernel's scale, so q is rounded against it
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    q = np.clip(np.rint(g * inv[..., None]), -127, 127).astype(np.int8).reshape(rows, k)
    return Parts("q8g", q, d, np.zeros_like(d))


UNPACK: dict[int, Callable[[np.ndarray], Parts]] = {
    T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q4_K: _q4_k,
    T.Q8_0: _q8_0, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
}
FLOATS: dict[int, np.dtype] = {T.F32: np.dtype(np.float32), T.F16: np.dtype(np.float16)}
EXACT = frozenset({T.Q4_0, T.Q4_1, T.Q8_0, T.Q5_0, T.Q5_1})  # kernel values == file values (a zero's sign aside)


def unpack(qtype: int, raw: np.ndarray) -> Parts:
    """Raw rows (uint8 [rows, bytes per row]) of a quantized type -> Parts. KeyError for a type not in UNPACK."""
    return UNPACK[qtype](raw)


def to_float(qtype: int, raw: np.ndarray) -> np.ndarray:
    """Raw rows of any supported type -> fp32 [rows, K] as the file means them (norms, float tables, the float
    model). The quant types go through gguf-py's `dequantize`, the reference: `Parts.dequantize` is the kernel's
    view (K-quant products rounded to fp16), and a·q + m with m = 0 loses the sign of a zero gguf-py keeps (d·q)."""
    if qtype == T.BF16:
        u = np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << 16
        return u.view(np.float32)
    if qtype in FLOATS:
        return _float(raw, FLOATS[qtype])
    if qtype not in UNPACK:
        raise KeyError(qtype)  # as `unpack`: a type sinkchat does not load
    return gguf_dequantize(np.ascontiguousarray(raw), qtype)


UNPACK_K: dict[int, Callable[[np.ndarray], KParts]] = {T.Q4_K: _q4_k_super, T.Q5_K: _q5_k_super, T.Q6_K: _q6_k_super}


def unpack_k(qtype: int, raw: np.ndarray) -> KParts:
    """Raw rows (uint8 [rows, bytes per row]) of Q4_K / Q5_K / Q6_K -> KParts. KeyError for another type."""
    return UNPACK_K[qtype](raw)
