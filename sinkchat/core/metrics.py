"""Live figures folded from engine events, plus memory probes. Pure bookkeeping: clients render `Stats`.

A status line is read on another thread than the one feeding the model (chat's live status, the toolbar), so
`read_stats` takes one consistent reading of the ledger (`ledger_view`) and shows what is fully in the cache: the
figures then add up at every moment, kv = seen - evicted - cleared. The status line itself (`status_line`) is
built from fields with a priority and fitted to the terminal by dropping whole fields (`fit_fields`).
"""

from __future__ import annotations

import os
import re
import statistics
import time
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
    feeding: bool = False  # the last event was a prefill chunk: a feed is under way (its rate is the one to show)
    feed_tokens: int = 0  # the current (or last) feed's chunks so far: its own rate, not an average over feeds
    feed_seconds: float = 0.0

    def fold(self, ev: Event) -> None:
        if isinstance(ev, TokenEvent):
            self.decode_tokens += 1
            self.decode_seconds += ev.seconds
            self.latencies.append(ev.seconds)
            self.feeding = False
        elif isinstance(ev, PrefillEvent):
            self.prefill_tokens += ev.tokens
            self.prefill_seconds += ev.seconds
            self.recent_prefill.append((ev.tokens, ev.seconds))
            if not self.feeding:  # the first chunk of a new feed
                self.feed_tokens, self.feed_seconds, self.feeding = 0, 0.0, True
            self.feed_tokens += ev.tokens
            self.feed_seconds += ev.seconds
        elif isinstance(ev, EvictionEvent):
            self.evicted += ev.count
            self.eviction_count += 1
            self.evictions.append(ev)
        elif isinstance(ev, GaugeEvent):
            self.gauge = ev
        elif isinstance(ev, DoneEvent):
            self.replies += 1
            self.feeding = False

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
    def feed_tok_s(self) -> float:
        """The current feed's own prefill rate (0 before its first chunk is in)."""
        return self.feed_tokens / self.feed_seconds if self.feed_seconds > 0 else 0.0

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
    """One consistent reading of everything a status line or /stats shows.

    `cache_len` is what is fully in the cache (the ledger's length), so cache_len == seen - evicted - cleared
    while `evicted` is the ledger's; a client showing its own eviction fold (`render.live_stats`) may show fewer
    (a stream loaded without its figures), never more. `kv_bytes`: the buffers at their size for this session,
    constant from the first status on (`session_kv_bytes`); `kv_allocated`: what is allocated so far."""

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
    cleared: int = 0  # tokens a /clear or a load dropped (not evicted): seen - evicted - cleared is what is held
    feeding: bool = False  # a feed is under way: the rate to show is `feed_tok_s`, not the last decode's
    feed_tok_s: float = 0.0  # that feed's own prefill rate (0 until its first chunk is in)
    kv_allocated: int = 0  # bytes the cache's buffers hold now (rings allocate lazily, up to `kv_bytes`)
    gauge_memory: float | None = None  # the share on the recalled memory slots (None: memory off or not measured)


@dataclass(frozen=True)
class LedgerView:
    """The ledger's figures read together: length == seen - evicted - cleared (see `ledger_view`)."""

    seen: int
    evicted: int
    cleared: int
    length: int
    start: int
    pinned: int
    holds_start: bool


def ledger_view(ledger: Any, tries: int = 200) -> LedgerView:
    """One consistent reading of the ledger while the engine may be updating it on another thread.

    `Ledger.append` / `evict` / `truncate` / `clear` change the lists and the counters one after the other, so a
    reader between two of those steps sees a length that disagrees with the counters (and the cache's own length
    runs a whole chunk ahead of both while that chunk is computed). The reading is retried, yielding to the
    writer, until the ledger's invariant holds; after `tries` the counters win and the length is derived."""
    for _ in range(tries):
        seen, evicted, cleared = ledger.seen, ledger.evicted, ledger.cleared
        length, start, pinned, holds = len(ledger.ids), ledger.start, ledger.pinned, ledger.holds_stream_start()
        if (length == seen - evicted - cleared == len(ledger.abs_index)
                and (seen, evicted, cleared) == (ledger.seen, ledger.evicted, ledger.cleared)):
            return LedgerView(seen, evicted, cleared, length, start, min(pinned, length), holds)
        time.sleep(0)  # let the writer finish its update
    return LedgerView(seen, evicted, cleared, max(0, seen - evicted - cleared), start, pinned, holds)


