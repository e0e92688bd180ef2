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
from sinkchat.kernels import native
from sinkchat.model.packed_linear import PackedLinear


class Int4Q0Linear(PackedLinear):
    """A drop-in nn.Linear over q40 weights (`native.pack_q40`) and an optional fp32 `bias`. `kernels`: "native" runs
    `native.q40_matmul`; "torch" dequantizes the exact weights on every call (slow; machines without the kernels)."""

    layout = "q40"

    def __init__(self, in_features: int, out_features: int, kernels: str = "native", bias: bool = False) -> None:
        """Zeroed weights of the right shapes (a state dict, or `from_values`, fills them). N % 16, K % 32 == 0."""
        super().__init__()
        g, b = self._check_shape(in_features, out_features, kernels, bias)
        self.register_buffer("qw", torch.zeros((g, b, 4, native.RG, 4), dtype=torch.uint8))
        self.register_buffer("sw", torch.zeros((g, b, native.RG), dtype=torch.float16))

    @classmethod
    def from_values(cls, q: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None = None,
                    kernels: str = "native") -> "Int4Q0Linear":
        """q [N, K] in 0..15, d [N, K/32] (fp16 values: stored fp16), bias [N] or None (kept fp32): w = d·(q − 8)."""
        n, k = q.shape
        lin = cls(k, n, kernels=kernels, bias=bias is not None)
        lin.qw, lin.sw = native.pack_q40(q, d)
        lin._set_bias(bias)
        return lin

    @classmethod
    def from_tiles(cls, qw: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None = None) -> "Int4Q0Linear":
        """The native kernels' tiles as they are (`native.pack_q40`'s, or `gguf_blocks.q4_tiles` straight from a
        Q4_0 file's bytes): qw uint8 [N/16, K/32, 4, 16, 4], sw fp16 [N/16, K/32, 16]."""
        lin = cls(qw.shape[1] * 32, qw.shape[0] * native.RG, kernels="native", bias=bias is not None)
        lin.qw, lin.sw = qw, sw
        lin._set_bias(bias)
        return lin

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        return native.q40_matmul(x2, self.qw, self.sw, self.bias)

    def _unpack(self, rows: torch.Tensor | int | None = None) -> torch.Tensor:
        """gguf-py's values: d·(q − 8) from the nibbles and d."""
        return native.q40_unpack(self.qw, self.sw, rows)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, q40: d·(q − 8) per 32, "
                f"{self.kernels} kernels")
