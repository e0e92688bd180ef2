"""The run loop of `sinkchat soak`: steps a scenario on the one persistent cache until a limit, folding what it yields
into samples, and stops cleanly on SIGTERM or Ctrl-C.

A scenario is an object whose `step(engine)` yields engine events (plus `Fault`s it handled and one `Outcome`: did
the step do its job) for one unit of work: a chat turn, an agent task, a summary, a block of streamed text. An
`NllTap` on the engine scores every token fed through the live cache; the runner folds the events and those scores
into per-interval figures (the NLL sum and count of the interval is that sample's perplexity bin; a scenario that
calls tools adds the running and per-interval counts of its valid and failed calls; the token total and the cache's
peak come from the engine's `ForwardTally`, which sees every model call), writes one record per
`--sample-every` seconds to DIR/metrics.jsonl (flushed and fsynced, so a killed run can still be judged with
`sinkchat soak report DIR`) and to the session log, and survives whatever a step raises: the engine rolls a broken
forward back, so the cache stays consistent and the next step just runs.

With the recall memory on, a `RecallProbe` (recall.py) plants facts and asks for them around every other step;
its tokens go through the live cache and count in the token total, but it is no step of its own: its events make
no Outcome, no perplexity bin (the tap is paused), no throughput or latency figure. Each sample then carries the
memory's figures (`mem_*`: blocks, tokens, forgotten, disk bytes and their peak since the last sample, budget) and
the probes' running counts (`recall_*`); each probe is also a `probe` record. A probe is taken back once answered
(its tokens leave the cache and the ledger: `recall_tokens_taken_back` counts them), so the run's token total is
the ledger's evicted tokens, plus the cache's, plus those.
"""

from __future__ import annotations

import logging
import math
import signal
import time
import traceback
from collections import deque
from typing import Any, Callable

from sinkchat.apps.runlog import ForwardTally
from sinkchat.apps.soak.display import Display
from sinkchat.apps.soak.interval import Interval, cache_ptrs, mean, nll_bin, rate
from sinkchat.apps.soak.recall import Probe, RecallProbe, memory_figures
from sinkchat.apps.soak.records import Recorder
from sinkchat.apps.soak.steps import Fault, InputExhausted, Outcome, ToolCall
from sinkchat.apps.soak.tap import NllTap
from sinkchat.core.events import EvictionEvent, ForgottenEvent, PrefillEvent, TokenEvent
from sinkchat.core.metrics import cuda_bytes, percentile, rss_bytes
from sinkchat.errors import UserError

log = logging.getLogger(__name__)

MAX_CONSECUTIVE_ERRORS = 25  # a step failing this often in a row is a crash, not a fault
# tokens the recall memory lost to its disk (ForgottenEvent reasons): a handled fault each, and a warning line
MEMORY_FAULTS = {"damaged": "memory block damaged (checksum)", "disk": "memory block not written (disk)"}


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so the engine's rollback (which catches BaseException) keeps the cache sane."""


