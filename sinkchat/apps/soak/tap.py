"""`NllTap` scores every token fed through the live cache (`Engine.feed_ids`, whoever calls it: the scenario itself
or the agent loop) from the logits of that very forward: the perplexity of the stream as the cache sees it."""

from __future__ import annotations

from typing import Any, Iterator

from sinkchat.apps.soak.steps import finite


class NllTap:
    """Installed on an engine: every `feed_ids` call (templated messages, tool results, stream blocks: all input fed
    through the live cache) runs with all logits, and the NLL (nats) of each fed token is kept until `drain()`. The
    first token of a feed is scored by the logits after the previous token, so a stream is scored without gaps.
    Chunks whose logits are not finite are not scored; they are counted in `nonfinite` instead."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.inner = engine.feed_ids
        self.scores: list[float] = []
        self.nonfinite: list[str] = []
        self.paused = False  # while True (the soak's recall probes), feeds pass through unscored
        engine.feed_ids = self.feed_ids

    def detach(self) -> None:
        if self.engine.__dict__.get("feed_ids") == self.feed_ids:
            del self.engine.feed_ids

    def drain(self) -> list[float]:
        out, self.scores = self.scores, []
        return out

    def take_nonfinite(self) -> list[str]:
        out, self.nonfinite = self.nonfinite, []
        return out

    def _score(self, logits: Any, targets: list[int]) -> None:
        import torch

        logp = torch.log_softmax(logits[: len(targets)].float(), -1)
        tgt = torch.tensor(targets, dtype=torch.long, device=logp.device)[:, None]
        self.scores.extend((-logp.gather(1, tgt)[:, 0]).tolist())

    def feed_ids(self, ids: Any, all_logits: bool = False) -> Iterator[Any]:
        import torch

        ids = list(ids)
        if self.paused:
            yield from self.inner(ids, all_logits=all_logits)
            return
        last = self.engine.last_logits
        if ids and last is not None and finite(last):
            self._score(last[None], ids[:1])
        pos = 0
        for item in self.inner(ids, all_logits=True):
            if not isinstance(item, torch.Tensor):
                yield item
                continue
            n = item.shape[0]
            targets = ids[pos + 1 : pos + n + 1]
            if not finite(item):
                self.nonfinite.append(f"NaN/inf logits while feeding tokens {pos}..{pos + n}")
            elif targets:
                self._score(item, targets)
            pos += n
            if all_logits:
                yield item
