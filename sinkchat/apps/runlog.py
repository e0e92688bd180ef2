"""Session logging for every client: open the SQLite log for a run.

Chat logs its own turns (apps/chat/session.py), the agent through `apps/agent/log.py`, `summarize` per summary;
all open their log here, so `sinkchat logs` lists every kind of session. What is stored is what the user gave and
the model produced: an agent's tasks, each model reply, tool calls with their results and evictions; for `summarize`, each summary question
(with its line range) and the summary itself plus the per-summary figures, but not the raw log lines, which stay in
the user's own log file (a `tail -f` running for weeks would otherwise copy the whole log into the database).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Callable


def open_log(engine: Any, mode: str, no_log: bool, system: str | None, warn: Callable[[str], None],
             resume_id: int | None = None, extra: dict[str, Any] | None = None) -> Any:
    """A SessionLog (or NullLog with --no-log / an unusable log dir). Only settings and text are stored."""
    from sinkchat.store.sessionlog import NullLog, SessionLog

    if no_log:
        return NullLog()
    if resume_id is not None:
        return SessionLog.resume(resume_id, warn=warn)
    loaded = getattr(engine, "loaded", None)
    settings = {"cache": asdict(engine.cache_cfg), "sampling": asdict(engine.sampling),
                "quant": getattr(loaded, "quant", None), **(extra or {})}
    return SessionLog.open(mode, getattr(loaded, "source", None), settings, system=system, warn=warn)
