"""A fresh cache region per task: every task starts from the cache as it stood before the first one.

Why: the bundled model copies the nearest assistant turn; run after another task, it answered the new task with the
previous task's final answer. Truncating the cache back to the checkpoint is exact (the kept slots are untouched,
nothing is recomputed) and costs nothing. The agent feeds its system prompt alone (`Engine.feed_system`) and takes
its checkpoint right after it, before its first task feeds anything (the examples are fed again for each task), or
wherever the engine's conversation stood. It was taken before the system prompt until 2026-12: every task fed the
prompt again (~1,450 tokens), and with the recall memory on, setting the task aside also moved the sinks and the
prompt into the memory (one more copy, ~33 MB, a task) and out of the window (the sink gauge then read 0.00).

The checkpoint holds as long as the slots before it hold what they held when it was taken: an eviction of later
slots (a task longer than the window, a recall probe between tasks) does not touch them, and a checkpoint at the
start of the cache or inside the pinned system prompt holds whatever is evicted. It was dropped at any eviction
before, and a new one taken where the cache then stood, after the previous task: once a task had overflowed the
window, every later task started from a full window holding the earlier tasks' calls, overflowed in turn, and the
checkpoint never came back. A 2h15 `--memory on` soak got 19 of its first 34 tasks right, then, from a 4-step listing
that filled the window at 16 min, 8 of the next 45: 42 of those tasks ended with no answer, the model copying the
calls in front of it until its steps ran out. Only when the slots before the checkpoint were evicted
does the conversation go on from where it is, and a new checkpoint is taken.

With the recall memory on, the earlier task is set aside into the memory instead of dropped: the region is fresh,
the memory is not, so a later task can recall what an earlier one found.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class TaskCheckpoint:
    """`restore(engine)` before each task: the first call (and any call after the checkpoint's own slots were
    evicted) records the state; later calls truncate the cache, the ledger and the conversation bookkeeping back to
    it. Uses the same calls as `Engine.add_message`'s own roll-back; an engine double without a cache is left
    alone. `taken`: how many times a checkpoint was recorded (1 in a run where it always held)."""

    def __init__(self) -> None:
        self.state: tuple[Any, ...] | None = None
        self.events: list[Any] = []
        self.taken = 0

    @property
    def length(self) -> int:
        return self.state[0] if self.state else 0

    def holds(self, eng: Any) -> bool:
        """Do the cache's first `length` slots still hold what they held at the checkpoint? Stream indices only
        grow and an eviction shifts every later slot down, so the last of them still at its slot says so."""
        if self.state is None:
            return False
        length, anchor = self.state[0], self.state[1]
        index = getattr(eng.ledger, "abs_index", ())
        if eng.cache.length < length or len(index) < length or (length and index[length - 1] != anchor):
            return False
        can = getattr(eng.cache, "can_truncate", None)  # a hybrid model's local rings may have let go of tokens
        return getattr(eng, "memory", None) is not None or can is None or bool(can(length))

    def restore(self, eng: Any) -> bool:
        """True if the engine was rewound to the checkpoint. With a recall memory the earlier task's tokens are not
        dropped but set aside into it (`Engine.set_aside`: evicted, recallable by later tasks); the events that
        says are in `self.events` for the caller to show."""
        self.events = []
        if not all(hasattr(eng, a) for a in ("cache", "ledger", "last_logits", "conv")):
            return False
        if not self.holds(eng):
            if self.state is not None:
                log.info("the task checkpoint at %d tokens was evicted: a new one at %d", self.length, eng.cache.length)
            self._take(eng)
            return False
        from sinkchat.core.interrupts import deferred_sigint

        length, _, messages, fed, logits = self.state  # type: ignore[misc]
        with deferred_sigint():
            if getattr(eng, "memory", None) is not None:
                self.events = eng.set_aside(length)
            else:
                eng.cache.truncate(length)
                eng.ledger.truncate(length)
            eng.conv.messages, eng.conv.fed, eng.last_logits = list(messages), fed, logits
        log.debug("task starts from the checkpoint at %d tokens", length)
        return True

    def _take(self, eng: Any) -> None:
        length = eng.cache.length
        anchor = eng.ledger.abs_index[length - 1] if length else None
        self.state = (length, anchor, list(eng.conv.messages), eng.conv.fed, eng.last_logits)
        self.taken += 1
