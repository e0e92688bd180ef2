"""What the recall memory holds and what a reply read from it, in figures and text a user can check.

Read-only views over a `RecallMemory` for the apps (status line, `/recall`, `/stats`, jsonl records): the apps
never reach into the memory's internals, and these figures are the same ones the ledger's invariant counts
(`ledger.evicted == memory.tokens + memory.forgotten`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from sinkchat.memory.events import ForgottenEvent
from sinkchat.memory.store import StoreError


@dataclass(frozen=True)
class MemoryStats:
    """The memory's totals now: blocks indexed, tokens held (blocks and the queue not yet a block), tokens
    reported forgotten, bytes on disk (of `budget` bytes), bytes of the index and of the recalled-slice cache."""

    blocks: int
    tokens: int
    forgotten: int
    disk_bytes: int
    budget: int
    index_bytes: int
    ram_bytes: int
    copies: int = 0  # of `forgotten`: copies of blocks read again as text, let go (the memory holds the originals)


@dataclass(frozen=True)
class Recalled:
    """A block a reply read: its id, the stream range [first, last) it holds, the wall time it was stored, in how
    many of the memory's layers it was chosen (at most `of`) at one call, and whether it was also read again as
    text before the message (`Engine.feed_query`)."""

    bid: int
    first: int
    last: int
    born: float
    layers: int
    of: int
    reread: bool = False

    def age(self, now: float | None = None) -> float:
        """Seconds since the block was stored."""
        return max(0.0, (time.time() if now is None else now) - self.born)


def stats(memory: Any) -> MemoryStats:
    return MemoryStats(memory.blocks, memory.tokens, memory.forgotten, memory.disk_bytes, memory.store.budget,
                       memory.index_bytes, memory.lru_bytes, getattr(memory, "copies", 0))


def take_recalled(memory: Any) -> list[Recalled]:
    """The blocks recalled since the last take (a reply's), in stream order; the tally starts again. A block
    forgotten since (budget, damage) is not listed."""
    out = []
    again = getattr(memory, "reread", set())
    for bid in sorted(set(memory.recalled) | set(again)):
        w = memory.store.where.get(bid)
        if w is not None:
            out.append(Recalled(bid, w.first, w.last, memory.born.get(bid, time.time()), memory.recalled.get(bid, 0),
                                len(memory.layers), bid in again))
    memory.recalled, memory.reread = {}, set()
    return out


def block_text(memory: Any, bid: int, decode: Callable[[list[int]], str]) -> str | None:
    """The text of a stored block (its token ids, decoded by `decode`), or None when it cannot be read back."""
    try:
        return decode(memory.store.token_ids(bid).tolist())
    except StoreError:
        return None


def spans(memory: Any) -> list[tuple[int, int, int]]:
    """What the memory holds as runs of consecutive stream indices: (first, last, tokens) with [first, last), in
    stream order; blocks and the queue (evicted tokens not yet a block) alike. `tokens` sums to `memory.tokens`."""
    parts = [(w.first, w.last, w.n) for w in (memory.store.where[b] for b in memory.index.ids)]
    for e in memory.queue:  # (keys, values, ids, stream indices, slots): one run per consecutive stretch
        for a in e[3]:
            parts.append((a, a + 1, 1))
    out: list[tuple[int, int, int]] = []
    for first, last, n in sorted(parts):
        if out and out[-1][1] == first:
            out[-1] = (out[-1][0], last, out[-1][2] + n)
        else:
            out.append((first, last, n))
    return out


def forget(memory: Any, cache: Any = None, reason: str = "/forget") -> list[ForgottenEvent]:
    """Drop everything the memory holds (its files too), reported: one `ForgottenEvent` per run of consecutive
    stream indices, counted in `memory.forgotten`, so `ledger.evicted == memory.tokens + memory.forgotten` still
    holds (as a /clear does, which drops the window too). The memory stays on: what is evicted
    from now on goes to it as before."""
    events = [ForgottenEvent(n, first, last, reason) for first, last, n in spans(memory)]
    queries, q_pos = memory.queries, memory.q_pos
    memory.clear(cache)  # counts what it held as forgotten
    if cache is not None and cache.length:  # the conversation goes on: keep choosing with its last queries
        memory.queries, memory.q_pos = queries, q_pos
    return events

