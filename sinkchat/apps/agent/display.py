"""What `sinkchat agent` shows: the event stream as lines (rich on a terminal), and the status after each step."""

from __future__ import annotations

import sys
from typing import Any, Callable

import click

from sinkchat.apps.agent.protocol import (
    AgentErrorEvent, FinalRejectedEvent, ModelTextEvent, StepEvent, TaskDoneEvent, ToolCallEvent, ToolResultEvent,
)
from sinkchat.core.events import EvictionEvent, ForgottenEvent, TokenEvent
from sinkchat.core.metrics import eviction_line


class Display:
    """Live view of the event stream: rich on a TTY (tokens stream as they come), plain lines otherwise."""

    def __init__(self, engine: Any, metrics: Any, tty: bool, model_nbytes: int | None = None,
                 log: Callable[[Any], None] | None = None) -> None:
        from rich.console import Console

        self.engine, self.metrics, self.tty, self.model_nbytes = engine, metrics, tty, model_nbytes
        self.log = log  # every event also goes here (the session log)
        self.console = Console(highlight=False, soft_wrap=True) if tty else None
        self.streaming = False

    def line(self, text: str, style: str = "") -> None:
        if self.streaming:
            self._raw("\n")
            self.streaming = False
        if self.console is not None:
            self.console.print(text, style=style or None, markup=False)
        else:
            click.echo(text)

    def _raw(self, text: str) -> None:
        (self.console.file if self.console is not None else sys.stdout).write(text)
        (self.console.file if self.console is not None else sys.stdout).flush()

    def status(self) -> None:
        from sinkchat.apps.render import live_stats
        from sinkchat.core.metrics import status_line

        self.line(status_line(live_stats(self.engine, self.metrics, self.model_nbytes)), "dim")

    def __call__(self, ev: Any) -> None:
        self.metrics.fold(ev)
        if self.log is not None:
            self.log(ev)
        if isinstance(ev, StepEvent):
            self.line(f"── step {ev.step} ──", "bold cyan")
        elif isinstance(ev, TokenEvent) and self.tty:
            self._raw(ev.text)
            self.streaming = True
        elif isinstance(ev, ModelTextEvent):
            if not self.tty:
                self.line(f"model: {_abridge(ev.text, 400)}")
            self.line(f"({ev.tokens} tokens, {ev.reason})", "dim")
        elif isinstance(ev, ToolCallEvent):
            self.line(f"→ {ev.name} {_abridge(repr(ev.args), 200)}", "yellow")
        elif isinstance(ev, AgentErrorEvent):
            self.line(f"! {ev.message}", "red")
        elif isinstance(ev, ToolResultEvent):
            cut = f", truncated from {ev.chars} chars" if ev.truncated else ""
            self.line(f"← {'ok' if ev.ok else 'error'} ({len(ev.text)} chars{cut}): {_abridge(ev.text, 200)}",
                      "green" if ev.ok else "red")
            self.status()
        elif isinstance(ev, (EvictionEvent, ForgottenEvent)):  # the recall memory's forgotten tokens too
            self.line(eviction_line(ev), "magenta")
        elif isinstance(ev, FinalRejectedEvent):
            self.line(f"! answer {_abridge(ev.answer, 80)!r} sent back: {_abridge('; '.join(ev.problems), 300)}",
                      "red")
        elif isinstance(ev, TaskDoneEvent):
            what = f"answer: {ev.answer}" if ev.reason == "final" else "no final answer"
            self.line(f"■ task ended after {ev.steps} step(s) ({ev.reason}); {what}", "bold")
            if not ev.verified:
                self.line(f"✗ task NOT verified: {_abridge(ev.problem, 400)}", "bold red")
            self.status()


def _abridge(text: str, n: int) -> str:
    one = " ".join(text.split())
    return one if len(one) <= n else one[: n - 1] + "…"


# ------------------------------------------------------------------------------------------------------ CLI
