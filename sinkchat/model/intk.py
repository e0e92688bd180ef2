"""`Int4KLinear` (layout "q4k"), `Int8KLinear` ("q8k") and `Int6KLinear` ("q6k"): linears holding llama.cpp's
K-quants exactly.

Why: a K-quant (Q4_K, Q5_K, Q6_K) scales each 32 or 16 weights by d·sc_j, d an fp16 per 256 weights and sc_j a 6- or
8-bit integer (Q4_K / Q5_K also subtract dmin·mn_j). The q4 / q8g layouts keep an fp16 (d, m) pair per 32 / 16
weights instead: the products rounded to fp16 (up to half an fp16 ulp off the file's weights), and more bytes than
the file: q4 0.625 bytes a weight against Q4_K's 0.5625, q8g 1.25 against Q6_K's 0.82, so a 3B Q4_K_M model missed
its memory bound (RSS ≤ 1.1 × file + 150 MB). These keep the file's integers and fp16 super-block scales (q4k
0.5625 bytes a weight, Q4_K's own 144 per 256: its 6-bit scales and mins in three 32-bit words a row, csrc/kernels.h;
ABI 11 held them a byte each, 0.578; q8k 1.14) and the kernels (`native.q4k_matmul`, `native.q8k_matmul`:
csrc/matmul_k.c) form d·sc_j in fp32, where it is exact: `dequantized` / `rows` equal gguf-py's dequantize bit for
bit.

- `Int4KLinear`: Q4_K. Buffers `qw` (the q4 nibbles, uint8 [N/16, K/32, 4, 16, 4]) and `sw` (sc_q4k_scales bytes,
  uint8 [N/16, K/256, 256]: fp16 d, dmin, then the 6-bit sc, mn as three words a row).
- `Int8KLinear`: Q5_K (q 0..31, each 32-weight scale and min given for both 16-halves) and Q6_K (q −32..31, int8 scale
  per 16, dmin = mn = 0). Buffers `hw` (q + 128, uint8 [N/16, K/32, 8, 16, 4]) and `sw` (sc_q8k_scales bytes, uint8
  [N/16, K/256, 576]).
- `Int6KLinear`: Q6_K at its own bits (issue #33: q8k held it at 1.14 bytes a weight against the file's 0.82, so a
  Q4_K_M file's Q6_K tensors made decode read more bytes a token than llama.cpp). Buffers `qw` (sc_q6k_block: the
  q4 nibble tile of q + 32 and two bit-planes of its high 2 bits, uint8 [N/16, K/32, 6, 16, 4]) and `sw`
  (sc_q6k_scales bytes: fp16 d, int8 sc per 16, uint8 [N/16, K/256, 288]): 0.8203 bytes a weight, the file's own
  210 per 256. The kernels rebuild q8k's bytes in registers and run its loop: the same output bits as q8k.

Both buffers have row groups of 16 as dim 0, so a tensor can be assembled from row chunks (the loader's token table)
and split at 16-row boundaries without a copy (the native step's views of Phi-3's fused projections). Plain
attributes are ints and strs only (gguf_packed saves a module as class name + attributes + buffers).
"""

from __future__ import annotations

from typing import Callable

import torch

from sinkchat.kernels import native
from sinkchat.kernels.abi import Q4K_SCALES, Q6K_SCALES, Q8K_SCALES
from sinkchat.model.packed_linear import PackedLinear


class _KLinear(PackedLinear):
    """What the K-quant linears share; subclasses set the layout's buffer name, block shape and functions."""

    layout = ""
    K_ALIGN = native.QK
    WEIGHTS = ""  # the weight buffer's name
    BLOCK: tuple[int, ...] = ()  # a 16-row x 32-column block's shape
    FILL = 0  # the byte of a zero weight
    SCALES = 0  # bytes of scales per 16 rows x 256 columns
    SUB = 0  # weights per sub-block scale
    _kpack: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    _kunpack: Callable[..., torch.Tensor]
    _kmatmul: Callable[..., torch.Tensor]

    def __init__(self, in_features: int, out_features: int, kernels: str = "native", bias: bool = False) -> None:
        """Zeroed weights of the right shapes (a state dict, or `from_values`, fills them). N % 16, K % 256 == 0."""
        super().__init__()
        g, b = self._check_shape(in_features, out_features, kernels, bias)
        self.register_buffer(self.WEIGHTS, torch.full((g, b, *self.BLOCK), self.FILL, dtype=torch.uint8))
        self.register_buffer("sw", torch.zeros((g, in_features // native.QK, self.SCALES), dtype=torch.uint8))

    @classmethod
    def from_values(cls, q: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor,
                    bias: torch.Tensor | None = None, kernels: str = "native") -> "_KLinear":
        """q [N, K], d and dmin [N, K/256] (fp16 values: stored fp16), sc and mn [N, K/sub], bias [N] or None (kept
        fp32): w = (d·sc_j)·q − (dmin·mn_j). See `native.pack_q4k` / `pack_q8k` for the dtypes."""
        n, k = q.shape
        lin = cls(k, n, kernels=kernels, bias=bias is not None)
        w, sw = cls._kpack(q, d, dmin, sc, mn)
        setattr(lin, cls.WEIGHTS, w)
        lin.sw = sw
        lin._set_bias(bias)
        return lin

    @property
    def weights(self) -> torch.Tensor:
        """The weight blocks (`qw` or `hw`)."""
        return getattr(self, self.WEIGHTS)

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        return self._kmatmul(x2, self.weights, self.sw, self.bias)

    def _unpack(self, rows: torch.Tensor | int | None = None) -> torch.Tensor:
        """gguf-py's values, from the integers and scales."""
        return self._kunpack(self.weights, self.sw, rows)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.layout}: (d·sc)·q − dmin·mn "
                f"per {self.SUB}, {self.kernels} kernels")


class Int4KLinear(_KLinear):
    """Q4_K: the q4 kernel's nibbles with the file's super-block scales (`native.pack_q4k`). sc, mn uint8 [N, K/32]."""

    layout, WEIGHTS, BLOCK, FILL, SCALES, SUB = "q4k", "qw", (4, native.RG, 4), 0, Q4K_SCALES, 32
    _kpack = staticmethod(native.pack_q4k)
    _kunpack = staticmethod(native.q4k_unpack)
    _kmatmul = staticmethod(native.q4k_matmul)


class Int8KLinear(_KLinear):
    """Q5_K / Q6_K: int8 bytes (q + 128) with the file's super-block scales (`native.pack_q8k`). q int8 [N, K], sc int8
    and mn uint8 [N, K/16]."""

    layout, WEIGHTS, BLOCK, FILL, SCALES, SUB = "q8k", "hw", (native.QB // 4, native.RG, 4), 128, Q8K_SCALES, 16
    _kpack = staticmethod(native.pack_q8k)
    _kunpack = staticmethod(native.q8k_unpack)
    _kmatmul = staticmethod(native.q8k_matmul)


class Int6KLinear(_KLinear):
    """Q6_K at its own 210 bytes per 256 weights (`native.pack_q6k`): `from_values` takes `Int8KLinear`'s arguments
    (q int8 in −32..31, sc int8 per 16; dmin and mn all zero), so a Q6_K `KParts` packs into either."""

    layout, WEIGHTS, BLOCK, FILL, SCALES, SUB = "q6k", "qw", (6, native.RG, 4), 0, Q6K_SCALES, 16
    _kpack = staticmethod(native.pack_q6k)
    _kunpack = staticmethod(native.q6k_unpack)
    _kmatmul = staticmethod(native.q6k_matmul)
