"""Session logging for every client: open the SQLite log for a run, and turn a client's events into log rows.

Chat logs its own turns (ui/repl.py); `agent` and `summarize` log through the adapters here, so `sinkchat logs`
lists every kind of session. What is stored is what the user gave and the model produced: an agent's tasks, each
model reply, tool calls with their results and evictions; for `summarize`, each summary question (with its line
range) and the summary itself plus the per-summary figures, but not the raw log lines, which stay in the user's
own log file (a `tail -f` running for weeks would otherwise copy the whole log into the database).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Callable

from sinkchat.core.events import EvictionEvent


def open_log(engine: Any, mode: str, no_log: bool, system: str | None, warn: Callable[[str], None],
             resume_id: int | None = None, extra: dict[str, Any] | None = None) -> Any:
    """A SessionLog (or NullLog with --no-log / an unusable log dir). Only settings and text are stored."""
    from sinkchat.store.transcript import NullLog, SessionLog

    if no_log:
        return NullLog()
    if resume_id is not None:
        return SessionLog.resume(resume_id, warn=warn)
    loaded = getattr(engine, "loaded", None)
    settings = {"cache": asdict(engine.cache_cfg), "sampling": asdict(engine.sampling),
                "quant": getattr(loaded, "quant", None), **(extra or {})}
    return SessionLog.open(mode, getattr(loaded, "source", None), settings, system=system, warn=warn)


class AgentLog:
    """Feeds the agent's event stream into a SessionLog: task -> user turn, reply -> assistant turn (its tool call
    and result attached to it), evictions buffered until the next turn."""

    def __init__(self, slog: Any, engine: Any) -> None:
        self.slog, self.engine = slog, engine
        self.call: tuple[str, Any] | None = None

    def __call__(self, ev: Any) -> None:
        from sinkchat.apps.agent.protocol import ModelTextEvent, StepEvent, TaskDoneEvent, ToolCallEvent, ToolResultEvent

        if isinstance(ev, EvictionEvent):
            self.slog.eviction(ev)
        elif isinstance(ev, StepEvent) and ev.step == 1:
            self.slog.turn("user", ev.task)
        elif isinstance(ev, ModelTextEvent):
            self.slog.turn("assistant", ev.text, ev.tokens, reason=ev.reason, cache_len=self.engine.cache.length)
        elif isinstance(ev, ToolCallEvent):
            self.call = (ev.name, ev.args)
        elif isinstance(ev, ToolResultEvent) and self.call is not None:  # a reply with no usable call logs no call
            name, args = self.call
            self.slog.tool_call(name, args, ev.text, ev.ok)
            self.call = None
        elif isinstance(ev, TaskDoneEvent):
            self.slog.metrics({"task_done": ev.reason, "steps": ev.steps, "cache_len": self.engine.cache.length,
                               "seen": self.engine.ledger.seen, "evicted": self.engine.ledger.evicted})
            self.slog.flush()
