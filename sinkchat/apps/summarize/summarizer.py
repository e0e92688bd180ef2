"""`sinkchat summarize`: a rolling summary of a log that keeps coming, in flat memory.

How log text and chat turns share the one cache: every chunk of log lines is fed once as a user message without a
generation prompt (`add_message(..., add_generation_prompt=False)`), so it is templated like any turn and never
re-encoded. At a summary boundary the question (prompts/summarize.txt, with the line range) is one more user
message, and the reply is generated into the same cache and recorded in the conversation. The conversation object
is then trimmed to its last turns (the cache already holds the rest, or evicted it), so nothing grows with the log:
the cache is fixed-size, the queue is bounded, the conversation is trimmed, and counters are integers.

Stopping (SIGTERM, Ctrl-C) never feeds the backlog: the command sets `halt`, the Summarizer raises `Interrupted` at
its next chunk or token boundary (never inside a model call), and `finish_stopped` counts what was read but not
fed as skipped and asks only about what the cache already holds, so a process manager's grace period is enough.

The plumbing around the model lives in reader.py (reader thread, queue), batching.py (filters, dedupe, batching,
accounting), answer.py (window budget, asking, rollback), guard.py (what the summary may show as fact: unsupported
sentences dropped, the digest's incidents stated by code) and output.py (output blocks); the command itself
(options, signals, exit codes) in command.py.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from datetime import datetime
from typing import Any, Callable, TextIO

from sinkchat.apps.summarize.answer import (TEMPLATE_TOKENS, Answer, Budget, ask, lines_in_cache,
                                            settle_conversation)
from sinkchat.apps.summarize.batching import Batcher, Period
from sinkchat.apps.summarize.digest import render
from sinkchat.apps.summarize.factcheck import Support, period_numbers
from sinkchat.apps.summarize.output import Output, fill
from sinkchat.apps.summarize.reader import End, Item, Line, Notice

log = logging.getLogger(__name__)

IDLE_FLUSH = 0.5  # feed a partial chunk after this long without new lines
LIVE_EVERY = 0.25  # status refresh on a terminal
PLAIN_EVERY = 10.0  # plain status lines when stderr is not a terminal
DEFAULT_SUMMARY_TOKENS = 128
STOP_POLL = 0.2  # the longest an idle wait on the queue runs before a stop request is seen


class Interrupted(Exception):
    """A stop was requested (SIGTERM / Ctrl-C): raised at a chunk or token boundary, never inside a model call, so
    an interrupted feed is rolled back whole by `Engine.add_message` and the line accounting stays exact."""


class Status:
    """Progress on stderr: one live line on a terminal, a plain line every PLAIN_EVERY seconds otherwise.

    `line(width)` builds the status for `width` columns (None: no limit); on a terminal it is given the terminal's
    width, so the line drops lower-priority fields whole instead of being cut mid-field by the edge."""

    def __init__(self, stream: TextIO, quiet: bool, line: Callable[[int | None], str] | None = None) -> None:
        self.stream, self.quiet = stream, quiet
        self.line = line
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.every = LIVE_EVERY if self.tty else PLAIN_EVERY
        self.last = time.monotonic()
        self.live = False

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            self.quiet = True  # stderr is gone; keep working without it

    def clear(self) -> None:
        if self.live:
            self._write("\r\x1b[K")
            self.live = False

    def notice(self, message: str) -> None:
        if not self.quiet:
            self.clear()
            self._write(f"sinkchat: {message}\n")

    def done(self) -> None:
        """The last status, left on screen as a plain line."""
        if not self.quiet and self.line is not None:
            self.clear()
            self._write(self.line(None) + "\n")

    def tick(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.quiet or self.line is None or (not force and now - self.last < self.every):
            return
        self.last = now
        if self.tty:
            width = max(20, _term_width() - 1)
            self._write("\r\x1b[K" + self.line(width)[:width])  # fitted: the cut is a last resort, never reached
            self.live = True
        else:
            self._write(self.line(None) + "\n")


def _term_width() -> int:
    """stderr's columns (where the live line goes); 120 when it is no terminal."""
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns or 120
    except (OSError, ValueError):
        return 120


