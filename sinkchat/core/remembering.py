"""The recall memory's side of eviction, as a mixin of the Engine: an agent's finished task set aside into the
memory, stream ranges the memory lets go instead of keeping (an agent's example turns, copies of blocks read again),
and a query fed after the blocks it names, read again as text (`feed_query`).

Split from engine.py to keep it about model calls and the cache; these methods use the Engine's cache, ledger and
memory and its `_evict`.
"""

from __future__ import annotations

import sys
from bisect import bisect_left
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from sinkchat.core.cache_policy import Eviction, Ledger, kept_parts
from sinkchat.core.events import Event, EvictionEvent, ForgottenEvent

if TYPE_CHECKING:
    from sinkchat.memory.recall import RecallMemory


class Remembering:
    """`set_aside`, `keep_out` and `_remember` (what `Engine._evict_run` calls for each eviction with a memory)."""

    memory: RecallMemory | None
    cache_cfg: Any
    ledger: Ledger
    cache: Any
    unkept: list[tuple[int, int]]
    copies: list[tuple[int, int]]  # the unkept ranges that are copies of blocks read again (`feed_query`)
    _forgotten: list[ForgottenEvent]

    def _evict(self, ev: Eviction) -> list[EvictionEvent | ForgottenEvent]:  # the Engine's
        raise NotImplementedError

    def pinned_slots(self) -> int:  # the Engine's
        raise NotImplementedError

    def feed_ids(self, ids: list[int]) -> Iterator[Any]:  # the Engine's
        raise NotImplementedError

    def feed_query(self, query: list[int], before: list[int] | tuple[int, ...] = ()) -> Iterator[Event]:
        """Feed `query` (a message, a question) after the memory's blocks its words single out, read again as text
        (`memory.reread`, the `reread` setting's number of blocks, within half the window; nothing else when the
        memory is off or the query names no block). `before` (what closes the last turn), the copies and the query
        go in one feed (passkey at 4k, 20 trials, one block read again: 17/20 in one feed, 16/20 fed apart). The
        memory does not keep the copies a second time (they go as "re-read" when they leave the window), and they
        count in what the reply recalled."""
        mem = self.memory
        got = []
        if mem is not None and mem.cfg.reread > 0 and not any(b == sys.maxsize for _, b in self.unkept):
            from sinkchat.memory.reread import to_reread  # not inside scaffolding the memory does not keep

            room = (self.cache_cfg.capacity - self.pinned_slots()) // 2 - len(query) - len(before)
            got = to_reread(mem, query, mem.cfg.reread, room)
        if not got:
            yield from self.feed_ids(list(before) + list(query))
            return
        again = [t for _, ids in got for t in ids]
        first = self.ledger.seen + len(before)
        try:
            self.keep_out(first, first + len(again))
            self.copies = [c for c in self.copies if c in self.unkept] + [(first, first + len(again))]
            yield from self.feed_ids(list(before) + again + list(query))
        finally:
            if self.ledger.seen < first + len(again):  # interrupted before the copy's end: the rest never fed
                self._cut_ranges(max(first, self.ledger.seen))
        assert mem is not None
        mem.reread.update(bid for bid, _ in got)

    def forget_memory(self, reason: str = "/forget") -> list[ForgottenEvent]:
        """Drop everything the memory holds (`report.forget`: one "forgotten" event a range; the memory stays on).
        The copies of its blocks read again into the window are then the only copy of that text: they leave the
        window as the rest of it does (into the memory), no longer let go as "re-read" copies of originals it
        does not hold any more."""
        from sinkchat.memory import report

        assert self.memory is not None
        events = report.forget(self.memory, self.cache, reason)
        self.unkept = [r for r in self.unkept if r not in self.copies]
        self.copies = []
        return events

    def set_aside(self, length: int) -> list[EvictionEvent | ForgottenEvent]:
        """Take slots >= `length` out of the window into the recall memory (an agent's finished task, before the
        next one starts from the same cache state): counted and shown as an eviction, so the tokens stay
        recallable and accounted for. Without a memory, nothing to keep them in: use `cache.truncate`."""
        if self.memory is None:
            raise RuntimeError("set_aside keeps tokens in the recall memory: the engine has none")
        n = self.cache.length - length
        events = self._evict(Eviction(length, n)) if n > 0 else []
        self.memory.hold_queue()
        return events

    def _taken_back(self) -> None:
        """Cut the ranges (`keep_out`, `reread`'s copies) at where the stream was last taken back to (an interrupted
        message, a soak probe, an agent's task checkpoint): the stream indices past it were never kept in the
        stream, and the tokens fed next reuse them (a probe's copy would otherwise mark the next real tokens as
        copies the memory holds, and let them go)."""
        low = self.ledger.take_low_water()
        if low is not None:
            self._cut_ranges(low)

    def _cut_ranges(self, low: int) -> None:
        """No range reaches past stream index `low` any more (indices from it on are fed anew)."""
        cut = [(a, min(b, low)) for a, b in self.unkept if a < low]
        self.copies = [(a, min(b, low)) for a, b in self.copies if a < low]
        self.unkept = cut

    def _remember(self, ev: Eviction) -> bool:
        """The slots of `ev` into the recall memory, but for the stream ranges marked not to be kept (`keep_out`):
        the memory lets those go at once, counted and reported as forgotten ("not kept"). True if any was kept."""
        assert self.memory is not None
        self._taken_back()
        ab, any_kept = self.ledger.abs_index, False
        for part, keep in kept_parts(ab, ev, self.unkept):
            end = part.start + part.count
            any_kept |= keep
            if keep:
                ids = self.ledger.ids[part.start : end]
                self._forgotten += self.memory.absorb(self.cache, part.start, part.count, ids, ab[part.start : end],
                                                      self.pinned_slots())
            else:
                self._let_go(ab[part.start : end])
        return any_kept

    def _let_go(self, abs_index: list[int]) -> None:
        """Stream indices the memory lets go: one "forgotten" event a run of copies of blocks read again ("re-read":
        the memory holds the originals, counted in `copies`) or of other scaffolding ("not kept")."""
        assert self.memory is not None
        self.memory.forgotten += len(abs_index)
        runs: list[list[Any]] = []  # [why, first, last, count]
        for a in abs_index:
            why = "re-read" if any(f <= a < b for f, b in self.copies) else "not kept"
            if runs and runs[-1][0] == why:
                runs[-1][2:] = [a + 1, runs[-1][3] + 1]
            else:
                runs.append([why, a, a + 1, 1])
        for why, first, last, n in runs:
            self.memory.copies += n if why == "re-read" else 0
            self._forgotten.append(ForgottenEvent(n, first, last, why))

    def keep_out(self, first: int, last: int | None = None) -> None:
        """Stream indices [first, last) are scaffolding the recall memory should not keep: an agent's example turns,
        fed again for every task. Kept, each task added one more copy, the lexical prior matched the next task's
        examples to an old copy of themselves, and the bundled model copied the calls and answers in it
        (`benchmarks/agent_tasks.py --only 43-48 --cache 1024 --memory on`: 0/6 right against 3/6 with the memory
        off). They leave the window as usual; the memory reports them forgotten instead of storing them.
        `last` None: open-ended, while they are fed (a long one overflows the window); call again with `last` (in a
        `finally`) to close the range."""
        if self.memory is None:
            return
        self._taken_back()
        ab = self.ledger.abs_index  # ascending: stream order
        kept = [(a, b) for a, b in self.unkept if a < first and _holds(ab, a, b)]  # past ranges still in the cache
        if last is None or last > first:
            kept.append((first, sys.maxsize if last is None else last))
        self.unkept = kept

    @contextmanager
    def not_kept(self) -> Iterator[None]:
        """The tokens fed inside the block are not kept by the recall memory (`keep_out`): the range opens before the
        first and closes after the last, however the block ends (an interrupted feed too). No-op without a memory."""
        first = self.ledger.seen
        self.keep_out(first)
        try:
            yield
        finally:
            self.keep_out(first, self.ledger.seen)


def _holds(abs_index: list[int], first: int, last: int) -> bool:
    """Whether the cache still holds a token of stream range [first, last) (`abs_index` ascending)."""
    i = bisect_left(abs_index, first)
    return i < len(abs_index) and abs_index[i] < last
