"""`NullLog`: the session log that stores nothing (--no-log, or a log whose database cannot be written).

Apart from `sessionlog` (which re-exports it) so that a run without a log imports neither sqlite3 nor psutil (the
process identity a session row records): `echo hi | sinkchat --no-log` imported both only to build this class,
0.05-0.07 s of its start on the busy 2-core box (`python -X importtime`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class NullLog:
    """Same methods as SessionLog, stores nothing (--no-log, or the fallback when the database is unwritable)."""

    id: int | None = None
    path: Path | None = None
    turn_count = 0
    warning: str | None = None
    resumed = False  # an existing session continued (SessionLog.resume), not a new one
    dropped = 0  # turns deleted when resumed from a soak's checkpoint (SessionLog.resume's drop_after)

    def turn(self, role: str, text: str, tokens: int = 0, seconds: float = 0.0, *, reason: str | None = None,
             cache_len: int | None = None) -> int:
        self.turn_count += 1
        return self.turn_count

    def tool_call(self, name: str, args: Any, result: Any, ok: bool) -> None: ...

    def event(self, kind: str, text: str, detail: str | None = None, tokens: int = 0) -> None: ...

    def set_system(self, text: str | None) -> None: ...

    def eviction(self, ev: Any) -> None: ...

    def metrics(self, data: dict[str, Any]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...

    def pointer(self) -> dict[str, Any]:
        """What a snapshot records to find its place in the transcript."""
        return {"session_id": self.id, "turns_logged": self.turn_count}

    @property
    def enabled(self) -> bool:
        return False
