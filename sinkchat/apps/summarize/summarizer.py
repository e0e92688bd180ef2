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
import queue
import threading
import time
from datetime import datetime
from typing import Any, Callable

from sinkchat.apps.summarize.answer import (TEMPLATE_TOKENS, Answer, Budget, ask, lines_in_cache, question_text,
                                            settle_conversation)
from sinkchat.apps.summarize.batching import Batcher, Period
from sinkchat.apps.summarize.factcheck import Support, period_numbers
from sinkchat.apps.summarize.output import Output
from sinkchat.apps.summarize.reader import End, Item, Notice
from sinkchat.apps.summarize.status import Status
from sinkchat.apps.summarize.stop import ChunkSizer, OutOfTime, StopClock, final_ask, skip_queued
from sinkchat.textutil import plural

log = logging.getLogger(__name__)

IDLE_FLUSH = 0.5  # feed a partial chunk after this long without new lines
DEFAULT_SUMMARY_TOKENS = 128
STOP_POLL = 0.2  # the longest an idle wait on the queue runs before a stop request is seen


class Interrupted(Exception):
    """A stop was requested (SIGTERM / Ctrl-C): raised at a chunk or token boundary, never inside a model call, so
    an interrupted feed is rolled back whole by `Engine.add_message` and the line accounting stays exact."""


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
        self.clock: StopClock | None = None  # after a stop: the time the final summary has (stop.py)
        self.skipped_at_stop = 0  # the period's skipped lines when the stop was seen (the rest are the stop's)
        status.line = self.status_text
        self.budget = Budget.for_engine(engine, prompt, max_tokens)  # see answer.py: lines + question + answer fit
        self.fed_chunks: list[tuple[int, int, int]] = []  # this period's chunks: absolute token span, lines
        self.period_text: list[str] = []  # this period's fed text, the fact check's support
        self.period_tokens = 0
        self.retry = True  # regenerate once when a summary claims something the lines do not say
        self.last_final = False
        self.told_fit = False
        # earlier lines a kept sentence cited: each is cited once. Why: in a Java log the model repeated "Error
        # Message: ... request failed" in every summary after its line, each time kept as "(earlier, at line 41)"
        self.cited: set[int] = set()
        self.q: Any = None
        base = getattr(engine, "prefill_chunk", None)
        self.chunk_sizer = ChunkSizer(base) if base else None  # the prefill chunk sized to the rate: stop.py
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
            self._interrupt()

    def _interrupt(self) -> None:
        self.skipped_at_stop = self.batcher.period.skipped  # a feed taken back after this counts as the stop's
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
                self._interrupt()
            if self.clock is not None and self.clock.late():
                events.close()  # the final summary after a stop ran past its deadline: the digest is the summary
                raise OutOfTime
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
        if self.chunk_sizer:  # a stop waits for the prefill chunk in hand: keep one to STOP_CHUNK_SECONDS
            self.engine.prefill_chunk = self.chunk_sizer(self.metrics)
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
            ans = self._answer(p, digest)
            if ans.dropped:
                reasons = ([f"unsupported: {', '.join(ans.unsupported)}"] if ans.unsupported else []) + ans.why
                why = f" ({'; '.join(reasons) or 'unfinished'})"
                self.status.notice(f"lines {p.first_line}-{p.last_line}: dropped {len(ans.dropped)} sentence(s) of "
                                   f"the summary{why}" + ("; written from the digest" if ans.prose == "digest" else ""))
        in_full = lines_in_cache(self.engine.ledger, self.fed_chunks)
        extra = {"lines_in_full": in_full, "lines_digest_only": max(0, digest["lines"] - p.deduped - in_full),
                 "unsupported": ans.unsupported, "regenerated": ans.regenerated, "summary_cut": ans.cut,
                 "prose": ans.prose, "dropped": ans.dropped, "added": ans.added, "why": ans.why, "digest": digest}
        if ans.earlier:
            extra["earlier"] = ans.earlier
            self.cited.update(ans.cited)
        if final and self.clock is not None:
            extra["stopped_by"] = self.clock.by
            extra["skipped_by_stop"] = max(0, p.skipped - self.skipped_at_stop)
        self.batcher.digest.reset()  # its record is in `extra` (computed once, above)
        self.fed_chunks, self.period_text, self.period_tokens = [], [], 0
        if p.binary:
            self.status.notice(f"lines {p.first_line}-{p.last_line}: skipped {p.binary} binary lines")
        self.emit(self.batcher.take_period(), ans.text, final, extra)

    def _answer(self, p: Period, digest: dict[str, Any]) -> Answer:
        """Ask the model (logged as a question and answer turn); after a stop only within the time left
        (stop.py): no regeneration, the answer cut to what fits, or the digest alone."""
        question = self.question(p, digest)
        t0 = time.perf_counter()
        support = Support(self.period_text, digest, numbers=period_numbers(
            p.first_line, p.last_line, p.lines, p.summarized, p.filtered, p.deduped, p.skipped, p.binary))
        earlier = [(no, text) for no, text in self.batcher.digest.notable
                   if no < p.first_line and no not in self.cited]
        if self.clock is not None:
            ans = final_ask(self.engine, self._events, question, support, digest, earlier, self.max_tokens,
                            self.clock, self.metrics)
        else:
            ans = ask(self.engine, self._events, question, support, self.max_tokens, retry=self.retry,
                      digest=digest, earlier=earlier)
        if ans.asked:
            self.slog.turn("user", question, ans.question_tokens, ans.question_seconds)
            self.slog.turn("assistant", ans.text, len(self.engine.last_reply_ids),
                           time.perf_counter() - t0 - ans.question_seconds, cache_len=self.engine.cache.length)
        settle_conversation(self.engine, keep=2, sink=self._fold)
        return ans

    def question(self, p: Period, digest: dict[str, Any]) -> str:
        """The question: prompts/summarize.txt filled with the line range, counts, notes and the digest text."""
        return question_text(self.prompt, p, digest, self.stopping, lambda t: len(self.engine.encode(t)),
                             self.budget.digest)

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
        self.summaries += 1 if p.lines else 0  # the end-of-run marker is no summary
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

    def finish_stopped(self, q: "queue.Queue[Item]", lines_read: int, at: float | None = None,
                       by: str = "a stop request") -> None:
        """After a stop (SIGTERM / Ctrl-C): feed nothing more. What is still queued, read but never queued
        (`lines_read`: the last line number the reader gave out) or waiting in the pending chunk counts as skipped,
        and the final summary asks only about what the cache already holds, within the time stop.py allows from
        the signal (`at`, time.monotonic(); `by`: "SIGTERM"). Feeding a backlog here instead would outlast any
        process manager's grace period (10-90 s before SIGKILL), and the final summary would be lost."""
        self.stopping = True
        self.clock = StopClock(time.monotonic() if at is None else at, by)
        self.error = skip_queued(q, self.batcher) or self.error
        self.batcher.skip_to(lines_read)
        dropped = self.batcher.drop_chunk()
        log.info("stopped: %d lines skipped since the last summary (%d of them from the chunk not yet fed)",
                 self.batcher.period.skipped, dropped)
        n = self.batcher.period.skipped - self.skipped_at_stop
        self.finish()
        self.status.notice(f"stopped by {by}: {plural(n, 'line')} read but not summarized"
                           + (" (counted as skipped in the final record)" if n else ""))

    def finish(self) -> None:
        """The final summary of whatever is pending (nothing is printed when nothing is pending)."""
        self.batcher.end_run()
        if self.batcher.period.lines:
            self.summarize(final=True)
        elif not self.last_final:  # a consumer of the JSONL sees where the run ended (on empty input too)
            last = self.batcher.last_no
            self.emit(Period(first_line=last + 1, last_line=last), "", True, {"lines_in_full": 0})
        self.status.done()
        if self.totals.lines == 0 and not self.error:
            self.status.notice("no input lines; nothing to summarize")
