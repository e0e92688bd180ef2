"""How long the final summary after a stop (SIGTERM, Ctrl-C) may take, so the README's "within a second or two"
holds on any machine.

Why: measured on the issue's repro (a 420-line log piped in, `--threads 1 --max-tokens 150`, SIGTERM at 15 s) on
a 2-core box shared with a benchmark, the process took 8.0-10.5 s from the signal to its exit: the final question
(~300-450 tokens with its digest) was fed at ~50 tokens/s, up to 150 tokens were generated at ~46 tokens/s, and an
unsupported claim in them was answered by a second generation (`"regenerated": true`). A process manager's grace
period is often 10 s before SIGKILL, which would have lost the final record. So after a stop:

- no regeneration;
- the answer gets only the tokens the measured rates allow within STOP_SECONDS from the signal (the question's
  prefill at the recent prefill rate, then the answer at the recent decode rate); under MIN_FINAL_TOKENS of room,
  or with no rate measured yet, the model is not asked and the summary is written from the digest (exact, and held
  to the same rule as any);
- a stop is seen between two prefill chunks (never inside a model call), and a 256-token chunk took ~2.7 s at
  the ~50-140 tokens/s of that box (measured: 2.70 s and 2.75 s from the signal to the exit when it came mid-feed,
  0.3-0.4 s when it came mid-answer); so the summarizer sizes the engine's prefill chunks to what the prefill
  rate measured at the engine's own chunk feeds in STOP_CHUNK_SECONDS (`ChunkSizer`: 256 on a quiet machine at
  850+ tokens/s, down to MIN_PREFILL_CHUNK on a loaded one);
- a hard deadline (`late`) at STOP_SECONDS + LATE_GRACE ends the question or answer at the next token boundary
  when the rates were wrong (a load spike), and the digest is the summary.
"""

from __future__ import annotations

import logging
import queue
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable

from sinkchat.apps.summarize.answer import TEMPLATE_TOKENS, Answer, ask, digest_answer
from sinkchat.apps.summarize.factcheck import Support
from sinkchat.apps.summarize.reader import End, Line

log = logging.getLogger(__name__)
STOP_SECONDS = 1.2  # from the signal to the final record (the interpreter's exit follows, ~0.1-0.3 s here)
LATE_GRACE = 0.4  # past STOP_SECONDS + this, what the model is doing is given up at the next token
MIN_FINAL_TOKENS = 24  # fewer answer tokens than this say nothing a digest does not: ask not at all
DECODE_VS_PREFILL = 4.0  # with no decode measured yet, one generated token costs this many fed ones
RATE_SAMPLE = 64  # recent decode latencies averaged
STOP_CHUNK_SECONDS = 0.3  # a prefill chunk is sized to take about this long, so a stop waits no longer for one
MIN_PREFILL_CHUNK = 128  # smaller chunks cost more in per-call overhead than they save in stop latency


class ChunkSizer:
    """The engine's prefill chunk (tokens): what the prefill rate measured at the engine's own chunk (`base`) feeds
    in STOP_CHUNK_SECONDS, within [MIN_PREFILL_CHUNK, base]; `base` until such a rate is measured.

    Why only chunks fed at `base`: sizing from every chunk's rate fed on itself (a smaller chunk pays the per-call
    overhead more often, measures a lower rate and gets a smaller chunk): on the 400-line log below the old sizing
    fed at 119, 104, ... 42 tokens, every feed, not only after a stop; here the chunk size never changes the rate
    it is sized from (83 feeds: one at 256, then 82 at 128). Why the floor of 128: below it per-call overhead
    costs throughput for a stop wait already within the README's "a second or two" (128 tokens at the ~160
    tokens/s measured). Measured on a 2-core box shared with a benchmark, SmolLM2-135M, `nice -n 19 ... summarize
    --file (400 lines) --every 0 --threads 1 --max-tokens 60 --temperature 0`: 150.9 s (prefill 163 tokens/s)
    against 149.3 s (168) before, within that box's noise; SIGTERM at 15 s of a piped 400-line log, `--max-tokens
    150`: 1.01, 1.34 and 1.42 s from the signal to the exit (0.92 and 1.15 s before, with its chunks of ~50).
    The rate is kept once no chunk at `base` is recent: a box that became quiet later keeps the smaller chunk, and
    one that became slower is caught by the deadline (`StopClock.late`)."""

    def __init__(self, base: int) -> None:
        self.base = base
        self.rate: float | None = None  # tokens/s of the recent chunks fed at `base`

    def __call__(self, metrics: Any) -> int:
        full = [(t, s) for t, s in metrics.recent_prefill if t >= self.base and s > 0]
        if full:
            self.rate = sum(t for t, _ in full) / sum(s for _, s in full)
        if self.rate is None:
            return self.base
        return max(min(MIN_PREFILL_CHUNK, self.base), min(self.base, int(self.rate * STOP_CHUNK_SECONDS)))


