"""Llama.cpp's 5-bit types at their own bits: the q5 blocks (csrc/layouts.h: sc_q5_block) and their linears,
`Int5Q0Linear` ("q50": Q5_0), `Int5Q1Linear` ("q51": Q5_1) and `Int5KLinear` ("q5k": Q5_K).

Why: each is u = a 5-bit integer (0..31) with a scale per 32 weights: Q5_0 w = d·(u − 16), Q5_1 w = d·u + m, Q5_K
w = (d·sc_j)·u − dmin·mn_j (6-bit sc, mn per 32, fp16 d, dmin per 256). q8g / q8k held them a byte a weight with
fp16 scales per 16 (q8g: 1.25 bytes a weight against Q5_0's 0.6875 and Q5_1's 0.75; q8k: 1.14 against Q5_K's
0.6875), so a Q5_K_M file's tensors took ~1.7x their size and decode read as much more. Here the bytes are the
file's: u's low 4 bits as the q4 layouts' nibble tile and one bit-plane of the fifth bit over the q8 layout's
[row][byte] tile (bit s of a byte: sub-block s), 320 bytes per 16 rows and 32; the scales are q80's (Q5_0: d),
q4's (Q5_1: d, m) and q4k's words (Q5_K). The kernels (`native.q50_matmul`, ... : csrc/rows*.h q5_bytes) rebuild
q8g's / q8k's bytes in the 8-bit loops' weight-unpack step and run those loops, so every output has the bits q8g /
q8k gave for the same tensor; `dequantized` / `rows` are gguf-py's dequantize bit for bit.

Buffers `qw` (uint8 [N/16, K/32, 5, 16, 4]) and `sw` (q50: fp16 [N/16, K/32, 16]; q51: fp16 [N/16, K/32, 2, 16];
q5k: uint8 [N/16, K/256, 256]), row groups of 16 first (tables assembled from row chunks, fused projections split
at 16-row boundaries without a copy). Plain attributes are ints and strs only (gguf_packed saves a module as class
name + attributes + buffers).
"""

from __future__ import annotations

import torch

from sinkchat.kernels import layouts, native
from sinkchat.kernels.abi import Q4K_SCALES, QB, QK, RG
from sinkchat.model.packed_linear import PackedLinear


