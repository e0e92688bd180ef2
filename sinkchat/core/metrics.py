"""Live figures folded from engine events, plus memory probes. Pure bookkeeping: clients render `Stats`."""

from __future__ import annotations

import os
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from sinkchat.core.events import DoneEvent, EvictionEvent, Event, GaugeEvent, PrefillEvent, TokenEvent


def rss_bytes() -> int:
    """Resident set size of this process."""
    try:
        import psutil

        return int(psutil.Process(os.getpid()).memory_info().rss)
    except Exception:  # noqa: BLE001 - psutil missing or restricted /proc
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            return 0


def cuda_bytes() -> tuple[int, int] | None:
    """(allocated, peak allocated) on the current CUDA device, or None without CUDA."""
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.memory_allocated()), int(torch.cuda.max_memory_allocated())
    except Exception:  # noqa: BLE001
        pass
    return None


def model_bytes(model: Any) -> int:
    """Bytes of parameters and buffers as stored (4-bit weights count as their packed bytes + quant stats)."""
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        total += t.numel() * t.element_size()
        qs = getattr(t, "quant_state", None)
        if qs is not None and getattr(qs, "absmax", None) is not None:
            total += qs.absmax.numel() * qs.absmax.element_size()
    return total


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


@dataclass
class Metrics:
    """Running totals folded from events (`fold`); rates cover the most recent `window` tokens."""

    window: int = 256
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    evicted: int = 0
    eviction_count: int = 0
    latencies: deque = field(default_factory=lambda: deque(maxlen=4096))  # seconds per decoded token
    recent_prefill: deque = field(default_factory=lambda: deque(maxlen=32))  # (tokens, seconds)
    evictions: deque = field(default_factory=lambda: deque(maxlen=100))
    gauge: GaugeEvent | None = None
    replies: int = 0

    def fold(self, ev: Event) -> None:
        if isinstance(ev, TokenEvent):
            self.decode_tokens += 1
            self.decode_seconds += ev.seconds
            self.latencies.append(ev.seconds)
        elif isinstance(ev, PrefillEvent):
            self.prefill_tokens += ev.tokens
            self.prefill_seconds += ev.seconds
            self.recent_prefill.append((ev.tokens, ev.seconds))
        elif isinstance(ev, EvictionEvent):
            self.evicted += ev.count
            self.eviction_count += 1
            self.evictions.append(ev)
        elif isinstance(ev, GaugeEvent):
            self.gauge = ev
        elif isinstance(ev, DoneEvent):
            self.replies += 1

    def new_stream(self) -> None:
        """The cache now holds another stream (a loaded snapshot or transcript): forget the eviction events and
        the gauge that described the old one; speed figures stay, they describe this machine."""
        self.evictions.clear()
        self.evicted = self.eviction_count = 0
        self.gauge = None

    @property
    def decode_tok_s(self) -> float:
        recent = list(self.latencies)[-self.window :]
        total = sum(recent)
        return len(recent) / total if total > 0 else 0.0

    @property
    def prefill_tok_s(self) -> float:
        toks = sum(t for t, _ in self.recent_prefill)
        secs = sum(s for _, s in self.recent_prefill)
        return toks / secs if secs > 0 else 0.0

    def latency_ms(self, q: float) -> float:
        return 1000.0 * percentile(list(self.latencies)[-self.window * 4 :], q)

    def median_ms(self) -> float:
        lat = list(self.latencies)
        return 1000.0 * statistics.median(lat) if lat else 0.0


@dataclass(frozen=True)
class Stats:
    """One consistent reading of everything a status line or /stats shows."""

    policy: str
    n_sink: int
    cache_len: int
    capacity: int
    kv_bytes: int
    model_bytes: int
    rss: int
    cuda: tuple[int, int] | None
    seen: int
    evicted: int
    evictions: int
    decode_tok_s: float
    prefill_tok_s: float
    p50_ms: float
    p99_ms: float
    gauge: float | None
    gauge_recent: float | None
    gauge_uniform: float | None
    holds_start: bool
    decoder: str = ""  # how single tokens are decoded now, e.g. "compiled, kv bfloat16"
    pinned: int = 0  # leading slots kept forever beyond the sinks' own count (the pinned system prompt)
    kv_layout: str = ""  # hybrid models: "global 6 layers 1024/1024, local 20 layers 511/511" (empty otherwise)
    gauge_local: float | None = None  # hybrid models: the local layers' share on the first tokens of their window
    gauge_local_uniform: float | None = None  # ... and an even spread's share there


