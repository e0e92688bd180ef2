"""The token table's lookups for a packed GGUF model, apart from `gguf_load` (which imports gguf-py and numpy for
its unpacking): a later start rebuilds it from the packed cache (`gguf_packed`) without importing gguf-py."""

from __future__ import annotations

import torch
from torch import nn


class PackedEmbedding(nn.Module):
    """Token lookups from a packed table (`rows`): the table is stored once, in the file's own values. `scale`:
    the model's own embedding factor (`int4.embed_scale`: Gemma's sqrt(hidden)), applied to the rows only, never
    to the tied head."""

    def __init__(self, table: nn.Module, padding_idx: int | None = None, dtype: torch.dtype = torch.float32,
                 scale: float = 1.0) -> None:
        super().__init__()
        self.table, self.padding_idx, self.dtype, self.scale = table, padding_idx, dtype, scale
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., C]
        out = self.table.rows(ids).to(self.dtype)
        return out if self.scale == 1.0 else out * self.scale
