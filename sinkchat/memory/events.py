"""What the recall memory reports; `sinkchat.core.events` re-exports these with the Engine's own events."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ForgottenEvent:
    """`count` tokens, stream indices [first, last), left the recall memory for good: over its disk budget, a write
    that failed (disk full), or never kept (an agent's example turns, `Engine.keep_out`). Like an eviction, but
    from the memory: nothing recalls them any more."""

    count: int
    first: int
    last: int
    reason: str  # "budget" | "disk" (the write failed) | "damaged" (a block failed its checksum when read back) |
    # "not kept" (scaffolding fed again and again, let go as it left the window)
