"""`Int4Q0Linear` (layout "q40"): a linear holding llama.cpp's Q4_0 at its own bits, 18 bytes per 32 weights.

Why: Q4_0 is w = d·(q − 8), one fp16 d per 32 weights. The q4 layout (`int4.Int4Linear`) held it as an fp16 (d, m)
pair with m = −8·d: 20 bytes a block, 0.625 bytes a weight against the file's 0.5625, and decode reads every weight
byte once a token (issue #33: 688 MB a token against llama.cpp's 621 on a ~1B Q4_0 file). This keeps the nibbles
(`qw`, uint8 [N/16, K/32, 4, 16, 4], the q4 kernel's sc_q4_blocks) and d alone (`sw`, fp16 [N/16, K/32, 16],
sc_q40_scales); the kernels (`native.q40_matmul`, csrc/matmul*.c: q40_scales) form m = −8·d in fp32, exact, so every
output is bit-identical to the q4 layout's on the same tensor. The bytes held are the file's, permuted
(`native.q40_gguf_bytes` gives them back); `dequantized` / `rows` are gguf-py's dequantize bit for bit.

Both buffers have row groups of 16 as dim 0 (a table assembled from row chunks, fused projections split at 16-row
boundaries without a copy). Plain attributes are ints and strs only (gguf_packed saves a module as class name +
attributes + buffers).
"""

from __future__ import annotations

import torch
from torch import nn

from sinkchat.kernels import native

KERNELS = ("native", "torch")


class Int4Q0Linear(nn.Module):
    """A drop-in nn.Linear over q40 weights (`native.pack_q40`) and an optional fp32 `bias`. `kernels`: "native" runs
    `native.q40_matmul`; "torch" dequantizes the exact weights on every call (slow; machines without the kernels)."""

    layout = "q40"

    def __init__(self, in_features: int, out_features: int, kernels: str = "native", bias: bool = False) -> None:
        """Zeroed weights of the right shapes (a state dict, or `from_values`, fills them). N % 16, K % 32 == 0."""
        super().__init__()
        if in_features % native.QB or out_features % native.RG:
            raise ValueError(f"q40 linear {in_features} -> {out_features}: want in % {native.QB} == 0 and "
                             f"out % {native.RG} == 0")
        if kernels not in KERNELS:
            raise ValueError(f"kernels {kernels!r}: one of {KERNELS}")
        self.in_features, self.out_features, self.kernels = in_features, out_features, kernels
        g, b = out_features // native.RG, in_features // native.QB
        self.register_buffer("qw", torch.zeros((g, b, 4, native.RG, 4), dtype=torch.uint8))
        self.register_buffer("sw", torch.zeros((g, b, native.RG), dtype=torch.float16))
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    @classmethod
    def from_values(cls, q: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None = None,
                    kernels: str = "native") -> "Int4Q0Linear":
        """q [N, K] in 0..15, d [N, K/32] (fp16 values: stored fp16), bias [N] or None (kept fp32): w = d·(q − 8)."""
        n, k = q.shape
        lin = cls(k, n, kernels=kernels, bias=bias is not None)
        lin.qw, lin.sw = native.pack_q40(q, d)
        if bias is not None:
            if bias.numel() != n:
                raise ValueError(f"bias of {bias.numel()} for {n} outputs")
            lin.bias.data = bias.detach().float().reshape(n).clone()
        return lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N] in x's dtype
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()  # [M, K]
        if self.kernels == "native":
            y = native.q40_matmul(x2, self.qw, self.sw, self.bias)  # [M, N]
        else:
            y = x2 @ self.dequantized().T
            y = y if self.bias is None else y + self.bias
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight, fp32 [N, K], from the nibbles and d (not through the kernel): gguf-py's values."""
        return native.q40_unpack(self.qw, self.sw)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [...] of the weight, fp32 [..., K] (an embedding lookup into a table stored so): unpacks only
        those rows, whatever the shape of ids."""
        flat = ids.reshape(-1).long()  # [n]
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.out_features):
            raise IndexError(f"row ids outside 0..{self.out_features - 1}")
        return native.q40_unpack(self.qw, self.sw, flat).reshape(*ids.shape, self.in_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, q40: d·(q − 8) per 32, "
                f"{self.kernels} kernels")
