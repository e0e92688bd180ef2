"""Next-token sampling: repetition penalty, temperature, top-k, top-p; greedy at temperature 0.

`Sampler` is what the Engine is given (mlx-lm's shape: a sampler plus logits processors injected, not decided
inside the generation loop): it holds the settings and the RNG, and runs any logits processors before `sample`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

import torch

from sinkchat.config import SamplingConfig

LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]  # (recent ids, logits [V]) -> logits [V]


def make_generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def apply_repetition_penalty(logits: torch.Tensor, recent_ids: list[int], penalty: float) -> torch.Tensor:
    """CTRL-style penalty on tokens already in the recent context: divide positive logits, multiply negative."""
    if penalty == 1.0 or not recent_ids:
        return logits
    idx = torch.tensor(sorted(set(recent_ids)), dtype=torch.long, device=logits.device)
    picked = logits[idx]
    logits = logits.clone()
    logits[idx] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def sample(
    logits: torch.Tensor, cfg: SamplingConfig, recent_ids: list[int], generator: torch.Generator | None = None
) -> int:
    """Pick the next token id from logits [V] (any float dtype; math in fp32)."""
    logits = logits.float()
    logits = torch.nan_to_num(logits, nan=-1e9, posinf=1e9, neginf=-1e9)
    logits = apply_repetition_penalty(logits, recent_ids, cfg.repetition_penalty)
    if cfg.temperature <= 0.0:
        return int(torch.argmax(logits))
    logits = logits / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.numel():
        kth = torch.topk(logits, cfg.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        drop = cum - probs > cfg.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


class Sampler:
    """Settings + RNG + processors; `__call__` picks one token id from logits [V]."""

    def __init__(self, cfg: SamplingConfig = SamplingConfig(), processors: Sequence[LogitsProcessor] = ()) -> None:
        self.cfg = cfg
        self.generator = make_generator(cfg.seed)
        self.processors = list(processors)

    def __call__(self, logits: torch.Tensor, recent_ids: list[int], cfg: SamplingConfig | None = None,
                 processors: Sequence[LogitsProcessor] = ()) -> int:
        """`cfg` overrides the settings for this call; `processors` run after the sampler's own."""
        for proc in (*self.processors, *processors):
            logits = proc(recent_ids, logits)
        return sample(logits, cfg or self.cfg, recent_ids, self.generator)

    def reconfigure(self, **changes: Any) -> None:
        """Change settings; a new seed restarts the RNG from it."""
        self.cfg = replace(self.cfg, **changes)
        if "seed" in changes:
            self.generator = make_generator(self.cfg.seed)
