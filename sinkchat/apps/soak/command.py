"""`sinkchat soak`: run a scenario for hours on the one persistent cache and record evidence that it stays sane.

A scenario is an object whose `step(engine)` yields engine events (plus `Fault`s it handled) for one unit of work: a
chat turn, an agent task, a block of streamed text. The runner folds the events into per-interval figures, writes
one record per `--sample-every` seconds to DIR/metrics.jsonl (flushed and fsynced, so a killed run can still be
judged with `sinkchat soak report DIR`) and to the session log, and survives whatever a step raises: the engine rolls
a broken forward back, so the cache stays consistent and the next step just runs. Scenarios live in soak_scenarios.
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
import sys
import time
import traceback
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import click

from sinkchat.bootstrap import build_settings, common_options, open_engine, pop_common, setup_logging, user_errors
from sinkchat.core.events import GaugeEvent, PrefillEvent, TokenEvent
from sinkchat.core.metrics import cuda_bytes, percentile, rss_bytes
from sinkchat.apps.soak.display import Display
from sinkchat.apps.soak.records import Recorder, load_run
from sinkchat.apps.soak.report import (
    EXIT_FAIL, pop_thresholds, recorded_thresholds, threshold_options, verdict_table, write_report,
)
from sinkchat.apps.soak.scenarios import Fault, InputExhausted, Probe, Scores, check_input, make_scenario

log = logging.getLogger(__name__)

MAX_CONSECUTIVE_ERRORS = 25  # a step failing this often in a row is a crash, not a fault
UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so the engine's rollback (which catches BaseException) keeps the cache sane."""