class OutOfTime(Exception):
    """The final summary after a stop ran past its deadline: raised at a token boundary, the digest is the summary."""


def signal_name(signum: int | None) -> str:
    """"SIGTERM", "SIGINT" (Ctrl-C); "a stop request" when unknown."""
    try:
        return signal.Signals(signum).name if signum is not None else "a stop request"
    except ValueError:
        return f"signal {signum}"


@dataclass
class StopClock:
    """The time left to the final summary after a stop, counted from the signal (`at`, time.monotonic())."""

    at: float
    by: str  # "SIGTERM", "SIGINT", ...

    def remaining(self) -> float:
        return self.at + STOP_SECONDS - time.monotonic()

    def late(self) -> bool:
        return time.monotonic() > self.at + STOP_SECONDS + LATE_GRACE

    def answer_tokens(self, metrics: Any, question_tokens: int, max_tokens: int) -> int:
        """The answer tokens that fit in the time left after feeding `question_tokens`, at the rates `metrics`
        measured in this run (recent prefill chunks, recent decoded tokens); 0: do not ask."""
        fed = sum(t for t, _ in metrics.recent_prefill)
        if not fed:
            return 0
        per_fed = sum(s for _, s in metrics.recent_prefill) / fed
        recent = list(metrics.latencies)[-RATE_SAMPLE:]
        per_token = sum(recent) / len(recent) if recent else per_fed * DECODE_VS_PREFILL
        room = self.remaining() - question_tokens * per_fed
        n = min(max_tokens, int(room / per_token)) if per_token > 0 else max_tokens
        return n if n >= min(MIN_FINAL_TOKENS, max_tokens) else 0


def final_ask(engine: Any, events: Callable[[Any], str], question: str, support: Support, digest: dict[str, Any],
              earlier: list[tuple[int, str]], max_tokens: int, clock: StopClock, metrics: Any) -> Answer:
    """The final summary after a stop: the model asked for only the answer tokens the time left allows, never
    twice; the digest alone when that is too few, or when the deadline passes while it is at work (`OutOfTime`,
    raised by the caller's `events` at a token boundary)."""
    n = clock.answer_tokens(metrics, len(engine.encode(question)) + TEMPLATE_TOKENS, max_tokens)
    if not n:
        log.info("stopped: no time left to ask the model; the final summary is the digest's")
        return digest_answer(support, digest, f"stopped by {clock.by}: no time to ask the model")
    try:
        return ask(engine, events, question, support, n, retry=False, digest=digest, earlier=earlier)
    except OutOfTime:
        log.info("stopped: the final answer ran past its deadline; the final summary is the digest's")
        return digest_answer(support, digest, f"stopped by {clock.by}: the model ran out of time")


def skip_queued(q: "queue.Queue[Any]", batcher: Any) -> str | None:
    """Take everything already on the queue without feeding it: its lines count as skipped in `batcher`. Returns
    the input error the End item carried, if any."""
    error = None
    while True:
        try:
            item = q.get_nowait()
        except queue.Empty:
            return error
        if isinstance(item, (Line, End)):
            batcher.skip(item)
        if isinstance(item, End) and item.error:
            error = item.error