def read_stats(engine: Any, m: Metrics, model_nbytes: int | None = None) -> Stats:
    """Everything a status shows, the cache's figures from one `ledger_view` (never the cache's running length)."""
    g, v = m.gauge, ledger_view(engine.ledger)
    cache = engine.cache
    return Stats(
        policy=engine.cache_cfg.policy,
        n_sink=engine.cache_cfg.n_sink,
        cache_len=v.length,
        capacity=engine.cache_cfg.capacity,
        kv_bytes=session_kv_bytes(engine),
        model_bytes=model_nbytes if model_nbytes is not None else model_bytes(engine.model),
        rss=rss_bytes(),
        cuda=cuda_bytes(),
        seen=v.seen,
        evicted=v.evicted,
        evictions=m.eviction_count,
        decode_tok_s=m.decode_tok_s,
        prefill_tok_s=m.prefill_tok_s,
        p50_ms=m.latency_ms(50),
        p99_ms=m.latency_ms(99),
        gauge=g.share if g else None,
        gauge_recent=g.recent if g else None,
        gauge_uniform=g.uniform if g else None,
        holds_start=v.holds_start,
        decoder=getattr(engine, "decoder_status", ""),
        pinned=v.pinned if engine.cache_cfg.policy == "sink" else 0,
        kv_layout=kv_layout(cache, v.length, v.seen - v.start),
        gauge_local=g.local if g else None,
        gauge_local_uniform=g.local_uniform if g else None,
        cleared=v.cleared,
        feeding=m.feeding or cache.length - v.length > 1,  # a chunk in flight: a feed began before its first event
        feed_tok_s=m.feed_tok_s if m.feeding else 0.0,
        kv_allocated=cache.nbytes,
        gauge_memory=g.memory if g and getattr(engine, "memory", None) is not None else None,  # /memory off: gone
    )


def session_kv_bytes(engine: Any) -> int:
    """The bytes of the cache's buffers at their size for this session, the same from the first status on.

    Buffers are allocated at the first forward (0 bytes before it) and a hybrid model's local rings are sized by
    the longest chunk they have taken so far (`WindowLayer._make_room` grows them): the allocation alone read
    15.4 then 19.0 MiB in one Gemma session. Each global (or shared) layer holds `capacity` slots; a ring at most
    its window (`keep`) + the longest chunk the engine feeds + its `slack` (the growth rule's ceiling)."""
    cache, spec = engine.cache, getattr(engine, "spec", None)
    store = getattr(engine, "kv_store", None)
    if spec is None or store is None or not cache.layers:
        return int(cache.nbytes)
    slot = spec.kv_bytes_per_token(torch_bits(store)) // max(1, len(cache.layers))  # one layer, one token
    chunk = min(int(getattr(engine, "prefill_chunk", cache.capacity)), cache.capacity)
    total = 0
    for layer in cache.layers:
        ring = hasattr(layer, "keep") and hasattr(layer, "slack")
        slots = max(layer.capacity, layer.keep + chunk + layer.slack) if ring else cache.capacity
        total += max(int(layer.nbytes), slot * slots)
    return total


def torch_bits(dtype: Any) -> int:
    """Bits per element of a torch dtype (what the KV buffers store)."""
    import torch

    return torch.finfo(dtype).bits if dtype.is_floating_point else torch.iinfo(dtype).bits


def kv_layout(cache: Any, length: int | None = None, stream: int | None = None) -> str:
    """How a hybrid cache holds its two kinds of layers (`HybridKVCache.layout`), or "" for a one-kind cache.
    `length` / `stream` come from a `ledger_view` (see there)."""
    layout = getattr(cache, "layout", None)
    return layout(length, stream) if callable(layout) else ""


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
    """One event line per eviction (chat and agent alike): how many tokens, which absolute range, what left; with
    the recall memory on, where they went. A `ForgottenEvent` (tokens that left the memory): its own line."""
    if not hasattr(ev, "policy"):
        why = {"budget": "over the memory budget", "disk": "the memory store could not write them",
               "damaged": "their memory block failed its checksum"}.get(ev.reason, ev.reason)
        return f"⟂ forgotten {ev.count} tokens [{ev.first},{ev.last}) ({why})"
    where = " to memory" if getattr(ev, "to_memory", False) else ""
    return (f"⟂ evicted {ev.count} tokens [{ev.first},{ev.last}){where} ({ev.policy}, {ev.cache_len} left): "
            f"{ev.preview!r}")


def policy_label(policy: str, n_sink: int, pinned: int = 0, capacity: int = 0) -> str:
    """`sink(4)`, or `sink(4) pinned 212 + window 1836` with a pinned system prompt (212 leading slots, sinks
    included, kept forever); the naive window and dense pin nothing, so they show no sink count."""
    if policy != "sink":
        return policy
    return f"sink({n_sink}) pinned {pinned} + window {capacity - pinned}" if pinned > n_sink else f"sink({n_sink})"


