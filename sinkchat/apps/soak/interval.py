"""What the soak's runner folds between two samples (`Interval`), and the small figures a sample is made of."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from sinkchat.core.events import GaugeEvent, PrefillEvent
from sinkchat.core.metrics import Metrics


@dataclass
class Interval(Metrics):
    """Figures folded from the events between two samples: the clients' own `Metrics` (decode and prefill tokens
    and seconds, every decoded token's latency: uncapped here, an interval is short) plus what only a sample needs:
    every prefill chunk's per-token latency (the stream scenario decodes nothing), the mean gauge, the NLL bin."""

    latencies: deque = field(default_factory=deque)  # seconds per decoded token, all of the interval's
    prefill_latencies: list[float] = field(default_factory=list)  # seconds per token of each prefill chunk
    gauges: list[float] = field(default_factory=list)
    local_gauges: list[float] = field(default_factory=list)  # hybrid models: the local layers' window-start share
    recalled_gauges: list[float] = field(default_factory=list)  # --memory on: the share on the recalled blocks
    nll: list[float] = field(default_factory=list)  # NLL of every token fed through the cache (the NllTap's)

    def fold(self, ev: Any) -> None:
        super().fold(ev)
        if isinstance(ev, PrefillEvent) and ev.tokens:
            self.prefill_latencies.append(ev.seconds / ev.tokens)
        elif isinstance(ev, GaugeEvent):
            self.gauges.append(ev.share)
            if ev.local is not None:
                self.local_gauges.append(ev.local)
            if ev.memory is not None:  # memory on
                self.recalled_gauges.append(ev.memory)


def mean(values: list[float]) -> float | None:
    """The interval's mean of a gauge figure, rounded as the records keep it (None: never measured)."""
    return round(sum(values) / len(values), 4) if values else None


def rate(n: float, s: float) -> float | None:
    return round(n / s, 3) if s > 0 else None


def nll_bin(nll: list[float]) -> tuple[float, int]:
    vals = [v for v in nll if math.isfinite(v)]
    return sum(vals), len(vals)


def cache_ptrs(cache: Any) -> int | None:
    """A fingerprint of the cache buffers' addresses: it changes when a buffer is reallocated (grown, replaced)."""
    try:
        return hash(tuple((layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers
                          if getattr(layer, "keys", None) is not None)) & 0xFFFFFFFF
    except Exception:  # noqa: BLE001 - a cache of another shape: no fingerprint
        return None
