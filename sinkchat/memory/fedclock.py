"""When each part of the stream was fed: the age a recalled block is shown with is its text's.

Why: a block's age was the time it was stored, i.e. when its tokens left the window: a fact typed a minute before
showed `1 s ago` in the recall line (a user audit). The Engine tells the memory the stream index of each model
call's first token (`note`); a block stored later takes the time of the call that fed its first token (`time_of`).
Bounded: one entry a second at most, and those no block can need any more go as blocks are stored.
"""

from __future__ import annotations

import bisect
import math
import time


class FedClock:
    """(stream index, wall time) of the calls whose tokens are not all stored yet."""

    def __init__(self) -> None:
        self.entries: list[tuple[int, float]] = []

    def __len__(self) -> int:
        return len(self.entries)

    def note(self, start: int) -> None:
        """A model call feeds the stream from index `start` now (a stream started over starts the entries over)."""
        now = time.time()
        if self.entries and start < self.entries[-1][0]:
            self.entries = []
        if not self.entries or now - self.entries[-1][1] >= 1.0:
            self.entries.append((start, now))

    def time_of(self, first: int, last: int) -> float:
        """When stream index `first` was fed (now, where no call recorded it: a loaded session's window); the
        entries only tokens before `last` needed go."""
        at = bisect.bisect_right(self.entries, (first, math.inf)) - 1
        t = self.entries[at][1] if at >= 0 else time.time()
        del self.entries[: max(0, bisect.bisect_right(self.entries, (last, math.inf)) - 1)]
        return t