class Summarizer:
    """The consumer: takes items off the queue, feeds chunks, asks for a summary every N lines / T seconds."""

    def __init__(self, engine: Any, batcher: Batcher, out: Output, status: Status, *, prompt: str, every: int,
                 interval: float, max_tokens: int, slog: Any = None, halt: threading.Event | None = None) -> None:
        """`halt`: set (by the command's signal handler) to stop at the next chunk or token boundary."""
        from sinkchat.core.metrics import Metrics, model_bytes
        from sinkchat.store.transcript import NullLog

        self.slog = slog if slog is not None else NullLog()  # summary questions and answers, evictions, figures

        self.engine, self.batcher, self.out, self.status = engine, batcher, out, status
        self.prompt, self.every, self.interval, self.max_tokens = prompt, every, interval, max_tokens
        self.metrics = Metrics()
        self.model_nbytes = model_bytes(engine.model)
        self.mark = (engine.ledger.seen, engine.ledger.evicted)
        self.totals = Period()
        self.summaries = 0
        self.error: str | None = None
        self.due = self._next_due()
        self.queued: Callable[[], int] = lambda: 0  # lines read but not yet taken (the command wires the queue in)
        self.halt = halt if halt is not None else threading.Event()
        self.stopping = False  # writing the final summary after a stop: no more Interrupted
        status.line = self.status_text
        self.budget = Budget.for_engine(engine, prompt, max_tokens)  # see answer.py: lines + question + answer fit
        self.fed_chunks: list[tuple[int, int, int]] = []  # this period's chunks: absolute token span, lines
        self.period_text: list[str] = []  # this period's fed text, the fact check's support
        self.period_tokens = 0
        self.retry = True  # regenerate once when a summary claims something the lines do not say
        self.last_final = False
        self.told_fit = False
        self.q: Any = None
        if not self.budget.fits:
            log.warning("window %d too small to fit log lines beside the question (%s)", self.budget.capacity,
                        self.budget)
            status.notice(f"the window (--cache {self.budget.capacity}) cannot hold the log lines beside the "
                          "question and answer: summaries will come partly from evicted lines (see lines_in_cache)")

    def _next_due(self) -> float:
        return time.monotonic() + self.interval if self.interval > 0 else float("inf")

    @property
    def stop_requested(self) -> bool:
        """A stop was asked for and the final summary after it is not being written yet."""
        return self.halt.is_set() and not self.stopping

    def check_stop(self) -> None:
        if self.stop_requested:
            raise Interrupted

    def _fold(self, ev: Any) -> None:
        """One engine event into the metrics, and an eviction into the session log."""
        from sinkchat.core.events import EvictionEvent, ForgottenEvent

        self.metrics.fold(ev)
        if isinstance(ev, (EvictionEvent, ForgottenEvent)):  # what the recall memory forgot: logged the same way
            self.slog.eviction(ev)

    def _events(self, events: Any) -> str:
        """Fold engine events into the metrics (keeps the status live); returns the generated text, if any.

        A stop request closes `events` after the event in hand, i.e. after a completed prefill chunk or generated
        token: the engine's rollback runs now (not whenever the generator is collected), then Interrupted."""
        from sinkchat.core.events import DoneEvent

        text = ""
        for ev in events:
            self._fold(ev)
            if isinstance(ev, DoneEvent):
                text = ev.text
            self.status.tick()
            if self.stop_requested:
                events.close()
                raise Interrupted
        return text

    def status_text(self, width: int | None = None) -> str:
        """The line accounting, then the engine's status fitted to what `width` leaves (None: all of it)."""
        from sinkchat.core.metrics import read_stats, status_line

        t, p = self.totals, self.batcher.period
        read = t.lines + p.lines
        head = (f"lines {read}: fed {t.summarized + p.summarized} filt {t.filtered + p.filtered} "
                f"dup {t.deduped + p.deduped} skip {t.skipped + p.skipped} queue {self.queued()} | "
                f"summaries {self.summaries} | ")
        rest = None if width is None else max(0, width - len(head))
        return head + status_line(read_stats(self.engine, self.metrics, self.model_nbytes), rest)

    # ------------------------------------------------------------------------------------------------ steps
    def handle(self, item: Item) -> bool:
        """Account one queue item; False at the end of input."""
        if isinstance(item, Notice):
            self.status.notice(item.message)
            return True
        self.batcher.add(item)
        if isinstance(item, End):
            if item.error:
                self.error = item.error
                self.status.notice(f"input error: {item.error}")
            return False
        return True

    def feed_chunk(self) -> None:
        """Feed the pending chunk as one user message. Interrupted before all of it is in and taken back by the
        engine, its lines were never fed: they count as skipped, not summarized."""
        self.check_stop()
        lines, truncated = self.batcher.chunk_summarized, self.batcher.chunk_truncated
        text = self.batcher.take_chunk()
        if text is None:
            return
        start = self.engine.ledger.seen
        try:
            self._events(self.engine.add_message("user", text, add_generation_prompt=False))
        except BaseException:
            if self.engine.message_taken_back:
                self.batcher.unfeed(lines, truncated)
            else:  # part of it stays (feeding it evicted older tokens): its lines are summarized, and support
                self._fed(start, lines, text)
            raise
        finally:
            self.batcher.commit_chunk()  # what is in the cache joins the digest (nothing, once unfed)
        self._fed(start, lines, text)
        settle_conversation(self.engine, keep=1, sink=self._fold)

    def _fed(self, start: int, lines: int, text: str) -> None:
        self.fed_chunks.append((start, self.engine.ledger.seen, lines))
        self.period_tokens += self.engine.ledger.seen - start
        self.period_text.append(text)

    def over_budget(self) -> bool:
        """The pending chunk would push this period past what the window holds beside the question and answer:
        ask now (more often than --every / --interval), before the first lines are evicted."""
        if not self.budget.fits or not self.batcher.chunk:
            return False
        over = self.period_tokens + self.batcher.chunk_tok + TEMPLATE_TOKENS >= self.budget.raw
        if over and not self.told_fit:
            self.told_fit = True
            self.status.notice(f"a question holds about {self.budget.raw} tokens of log lines: summarizing more "
                               "often than --every / --interval so the model reads every line in full")
        return over

    def end_is_next(self) -> bool:
        """The input's End is already queued: the summary due now is the final one (one block, marked final)."""
        q = self.q
        if q is None:
            return False
        with q.mutex:
            return bool(q.queue) and isinstance(q.queue[0], End) and not q.queue[0].skipped_before

    def boundary(self) -> None:
        """After an item: summarize when N lines or the interval are reached, else feed a full chunk."""
        p = self.batcher.period
        if p.lines and ((self.every and p.lines >= self.every) or time.monotonic() >= self.due or self.over_budget()):
            if not self.end_is_next():
                self.summarize()
        elif self.batcher.full:
            self.feed_chunk()

    def summarize(self, final: bool = False) -> None:
        """Ask the model about the lines since the last summary (with their exact digest) and print one block."""
        self.batcher.end_run()
        self.feed_chunk()
        p = self.batcher.period
        digest = self.batcher.digest.record()  # taken only once the block is out: a stop while asking keeps it
        ans = Answer()
        if p.summarized or (self.stopping and digest["lines"]):
            question = self.question(p, digest)
            t0 = time.perf_counter()
            support = Support(self.period_text, digest, numbers=period_numbers(
                p.first_line, p.last_line, p.lines, p.summarized, p.filtered, p.deduped, p.skipped, p.binary))
            ans = ask(self.engine, self._events, question, support, self.max_tokens, retry=self.retry,
                      digest=digest)
            self.slog.turn("user", question, ans.question_tokens, ans.question_seconds)
            self.slog.turn("assistant", ans.text, len(self.engine.last_reply_ids),
                           time.perf_counter() - t0 - ans.question_seconds, cache_len=self.engine.cache.length)
            settle_conversation(self.engine, keep=2, sink=self._fold)
            if ans.dropped:
                reasons = ([f"unsupported: {', '.join(ans.unsupported)}"] if ans.unsupported else []) + ans.why
                why = f" ({'; '.join(reasons) or 'unfinished'})"
                self.status.notice(f"lines {p.first_line}-{p.last_line}: dropped {len(ans.dropped)} sentence(s) of "
                                   f"the summary{why}" + ("; written from the digest" if ans.prose == "digest" else ""))
        in_full = lines_in_cache(self.engine.ledger, self.fed_chunks)
        extra = {"lines_in_full": in_full, "lines_digest_only": max(0, digest["lines"] - p.deduped - in_full),
                 "unsupported": ans.unsupported, "regenerated": ans.regenerated, "summary_cut": ans.cut,
                 "prose": ans.prose, "dropped": ans.dropped, "added": ans.added, "why": ans.why, "digest": digest}
        self.batcher.digest.reset()  # its record is in `extra` (computed once, above)
        self.fed_chunks, self.period_text, self.period_tokens = [], [], 0
        if p.binary:
            self.status.notice(f"lines {p.first_line}-{p.last_line}: skipped {p.binary} binary lines")
        self.emit(self.batcher.take_period(), ans.text, final, extra)

    def question(self, p: Period, digest: dict[str, Any]) -> str:
        """The question: prompts/summarize.txt filled with the line range, counts, notes and the digest text."""
        why = "the summarizer was stopped before it fed them" if self.stopping else \
            "they came faster than they could be read"
        other = p.skipped - p.binary
        note = f" {other} lines were skipped because {why}." if other else ""
        if p.binary:
            note += f" {p.binary} binary (non-text) lines were skipped and are not shown."
        text = render(digest, lambda t: len(self.engine.encode(t)), self.budget.digest) if self.budget.digest else ""
        return fill(self.prompt, first_line=p.first_line, last_line=p.last_line, lines=p.lines,
                    summarized=p.summarized, filtered=p.filtered, deduped=p.deduped, skipped=p.skipped,
                    binary=p.binary, note=note, digest=text)

    def emit(self, p: Period, text: str, final: bool, extra: dict[str, Any] | None = None) -> None:
        from sinkchat.core.metrics import rss_bytes

        led, cache = self.engine.ledger, self.engine.cache
        block = {
            "time": datetime.now().astimezone().isoformat(timespec="seconds"),
            "first_line": p.first_line, "last_line": p.last_line, "lines": p.lines, "summarized": p.summarized,
            "filtered": p.filtered, "deduped": p.deduped, "skipped": p.skipped, "truncated": p.truncated,
            "tokens_fed": led.seen - self.mark[0], "tokens_evicted": led.evicted - self.mark[1],
            "kv_bytes": cache.nbytes, "cache_len": cache.length, "capacity": self.engine.cache_cfg.capacity,
            "rss": rss_bytes(), "final": final, "summary": text, "binary": p.binary, **(extra or {}),
        }
        self.slog.metrics({k: v for k, v in block.items() if k not in ("summary", "digest")})
        self.slog.flush()
        self.mark = (led.seen, led.evicted)
        self.last_final = final
        for k in ("summarized", "filtered", "deduped", "skipped", "truncated", "binary"):
            setattr(self.totals, k, getattr(self.totals, k) + getattr(p, k))
        self.summaries += 1
        self.due = self._next_due()
        self.status.clear()
        self.out.write(block)
        self.status.tick(force=not self.status.tty)

    # ------------------------------------------------------------------------------------------------ loops
    def run(self, q: "queue.Queue[Item]") -> None:
        """Until the input ends: take lines as they come, feed idle chunks, summarize on time."""
        self.q = q
        while True:
            self.check_stop()
            wait = min(self.due - time.monotonic(), self.status.every, STOP_POLL)
            if self.batcher.chunk:
                wait = min(wait, IDLE_FLUSH)
            try:
                item = q.get(timeout=max(0.01, wait))
            except queue.Empty:
                if self.batcher.chunk:
                    self.feed_chunk()
                if time.monotonic() >= self.due:
                    if self.batcher.period.lines:
                        self.summarize()
                    else:
                        self.due = self._next_due()
                self.status.tick()
                continue
            if not self.handle(item):
                break
            self.boundary()
            self.status.tick()
        self.finish()

    def finish_stopped(self, q: "queue.Queue[Item]", lines_read: int) -> None:
        """After a stop (SIGTERM / Ctrl-C): feed nothing more. What is still queued, read but never queued
        (`lines_read`: the last line number the reader gave out) or waiting in the pending chunk counts as skipped,
        and the final summary asks only about what the cache already holds. Feeding a backlog here instead would
        outlast any process manager's grace period (10-90 s before SIGKILL), and the final summary would be lost."""
        self.stopping = True
        self.skip_queued(q)
        self.batcher.skip_to(lines_read)
        dropped = self.batcher.drop_chunk()
        log.info("stopped: %d lines skipped since the last summary (%d of them from the chunk not yet fed)",
                 self.batcher.period.skipped, dropped)
        self.finish()

    def skip_queued(self, q: "queue.Queue[Item]") -> None:
        """Take everything already on the queue without feeding it: lines count as skipped."""
        while True:
            try:
                item = q.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, (Line, End)):
                self.batcher.skip(item)
            if isinstance(item, End) and item.error:
                self.error = item.error

    def finish(self) -> None:
        """The final summary of whatever is pending (nothing is printed when nothing is pending)."""
        self.batcher.end_run()
        if self.batcher.period.lines:
            self.summarize(final=True)
        elif self.summaries and not self.last_final:  # a consumer of the JSONL sees where the run ended
            last = self.batcher.last_no
            self.emit(Period(first_line=last + 1, last_line=last), "", True, {"lines_in_full": 0})
        self.status.done()
        if self.totals.lines == 0 and not self.error:
            self.status.notice("no input lines; nothing to summarize")
