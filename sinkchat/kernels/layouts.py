"""The weight layouts the native kernels read (csrc/layouts.h: sc_q4_block / sc_q4_scales, sc_q8_block, q8g's
sc_q8_block / sc_q8g_scales, the K-quants' q4k / q8k: sc_q4k_scales, sc_q8k_scales, Q6_K's q6k: sc_q6k_block /
sc_q6k_scales, Q4_0's q40: sc_q4_block / sc_q40_scales, and Q8_0's q80: sc_q8_block / sc_q80_scales; the q5 blocks:
model/int5.py): packing from integer values and scales, and unpacking rows back to fp32 in torch. Pure torch, no library: `native` re-exports every function here (`native.pack_q4`,
`native.pack_q8g`, `native.pack_q4k`, ...).
"""

from __future__ import annotations

import torch

import numpy as np

from sinkchat.kernels.abi import Q4K_SCALES, Q6K_SCALES, Q8K_SCALES, QB, QK, RG


def pack_q4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q int [N, K] in 0..15, scale / zero [N, K/32] in torch's convention (w = (q - 8)·scale + zero) -> the
    kernel's layout (csrc/layouts.h: sc_q4_block, sc_q4_scales): qw uint8 [N/16, K/32, 4, 16, 4] (sub-block s,
    row r, byte t: q[r, 8s+t] low nibble, q[r, 8s+4+t] high nibble) and sw fp16 [N/16, K/32, 2, 16] (d = scale,
    m = zero - 8·scale: w = d·q + m).

    fp16, as ggml's Q4_1 stores d and m, so a Q4_1 GGUF is held exactly. Not bf16 (torch's kernel's choice): m is a
    block's minimum, ~8 steps from zero, and bf16's 8-bit mantissa shifted every weight of a block by up to 1.5%
    of a step, the same way (+0.8% perplexity on the bundled model, measured)."""
    return pack_q4_dm(q, scale, zero.double() - 8 * scale.double())


def pack_q4_dm(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack_q4` for weights given as w = d·q + m (a GGUF's own d and m): each rounded to fp16 once, so fp16 values
    are stored exactly (via torch's zero = m + 8·d, m would be rounded twice)."""
    n, k = q.shape
    if n % RG or k % QB or d.shape != (n, k // QB) or m.shape != (n, k // QB):
        raise ValueError(f"q4 weights {tuple(q.shape)}, d {tuple(d.shape)}, m {tuple(m.shape)}: want N % {RG} == 0, "
                         f"K % {QB} == 0, d and m [N, K/{QB}]")
    qw = _nibble_blocks(q)
    dm = torch.stack([d.to(torch.float16), m.to(torch.float16)], -1)  # [N, K/32, 2]
    sw = dm.reshape(n // RG, RG, k // QB, 2).permute(0, 2, 3, 1).contiguous()  # [g, b, 2, r]
    return qw, sw


def pack_q40(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q4_0 at its own bits: q [N, K] in 0..15 and d [N, K/32] (fp16 values; stored fp16), w = d·(q − 8)
    -> (qw, sw): qw the q4 nibbles, uint8 [N/16, K/32, 4, 16, 4] (as `pack_q4`), and sw fp16 [N/16, K/32, 16]
    (sc_q40_scales: block b's d of rows 16g..16g+15). 16 + 2 bytes per row and 32 weights, the file's 18: no m is
    stored; the kernels form m = −8·d in fp32 (exact), the value `pack_q4` held, so the same bits as q4."""
    n, k = q.shape
    if n % RG or k % QB or d.shape != (n, k // QB):
        raise ValueError(f"q40 weights {tuple(q.shape)}, d {tuple(d.shape)}: want N % {RG} == 0, K % {QB} == 0, "
                         f"d [N, K/{QB}]")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError("q40 values outside 0..15")
    sw = d.to(torch.float16).reshape(n // RG, RG, k // QB).permute(0, 2, 1)  # [g, b, r]
    return _nibble_blocks(q), sw.contiguous()


def q40_unpack(qw: torch.Tensor, sw: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The weights of a `pack_q40` layout in fp32, [N, K] (or rows `rows` [n]: [n, K]): d·(q − 8) in fp32, as
    gguf-py's dequantize computes Q4_0 (exact, signed zeros included: the two agree bit for bit)."""
    if rows is None:
        b = qw.permute(0, 3, 1, 2, 4).reshape(qw.shape[0] * RG, qw.shape[1], 4, 4)  # [N, K/32, s, t]
        d = sw.permute(0, 2, 1).reshape(sw.shape[0] * RG, -1)  # [N, K/32]
    else:
        b = qw[rows // RG, :, :, rows % RG, :]  # [n, K/32, s, t]
        d = sw[rows // RG, :, rows % RG]  # [n, K/32]
    q = torch.stack([b & 15, b >> 4], -2).float().reshape(b.shape[0], b.shape[1], QB)  # [n, K/32, 32]: 8s + 4h + t
    return (d.float()[..., None] * (q - 8)).reshape(b.shape[0], b.shape[1] * QB)


def q40_gguf_bytes(qw: torch.Tensor, sw: torch.Tensor) -> np.ndarray:
    """A `pack_q40` layout back to the GGUF tensor's own bytes, uint8 [N, K/32 · 18] (per block: fp16 d, then 16
    bytes with weight j in the low nibble of byte j and weight j + 16 in the high one): every bit the file had, from
    nothing but what is held (tests, benchmarks/q4_0_bits.py)."""
    n, nb = qw.shape[0] * RG, qw.shape[1]
    b = qw.permute(0, 3, 1, 2, 4).reshape(n, nb, 4, 4)  # [N, K/32, s, t]
    q = torch.stack([b & 15, b >> 4], -2).reshape(n, nb, QB)  # [N, K/32, 32] in column order
    qs = q[..., :16] | (q[..., 16:] << 4)  # [N, K/32, 16]
    d = sw.permute(0, 2, 1).reshape(n, nb, 1).contiguous().view(torch.uint8)  # [N, K/32, 2]
    return torch.cat([d, qs], -1).reshape(n, nb * 18).numpy()


def _nibble_blocks(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] in 0..15 -> sc_q4_blocks, uint8 [N/16, K/32, 4, 16, 4] (sub-block s, row r, byte t: q[r, 8s+t] in the
    low nibble, q[r, 8s+4+t] in the high one)."""
    n, k = q.shape
    qq = q.to(torch.uint8).reshape(n // RG, RG, k // QB, 4, 2, 4)  # [g, r, b, s, half, t]: k = 32b + 8s + 4half + t
    return (qq[..., 0, :] | (qq[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).contiguous()  # [g, b, s, r, t]


def _byte_blocks(q: torch.Tensor) -> torch.Tensor:
    """int8 q [N, K] -> sc_q8_blocks, uint8 (q + 128) [N/16, K/32, 8, 16, 4] (sub-block s, row r, byte t is
    q[r, 32b + 4s + t])."""
    n, k = q.shape
    u = q.contiguous().view(torch.uint8) ^ 128  # two's complement: q + 128 as a byte
    return u.reshape(n // RG, RG, k // QB, QB // 4, 4).permute(0, 2, 3, 1, 4).contiguous()  # [g, b, s, r, t]


def pack_q8g(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 q [N, K] with d, m [N, K/16] (w = d·q + m per 16 weights along K) -> the q8g layout (csrc/kernels.h):
    hw uint8 (q + 128) [N/16, K/32, 8, 16, 4] (sc_q8_block: sub-block s, row r, byte t is w[r, 32b + 4s + t]) and
    sw fp16 [N/16, K/32, 2, 2, 16] (sc_q8g_scales: [d | m][half][row]; half 0 is columns 32b..32b+15).

    For llama.cpp's 5-, 6- and 8-bit blocks (Q5_0/Q5_1/Q5_K/Q6_K/Q8_0): each is d·q + m with q in -128..127 and a
    d, m per 16 or per 32 (repeat it), held exactly where d and m are fp16 values. N % 16 == 0, K % 32 == 0."""
    n, k = q.shape
    if n % RG or k % QB or d.shape != (n, k // 16) or m.shape != (n, k // 16) or q.dtype != torch.int8:
        raise ValueError(f"q8g weights {tuple(q.shape)} {q.dtype}, d {tuple(d.shape)}, m {tuple(m.shape)}: want int8, "
                         f"N % {RG} == 0, K % {QB} == 0, d and m [N, K/16]")
    hw = _byte_blocks(q)
    dm = torch.stack([d.to(torch.float16), m.to(torch.float16)], -1)  # [N, K/16, 2]: (d, m)
    sw = dm.reshape(n // RG, RG, k // QB, 2, 2).permute(0, 2, 4, 3, 1).contiguous()  # [g, b, d|m, half, r]
    return hw, sw


def pack_q80(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8_0 at its own bits: int8 q [N, K] and d [N, K/32] (fp16 values; stored fp16), w = d·q -> (hw,
    sw): hw the q8 bytes (q + 128), uint8 [N/16, K/32, 8, 16, 4] (as `pack_q8g`), and sw fp16 [N/16, K/32, 16]
    (sc_q80_scales: block b's d of rows 16g..16g+15). 32 + 2 bytes per row and 32 weights, the file's 34, where q8g
    held 40 (d and m = 0 per 16); the kernels run q8g's loop with d for both halves and m = +0: q8g's bits."""
    n, k = q.shape
    if n % RG or k % QB or d.shape != (n, k // QB) or q.dtype != torch.int8:
        raise ValueError(f"q80 weights {tuple(q.shape)} {q.dtype}, d {tuple(d.shape)}: want int8, N % {RG} == 0, "
                         f"K % {QB} == 0, d [N, K/{QB}]")
    sw = d.to(torch.float16).reshape(n // RG, RG, k // QB).permute(0, 2, 1)  # [g, b, r]
    return _byte_blocks(q), sw.contiguous()


def q80_unpack(hw: torch.Tensor, sw: torch.Tensor, rows: torch.Tensor | int | None = None) -> torch.Tensor:
    """The weights of a `pack_q80` layout in fp32, [N, K] (or rows `rows` [n]: [n, K]; one row `rows` int: [1, K],
    views, no gather): d·q in fp32, exact, as gguf-py's dequantize computes Q8_0 (bit for bit)."""
    k = hw.shape[1] * QB
    if isinstance(rows, int):
        u, d = hw[rows // RG, :, :, rows % RG, :].reshape(1, k), sw[rows // RG, :, rows % RG].reshape(1, -1)
    elif rows is None:
        u = hw.permute(0, 3, 1, 2, 4).reshape(hw.shape[0] * RG, k)  # [N, K]: [g, r, b, s, t]
        d = sw.permute(0, 2, 1).reshape(sw.shape[0] * RG, -1)  # [N, K/32]
    else:
        u, d = hw[rows // RG, :, :, rows % RG, :].reshape(len(rows), k), sw[rows // RG, :, rows % RG]
    q = (u.to(torch.int16) - 128).float().reshape(u.shape[0], k // QB, QB)  # [n, K/32, 32]
    return (d.float()[..., None] * q).reshape(u.shape)


def q80_gguf_bytes(hw: torch.Tensor, sw: torch.Tensor) -> np.ndarray:
    """A `pack_q80` layout back to the GGUF tensor's own bytes, uint8 [N, K/32 · 34] (per block: fp16 d, then the 32
    int8 q in column order): every bit the file had, from what is held (tests, benchmarks)."""
    n, nb = hw.shape[0] * RG, hw.shape[1]
    q = (hw.permute(0, 3, 1, 2, 4).reshape(n, nb, QB) ^ 128)  # [N, K/32, 32]: q as a two's-complement byte
    d = sw.permute(0, 2, 1).reshape(n, nb, 1).contiguous().view(torch.uint8)  # [N, K/32, 2]
    return torch.cat([d, q], -1).reshape(n, nb * 34).numpy()


def q8g_unpack(hw: torch.Tensor, sw: torch.Tensor, rows: torch.Tensor | int | None = None) -> torch.Tensor:
    """The weights of a `pack_q8g` layout in fp32, [N, K] (or rows `rows` [n] only: [n, K]; one row `rows` int:
    [1, K]), from the bytes and scales directly: d·q is exact in fp32 (11 x 8 bits), so each weight is d·q + m
    rounded once."""
    k = hw.shape[1] * QB
    if isinstance(rows, int):  # views, no gather
        u = hw[rows // RG, :, :, rows % RG, :].reshape(1, k)  # [1, K]
        dm = sw[rows // RG, :, :, :, rows % RG].transpose(-1, -2).reshape(1, k // 16, 2)  # [1, K/16, 2]
    elif rows is None:
        u = hw.permute(0, 3, 1, 2, 4).reshape(hw.shape[0] * RG, k)  # [N, K]: [g, r, b, s, t]
        dm = sw.permute(0, 4, 1, 3, 2).reshape(sw.shape[0] * RG, k // 16, 2)  # [N, K/16, 2]: [g, r, b, half, d|m]
    else:
        u = hw[rows // RG, :, :, rows % RG, :].reshape(len(rows), k)  # [n, K]
        dm = sw[rows // RG, :, :, :, rows % RG].transpose(-1, -2).reshape(len(rows), k // 16, 2)  # [n, K/16, 2]
    q = (u.to(torch.int16) - 128).float().reshape(u.shape[0], k // 16, 16)  # [n, K/16, 16]
    return (q * dm[..., :1].float() + dm[..., 1:].float()).reshape(u.shape)


def q4_unpack(qw: torch.Tensor, sw: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The weights of a `pack_q4` layout in fp32, [N, K] (or rows `rows` [n]: [n, K]), from nibbles and scales."""
    if rows is None:
        b = qw.permute(0, 3, 1, 2, 4).reshape(qw.shape[0] * RG, qw.shape[1], 4, 4)  # [N, K/32, s, t]
        dm = sw.permute(0, 3, 1, 2).reshape(sw.shape[0] * RG, -1, 2)  # [N, K/32, d|m]
    else:
        b = qw[rows // RG, :, :, rows % RG, :]  # [n, K/32, s, t]
        dm = sw[rows // RG, :, :, rows % RG]  # [n, K/32, d|m]
    q = torch.stack([b & 15, b >> 4], -2).float().reshape(b.shape[0], b.shape[1], QB)  # [n, K/32, 32]: 8s + 4h + t
    return (q * dm[..., :1].float() + dm[..., 1:].float()).reshape(b.shape[0], b.shape[1] * QB)


def pack_q8(q: torch.Tensor) -> torch.Tensor:
    """int8 [V, K] -> uint8 (q + 128) [V/16, K/4, 16, 4] (csrc/layouts.h: sc_q8_block [V/16][K/32]), padded to a
    multiple of 16 rows with q = 0 (stored 128; their scale is 0, so they project to 0 and are cut off)."""
    v, k = q.shape
    pad = (-v) % RG
    u = q.view(torch.uint8) ^ 128  # two's complement: q + 128 as a byte
    if pad:
        u = torch.cat([u, torch.full((pad, k), 128, dtype=torch.uint8)])
    return u.reshape(-1, RG, k // 4, 4).permute(0, 2, 1, 3).contiguous()


def q8_rows(hw: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [...] of a `pack_q8` table as int16 [..., K] (embedding lookups read the head's one copy)."""
    rows = hw[ids // RG, :, ids % RG, :]  # [..., K/4, 4]
    return rows.reshape(*ids.shape, -1).to(torch.int16) - 128


# ---- K-quants: q4k (sc_q4_block + sc_q4k_scales), q8k (sc_q8_block + sc_q8k_scales) --------------------------------
def _exact(t: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    """`t` as `dtype`, refusing values that type cannot hold (a wrapped scale would be a silently wrong weight)."""
    out = t.to(dtype)
    if t.dtype != dtype and not torch.equal(out.to(t.dtype), t):
        raise ValueError(f"{what} has values outside {dtype}")
    return out


def _k_scales(d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """Per-row super-block scales -> sc_q8k_scales as bytes, uint8 [N/16, K/256, size]: fp16 d[16],
    dmin[16], then sc[j][16], mn[j][16] (j the sub-blocks of a super-block; sc, mn [N, K/256, j] one byte each)."""
    n, s, j = sc.shape
    f16 = torch.stack([d.to(torch.float16), dmin.to(torch.float16)], -1)  # [N, S, 2]
    f16 = f16.reshape(n // RG, RG, s, 2).permute(0, 2, 3, 1).contiguous().view(torch.uint8)  # [g, S, 2, 32 bytes]
    ints = torch.stack([sc.contiguous().view(torch.uint8), mn], -2)  # [N, S, 2, j]
    ints = ints.reshape(n // RG, RG, s, 2, j).permute(0, 2, 3, 4, 1)  # [g, S, sc|mn, j, r]
    return torch.cat([f16.reshape(n // RG, s, -1), ints.reshape(n // RG, s, -1)], -1).contiguous()


def _check_k(name: str, q: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor,
             sub: int) -> None:
    n, k = q.shape
    if (n % RG or k % QK or d.shape != (n, k // QK) or dmin.shape != (n, k // QK) or sc.shape != (n, k // sub)
            or mn.shape != (n, k // sub)):
        raise ValueError(f"{name} weights {tuple(q.shape)}, d {tuple(d.shape)}, dmin {tuple(dmin.shape)}, sc "
                         f"{tuple(sc.shape)}, mn {tuple(mn.shape)}: want N % {RG} == 0, K % {QK} == 0, d and dmin "
                         f"[N, K/{QK}], sc and mn [N, K/{sub}]")


def pack_q4k(q: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q4_K held at its own size: q [N, K] in 0..15, d and dmin [N, K/256] (fp32 holding fp16 values:
    stored fp16), sc and mn [N, K/32] in 0..63 (Q4_K's 6 bits) -> (qw, sw): qw the q4 nibbles, uint8 [N/16, K/32, 4,
    16, 4], and sw the sc_q4k_scales bytes, uint8 [N/16, K/256, 256]: fp16 d[16], dmin[16], then three uint32 words
    a row, w[3][16], holding v = (sc_0..7, mn_0..7): v_k (k < 15) at bits 6(k % 5) of w[k / 5], v_15's bits 2i..2i+1
    at bits 30..31 of w[i]. 144 bytes per row and 256 weights, the file's (ABI 11 held sc, mn a byte each: 148).
    w = (d·sc_j)·q − (dmin·mn_j) per 32 along K."""
    _check_k("q4k", q, d, dmin, sc, mn, QB)
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError("q4k values outside 0..15")
    return _nibble_blocks(q), q4k_scale_words(d, dmin, sc, mn)


def q4k_scale_words(d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """d, dmin [N, K/256] and 6-bit sc, mn [N, K/32] -> the sc_q4k_scales bytes, uint8 [N/16, K/256, 256] (`pack_q4k`;
    Q5_K's q5k takes the same)."""
    n = d.shape[0]
    sc8, mn8 = _exact(sc, torch.uint8, "q4k sc"), _exact(mn, torch.uint8, "q4k mn")
    if sc8.numel() and (int(sc8.max()) > 63 or int(mn8.max()) > 63):
        raise ValueError("q4k sc / mn outside 0..63 (Q4_K's 6 bits)")
    s = d.shape[1]
    v = torch.cat([sc8.reshape(n, s, 8), mn8.reshape(n, s, 8)], -1).to(torch.int64)  # [N, S, 16]
    words = torch.zeros(n, s, 3, dtype=torch.int64)
    for i in range(15):
        words[..., i // 5] |= v[..., i] << (6 * (i % 5))
    for i in range(3):
        words[..., i] |= ((v[..., 15] >> (2 * i)) & 3) << 30
    w32 = words.to(torch.int32)  # the low 32 bits (two's complement: bit 31 as set)
    f16 = torch.stack([d.to(torch.float16), dmin.to(torch.float16)], -1)  # [N, S, 2]
    f16 = f16.reshape(n // RG, RG, s, 2).permute(0, 2, 3, 1).contiguous().view(torch.uint8)  # [g, S, 2, 32 bytes]
    w32 = w32.reshape(n // RG, RG, s, 3).permute(0, 2, 3, 1).contiguous().view(torch.uint8)  # [g, S, 3, 64 bytes]
    sw = torch.cat([f16.reshape(n // RG, s, -1), w32.reshape(n // RG, s, -1)], -1).contiguous()
    assert sw.shape[-1] == Q4K_SCALES
    return sw


def q4k_fields(sw: torch.Tensor, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """From sc_q4k_scales bytes [N/16, S, 256]: per row (all, or `rows` [n]) ds = d·sc and dm = dmin·mn, fp32 [n, S,
    8] (products of an fp16 and a 6-bit integer: exact), the 6-bit values taken from the words as the kernels do."""
    t = sw if rows is None else sw[rows // RG]  # [G or n, S, 256]
    g, s = t.shape[:2]
    f16 = t[..., : 4 * RG].contiguous().view(torch.float16).reshape(g, s, 2, RG).float()  # [., S, d|dmin, r]
    w = t[..., 4 * RG :].contiguous().view(torch.int32).reshape(g, s, 3, RG).to(torch.int64) & 0xFFFFFFFF
    v = [(w[:, :, i // 5] >> (6 * (i % 5))) & 63 for i in range(15)]  # [., S, r] each
    v.append(sum(((w[:, :, i] >> 30) & 3) << (2 * i) for i in range(3)))
    sc, mn = torch.stack(v[:8], 2).float(), torch.stack(v[8:], 2).float()  # [., S, j, r]
    return _row_products(f16, sc, mn, rows)


def pack_q8k(q: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q6_K (dmin = 0, mn = 0) or Q5_K (each 32-weight sc / mn given for both its 16-halves) held as it
    is: q int8 [N, K], d and dmin [N, K/256] (fp16 values, stored fp16), sc int8 and mn uint8 [N, K/16] -> (hw, sw):
    hw the q8 bytes (q + 128), uint8 [N/16, K/32, 8, 16, 4], and sw the sc_q8k_scales bytes, uint8 [N/16, K/256,
    576]. w = (d·sc_j)·q − (dmin·mn_j) per 16 along K."""
    _check_k("q8k", q, d, dmin, sc, mn, 16)
    n, k = q.shape
    if q.dtype != torch.int8:
        raise ValueError(f"q8k weights {q.dtype}: want int8")
    sc8, mn8 = _exact(sc, torch.int8, "q8k sc"), _exact(mn, torch.uint8, "q8k mn")
    sw = _k_scales(d, dmin, sc8.reshape(n, k // QK, 16), mn8.reshape(n, k // QK, 16))
    assert sw.shape[-1] == Q8K_SCALES
    return _byte_blocks(q), sw


def _k_fields(sw: torch.Tensor, rows: torch.Tensor | None, j: int, sc_dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """From sc_q8k_scales bytes [N/16, S, size]: per row (all, or `rows` [n]) ds = d·sc and dm =
    dmin·mn, fp32 [n, S, j] (products of an fp16 and a small integer: exact)."""
    t = sw if rows is None else sw[rows // RG]  # [G or n, S, size]
    g, s = t.shape[:2]
    f16 = t[..., : 4 * RG].contiguous().view(torch.float16).reshape(g, s, 2, RG).float()  # [., S, d|dmin, r]
    ints = t[..., 4 * RG :].contiguous().reshape(g, s, 2, j, RG)  # [., S, sc|mn, j, r]
    sc, mn = ints[:, :, 0].view(sc_dtype).float(), ints[:, :, 1].float()  # [., S, j, r]
    return _row_products(f16, sc, mn, rows)


def _row_products(f16: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor, rows: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """K-quant scales of row groups, d|dmin f16 [., S, 2, r] and sc / mn [., S, j, r] fp32, per row (all, or `rows`
    [n]): ds = d·sc and dm = dmin·mn, fp32 [n, S, j]."""
    g, s = f16.shape[:2]
    if rows is None:
        f16, sc, mn = f16.permute(0, 3, 1, 2), sc.permute(0, 3, 1, 2), mn.permute(0, 3, 1, 2)  # [g, r, S, .]
        f16, sc, mn = (x.reshape(g * RG, s, -1) for x in (f16, sc, mn))
    else:
        i, r = torch.arange(len(rows)), rows % RG
        f16, sc, mn = f16[i, :, :, r], sc[i, :, :, r], mn[i, :, :, r]  # [n, S, .]
    return f16[..., :1] * sc, f16[..., 1:] * mn


def q4k_unpack(qw: torch.Tensor, sw: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The weights of a `pack_q4k` layout in fp32, [N, K] (or rows `rows` [n]: [n, K]): (d·sc)·q − (dmin·mn) in
    fp32, in that order, as gguf-py's dequantize computes Q4_K (so the two agree bit for bit)."""
    if rows is None:
        b = qw.permute(0, 3, 1, 2, 4).reshape(-1, qw.shape[1], 4, 4)  # [N, K/32, s, t]
    else:
        b = qw[rows // RG, :, :, rows % RG, :]  # [n, K/32, s, t]
    q = torch.stack([b & 15, b >> 4], -2).float()  # [n, K/32, s, half, t]: column 8s + 4half + t of the block
    ds, dm = q4k_fields(sw, rows)  # [n, S, 8]
    q = q.reshape(b.shape[0], sw.shape[1], 8, QB)  # [n, S, j, 32]
    return (ds[..., None] * q - dm[..., None]).reshape(b.shape[0], qw.shape[1] * QB)


def q8k_unpack(hw: torch.Tensor, sw: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The weights of a `pack_q8k` layout in fp32, [N, K] (or rows `rows` [n]: [n, K]): (d·sc)·q − (dmin·mn) in
    fp32, as gguf-py's dequantize computes Q5_K (Q6_K's (d·sc)·q − 0 is the same number)."""
    k = hw.shape[1] * QB
    if rows is None:
        u = hw.permute(0, 3, 1, 2, 4).reshape(-1, k)  # [N, K]: [g, r, b, s, t]
    else:
        u = hw[rows // RG, :, :, rows % RG, :].reshape(len(rows), k)  # [n, K]
    q = (u.to(torch.int16) - 128).float().reshape(u.shape[0], sw.shape[1], 16, 16)  # [n, S, j, 16]
    ds, dm = _k_fields(sw, rows, 16, torch.int8)  # [n, S, 16]
    return (ds[..., None] * q - dm[..., None]).reshape(u.shape[0], k)


# ---- q6k: Q6_K at its own 6.56 bits (sc_q6k_block + sc_q6k_scales) ------------------------------------------------
def pack_q6k(q: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q6_K at its own size: q int8 [N, K] in −32..31, d [N, K/256] (fp16 values, stored fp16), sc int8
    [N, K/16]; dmin and mn (`pack_q8k`'s arguments, so a `KParts` packs either way) must be all zero -> (qw, sw): qw
    uint8 [N/16, K/32, 6, 16, 4] (sc_q6k_block: [:, :, :4] the q4 nibble tile of u = q + 32, [:, :, 4:] the two
    planes of its high 2 bits, sub-block s = 4p + i at bits 2i of plane p) and sw the sc_q6k_scales bytes, uint8
    [N/16, K/256, 288]. 210 bytes per row and 256 weights: the file's, where q8k holds 292."""
    _check_k("q6k", q, d, dmin, sc, mn, 16)
    n, k = q.shape
    if q.dtype != torch.int8 or (q.numel() and (int(q.min()) < -32 or int(q.max()) > 31)):
        raise ValueError(f"q6k weights {q.dtype}: want int8 in -32..31")
    if bool(dmin.ne(0).any()) or bool(mn.ne(0).any()):
        raise ValueError("q6k has no mins: dmin and mn must be 0 (Q5_K goes to q8k)")
    u = (q.to(torch.int16) + 32).to(torch.uint8)  # [N, K] in 0..63
    hi = (u >> 4).reshape(n // RG, RG, k // QB, 2, 4, 4)  # [g, r, b, p, i, t]: column 32b + 16p + 4i + t
    planes = hi[..., 0, :] | (hi[..., 1, :] << 2) | (hi[..., 2, :] << 4) | (hi[..., 3, :] << 6)  # [g, r, b, p, t]
    qw = torch.cat([_nibble_blocks(u & 15), planes.permute(0, 2, 3, 1, 4)], 2).contiguous()  # [g, b, 6, r, t]
    f16 = d.to(torch.float16).reshape(n // RG, RG, k // QK).permute(0, 2, 1).contiguous().view(torch.uint8)
    sc8 = _exact(sc, torch.int8, "q6k sc").reshape(n // RG, RG, k // QK, 16).permute(0, 2, 3, 1)  # [g, S, j, r]
    sw = torch.cat([f16, sc8.contiguous().view(torch.uint8).reshape(n // RG, k // QK, 16 * RG)], -1).contiguous()
    assert sw.shape[-1] == Q6K_SCALES
    return qw, sw


def _q6k_u(qw: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """u = q + 32 of a `pack_q6k` layout's rows (all, or `rows` [n]), uint8 [n, K/32, 32] in column order."""
    b = qw.permute(0, 3, 1, 2, 4).reshape(-1, qw.shape[1], 6, 4) if rows is None else qw[rows // RG, :, :, rows % RG]
    lo = torch.stack([b[:, :, :4] & 15, b[:, :, :4] >> 4], -2)  # [n, K/32, s, half, t]: column 8s + 4half + t
    hi = torch.stack([(b[:, :, 4:] >> (2 * i)) & 3 for i in range(4)], -2)  # [n, K/32, p, i, t]: 16p + 4i + t
    return lo.reshape(b.shape[0], b.shape[1], QB) | (hi.reshape(b.shape[0], b.shape[1], QB) << 4)


def _q6k_scales(sw: torch.Tensor, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """d fp16 [n, K/256] and sc int8 [n, K/256, 16] of a `pack_q6k` layout's rows (all, or `rows` [n])."""
    g, s = sw.shape[:2]
    d = sw[..., : 2 * RG].contiguous().view(torch.float16)  # [g, S, r]
    sc = sw[..., 2 * RG :].contiguous().view(torch.int8).reshape(g, s, 16, RG)  # [g, S, j, r]
    if rows is None:
        return d.permute(0, 2, 1).reshape(g * RG, s), sc.permute(0, 3, 1, 2).reshape(g * RG, s, 16)
    return d[rows // RG, :, rows % RG], sc[rows // RG, :, :, rows % RG]


def q6k_unpack(qw: torch.Tensor, sw: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The weights of a `pack_q6k` layout in fp32, [N, K] (or rows `rows` [n]: [n, K]): (d·sc)·q in fp32, as
    gguf-py's dequantize computes Q6_K (so the two agree bit for bit)."""
    u = _q6k_u(qw, rows)  # [n, K/32, 32]
    d, sc = _q6k_scales(sw, rows)
    ds = d.float()[..., None] * sc.float()  # [n, S, 16]: exact
    q = (u.to(torch.int16) - 32).float().reshape(u.shape[0], sw.shape[1], 16, 16)  # [n, S, j, 16]
    return (ds[..., None] * q).reshape(u.shape[0], qw.shape[1] * QB)


def q6k_gguf_bytes(qw: torch.Tensor, sw: torch.Tensor) -> np.ndarray:
    """A `pack_q6k` layout back to the GGUF tensor's own bytes, uint8 [N, K/256 · 210] (per block ggml's block_q6_K:
    ql[128] (per 128-half: weights l and l + 64 in the low / high nibble of byte l), qh[64] (per half: weight
    l + 32i at bits 2i of byte l), int8 scales[16], fp16 d): every bit the file had, from what is held."""
    u = _q6k_u(qw, None).reshape(-1, sw.shape[1], 2, 128)  # [N, S, half, 128]
    lo, hi = u & 15, u >> 4
    ql = lo[..., :64] | (lo[..., 64:] << 4)  # [N, S, 2, 64]
    qh = hi[..., :32] | (hi[..., 32:64] << 2) | (hi[..., 64:96] << 4) | (hi[..., 96:] << 6)  # [N, S, 2, 32]
    d, sc = _q6k_scales(sw, None)
    n, s = d.shape
    parts = [ql.reshape(n, s, 128), qh.reshape(n, s, 64), sc.contiguous().view(torch.uint8),
             d.contiguous().view(torch.uint8).reshape(n, s, 2)]
    return torch.cat(parts, -1).reshape(n, s * 210).numpy()
