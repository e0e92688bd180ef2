"""The sink-attention gauge: how much of the newest query's attention lands on the first cache slots.

With the fast decode step the step itself returns these shares (it has the softmax in hand); what follows is how
they are measured for tokens that went through transformers' forward.

sdpa does not return attention weights, and asking for them would force the slow eager path on every step. Instead a
forward hook keeps the last token's query projection per layer; on sampled steps we rotate it to its in-cache position
and recompute softmax(q K^T * scale) against the cached keys, which are exactly what attention used. Cost: one
[H, D] x [D, L] product per layer on sampled steps only.

Hybrid models (Gemma 2 / 3): the gauge proper is over the global (full-attention) layers, the ones the sink policy
governs. The local layers are measured separately: their share on the first tokens of their own window (a ring of
the last W tokens, so once the stream is longer than W those are whatever tokens W back, not the stream's start).
That figure says whether local layers also park attention on whatever comes first in what they see; the sink
policy cannot help them there and never evicts from their window. Each layer's query is rotated with its own RoPE,
and Gemma 2's score soft-capping is applied as in its attention.
"""

from __future__ import annotations

from typing import Any

import torch

from sinkchat.core.events import GaugeEvent
from sinkchat.core.hybrid_cache import WindowLayer
from sinkchat.core.kv_cache import SinkKVCache
from sinkchat.model.spec import ModelSpec


