"""One chat turn's outcome as the loop gathers it: what the log stores and what `--format jsonl` prints.

Kept apart from the loop so the record a script reads is defined in one place: every message line the chat reads
gives exactly one record (a reply, a reply cut short, a message not sent, or an error), so answers stay aligned with
questions however many lines each answer has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sinkchat.core.events import DoneEvent

FORMATS = ("text", "jsonl")


@dataclass
class TurnResult:
    """Filled in as the turn runs; `record()` is the answer a script gets."""

    question: str
    prompt_tokens: int = 0  # tokens fed for the prompt (template and, on the first turn, the system prompt)
    prefill_seconds: float = 0.0
    generating: bool = False
    reply: str = ""
    tokens: int = 0
    seconds: float = 0.0  # spent generating
    done: DoneEvent | None = None
    interrupted: bool = False
    error: str | None = None
    recalled: list[dict[str, Any]] | None = None  # blocks the turn read from the recall memory (None: memory off)

    @property
    def finish_reason(self) -> str:
        """The engine's reason ('eos', 'stop', 'length', ...), else 'interrupted' (Ctrl-C during the reply),
        'not sent' (Ctrl-C while the prompt was fed) or 'error'."""
        if self.error is not None:
            return "error"
        if self.done is not None:
            return self.done.reason
        return "interrupted" if self.generating else "not sent"

    def record(self) -> dict[str, Any]:
        rec: dict[str, Any] = {"question": self.question, "answer": self.reply, "tokens": self.tokens,
                               "finish_reason": self.finish_reason, "seconds": round(self.seconds, 4),
                               "prompt_tokens": self.prompt_tokens, "prefill_seconds": round(self.prefill_seconds, 4)}
        if self.error is not None:
            rec["error"] = self.error
        if self.recalled is not None:
            rec["recalled"] = self.recalled
        return rec
