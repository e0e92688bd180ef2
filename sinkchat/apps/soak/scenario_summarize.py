"""The summarize scenario of `sinkchat soak`: rolling summaries of a synthetic application log."""

from __future__ import annotations

import random
from typing import Any, Iterator

from sinkchat.apps.soak.checkpoint import rng_state, set_rng_state
from sinkchat.apps.soak.steps import CHAT_MAX_TOKENS, Fault, Outcome, ask, generate_reply, log_reply, logged, recover
from sinkchat.bootstrap import read_prompt
from sinkchat.store.sessionlog import NullLog

LOG_SERVICES = ("api", "db", "auth", "worker", "cache", "billing")
LOG_OK = ("GET /users/{n} 200 {ms}ms", "POST /orders 201 {ms}ms", "job {n} finished in {ms}ms",
          "cache hit ratio 0.{n}", "user {n} logged in", "heartbeat ok")
LOG_BAD = ("WARN slow query on orders ({ms}ms)", "ERROR connection refused to db-{n}:5432",
           "ERROR job {n} failed: timeout after {ms}ms", "WARN retrying payment {n}")


class SummarizeScenario:
    """The summarize loop on a synthetic application log: chunks of lines are fed as user messages without a
    generation prompt, then the summary question (prompts/summarize.txt with the line range) is asked and answered
    into the same cache, as `sinkchat summarize` does (same prompt, same conversation trimming). One step is one
    summary; its job is done when the summary is non-empty, readable and complete (ended by the model, not cut off
    at --max-tokens)."""

    name = "summarize"
    unit = "complete summaries"
    recover = staticmethod(recover)
    slog: Any = NullLog()

    def __init__(self, max_tokens: int = CHAT_MAX_TOKENS, seed: int = 0, lines_per_summary: int = 24,
                 chunk_lines: int = 8) -> None:
        self.prompt = read_prompt("summarize")
        self.max_tokens, self.rng = max_tokens, random.Random(seed)
        self.lines_per_summary, self.chunk_lines = lines_per_summary, chunk_lines
        self.line_no = 0
        self.clock = 1_700_000_000
        self.levels: dict[str, int] = {}  # lines per level since the last summary: the prompt's {digest}

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (checkpoint.py): the log goes on where it was."""
        return {"rng": rng_state(self.rng), "line_no": self.line_no, "clock": self.clock, "levels": self.levels}

    def load_state(self, d: dict[str, Any]) -> None:
        set_rng_state(self.rng, d["rng"])
        self.line_no, self.clock = int(d["line_no"]), int(d["clock"])
        self.levels = {str(k): int(v) for k, v in d["levels"].items()}

    def next_line(self) -> str:
        import time as _time

        r = self.rng
        self.line_no += 1
        self.clock += r.randint(0, 3)
        pat = r.choice(LOG_BAD) if r.random() < 0.15 else "INFO " + r.choice(LOG_OK)
        level = pat.split()[0]
        self.levels[level] = self.levels.get(level, 0) + 1
        stamp = _time.strftime("%Y-%m-%dT%H:%M:%S", _time.gmtime(self.clock))
        return f"{stamp} {r.choice(LOG_SERVICES)}: " + pat.format(n=r.randint(1, 999), ms=r.randint(2, 4000))

    def step(self, engine: Any) -> Iterator[Any]:
        from sinkchat.apps.summarize.output import fill
        from sinkchat.apps.summarize.summarizer import settle_conversation

        first = self.line_no + 1
        left = self.lines_per_summary
        while left > 0:
            n = min(self.chunk_lines, left)
            chunk = "\n".join(self.next_line() for _ in range(n))
            yield from logged(engine.add_message("user", chunk, add_generation_prompt=False), self.slog)
            settle_conversation(engine, keep=1)
            left -= n
        digest = ", ".join(f"{k} {v}" for k, v in sorted(self.levels.items()))
        self.levels = {}
        question = fill(self.prompt, first_line=first, last_line=self.line_no, lines=self.lines_per_summary,
                        summarized=self.lines_per_summary, filtered=0, deduped=0, skipped=0, binary=0,
                        digest=digest, note="")
        yield from ask(engine, question, self.slog)  # logged with its figures (was "0 tokens fed in 0 ms")
        done = yield from generate_reply(engine, self.max_tokens, self.slog)
        text = (done.text if done else "").strip()
        log_reply(self.slog, engine, text, done)
        settle_conversation(engine, keep=2)
        if not text:
            yield Fault("empty_reply", "empty summary")
            yield Outcome(False, "empty summary")
        elif "\ufffd" in text:
            yield Fault("malformed_output", "summary holds undecodable bytes")
            yield Outcome(False, "summary holds undecodable bytes")
        elif done is None or done.reason == "length":
            yield Outcome(False, f"summary cut off at {self.max_tokens} tokens")
        else:
            yield Outcome(True, f"summary of lines {first}-{self.line_no}: {len(text)} chars")