def parse_duration(text: str) -> float:
    """'8h', '90m', '1h30m', '45s', '2.5h' or plain seconds -> seconds."""
    s = re.sub(r"\s", "", text.lower())
    if not re.fullmatch(r"(\d+(\.\d+)?[smhd]?)+", s):
        raise click.BadParameter(f"{text!r} is not a duration like 8h, 90m, 1h30m or 45s", param_hint="--duration")
    secs = sum(float(n) * UNITS[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([smhd]?)", s))
    if secs <= 0:
        raise click.BadParameter("must be more than 0 seconds", param_hint="--duration")
    return secs


@dataclass
class Interval:
    """Figures folded from the events between two samples."""

    decode_tokens: int = 0
    decode_seconds: float = 0.0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)  # seconds per decoded token
    prefill_latencies: list[float] = field(default_factory=list)  # seconds per token of each prefill chunk
    gauges: list[float] = field(default_factory=list)
    nll: list[float] = field(default_factory=list)  # scenario input scored through the cache

    def fold(self, ev: Any) -> None:
        if isinstance(ev, TokenEvent):
            self.decode_tokens += 1
            self.decode_seconds += ev.seconds
            self.latencies.append(ev.seconds)
        elif isinstance(ev, PrefillEvent):
            self.prefill_tokens += ev.tokens
            self.prefill_seconds += ev.seconds
            if ev.tokens:
                self.prefill_latencies.append(ev.seconds / ev.tokens)
        elif isinstance(ev, GaugeEvent):
            self.gauges.append(ev.share)


def _rate(n: float, s: float) -> float | None:
    return round(n / s, 3) if s > 0 else None


def _ppl(nll: list[float]) -> float | None:
    vals = [v for v in nll if math.isfinite(v)]
    return round(math.exp(sum(vals) / len(vals)), 4) if vals else None


class Soak:
    """The loop: steps the scenario until a limit, samples every `sample_every` seconds, counts faults."""

    def __init__(self, engine: Any, scenario: Any, recorder: Recorder, *, sample_every: float,
                 duration: float | None = None, tokens: int | None = None, steps: int | None = None,
                 probe: Probe | None = None, on_sample: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.engine, self.scenario, self.rec = engine, scenario, recorder
        self.sample_every, self.duration, self.max_tokens, self.max_steps = sample_every, duration, tokens, steps
        self.probe, self.on_sample = probe, on_sample or (lambda r: None)
        self.t0 = time.monotonic()
        self.next_sample = self.t0 + sample_every
        self.seen0, self.evicted0 = engine.ledger.seen, engine.ledger.evicted
        self.iv = Interval()
        self.steps = self.errors = self.faults = 0
        self.fault_kinds: dict[str, int] = {}
        self.samples: deque[dict[str, Any]] = deque(maxlen=120)  # for the live sparklines

    @property
    def tokens(self) -> int:
        return self.engine.ledger.seen - self.seen0

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

    def error(self, kind: str, exc: BaseException | None = None, detail: str = "") -> None:
        self.errors += 1
        msg = detail or (f"{type(exc).__name__}: {exc}" if exc else kind)
        log.warning("soak error (%s): %s", kind, msg)
        self.rec.write({"kind": "error", "elapsed": round(time.monotonic() - self.t0, 3), "error": kind,
                        "detail": msg[:2000], "trace": traceback.format_exc()[-4000:] if exc else None})

    def fold(self, ev: Any) -> None:
        if isinstance(ev, Fault):
            if ev.error:
                self.error(ev.kind, detail=ev.detail)
            else:
                self.faults += 1
                self.fault_kinds[ev.kind] = self.fault_kinds.get(ev.kind, 0) + 1
                log.info("handled fault (%s): %s", ev.kind, ev.detail)
                self.rec.write({"kind": "fault", "elapsed": round(time.monotonic() - self.t0, 3), "fault": ev.kind,
                                "detail": ev.detail[:300]})
        elif isinstance(ev, Scores):
            self.iv.nll.extend(ev)
        else:
            self.iv.fold(ev)
        if time.monotonic() >= self.next_sample:
            self.sample()

    def sample(self) -> dict[str, Any]:
        now = time.monotonic()
        iv, self.iv = self.iv, Interval()
        self.next_sample = max(self.next_sample + self.sample_every, now + 0.5 * self.sample_every)
        eng = self.engine
        probe_ppl = None
        if self.probe is not None:
            try:
                probe_ppl = self.probe.ppl()
            except Exception as e:  # noqa: BLE001
                self.error("probe", e)
        cuda = cuda_bytes()
        input_ppl = _ppl(iv.nll)
        lat = iv.latencies or iv.prefill_latencies  # decode latency; per-token prefill latency for stream
        rec = {
            "kind": "sample", "t": round(time.time(), 3), "elapsed": round(now - self.t0, 3), "steps": self.steps,
            "tokens": self.tokens, "evicted": eng.ledger.evicted - self.evicted0, "cache_len": eng.cache.length,
            "cache_bytes": eng.cache.nbytes, "rss": rss_bytes(), "cuda": cuda[0] if cuda else None,
            "cuda_peak": cuda[1] if cuda else None,
            "decode_tok_s": _rate(iv.decode_tokens, iv.decode_seconds),
            "prefill_tok_s": _rate(iv.prefill_tokens, iv.prefill_seconds),
            "p50_ms": round(1000 * percentile(lat, 50), 3) if lat else None,
            "p99_ms": round(1000 * percentile(lat, 99), 3) if lat else None,
            "gauge": round(sum(iv.gauges) / len(iv.gauges), 4) if iv.gauges else None,
            "ppl": input_ppl if self.probe is None else probe_ppl, "ppl_input": input_ppl, "ppl_probe": probe_ppl,
            "errors": self.errors, "faults": self.faults,
        }
        self.rec.write(rec)
        self.samples.append(rec)
        self.on_sample(rec)
        return rec

    def run(self) -> str:
        """Step until a limit; returns the end reason. Ctrl-C / SIGTERM propagate (the caller records them)."""
        consecutive = 0
        while True:
            reason = self.limit_reached()
            if reason:
                return reason
            gen = self.scenario.step(self.engine)
            try:
                for ev in gen:
                    self.fold(ev)
                    if self.limit_reached():
                        break
                else:
                    self.steps += 1
                consecutive = 0
            except InputExhausted:
                return "input exhausted"
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
            if time.monotonic() >= self.next_sample:
                self.sample()


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated()


@click.group("soak", invoke_without_command=True)
@click.option("--duration", default=None, help="stop after this long: 8h, 90m, 1h30m, 45s [1h if no limit given]")
@click.option("--tokens", type=click.IntRange(1), default=None, help="stop after N tokens processed")
@click.option("--steps", type=click.IntRange(1), default=None, help="stop after N scenario steps (turns/tasks/blocks)")
@click.option("--scenario", type=click.Choice(("agent", "chat", "stream")), default="agent", show_default=True)
@click.option("--input", "input_path", type=click.Path(dir_okay=False, allow_dash=True), default=None,
              help="stream: text file (looped) or - for stdin (ends at EOF)")
@click.option("--sample-every", type=click.FloatRange(0.5), default=30.0, show_default=True, help="seconds per record")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="run directory [./soak-YYYYmmdd-HHMMSS]")
@click.option("--allow-shell", is_flag=True, help="agent: give the agent the shell tool too")
@common_options
@threshold_options
@click.pass_context
def soak_command(ctx: click.Context, duration: str | None, tokens: int | None, steps: int | None, scenario: str,
                 input_path: str | None, sample_every: float, out_dir: str | None, allow_shell: bool,
                 **kw: Any) -> None:
    """Run a scenario on the one persistent cache for hours; record metrics, then judge them (report.md, PNGs).

    Replies (chat, agent) default to 96 tokens; --max-tokens changes that.
    Exit status: 0 every criterion passed, 3 a criterion failed, 1 runtime error, 2 bad usage.
    `sinkchat soak report DIR` judges a run again (e.g. one that was killed).
    """
    if ctx.invoked_subcommand is not None:
        return
    opts = pop_common(kw)
    th = pop_thresholds(kw)
    setup_logging(opts["verbose"] or 0)
    secs = parse_duration(duration) if duration else (None if tokens or steps else 3600.0)
    with user_errors():
        settings = build_settings(opts)
        out = _make_out_dir(out_dir)
        input_path = _stream_input(scenario, input_path)
        engine = open_engine(settings, system=None, progress=lambda m: click.echo(m, err=True))
        scen = make_scenario(scenario, engine, input_path=input_path, workspace=out / "workspace",
                             allow_shell=allow_shell, max_tokens=opts.get("max_tokens"))
        probe = None if scenario == "stream" else Probe(engine)
        session = _open_session(engine, settings, scenario)
        rec = Recorder(out, session, warn=lambda m: click.echo(f"warning: {m}", err=True))
        limits = {"duration": secs, "tokens": tokens, "steps": steps}
        rec.write(_start_record(engine, scenario, sample_every, limits, th, input_path))
        soak = Soak(engine, scen, rec, sample_every=sample_every, duration=secs, tokens=tokens, steps=steps,
                    probe=probe)
        reason = _run_until_stopped(soak)
        _end_records(rec, soak, reason, input_path)
        _finish(out, th, f"soak ended: {reason} after {soak.steps} steps, {soak.tokens} tokens")


def _make_out_dir(out_dir: str | None) -> Path:
    out = Path(out_dir or time.strftime("soak-%Y%m%d-%H%M%S"))
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise click.ClickException(f"cannot create {out}: {e.strerror}") from None
    return out


def _stream_input(scenario: str, input_path: str | None) -> str | None:
    """The stream scenario's input, checked before the model loads (a bad path fails in a second, not after it):
    stdin when it is piped and no --input was given."""
    if scenario != "stream":
        return input_path
    if input_path is None:
        if sys.stdin.isatty():
            raise click.UsageError("--scenario stream needs --input FILE (or - with text on stdin)")
        input_path = "-"
    check_input(input_path)
    return input_path


def _start_record(engine: Any, scenario: str, sample_every: float, limits: dict[str, Any], th: Any,
                  input_path: str | None) -> dict[str, Any]:
    """What the run was: `soak report` judges a killed run later with the thresholds recorded here."""
    c = engine.cache_cfg
    return {"kind": "start", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pid": os.getpid(),
            "scenario": scenario, "policy": c.policy, "capacity": c.capacity, "n_sink": c.n_sink,
            "evict_chunk": c.evict_chunk, "model": engine.loaded.source, "quant": engine.loaded.quant,
            "sample_every": sample_every, "limits": limits, "thresholds": asdict(th), "input": input_path}


def _run_until_stopped(soak: Soak) -> str:
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


def _end_records(rec: Recorder, soak: Soak, reason: str, input_path: str | None) -> None:
    """The end record, then close; a run that read no text or lost records is an error, not a verdict."""
    rec.write({"kind": "end", "reason": reason, "elapsed": round(time.monotonic() - soak.t0, 3),
               "steps": soak.steps, "tokens": soak.tokens, "errors": soak.errors, "faults": soak.faults,
               "fault_kinds": soak.fault_kinds})
    rec.close()
    if reason == "input exhausted" and soak.tokens == 0:
        raise click.ClickException(f"{input_path} held no text")
    if rec.failed:
        raise click.ClickException(f"the run ended ({reason}) but {rec.path} could not be written; "
                                   f"{len(rec.lost)} records were lost")


def _open_session(engine: Any, settings: Any, scenario: str) -> Any:
    try:
        from sinkchat.store.transcript import SessionLog
    except ImportError:
        return None
    return SessionLog.open("soak", engine.loaded.source, {"scenario": scenario, **asdict(settings)},
                           warn=lambda m: click.echo(f"warning: {m}", err=True))


def _finish(out: Path, th: Any, headline: str) -> None:
    verdicts = write_report(out, th)
    failed = any(v.failed for v in verdicts)
    text = f"{headline}\n{verdict_table(verdicts)}\nreport: {out / 'report.md'}: {'FAIL' if failed else 'PASS'}"
    try:
        click.echo(text)
        sys.stdout.flush()
    except BrokenPipeError:  # stdout closed (| head): the report on disk is what counts
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if failed:
        sys.exit(EXIT_FAIL)


@soak_command.command("report")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@threshold_options
def report_command(directory: str, **kw: Any) -> None:
    """Judge the run in DIRECTORY again (a killed one too): rewrite report.md and the plots, print the verdicts."""
    th = pop_thresholds(kw, base=recorded_thresholds(load_run(directory)[0]))
    _finish(Path(directory), th, f"soak run {directory}")