# ------------------------------------------------------------------------------------------------- status line
FIELDS = ("policy", "mem", "kv", "seen", "rate", "gauge")  # the order they are shown in
# How a line too wide for the terminal gives way, one step at a time: (field, its next shorter variant). The last
# to go: the cache fill and the evictions, then the gauge's figures (sink and local layers), tokens seen, the rate,
# the policy, the KV bytes, memory; the gauge bar shrinks first and goes before any figure. A field is shown whole
# or not at all.
SHRINK = (("gauge", 1), ("policy", 1), ("mem", 1), ("gauge", 2), ("kv", 1), ("policy", 2), ("rate", 1),
          ("kv", 2), ("seen", 1), ("seen", 2), ("gauge", 3))


def status_variants(s: Stats, toolbar: bool = False) -> dict[str, list[str]]:
    """Each field's texts, longest first ("" = not shown). `toolbar`: chat's bottom toolbar spelling (capital
    labels, fill %, eviction count)."""
    label = policy_label(s.policy, s.n_sink, s.pinned, s.capacity)
    short = f"{s.policy}({s.n_sink}){'+' + str(s.pinned) if s.pinned > s.n_sink else ''}" if s.policy == "sink" \
        else s.policy
    cuda = f" {'CUDA' if toolbar else 'cuda'} {human_bytes(s.cuda[0])}" if s.cuda else ""
    kv = "KV" if toolbar else "kv"
    fill = s.kv_layout or f"{s.cache_len}/{s.capacity}" + (f" {s.cache_len / s.capacity:.0%}" if toolbar and
                                                           s.capacity else "")
    compact = re.sub(r"global \d+ layers? |(?<=local )\d+ layers? |,", "", s.kv_layout) if s.kv_layout else fill
    count = f" ({s.evictions}x)" if toolbar else ""
    cleared = f" cleared {s.cleared}" if s.cleared else ""
    rate = f"prefill {s.feed_tok_s:.1f} tok/s" if s.feeding and s.feed_tok_s else "prefill … tok/s" if s.feeding \
        else f"{s.decode_tok_s:.1f} tok/s{' (compiling)' if 'compiling' in s.decoder else ''}"
    value = "n/a" if s.gauge is None else f"{s.gauge:.2f}"
    start = "" if s.holds_start or s.gauge is None else " (start gone)"
    tail = f"{value}{start}{local_gauge(s)}{memory_gauge(s)}"
    return {
        "policy": [label, short, ""],
        "mem": [f"{'RSS' if toolbar else 'rss'} {human_bytes(s.rss)}{cuda}", ""],
        "kv": [f"{kv} {human_bytes(s.kv_bytes)}{':' if s.kv_layout else ''} {fill}", f"{kv} {fill}",
               f"{kv} {compact}"],
        "seen": [f"seen {s.seen} evicted {s.evicted}{count}{cleared}", f"seen {s.seen} evicted {s.evicted}",
                 f"evicted {s.evicted}"],
        "rate": [rate, ""],
        "gauge": [f"sink {gauge_bar(s.gauge)} {tail}", f"sink {gauge_bar(s.gauge, 5)} {tail}", f"sink {tail}", ""],
    }


def fit_fields(variants: dict[str, list[str]], width: int, sep: int) -> dict[str, str]:
    """The longest texts of every field that fit `width` columns together (`sep` columns between two shown
    fields), reached by taking the `SHRINK` steps in order: lower-priority fields shrink or go whole."""
    pick = {name: 0 for name in FIELDS}

    def chosen() -> dict[str, str]:
        return {name: variants[name][pick[name]] for name in FIELDS}

    def length(texts: dict[str, str]) -> int:
        shown = [t for t in texts.values() if t]
        return sum(len(t) for t in shown) + sep * max(0, len(shown) - 1)

    for name, step in SHRINK:
        if length(chosen()) <= width:
            break
        pick[name] = max(pick[name], min(step, len(variants[name]) - 1))
    return chosen()


def status_line(s: Stats, width: int | None = None) -> str:
    """The one-line status (stderr, chat's live line, summarize): policy, memory, KV bytes and fill, totals,
    rate (the feed's own prefill rate during a feed), gauge. `width`: the terminal's columns, met by dropping
    lower-priority fields whole (`fit_fields`); None: everything."""
    texts = fit_fields(status_variants(s), width if width is not None else 1 << 30, 3)
    return " | ".join(texts[name] for name in FIELDS if texts[name])


def local_gauge(s: Stats) -> str:
    """" local 0.05": a hybrid model's local layers' share on the first tokens of their window (else "")."""
    return "" if s.gauge_local is None else f" local {s.gauge_local:.2f}"


def memory_gauge(s: Stats) -> str:
    """" · mem 0.11": the share of attention on the recalled memory blocks, with the memory on (else "")."""
    return "" if s.gauge_memory is None else f" · mem {s.gauge_memory:.2f}"