class SinkGauge:
    """Measures on sampled steps; `armed` says whether this step is one. A fast decode step hands its own shares to
    `record`; a transformers forward leaves its queries in the hooks and `measure` recomputes the softmax."""

    def __init__(self, model: Any, spec: ModelSpec) -> None:
        self.layers = spec.global_layers  # the gauge proper: the layers the sink policy governs
        self.local_layers = tuple(i for i in range(spec.n_layers) if i not in self.layers)  # hybrids only
        self.measured = self.layers + self.local_layers  # cache layer of each measured layer (`attn`, `queries`,
        ropes = spec.ropes()  # `ropes`, `scales` and `probs(cache, i)` follow this order: global, then local)
        self.ropes = [ropes[i] for i in self.measured]
        self.n_heads, self.n_kv, self.head_dim = spec.n_heads, spec.n_kv, spec.head_dim
        self.scales = [spec.layers[i].scaling for i in self.measured]
        self.softcap = spec.attn_softcap
        base = getattr(model, "model", model)
        self.attn = [base.layers[i].self_attn for i in self.measured]
        self.queries: list[torch.Tensor | None] = [None] * len(self.attn)
        self.shares: tuple[int, torch.Tensor] | None = None  # (n, [L, 3]) from the fast decode step, if it ran
        self.armed = False
        self.capture = False  # keep every forward's last queries (`captured_queries`: the recall memory's)
        self.captured: list[torch.Tensor | None] = [None] * len(self.attn)
        self._handles = []
        # Phi-3 fuses q, k, v into qkv_proj (q first). Qwen3 / Gemma 3 RMS-normalize each head's q after q_proj:
        # the hook applies the layer's own q_norm to the captured row (hooking q_norm itself would need its input
        # layout, which differs: [B, T, H, D] in Qwen3, [B, H, T, D] in Gemma 3)
        fused = "self_attn.qkv_proj" in spec.linears
        name = "qkv_proj" if fused else "q_proj"
        for i, attn in enumerate(self.attn):
            norm = getattr(attn, "q_norm", None) if spec.norm.qk_norm else None
            self._handles.append(getattr(attn, name).register_forward_hook(self._make_hook(i, fused, norm)))

    def _make_hook(self, i: int, fused: bool, norm: Any) -> Any:
        width = self.n_heads * self.head_dim

        def hook(module: Any, args: Any, out: torch.Tensor) -> None:
            if self.armed or self.capture:
                q = out[:, -1:].detach()  # [B, 1, H*D] (or [B, 1, (H+2Hkv)*D] fused)
                q = q[..., :width] if fused else q
                if norm is not None:
                    with torch.no_grad():
                        q = norm(q.reshape(q.shape[0], 1, self.n_heads, self.head_dim))  # [B, 1, H, D]
                if self.armed:
                    self.queries[i] = q
                if self.capture:
                    self.captured[i] = q

        return hook

    def record(self, queries: torch.Tensor, n: int, shares: torch.Tensor) -> None:
        """A fast step's pre-RoPE queries [L, H*D] and its shares [L, 3] on the first / newest `n` slots (the
        stream's first: past any recalled memory slots) and on the recalled slots."""
        if self.armed:
            self.queries = list(queries[list(self.measured), None])
            self.shares = (n, shares[list(self.measured)])  # a ring's slots run oldest first: its window's start

    def captured_queries(self) -> torch.Tensor | None:
        """The last forward's last-token pre-RoPE queries [L, H*D] in layer order (None: not captured)."""
        if not self.capture or any(q is None for q in self.captured):
            return None
        rows = {layer: q.reshape(-1) for layer, q in zip(self.measured, self.captured)}
        self.captured = [None] * len(self.attn)
        return torch.stack([rows[i] for i in sorted(rows)])

    def discard_shares(self) -> None:
        """Before a transformers forward: an earlier step's shares must not stand for this forward's attention."""
        self.shares = None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    @staticmethod
    def attended_keys(layer: Any, length: int) -> torch.Tensor:
        """The cached keys [B, H_kv, n, D] the last token fed attended to, oldest first: a local layer's ring holds
        its window (the token itself and the W - 1 before it), any other layer the recalled memory slots it attended
        (`layer.used`, first) and the slots 0..length-1."""
        if isinstance(layer, WindowLayer):
            return layer.keys[:, :, max(layer.floor, layer.end - layer.window) : layer.end]
        return layer.keys[:, :, layer.base - layer.used : layer.base + length]

    def probs(self, cache: SinkKVCache, i: int) -> torch.Tensor:
        """The i-th measured layer's attention probabilities [B, H_kv, G, n] of the captured query, rotated to its
        in-cache position L-1, against the keys it attended to: what attention computed for the last token fed."""
        L = cache.length
        q = self.queries[i].reshape(1, self.n_heads, 1, self.head_dim)  # [B, H, 1, D]
        q = self.ropes[i].rotate(q, L - 1).float()
        keys = self.attended_keys(cache.layers[self.measured[i]], L).float()  # [B, H_kv, n, D]
        qg = q.view(1, self.n_kv, self.n_heads // self.n_kv, self.head_dim)  # [B, H_kv, G, D]
        scores = torch.einsum("bhgd,bhld->bhgl", qg, keys) * self.scales[i]  # [B, H_kv, G, n]
        if self.softcap:  # Gemma 2: scores squashed into (-cap, cap) before the softmax
            scores = torch.tanh(scores / self.softcap) * self.softcap
        return torch.softmax(scores, dim=-1)

    def measure(self, cache: SinkKVCache, n: int, holds_start: bool) -> GaugeEvent | None:
        """Attention share of the last fed token on slots [0, n) of the stream (and a local layer's on the first n
        of its window), on the newest n and on the recalled memory slots, from the shares a fast step computed or
        the queries captured in the last forward."""
        L = cache.length
        shares, self.shares = self.shares, None
        if L == 0 or any(q is None for q in self.queries):
            return None
        g = len(self.layers)
        if shares is not None and shares[0] == n:  # the fast step measured this attention while computing it
            first, last, recalled = (shares[1][:, c].tolist() for c in range(3))
        else:
            first, last, recalled = self._recompute(cache, n)
        self.queries = [None] * len(self.attn)
        n, local = min(n, L), tuple(first[g:])
        window = self.attended_keys(cache.layers[self.local_layers[0]], L).shape[-2] if self.local_layers else 0
        memory_on = any(getattr(cache.layers[i], "base", 0) for i in self.layers)  # a region in front of the stream
        return GaugeEvent(share=sum(first[:g]) / g, per_layer=tuple(first[:g]), recent=sum(last[:g]) / g,
                                uniform=n / L, n=n, holds_start=holds_start,
                                local=sum(local) / len(local) if local else None, local_per_layer=local,
                                local_uniform=min(n, window) / window if window else None,
                                memory=sum(recalled[:g]) / g if memory_on else None,
                                memory_per_layer=tuple(recalled[:g]) if memory_on else ())

    def _recompute(self, cache: SinkKVCache, n: int) -> tuple[list[float], list[float], list[float]]:
        """(first, newest, recalled) shares per measured layer from the captured queries (`probs`): the first n
        stream slots after the `used` recalled ones, the newest n (never a recalled slot), the recalled ones; the
        newest and recalled figures of the global layers only (what the status line shows)."""
        first, last, recalled = [], [], []
        for i in range(len(self.attn)):
            probs = self.probs(cache, i)  # [B, H_kv, G, used_i + n_i]: recalled slots first
            used = getattr(cache.layers[self.measured[i]], "used", 0)
            first.append(float(probs[..., used : used + n].sum(-1).mean()))
            if i < len(self.layers):
                last.append(float(probs[..., max(used, probs.shape[-1] - n) :].sum(-1).mean()))
                recalled.append(float(probs[..., :used].sum(-1).mean()))
        return first, last, recalled
