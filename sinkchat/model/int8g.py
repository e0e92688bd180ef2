"""`Int8GLinear`: a linear whose weights are int8 with an fp16 (d, m) pair per 16 weights along K (layout "q8g").

Why this layout: llama.cpp's 5-, 6- and 8-bit weight types (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0) are each w = d·q + m with
an integer q of at most 8 bits and a scale (and offset) per 16 or 32 weights, d and m (after the super-block
arithmetic of the K-quants) fp16-representable for the types held exactly. One int8 layout with a (d, m) per 16
holds all of them exactly, so a GGUF of mixed types loads without re-quantizing any tensor, and one VNNI kernel
(`native.q8g_matmul`, csrc/matmul.c) runs them all: twice the bytes of q4, ~the same arithmetic per weight.

The loader builds these with `Int8GLinear.from_values`; an embedding table stored the same way is read with `rows`.
On the native kernels Q8_0 now has its own layout at the file's 34 bytes a block (`int8q0.Int8Q0Linear`, "q80", the
same output bits) and Q4_K / Q5_K / Q6_K theirs (`intk`); q8g holds Q5_0, Q5_1 and the float types.
"""

from __future__ import annotations

import logging

import torch
from sinkchat.kernels import native
from sinkchat.model.packed_linear import PackedLinear

log = logging.getLogger(__name__)

GROUP = 16  # weights per (d, m) pair along K


class Int8GLinear(PackedLinear):
    """A drop-in nn.Linear over q8g weights: buffers `qw` (uint8 q + 128, [N/16, K/32, 8, 16, 4]) and `sw` (fp16
    [N/16, K/32, 2, 2, 16]), as `native.pack_q8g` writes them, and an optional fp32 `bias`.

    `kernels`: "native" runs `native.q8g_matmul` (int8 activations per 32, as the q4 kernel); "torch" is the fallback
    for machines without the native kernels: it dequantizes the weight on every call (slow, but exact weights)."""

    layout = "q8g"

    def __init__(self, in_features: int, out_features: int, kernels: str = "native", bias: bool = False) -> None:
        """Zeroed weights of the right shapes (a state dict, or `from_values`, fills them). N % 16 == 0, K % 32 == 0."""
        super().__init__()
        g, b = self._check_shape(in_features, out_features, kernels, bias)
        self.register_buffer("qw", torch.full((g, b, native.QB // 4, native.RG, 4), 128, dtype=torch.uint8))
        self.register_buffer("sw", torch.zeros((g, b, 2, 2, native.RG), dtype=torch.float16))

    @classmethod
    def from_values(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None = None,
                    kernels: str = "native") -> "Int8GLinear":
        """q int8 [N, K], d and m [N, K/16] (w = d·q + m per 16 along K), bias [N] or None. d and m are rounded to
        fp16 here (the only loss: none where they are fp16 values, as in a GGUF); the bias is kept in fp32."""
        n, k = q.shape
        lin = cls(k, n, kernels=kernels, bias=bias is not None)
        lin.qw, lin.sw = native.pack_q8g(q, d, m)
        lin._set_bias(bias)
        return lin

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        return native.q8g_matmul(x2, self.qw, self.sw, self.bias)

    def _unpack(self, rows: torch.Tensor | int | None = None) -> torch.Tensor:
        """d·q + m rounded once, from the bytes and scales."""
        return native.q8g_unpack(self.qw, self.sw, rows)

    def _one(self, flat: torch.Tensor) -> torch.Tensor | int:
        """One token (every decode step): plain indexing, half the time of a gather."""
        return int(flat) if flat.numel() == 1 else flat

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group={GROUP}, int8 d·q+m, "
                f"{self.kernels} kernels")
