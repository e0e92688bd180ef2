"""The recall memory's side of eviction, as a mixin of the Engine: an agent's finished task set aside into the
memory, and stream ranges the memory lets go instead of keeping (an agent's example turns).

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
from sinkchat.core.events import EvictionEvent, ForgottenEvent

if TYPE_CHECKING:
    from sinkchat.memory.recall import RecallMemory


class Remembering:
    """`set_aside`, `keep_out` and `_remember` (what `Engine._evict_run` calls for each eviction with a memory)."""

    memory: RecallMemory | None
    ledger: Ledger
    cache: Any
    unkept: list[tuple[int, int]]
    _forgotten: list[ForgottenEvent]

    def _evict(self, ev: Eviction) -> list[EvictionEvent | ForgottenEvent]:  # the Engine's
        raise NotImplementedError

    def pinned_slots(self) -> int:  # the Engine's
        raise NotImplementedError

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

    def _remember(self, ev: Eviction) -> bool:
        """The slots of `ev` into the recall memory, but for the stream ranges marked not to be kept (`keep_out`):
        the memory lets those go at once, counted and reported as forgotten ("not kept"). True if any was kept."""
        assert self.memory is not None
        ab, any_kept = self.ledger.abs_index, False
        for part, keep in kept_parts(ab, ev, self.unkept):
            end = part.start + part.count
            any_kept |= keep
            if keep:
                ids = self.ledger.ids[part.start : end]
                self._forgotten += self.memory.absorb(self.cache, part.start, part.count, ids, ab[part.start : end],
                                                      self.pinned_slots())
            else:
                self.memory.forgotten += part.count
                self._forgotten.append(ForgottenEvent(part.count, ab[part.start], ab[end - 1] + 1, "not kept"))
        return any_kept

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
