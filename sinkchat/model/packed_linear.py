"""`PackedLinear`: what the linears over the native kernels' packed layouts share (q8g, q40, q4k, q8k, q6k): shape
checks, the optional fp32 bias, the forward (the kernel, or the exact weights dequantized where the kernels cannot
run), and `rows` for an embedding table stored the same way. A subclass names its layout and gives `_matmul` and
`_unpack`."""

from __future__ import annotations

import torch
from torch import nn

from sinkchat.kernels import native

KERNELS = ("native", "torch")


class PackedLinear(nn.Module):
    """A drop-in nn.Linear over packed weights (buffers `qw`, `sw` of the subclass's layout) and an optional fp32
    `bias`. `kernels`: "native" runs the subclass's `_matmul`; "torch" dequantizes the exact weights on every call
    (slow; machines without the kernels)."""

    layout = ""
    K_ALIGN = native.QB  # in_features must be a multiple of this (the K-quants: their 256-weight super-blocks)

    def _check_shape(self, in_features: int, out_features: int, kernels: str, bias: bool) -> tuple[int, int]:
        """Set the features, kernels and bias; return (row groups of 16, blocks of 32 along K)."""
        if in_features % self.K_ALIGN or out_features % native.RG:
            raise ValueError(f"{self.layout} linear {in_features} -> {out_features}: want in % {self.K_ALIGN} == 0 "
                             f"and out % {native.RG} == 0")
        if kernels not in KERNELS:
            raise ValueError(f"kernels {kernels!r}: one of {KERNELS}")
        self.in_features, self.out_features, self.kernels = in_features, out_features, kernels
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        return out_features // native.RG, in_features // native.QB

    def _set_bias(self, bias: torch.Tensor | None) -> None:
        if bias is None:
            return
        if bias.numel() != self.out_features:
            raise ValueError(f"bias of {bias.numel()} for {self.out_features} outputs")
        self.bias.data = bias.detach().float().reshape(self.out_features).clone()  # type: ignore[union-attr]

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:  # x2 [M, K] fp32 -> [M, N]
        raise NotImplementedError

    def _unpack(self, rows: torch.Tensor | int | None = None) -> torch.Tensor:  # -> fp32 [N or n, K]
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N] in x's dtype
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()  # [M, K]
        if self.kernels == "native":
            y = self._matmul(x2)  # [M, N]
        else:
            y = x2 @ self.dequantized().T
            y = y if self.bias is None else y + self.bias
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight, fp32 [N, K], from the packed bytes and scales (not through the kernel)."""
        return self._unpack()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [...] of the weight, fp32 [..., K] (an embedding lookup into a table stored so): unpacks only
        those rows, whatever the shape of ids."""
        flat = ids.reshape(-1).long()  # [n]
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.out_features):
            raise IndexError(f"row ids outside 0..{self.out_features - 1}")
        return self._unpack(self._one(flat)).reshape(*ids.shape, self.in_features)

    def _one(self, flat: torch.Tensor) -> torch.Tensor | int:
        """The rows as the subclass's unpack takes them (q8g: one row as an int, a view instead of a gather)."""
        return flat