def read_stats(engine: Any, m: Metrics, model_nbytes: int | None = None) -> Stats:
    g = m.gauge
    return Stats(
        policy=engine.cache_cfg.policy,
        n_sink=engine.cache_cfg.n_sink,
        cache_len=engine.cache.length,
        capacity=engine.cache_cfg.capacity,
        kv_bytes=engine.cache.nbytes,
        model_bytes=model_nbytes if model_nbytes is not None else model_bytes(engine.model),
        rss=rss_bytes(),
        cuda=cuda_bytes(),
        seen=engine.ledger.seen,
        evicted=engine.ledger.evicted,
        evictions=m.eviction_count,
        decode_tok_s=m.decode_tok_s,
        prefill_tok_s=m.prefill_tok_s,
        p50_ms=m.latency_ms(50),
        p99_ms=m.latency_ms(99),
        gauge=g.share if g else None,
        gauge_recent=g.recent if g else None,
        gauge_uniform=g.uniform if g else None,
        holds_start=engine.ledger.holds_stream_start(),
        decoder=getattr(engine, "decoder_status", ""),
        pinned=engine.ledger.pinned if engine.cache_cfg.policy == "sink" else 0,
        kv_layout=kv_layout(engine.cache),
        gauge_local=g.local if g else None,
        gauge_local_uniform=g.local_uniform if g else None,
    )


def kv_layout(cache: Any) -> str:
    """How a hybrid cache holds its two kinds of layers (`HybridCache.layout`), or "" for a one-kind cache."""
    layout = getattr(cache, "layout", None)
    return layout() if callable(layout) else ""


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def gauge_bar(share: float | None, width: int = 10) -> str:
    if share is None:
        return "·" * width
    full = max(0, min(width, round(share * width)))
    return "█" * full + "░" * (width - full)


def eviction_line(ev: Any) -> str:
    """One event line per eviction (chat and agent alike): how many tokens, which absolute range, what left."""
    return f"⟂ evicted {ev.count} tokens [{ev.first},{ev.last}) ({ev.policy}, {ev.cache_len} left): {ev.preview!r}"


def policy_label(policy: str, n_sink: int, pinned: int = 0, capacity: int = 0) -> str:
    """`sink(4)`, or `sink(4) pinned 212 + window 1836` with a pinned system prompt (212 leading slots, sinks
    included, kept forever); the naive window and dense pin nothing, so they show no sink count."""
    if policy != "sink":
        return policy
    return f"sink({n_sink}) pinned {pinned} + window {capacity - pinned}" if pinned > n_sink else f"sink({n_sink})"


def status_line(s: Stats) -> str:
    """The one-line status (toolbar, stderr): memory, cache fill, totals, speed, gauge, policy."""
    cuda = f" cuda {human_bytes(s.cuda[0])}" if s.cuda else ""
    gauge = "n/a" if s.gauge is None else f"{s.gauge:.2f}"
    return (
        f"{policy_label(s.policy, s.n_sink, s.pinned, s.capacity)} | rss {human_bytes(s.rss)}{cuda} | kv {human_bytes(s.kv_bytes)} "
        f"{s.kv_layout or f'{s.cache_len}/{s.capacity}'} | seen {s.seen} evicted {s.evicted} | {s.decode_tok_s:.1f} tok/s | "
        f"sink {gauge_bar(s.gauge)} {gauge}{local_gauge(s)}"
    )


def local_gauge(s: Stats) -> str:
    """" local 0.05": a hybrid model's local layers' share on the first tokens of their window (else "")."""
    return "" if s.gauge_local is None else f" local {s.gauge_local:.2f}"
