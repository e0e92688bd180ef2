"""`Int8GLinear`: a linear whose weights are int8 with an fp16 (d, m) pair per 16 weights along K (layout "q8g").

Why this layout: llama.cpp's 5-, 6- and 8-bit weight types (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0) are each w = d·q + m with
an integer q of at most 8 bits and a scale (and offset) per 16 or 32 weights, d and m (after the super-block
arithmetic of the K-quants) fp16-representable for the types held exactly. One int8 layout with a (d, m) per 16
holds all of them exactly, so a GGUF of mixed types loads without re-quantizing any tensor, and one VNNI kernel
(`native.q8g_matmul`, csrc/matmul.c) runs them all: twice the bytes of q4, ~the same arithmetic per weight.

The loader builds these with `Int8GLinear.from_values`; an embedding table stored the same way is read with `rows`.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from sinkchat.kernels import native

log = logging.getLogger(__name__)

GROUP = 16  # weights per (d, m) pair along K
KERNELS = ("native", "torch")


class Int8GLinear(nn.Module):
    """A drop-in nn.Linear over q8g weights: buffers `qw` (uint8 q + 128, [N/16, K/32, 8, 16, 4]) and `sw` (fp16
    [N/16, K/32, 2, 2, 16]), as `native.pack_q8g` writes them, and an optional fp32 `bias`.

    `kernels`: "native" runs `native.q8g_matmul` (int8 activations per 32, as the q4 kernel); "torch" is the fallback
    for machines without the native kernels: it dequantizes the weight on every call (slow, but exact weights)."""

    layout = "q8g"

    def __init__(self, in_features: int, out_features: int, kernels: str = "native", bias: bool = False) -> None:
        """Zeroed weights of the right shapes (a state dict, or `from_values`, fills them). N % 16 == 0, K % 32 == 0."""
        super().__init__()
        if in_features % native.QB or out_features % native.RG:
            raise ValueError(f"q8g linear {in_features} -> {out_features}: want in % {native.QB} == 0 and "
                             f"out % {native.RG} == 0")
        if kernels not in KERNELS:
            raise ValueError(f"kernels {kernels!r}: one of {KERNELS}")
        self.in_features, self.out_features, self.kernels = in_features, out_features, kernels
        g, b = out_features // native.RG, in_features // native.QB
        self.register_buffer("qw", torch.full((g, b, native.QB // 4, native.RG, 4), 128, dtype=torch.uint8))
        self.register_buffer("sw", torch.zeros((g, b, 2, 2, native.RG), dtype=torch.float16))
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    @classmethod
    def from_values(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None = None,
                    kernels: str = "native") -> "Int8GLinear":
        """q int8 [N, K], d and m [N, K/16] (w = d·q + m per 16 along K), bias [N] or None. d and m are rounded to
        fp16 here (the only loss: none where they are fp16 values, as in a GGUF); the bias is kept in fp32."""
        n, k = q.shape
        lin = cls(k, n, kernels=kernels, bias=bias is not None)
        lin.qw, lin.sw = native.pack_q8g(q, d, m)
        if bias is not None:
            if bias.numel() != n:
                raise ValueError(f"bias of {bias.numel()} for {n} outputs")
            lin.bias.data = bias.detach().float().reshape(n).clone()
        return lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N] in x's dtype
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()  # [M, K]
        if self.kernels == "native":
            y = native.q8g_matmul(x2, self.qw, self.sw, self.bias)  # [M, N]
        else:
            y = x2 @ self.dequantized().T
            y = y if self.bias is None else y + self.bias
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight, fp32 [N, K], from the bytes and scales (not through the kernel): d·q + m rounded once."""
        return native.q8g_unpack(self.qw, self.sw)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [...] of the weight, fp32 [..., K]: an embedding lookup into a table stored as q8g. Unpacks only
        those rows (cheap for a few ids), whatever the shape of ids."""
        flat = ids.reshape(-1).long()  # [n]
        if flat.numel() == 1:  # one token (every decode step): plain indexing, half the time of a gather
            row = int(flat)
            if not 0 <= row < self.out_features:
                raise IndexError(f"row ids outside 0..{self.out_features - 1}")
            return native.q8g_unpack(self.qw, self.sw, row).reshape(*ids.shape, self.in_features)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.out_features):
            raise IndexError(f"row ids outside 0..{self.out_features - 1}")
        return native.q8g_unpack(self.qw, self.sw, flat).reshape(*ids.shape, self.in_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group={GROUP}, int8 d·q+m, "
                f"{self.kernels} kernels")
