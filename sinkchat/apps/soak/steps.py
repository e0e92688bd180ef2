"""What a soak scenario's step yields, and the engine helpers every scenario shares.

Each scenario's `step(engine)` does one unit of work and yields engine events, `Fault`s it detected and handled (an
empty or undecodable reply, a tool that failed, non-finite logits) and one `Outcome`: whether the step did its job
(chat: a reply was produced; agent: the task was done right, e.g. the file it asked for exists with the right
content; summarize: a non-empty, complete summary; stream: the block went in). A scenario whose model calls tools
(agent) also yields one `ToolCall` per call it attempted, so the soak reports the share of valid calls over time
besides the tasks' outcomes. Anything a step raises is counted by the runner as an error; `recover` puts the engine
back in a usable state afterwards. Scenarios log their turns to the session log (`slog`) the way the chat, agent and
summarize apps do.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Generator, Iterator

from sinkchat.core.events import DoneEvent, PrefillEvent, TokenEvent

log = logging.getLogger(__name__)

CHAT_MAX_TOKENS = 96


@dataclass(frozen=True)
class Fault:
    """Something went wrong and was handled. `error=True` counts against the errors criterion (a guard tripped);
    otherwise it is a fault the scenario is expected to meet now and then (a small model's malformed output)."""

    kind: str
    detail: str = ""
    error: bool = False


@dataclass(frozen=True)
class Outcome:
    """Whether one step did its job (one per step): `ok`, and what was checked or what was wrong."""

    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class ToolCall:
    """One tool call the model attempted (one per agent step that did not end the task). `ok`: the agent accepted
    it and the tool ran without error; `valid`: the agent accepted it (a known tool, arguments matching its schema,
    not denied), whether or not the tool then failed. A malformed reply, or one with neither a call nor an answer,
    is an attempt that is neither."""

    name: str
    ok: bool
    valid: bool


class InputExhausted(Exception):
    """The stream scenario's stdin ended: the soak stops cleanly."""


def finite(t: Any) -> bool:
    import torch

    return bool(torch.isfinite(t).all())


def logged(events: Iterator[Any], slog: Any) -> Iterator[Any]:
    """Pass engine events on, logging evictions to the session log (buffered there until the next turn)."""
    from sinkchat.core.events import EvictionEvent, ForgottenEvent

    for ev in events:
        if isinstance(ev, (EvictionEvent, ForgottenEvent)):  # the recall memory's forgotten tokens too
            slog.eviction(ev)
        yield ev


def ask(engine: Any, text: str, slog: Any) -> Iterator[Any]:
    """Feed `text` as a user message (with the reply's header), its events logged, then log it as the user turn
    with the tokens and seconds feeding it took, before any reply: `logs show` tells the story in order."""
    fed, seconds = 0, 0.0
    for ev in logged(engine.add_message("user", text, recall=True), slog):
        if isinstance(ev, PrefillEvent):
            fed, seconds = fed + ev.tokens, seconds + ev.seconds
        yield ev
    slog.turn("user", text, fed, seconds)


def guarded_generate(engine: Any, max_tokens: int) -> Iterator[Any]:
    """engine.generate, checking every step's logits (sampling maps NaN to -1e9, which would hide a broken model)."""
    bad = 0
    for ev in engine.generate(max_tokens):
        if isinstance(ev, TokenEvent) and engine.last_logits is not None and not finite(engine.last_logits):
            bad += 1
        yield ev
    if bad:
        yield Fault("nonfinite_logits", f"{bad} generated tokens had NaN/inf logits", error=True)


def generate_reply(engine: Any, max_tokens: int, slog: Any) -> Generator[Any, None, DoneEvent | None]:
    """A guarded reply, its events logged, added to the conversation even when the step is cut short; returns its
    DoneEvent (None when it never came)."""
    done = None
    try:
        for ev in logged(guarded_generate(engine, max_tokens), slog):
            done = ev if isinstance(ev, DoneEvent) else done
            yield ev
    finally:
        engine.conv.add_reply(engine.reply_text())
    return done


def log_reply(slog: Any, engine: Any, text: str, done: DoneEvent | None) -> None:
    """The assistant turn to the session log, with the figures of its DoneEvent."""
    slog.turn("assistant", text, done.tokens if done else 0, done.seconds if done else 0.0,
              reason=done.reason if done else None, cache_len=engine.cache.length)


def recover(engine: Any, exc: BaseException) -> None:
    """After a failed step: a full dense cache (ContextFull) or any cache/ledger mismatch starts a fresh cache."""
    from sinkchat.core.cache_policy import ContextFull

    if isinstance(exc, ContextFull) or engine.cache.length != len(engine.ledger):
        log.warning("soak: clearing the cache after %s", type(exc).__name__)
        engine.clear()
