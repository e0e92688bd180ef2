"""A fresh cache region per task: every task starts from the cache as it stood before the first one.

Why: the bundled model copies the nearest assistant turn; run after another task, it answered the new task with the
previous task's final answer. Truncating the cache back to the end of the system prompt and examples is exact (the
kept slots are untouched, nothing is recomputed) and costs nothing. It needs the cache not to have evicted since the
checkpoint; when it has (a task longer than the cache), the conversation simply goes on and a new checkpoint is taken.
With the recall memory on, the earlier task is set aside into the memory instead of dropped: the region is fresh,
the memory is not, so a later task can recall what an earlier one found.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class TaskCheckpoint:
    """`restore(engine)` before each task: the first call (and any call after an eviction) records the state; later
    calls truncate the cache, the ledger and the conversation bookkeeping back to it. Uses the same calls as
    `Engine.add_message`'s own roll-back; an engine double without a cache is left alone."""

    def __init__(self) -> None:
        self.state: tuple[Any, ...] | None = None

    @property
    def length(self) -> int:
        return self.state[0] if self.state else 0

    def restore(self, eng: Any) -> bool:
        """True if the engine was rewound to the checkpoint. With a recall memory the earlier task's tokens are not
        dropped but set aside into it (`Engine.set_aside`: evicted, recallable by later tasks); the events that
        says are in `self.events` for the caller to show."""
        self.events: list[Any] = []
        if not all(hasattr(eng, a) for a in ("cache", "ledger", "last_logits", "conv")):
            return False
        s = self.state
        if s is None or s[1] != eng.ledger.evicted or eng.cache.length < s[0]:
            self.state = (eng.cache.length, eng.ledger.evicted, list(eng.conv.messages), eng.conv.fed, eng.last_logits)
            return False
        from sinkchat.core.interrupts import deferred_sigint

        length, _, messages, fed, logits = s
        with deferred_sigint():
            if getattr(eng, "memory", None) is not None:
                self.events = eng.set_aside(length)
            else:
                eng.cache.truncate(length)
                eng.ledger.truncate(length)
            eng.conv.messages, eng.conv.fed, eng.last_logits = list(messages), fed, logits
        self.state = (length, eng.ledger.evicted, *s[2:])
        log.debug("task starts from the checkpoint at %d tokens", length)
        return True
