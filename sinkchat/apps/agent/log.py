"""The agent's session log: its event stream as turns, tool calls, error feedback and evictions in the SQLite log."""

from __future__ import annotations

from typing import Any

from sinkchat.apps.agent.protocol import (
    AgentErrorEvent, FinalRejectedEvent, ModelTextEvent, StepEvent, TaskDoneEvent, ToolCallEvent, ToolResultEvent,
)
from sinkchat.core.events import DoneEvent, EvictionEvent, ForgottenEvent, PrefillEvent


class AgentLog:
    """Feeds the agent's event stream into a SessionLog: task -> user turn, reply -> assistant turn (its tool call
    and result attached to it), error feedback -> an event after the reply, evictions buffered until the next turn.

    Timings come from the engine's own events, so `logs show` says how long each part took: a task's turn carries
    the tokens and seconds spent feeding it (its PrefillEvents since the last step), a reply the seconds of its
    generation (the DoneEvent just before the ModelTextEvent)."""

    def __init__(self, slog: Any, engine: Any) -> None:
        self.slog, self.engine = slog, engine
        self.call: tuple[str, Any] | None = None
        self.fed_tokens, self.fed_seconds = 0, 0.0  # prefill since the last turn was logged
        self.gen_seconds = 0.0  # the last DoneEvent's

    def __call__(self, ev: Any) -> None:
        if isinstance(ev, (EvictionEvent, ForgottenEvent)):
            self.slog.eviction(ev)
        elif isinstance(ev, PrefillEvent):
            self.fed_tokens += ev.tokens
            self.fed_seconds += ev.seconds
        elif isinstance(ev, DoneEvent):
            self.gen_seconds = ev.seconds
        elif isinstance(ev, StepEvent):
            if ev.step == 1:
                self.slog.turn("user", ev.task, self.fed_tokens, self.fed_seconds)
            self._reset()
        elif isinstance(ev, ModelTextEvent):
            self.slog.turn("assistant", ev.text, ev.tokens, self.gen_seconds, reason=ev.reason,
                           cache_len=self.engine.cache.length)
            self.gen_seconds = 0.0
            self._reset()
        elif isinstance(ev, ToolCallEvent):
            self.call = (ev.name, ev.args)
        elif isinstance(ev, AgentErrorEvent):  # what the model is told about a reply it cannot use
            self.slog.event("feedback", ev.message)
        elif isinstance(ev, FinalRejectedEvent):
            self.slog.event("feedback", "answer sent back: " + "; ".join(ev.problems))
        elif isinstance(ev, ToolResultEvent) and self.call is not None:  # a reply with no usable call logs no call
            name, args = self.call
            self.slog.tool_call(name, args, ev.text, ev.ok)
            self.call = None
        elif isinstance(ev, TaskDoneEvent):
            self.slog.metrics({"task_done": ev.reason, "verified": ev.verified, "problem": ev.problem[:500],
                               "steps": ev.steps, "cache_len": self.engine.cache.length,
                               "seen": self.engine.ledger.seen, "evicted": self.engine.ledger.evicted})
            self.slog.flush()
            self._reset()

    def _reset(self) -> None:
        self.fed_tokens, self.fed_seconds = 0, 0.0
