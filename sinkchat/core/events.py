"""Dataclasses the Engine yields. Clients (REPL, summarizer, agent, soak) fold them; the Engine never prints."""

from __future__ import annotations

from dataclasses import dataclass, field

from sinkchat.memory.events import ForgottenEvent  # noqa: F401 - the memory's, re-exported

PREVIEW_CHARS = 60  # an eviction's preview: its first tokens' text, cut to this many characters (Engine._evict)


@dataclass(frozen=True)
class PrefillEvent:
    """A chunk of input went through the model."""

    tokens: int
    seconds: float
    cache_len: int


@dataclass(frozen=True)
class EvictionEvent:
    """`count` tokens left the cache: absolute stream indices [first, last) and a preview of their text."""

    count: int
    first: int
    last: int
    preview: str
    policy: str
    cache_len: int  # after the eviction
    seconds: float = 0.0
    to_memory: bool = False  # kept by the recall memory (recallable), not dropped


@dataclass(frozen=True)
class TokenEvent:
    """One generated token; `text` is the newly decodable text (may be '' while a multi-byte char is incomplete)."""

    token_id: int
    text: str
    seconds: float
    cache_len: int


@dataclass(frozen=True)
class GaugeEvent:
    """Share of the latest query's attention on the first `n` cache slots, mean over heads, per layer and overall.

    `holds_start` tells whether those slots still hold the stream's first tokens (False once `window` evicted them).
    `recent` is the same share for the most recent `n` slots and `uniform` what an even spread would give.
    Hybrid models: all of these describe the global layers; `local` is the local layers' share on the first `n`
    tokens of their own window (mean over layers and heads; None without local layers), `local_uniform` an even
    spread's share of that window. `memory`: with the recall memory on, the share on the recalled memory slots in
    front of the stream (mean over the global layers and heads; 0.0 while it recalls nothing, None with it off),
    `memory_per_layer` per global layer: the sink share alone cannot say whether the model reads what the memory
    brings back. The recalled slots, the first `n` stream slots and the newest `n` (never a recalled slot) are
    disjoint once the stream holds 2n slots, so the three shares then sum to at most 1.
    """

    share: float
    per_layer: tuple[float, ...]
    recent: float
    uniform: float
    n: int
    holds_start: bool
    local: float | None = None
    local_per_layer: tuple[float, ...] = ()
    local_uniform: float | None = None
    memory: float | None = None
    memory_per_layer: tuple[float, ...] = ()


@dataclass(frozen=True)
class DoneEvent:
    """Generation ended. reason: 'eos' | 'stop' | 'length' | 'cancelled'."""

    reason: str
    tokens: int
    seconds: float
    text: str = ""
    token_ids: tuple[int, ...] = field(default_factory=tuple)


Event = PrefillEvent | EvictionEvent | TokenEvent | GaugeEvent | DoneEvent | ForgottenEvent
