"""The chat scenario of `sinkchat soak`: self-play turns on the one persistent cache."""

from __future__ import annotations

import random
from typing import Any, Iterator

import click

from sinkchat.apps.soak.checkpoint import rng_state, set_rng_state
from sinkchat.apps.soak.steps import CHAT_MAX_TOKENS, Fault, Outcome, ask, generate_reply, log_reply, recover
from sinkchat.bootstrap import read_prompt
from sinkchat.store.sessionlog import NullLog


class ChatScenario:
    """Self-play: prompts from prompts/soak_chat.txt, every other turn the model's own last reply quoted back."""

    name = "chat"
    unit = "replies produced"
    recover = staticmethod(recover)
    slog: Any = NullLog()

    def __init__(self, prompts: list[str], max_tokens: int = CHAT_MAX_TOKENS, seed: int = 0) -> None:
        if not prompts:
            raise click.UsageError("no self-play prompts")
        self.prompts, self.max_tokens = prompts, max_tokens
        self.rng = random.Random(seed)
        self.turn = 0
        self.last_reply = ""

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (checkpoint.py): the next turns follow from it."""
        return {"rng": rng_state(self.rng), "turn": self.turn, "last_reply": self.last_reply}

    def load_state(self, d: dict[str, Any]) -> None:
        set_rng_state(self.rng, d["rng"])
        self.turn, self.last_reply = int(d["turn"]), str(d["last_reply"])

    def next_message(self) -> str:
        self.turn += 1
        words = self.last_reply.split()
        if self.turn % 2 == 0 and words:
            return f'You said: "{" ".join(words[:30])}". Tell me more about that, briefly.'
        return self.rng.choice(self.prompts)

    def step(self, engine: Any) -> Iterator[Any]:
        msg = self.next_message()
        yield from ask(engine, msg, self.slog)
        done = yield from generate_reply(engine, self.max_tokens, self.slog)
        text = done.text if done else ""
        log_reply(self.slog, engine, text, done)
        self.last_reply = text
        if not text.strip():
            yield Fault("empty_reply", f"reply of {done.tokens if done else 0} tokens has no text")
            yield Outcome(False, "empty reply")
        elif "\ufffd" in text:
            yield Fault("malformed_output", "reply holds undecodable bytes")
            yield Outcome(False, "reply holds undecodable bytes")
        else:
            yield Outcome(True, f"reply of {done.tokens if done else 0} tokens")


def chat_prompts() -> list[str]:
    lines = read_prompt("soak_chat").splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