# ---- the layouts -------------------------------------------------------------------------------------------------
def _q5_blocks(u: torch.Tensor, what: str) -> torch.Tensor:
    """u [N, K] in 0..31 -> sc_q5_blocks, uint8 [N/16, K/32, 5, 16, 4]: the nibble tile of u & 15, then the plane
    (bit s of byte [r][t] is bit 4 of u[r, 32b + 4s + t])."""
    n, k = u.shape
    if n % RG or k % QB:
        raise ValueError(f"{what} weights {tuple(u.shape)}: want N % {RG} == 0, K % {QB} == 0")
    if u.numel() and (int(u.min()) < 0 or int(u.max()) > 31):
        raise ValueError(f"{what} values outside 0..31 (5 bits)")
    u = u.to(torch.uint8)
    bit = ((u >> 4) & 1).reshape(n // RG, RG, k // QB, 8, 4)  # [g, r, b, s, t]
    plane = sum(bit[..., s, :] << s for s in range(8)).to(torch.uint8)  # [g, r, b, t]
    return torch.cat([layouts._nibble_blocks(u & 15), plane.permute(0, 2, 1, 3)[:, :, None]], 2).contiguous()


def _q5_u(qw: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """u of a q5 layout's rows (all, or `rows` [n]), uint8 [n, K/32, 32] in column order."""
    b = qw.permute(0, 3, 1, 2, 4).reshape(-1, qw.shape[1], 5, 4) if rows is None else qw[rows // RG, :, :, rows % RG]
    lo = torch.stack([b[:, :, :4] & 15, b[:, :, :4] >> 4], -2)  # [n, K/32, s', half, t]: column 8s' + 4half + t
    hi = torch.stack([(b[:, :, 4] >> s) & 1 for s in range(8)], -2)  # [n, K/32, s, t]: column 4s + t
    return lo.reshape(b.shape[0], b.shape[1], QB) | (hi.reshape(b.shape[0], b.shape[1], QB) << 4)


def _per_block(x: torch.Tensor, n: int, k: int, what: str) -> torch.Tensor:
    """A per-32 scale [N, K/32] (or a loader's per-16 one with equal halves) as fp16 [N/16, K/32, 16]."""
    if x.shape == (n, k // 16):
        if not torch.equal(x[:, ::2], x[:, 1::2]):
            raise ValueError(f"{what}: per-16 values whose halves differ (not a per-32 type)")
        x = x[:, ::2]
    if x.shape != (n, k // QB):
        raise ValueError(f"{what} {tuple(x.shape)}: want [N, K/{QB}]")
    return x.to(torch.float16).reshape(n // RG, RG, k // QB).permute(0, 2, 1).contiguous()  # [g, b, r]


def pack_q50(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_0: q [N, K] in −16..15, d [N, K/32] (or per 16, equal halves) -> (qw, sw fp16 [N/16, K/32, 16]): 22 bytes
    a row and block, the file's."""
    n, k = q.shape
    return _q5_blocks(q.to(torch.int16) + 16, "q50"), _per_block(d, n, k, "q50 d")


def pack_q51(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_1: q [N, K] in 0..31, d and m [N, K/32] (or per 16) -> (qw, sw fp16 [N/16, K/32, 2, 16]: d then m, as
    sc_q4_scales): 24 bytes a row and block, the file's."""
    n, k = q.shape
    sw = torch.stack([_per_block(d, n, k, "q51 d"), _per_block(m, n, k, "q51 m")], 2).contiguous()
    return _q5_blocks(q, "q51"), sw


def pack_q5k(q: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_K: q [N, K] in 0..31, d and dmin [N, K/256], 6-bit sc and mn per 32 [N, K/32] (or `pack_q8k`'s per 16,
    equal halves, so a Q5_K `KParts` packs either way) -> (qw, sw: sc_q4k_scales bytes [N/16, K/256, 256]): 176
    bytes a row and 256, the file's."""
    n, k = q.shape
    if k % QK or d.shape != (n, k // QK) or dmin.shape != (n, k // QK):
        raise ValueError(f"q5k weights {tuple(q.shape)}, d {tuple(d.shape)}: want K % {QK} == 0, d [N, K/{QK}]")
    per32 = []
    for x, what in ((sc, "q5k sc"), (mn, "q5k mn")):
        if x.shape == (n, k // 16) and torch.equal(x[:, ::2], x[:, 1::2]):
            x = x[:, ::2]
        if x.shape != (n, k // QB):
            raise ValueError(f"{what} {tuple(x.shape)}: want [N, K/{QB}] (or per 16 with equal halves)")
        per32.append(x)
    return _q5_blocks(q, "q5k"), layouts.q4k_scale_words(d, dmin, *per32)


def q50_unpack(qw: torch.Tensor, sw: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """d·(u − 16) in fp32 (exact), as gguf-py's dequantize computes Q5_0: [N, K] or rows `rows` [n, K]."""
    u = _q5_u(qw, rows)
    d = sw.permute(0, 2, 1).reshape(-1, sw.shape[1]) if rows is None else sw[rows // RG, :, rows % RG]
    return (d.float()[..., None] * (u.float() - 16)).reshape(u.shape[0], qw.shape[1] * QB)


def q51_unpack(qw: torch.Tensor, sw: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """d·u + m in fp32 (one rounding), as gguf-py's dequantize computes Q5_1."""
    u = _q5_u(qw, rows)
    dm = sw.permute(0, 3, 1, 2).reshape(-1, sw.shape[1], 2) if rows is None else sw[rows // RG, :, :, rows % RG]
    return (dm[..., :1].float() * u.float() + dm[..., 1:].float()).reshape(u.shape[0], qw.shape[1] * QB)


def q5k_unpack(qw: torch.Tensor, sw: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """(d·sc)·u − (dmin·mn) in fp32, as gguf-py's dequantize computes Q5_K."""
    u = _q5_u(qw, rows)
    q = u.float().reshape(u.shape[0], sw.shape[1], 8, QB)  # [n, S, j, 32]
    ds, dm = layouts.q4k_fields(sw, rows)  # [n, S, 8]
    return (ds[..., None] * q - dm[..., None]).reshape(u.shape[0], qw.shape[1] * QB)


# ---- the linears -------------------------------------------------------------------------------------------------
class _Int5Linear(PackedLinear):
    """What the q5 linears share: `qw` (sc_q5_blocks) and `sw` of the subclass's shape; `from_values` packs."""

    layout = ""
    SW: tuple[int, ...] = ()  # sw's shape past [N/16, K/32 or K/256]
    SW_DTYPE = torch.float16

    def __init__(self, in_features: int, out_features: int, kernels: str = "native", bias: bool = False) -> None:
        """Zeroed weights of the right shapes (a state dict, or `from_values`, fills them)."""
        super().__init__()
        g, b = self._check_shape(in_features, out_features, kernels, bias)
        self.register_buffer("qw", torch.zeros((g, b, 5, RG, 4), dtype=torch.uint8))
        s = in_features // (QK if self.K_ALIGN == QK else QB)
        self.register_buffer("sw", torch.zeros((g, s, *self.SW), dtype=self.SW_DTYPE))

    @classmethod
    def from_values(cls, q: torch.Tensor, *scales: torch.Tensor, bias: torch.Tensor | None = None,
                    kernels: str = "native") -> "_Int5Linear":
        """q [N, K] and the type's scales (`pack_q50` / `pack_q51` / `pack_q5k`), bias [N] or None (kept fp32)."""
        n, k = q.shape
        lin = cls(k, n, kernels=kernels, bias=bias is not None)
        lin.qw, lin.sw = cls._pack(q, *scales)
        lin._set_bias(bias)
        return lin

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.layout}, "
                f"{self.kernels} kernels")


class Int5Q0Linear(_Int5Linear):
    """Q5_0 at its own 22 bytes a block: w = d·(u − 16)."""

    layout, SW = "q50", (RG,)
    _pack = staticmethod(pack_q50)

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        return native.q50_matmul(x2, self.qw, self.sw, self.bias)

    def _unpack(self, rows: torch.Tensor | int | None = None) -> torch.Tensor:
        return q50_unpack(self.qw, self.sw, rows)


class Int5Q1Linear(_Int5Linear):
    """Q5_1 at its own 24 bytes a block: w = d·u + m."""

    layout, SW = "q51", (2, RG)
    _pack = staticmethod(pack_q51)

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        return native.q51_matmul(x2, self.qw, self.sw, self.bias)

    def _unpack(self, rows: torch.Tensor | int | None = None) -> torch.Tensor:
        return q51_unpack(self.qw, self.sw, rows)


class Int5KLinear(_Int5Linear):
    """Q5_K at its own 176 bytes per 256: w = (d·sc_j)·u − dmin·mn_j (`from_values` takes a `KParts`' q, d, dmin,
    sc, mn, as `Int8KLinear`)."""

    layout, SW, SW_DTYPE, K_ALIGN = "q5k", (Q4K_SCALES,), torch.uint8, QK
    _pack = staticmethod(pack_q5k)

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        return native.q5k_matmul(x2, self.qw, self.sw, self.bias)

    def _unpack(self, rows: torch.Tensor | int | None = None) -> torch.Tensor:
        return q5k_unpack(self.qw, self.sw, rows)
