"""`Int8Q0Linear` (layout "q80"): a linear holding llama.cpp's Q8_0 at its own bits, 34 bytes per 32 weights.

Why: Q8_0 is w = d·q, one fp16 d per 32 int8 weights. The q8g layout (`int8g.Int8GLinear`) held it as an fp16 (d, m)
pair per 16 weights with m = 0: 40 bytes a block, 10 bits a weight against the file's 8.5, and decode reads every
weight byte once a token (issue #33: the bundled model's tied Q8_0 token table is its output head, 28 MB of its
~108 MB a token). This keeps the bytes (`qw`, q + 128, uint8 [N/16, K/32, 8, 16, 4], the q8g kernel's sc_q8_blocks)
and d alone (`sw`, fp16 [N/16, K/32, 16], sc_q80_scales); the kernels (`native.q80_matmul`, csrc/matmul*.c:
q80_scales) give both half blocks d and m = +0, so every output is bit-identical to the q8g layout's on the same
tensor. The bytes held are the file's, permuted (`native.q80_gguf_bytes` gives them back); `dequantized` / `rows`
are gguf-py's dequantize bit for bit.

Both buffers have row groups of 16 as dim 0 (a table assembled from row chunks, fused projections split at 16-row
boundaries without a copy). Plain attributes are ints and strs only (gguf_packed saves a module as class name +
attributes + buffers).
"""

from __future__ import annotations

import torch
from sinkchat.kernels import native
from sinkchat.model.packed_linear import PackedLinear


class Int8Q0Linear(PackedLinear):
    """A drop-in nn.Linear over q80 weights (`native.pack_q80`) and an optional fp32 `bias`. `kernels`: "native" runs
    `native.q80_matmul`; "torch" dequantizes the exact weights on every call (slow; machines without the kernels)."""

    layout = "q80"

    def __init__(self, in_features: int, out_features: int, kernels: str = "native", bias: bool = False) -> None:
        """Zeroed weights of the right shapes (a state dict, or `from_values`, fills them). N % 16, K % 32 == 0."""
        super().__init__()
        g, b = self._check_shape(in_features, out_features, kernels, bias)
        self.register_buffer("qw", torch.full((g, b, native.QB // 4, native.RG, 4), 128, dtype=torch.uint8))
        self.register_buffer("sw", torch.zeros((g, b, native.RG), dtype=torch.float16))

    @classmethod
    def from_values(cls, q: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None = None,
                    kernels: str = "native") -> "Int8Q0Linear":
        """q int8 [N, K], d [N, K/32] (fp16 values: stored fp16), bias [N] or None (kept fp32): w = d·q."""
        n, k = q.shape
        lin = cls(k, n, kernels=kernels, bias=bias is not None)
        lin.qw, lin.sw = native.pack_q80(q, d)
        lin._set_bias(bias)
        return lin

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        return native.q80_matmul(x2, self.qw, self.sw, self.bias)

    def _unpack(self, rows: torch.Tensor | int | None = None) -> torch.Tensor:
        """gguf-py's values: d·q from the bytes and d."""
        return native.q80_unpack(self.qw, self.sw, rows)

    def _one(self, flat: torch.Tensor) -> torch.Tensor | int:
        """One token (every decode step): plain indexing, half the time of a gather (as `Int8GLinear`)."""
        return int(flat) if flat.numel() == 1 else flat

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, q80: d·q per 32, "
                f"{self.kernels} kernels")
