"""What the Engine needs from a single-token decode step. The bootstrap builds one (`sinkchat.decode.select`) and
injects it; the Engine never imports the decode package, so core stays below decode in the import order."""

from __future__ import annotations

from typing import Protocol

import torch


class DecodeStep(Protocol):
    """One token through every layer, writing its k/v straight into the sink cache's buffers.

    Implemented by `decode.native_step.NativeStep` (one C call) and `decode.torch_step.TorchStep` (~20 torch ops a
    layer, optionally compiled). Tests check both against transformers' forward on the same weights."""

    mode: str  # "native" | "auto" | "compiled" | "eager"

    @property
    def n_kv(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def status(self) -> str:
        """For status lines: "native (avx2; prefill native)", "compiled", "compiling", "eager"."""
        ...

    def __call__(self, tok: int, pos: int, keys: list[torch.Tensor], values: list[torch.Tensor], n_gauge: int = 4
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token `tok` at slot `pos` (keys/values: per layer [1, H_kv, cap, D]): logits [1, V], pre-RoPE queries
        [L, H*D], gauge shares [L, 3] (attention on the stream's first / newest `n_gauge` slots and on the recalled
        memory slots in front of the stream, 0 without them; mean over heads)."""
        ...

    def prepare(self, kv_dtype: torch.dtype) -> None:
        """Make sure whatever the step builds for this kv dtype exists or is being built."""
        ...

    def warm_up(self, kv_dtype: torch.dtype) -> None:
        """Start building in the background if the mode asks for it (called when a cache is made)."""
        ...