class Soak:
    """The loop: steps the scenario until a limit, samples every `sample_every` seconds, counts faults."""

    def __init__(self, engine: Any, scenario: Any, recorder: Recorder, *, sample_every: float,
                 duration: float | None = None, tokens: int | None = None, steps: int | None = None,
                 on_sample: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.engine, self.scenario, self.rec = engine, scenario, recorder
        self.sample_every, self.duration, self.max_tokens, self.max_steps = sample_every, duration, tokens, steps
        self.on_sample = on_sample or (lambda r: None)
        self.tap = NllTap(engine)
        self.tally = ForwardTally.of(engine)  # every model call: the token total and the cache's true peak
        self.tokens0 = self.tally.tokens if self.tally else 0
        if self.tally:
            self.tally.take_peak()  # the peak from the run's start
        self.t0 = time.monotonic()
        self.next_sample = self.t0 + sample_every
        self.evicted0 = engine.ledger.evicted
        self.iv = Interval()
        self.steps = self.errors = self.faults = 0
        self.attempts = self.faulted_steps = 0  # steps started; steps with at least one fault or error
        self.jobs = self.jobs_ok = 0  # steps judged by their Outcome; those that did their job
        self.step_faulted = False
        self.processed = 0  # tokens fed or generated, from the events: only for an engine double without a tally
        self.calls_tools = bool(getattr(scenario, "calls_tools", False))
        self.calls = {"ok": 0, "failed": 0, "invalid": 0}  # ToolCalls: ran ok / did not / rejected before running
        self.calls_at_sample = dict(self.calls)
        self.fatal: BaseException | None = None  # a UserError that ended the run
        self.fault_kinds: dict[str, int] = {}
        self.samples: deque[dict[str, Any]] = deque(maxlen=120)  # for the live sparklines
        self.memory = getattr(engine, "memory", None)
        self.recall = (RecallProbe.for_scenario(scenario, seed=int(getattr(scenario, "seed", 0) or 0),
                                                clock=lambda: time.monotonic() - self.t0, slog=lambda: self.slog)
                       if self.memory is not None else None)
        self.mem_peak = self.memory.disk_bytes if self.memory is not None else 0  # disk bytes, since the last sample
        self.segment = 0  # resumed runs (checkpoint.py): how many times; every sample says which process made it
        self.on_checkpoint: Callable[["Soak"], None] | None = None  # set with checkpoint_every by the command
        self.checkpoint_every = 0.0
        self.last_checkpoint = self.t0

    @property
    def tokens(self) -> int:
        """Tokens the model processed since the run started, fed and generated (an EOS too): the same count as the
        session log's TOKENS for this run (`sinkchat logs`), which the tokens of the logged turns are not (tool
        results are fed between turns). Not the ledger's `seen`, which goes back down when the agent rewinds the
        cache to its checkpoint before each task."""
        return self.tally.tokens - self.tokens0 if self.tally else self.processed

    def limit_reached(self) -> str | None:
        if self.duration is not None and time.monotonic() - self.t0 >= self.duration:
            return "duration"
        if self.max_tokens is not None and self.tokens >= self.max_tokens:
            return "tokens"
        if self.max_steps is not None and self.steps >= self.max_steps:
            return "steps"
        return None

    def progress(self) -> float:
        """Fraction done by the nearest limit (0 when unlimited)."""
        fr = [0.0]
        if self.duration:
            fr.append((time.monotonic() - self.t0) / self.duration)
        if self.max_tokens:
            fr.append(self.tokens / self.max_tokens)
        if self.max_steps:
            fr.append(self.steps / self.max_steps)
        return min(1.0, max(fr))

    @property
    def slog(self) -> Any:
        return getattr(self.scenario, "slog", None)

    def error(self, kind: str, exc: BaseException | None = None, detail: str = "") -> None:
        self.errors += 1
        self.step_faulted = True
        msg = detail or (f"{type(exc).__name__}: {exc}" if exc else kind)
        log.warning("soak error (%s): %s", kind, msg)
        self.rec.write({"kind": "error", "elapsed": round(time.monotonic() - self.t0, 3), "error": kind,
                        "detail": msg[:2000], "trace": traceback.format_exc()[-4000:] if exc else None})
        self._log_event("error", f"{kind}: {msg[:2000]}")

    def _log_event(self, kind: str, text: str) -> None:
        if self.slog is not None:
            try:
                self.slog.event(kind, text)
            except Exception as e:  # noqa: BLE001 - the log is evidence, never a reason to stop the soak
                log.warning("session log: %s", e)

    def _check_tap(self) -> None:
        for detail in self.tap.take_nonfinite():
            self.error("nonfinite_logits", detail=detail)

    def fold(self, ev: Any) -> None:
        if isinstance(ev, Fault):
            if ev.error:
                self.error(ev.kind, detail=ev.detail)
            else:
                self.faults += 1
                self.step_faulted = True
                self.fault_kinds[ev.kind] = self.fault_kinds.get(ev.kind, 0) + 1
                log.info("handled fault (%s): %s", ev.kind, ev.detail)
                self.rec.write({"kind": "fault", "elapsed": round(time.monotonic() - self.t0, 3), "fault": ev.kind,
                                "detail": ev.detail[:300]})
                self._log_event("fault", f"{ev.kind}: {ev.detail[:300]}")
        elif isinstance(ev, ToolCall):
            self.calls["ok" if ev.ok else "failed"] += 1
            self.calls["invalid"] += not ev.valid
        elif isinstance(ev, ForgottenEvent) and ev.reason in MEMORY_FAULTS:  # lost to the disk: said, and a fault
            kind = MEMORY_FAULTS[ev.reason]
            log.warning("%s: %d tokens [%d,%d) forgotten", kind, ev.count, ev.first, ev.last)
            self.fold(Fault(kind, f"{ev.count} tokens [{ev.first},{ev.last}) forgotten"))
            self.iv.fold(ev)
        elif isinstance(ev, Outcome):
            self.jobs += 1
            self.jobs_ok += bool(ev.ok)
            if not ev.ok:
                self.rec.write({"kind": "job", "elapsed": round(time.monotonic() - self.t0, 3), "ok": False,
                                "detail": ev.detail[:300]})
            self._log_event("job", f"{'done' if ev.ok else 'NOT done'}: {ev.detail[:300]}")
        else:
            self.iv.fold(ev)
            self._count(ev)
        self._check_tap()
        if time.monotonic() >= self.next_sample:
            self.sample()

    def _count(self, ev: Any) -> None:
        """Tokens for an engine double without a tally; the memory's disk peak after each eviction (blocks are
        written, and the budget enforced, as evicted tokens come in)."""
        self.processed += ev.tokens if isinstance(ev, PrefillEvent) else int(isinstance(ev, TokenEvent))
        if self.memory is not None and isinstance(ev, EvictionEvent):
            self.mem_peak = max(self.mem_peak, self.memory.disk_bytes)

    def probe(self, actions: Callable[[Any], Any]) -> None:
        """Run recall-probe `actions` (RecallProbe.before / after) on the live cache: their tokens are counted, their
        Probes recorded, nothing else of theirs folded (the tap is paused: no perplexity bin of theirs). An exception
        is an error, as in a step; the scenario's `recover` puts the engine back."""
        self.tap.paused = True
        try:
            for ev in actions(self.engine):
                if isinstance(ev, Probe):
                    self._record_probe(ev)
                else:
                    self._count(ev)
        except (KeyboardInterrupt, UserError):
            raise
        except Exception as e:  # noqa: BLE001 - counted like a step's
            self.error("recall_probe", e)
            recover = getattr(self.scenario, "recover", None)
            if recover:
                recover(self.engine, e)
        finally:
            self.tap.paused = False
            self._check_tap()

    def _record_probe(self, p: Probe) -> None:
        self.rec.write({"kind": "probe", "elapsed": round(time.monotonic() - self.t0, 3), "where": p.where,
                        "right": p.right, "age_tokens": p.age_tokens, "age_s": p.age_s, "topic": p.topic,
                        "value": p.value, "answer": p.answer[:200], "first": p.first, "end": p.end,
                        "block_layers": p.block_layers})
        self._log_event("recall", f"{p.where} probe {'right' if p.right else 'wrong'}: the {p.topic} = {p.value}, "
                                  f"{p.age_tokens} tokens ago; answered {p.answer[:80]!r}")

    def _memory_fields(self) -> dict[str, Any]:
        if self.memory is None:
            return {}
        out = memory_figures(self.memory)
        out["mem_disk_peak"] = max(self.mem_peak, out["mem_disk_bytes"])
        self.mem_peak = out["mem_disk_bytes"]
        if self.recall is not None:
            out.update(self.recall.figures())
        return out

    def sample(self) -> dict[str, Any]:
        now = time.monotonic()
        iv, self.iv = self.iv, Interval()
        self.next_sample = max(self.next_sample + self.sample_every, now + 0.5 * self.sample_every)
        eng = self.engine
        self._check_tap()
        iv.nll.extend(self.tap.drain())
        nll_sum, nll_n = nll_bin(iv.nll)
        cuda = cuda_bytes()
        input_ppl = round(math.exp(nll_sum / nll_n), 4) if nll_n else None
        lat = iv.latencies or iv.prefill_latencies  # decode latency; per-token prefill latency for stream
        rec = {
            "kind": "sample", "t": round(time.time(), 3), "elapsed": round(now - self.t0, 3), "segment": self.segment,
            "steps": self.steps,
            "tokens": self.tokens, "evicted": eng.ledger.evicted - self.evicted0, "cache_len": eng.cache.length,
            "cache_peak": self.tally.take_peak() if self.tally else eng.cache.length,
            "ledger_len": len(eng.ledger), "capacity": eng.cache_cfg.capacity, "cache_bytes": eng.cache.nbytes,
            "cache_ptrs": cache_ptrs(eng.cache), "rss": rss_bytes(), "cuda": cuda[0] if cuda else None,
            "cuda_peak": cuda[1] if cuda else None,
            "decode_tok_s": rate(iv.decode_tokens, iv.decode_seconds),
            "prefill_tok_s": rate(iv.prefill_tokens, iv.prefill_seconds),
            "p50_ms": round(1000 * percentile(lat, 50), 3) if lat else None,
            "p99_ms": round(1000 * percentile(lat, 99), 3) if lat else None,
            "gauge": round(sum(iv.gauges) / len(iv.gauges), 4) if iv.gauges else None,
            "gauge_local": round(sum(iv.local_gauges) / len(iv.local_gauges), 4) if iv.local_gauges else None,
            "gauge_recalled": mean(iv.recalled_gauges),
            "ppl": input_ppl, "nll_sum": round(nll_sum, 4), "nll_n": nll_n,
            "errors": self.errors, "faults": self.faults, "attempts": self.attempts,
            "faulted_steps": self.faulted_steps, "jobs": self.jobs, "jobs_ok": self.jobs_ok,
        }
        rec.update(self._call_counts())
        rec.update(self._memory_fields())
        self.rec.write(rec)
        self.samples.append(rec)
        self.on_sample(rec)
        return rec

    def _call_counts(self) -> dict[str, int]:
        """The tool-call fields of a sample (none for a scenario that calls no tools): running totals and the
        interval's own counts, so the report can plot the valid-call share both ways."""
        if not self.calls_tools:
            return {}
        c, prev = self.calls, self.calls_at_sample
        self.calls_at_sample = dict(c)
        return {"tool_calls_ok": c["ok"], "tool_calls_failed": c["failed"], "tool_calls_invalid": c["invalid"],
                "interval_tool_calls_ok": c["ok"] - prev["ok"],
                "interval_tool_calls_failed": c["failed"] - prev["failed"]}

    def totals(self) -> dict[str, Any]:
        """The running counts the end record carries (the tool-call ones only for a scenario that calls tools)."""
        out: dict[str, Any] = {"steps": self.steps, "tokens": self.tokens, "errors": self.errors,
                               "faults": self.faults, "fault_kinds": self.fault_kinds, "attempts": self.attempts,
                               "faulted_steps": self.faulted_steps, "jobs": self.jobs, "jobs_ok": self.jobs_ok}
        if self.recall is not None:
            out.update(self.recall.figures())
        if self.calls_tools:
            out.update({"tool_calls_ok": self.calls["ok"], "tool_calls_failed": self.calls["failed"],
                        "tool_calls_invalid": self.calls["invalid"]})
        return out

    def run(self) -> str:
        """Step until a limit; returns the end reason. Ctrl-C / SIGTERM propagate (the caller records them)."""
        consecutive = 0
        while True:
            reason = self.limit_reached()
            if reason:
                return reason
            probing = self.recall is not None and self.recall.due(self.steps)
            if probing:
                self.probe(self.recall.before)  # type: ignore[union-attr]
            gen = self.scenario.step(self.engine)
            stepped = False
            self.attempts += 1
            self.step_faulted = False
            try:
                for ev in gen:
                    self.fold(ev)
                    if self.limit_reached():
                        break
                else:
                    self.steps += 1
                    stepped = True
                consecutive = 0
            except InputExhausted:
                return "input exhausted"
            except UserError as e:  # the settings cannot work (e.g. a cache too small for the agent's prompt):
                self.error("step", e)  # no use retrying 25 times; the command ends with the message
                self.fatal = e
                return "crashed"
            except Exception as e:  # noqa: BLE001 - count, log, keep going: that is the point of a soak
                self.error("step", e)
                consecutive += 1
                recover = getattr(self.scenario, "recover", None)
                if recover:
                    recover(self.engine, e)
                if consecutive >= MAX_CONSECUTIVE_ERRORS:
                    return "crashed"
            finally:
                gen.close()
                self._check_tap()
                self.faulted_steps += self.step_faulted
                self.step_faulted = False
            if probing and stepped and not self.limit_reached():
                self.probe(self.recall.after)  # type: ignore[union-attr]
            if self.on_checkpoint is not None and time.monotonic() - self.last_checkpoint >= self.checkpoint_every:
                due = self.next_sample
                self.sample()  # the checkpoint covers every record up to here: no interval is split by a resume
                self.next_sample = due  # the regular samples keep their pace
                self.on_checkpoint(self)
                self.last_checkpoint = time.monotonic()
            if time.monotonic() >= self.next_sample:
                self.sample()


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated()


def run_until_stopped(soak: Soak) -> str:
    """Run the soak with the live display; returns the end reason. SIGTERM ends it like Ctrl-C, with a last
    sample (and then an end record), so a stopped run can still be judged."""
    old = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        with Display(soak) as disp:
            soak.on_sample = disp.update
            try:
                reason = soak.run()
            except Terminated:
                reason = "terminated"
            except KeyboardInterrupt:
                reason = "interrupted"
            for sig in (signal.SIGTERM, signal.SIGINT):  # shutdown takes seconds: more signals must not
                signal.signal(sig, signal.SIG_IGN)  # tear the records or the report
            soak.sample()
    finally:
        signal.signal(signal.SIGTERM, old)
    return reason
