"""`sinkchat soak`: run a scenario for hours on the one persistent cache and record evidence that it stays sane.

The command line: the options, the run directory and its start and end records around the run loop (runner.py),
then the verdicts (criteria.py) and report.md (report.py); `sinkchat soak report DIR` judges a recorded run again.
Scenarios live in scenarios.py and its scenario_* modules.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click

from sinkchat.apps.soak import checkpoint
from sinkchat.apps.soak.criteria import EXIT_CODES, overall
from sinkchat.apps.soak.records import Recorder, load_run
from sinkchat.apps.soak.report import verdict_table, write_report
from sinkchat.apps.soak.resume import ENDED, folder_id, open_session, session_ref
from sinkchat.apps.soak.runner import Soak, run_until_stopped
from sinkchat.apps.soak.scenario_stream import check_input
from sinkchat.apps.soak.scenarios import SCENARIOS, make_scenario
from sinkchat.apps.soak.thresholds import pop_thresholds, recorded_thresholds, threshold_options
from sinkchat.api import start
from sinkchat.bootstrap import build_settings, common_options, pop_common, setup_logging, user_errors

UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, hint: str = "--duration") -> float:
    """'8h', '90m', '1h30m', '45s', '2.5h' or plain seconds -> seconds."""
    s = re.sub(r"\s", "", text.lower())
    if not re.fullmatch(r"(\d+(\.\d+)?[smhd]?)+", s):
        raise click.BadParameter(f"{text!r} is not a duration like 8h, 90m, 1h30m or 45s", param_hint=hint)
    secs = sum(float(n) * UNITS[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([smhd]?)", s))
    if secs <= 0:
        raise click.BadParameter("must be more than 0 seconds", param_hint=hint)
    return secs


@click.group("soak", invoke_without_command=True)
@click.option("--duration", default=None, help="stop after this long: 8h, 90m, 1h30m, 45s [1h if no limit given]")
@click.option("--tokens", type=click.IntRange(1), default=None, help="stop after N tokens processed")
@click.option("--steps", type=click.IntRange(1), default=None, help="stop after N scenario steps (turns/tasks/blocks)")
@click.option("--scenario", type=click.Choice(SCENARIOS), default="agent", show_default=True,
              help="agent: generated tool tasks, each checked; chat: self-play turns; summarize: rolling summaries "
                   "of a synthetic log; stream: a text fed block by block")
@click.option("--input", "input_path", type=click.Path(dir_okay=False, allow_dash=True), default=None,
              help="stream: text file (looped) or - for stdin (ends at EOF)")
@click.option("--sample-every", type=click.FloatRange(0.5), default=30.0, show_default=True, help="seconds per record")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="run directory [./soak-YYYYmmdd-HHMMSS]")
@click.option("--allow-shell", is_flag=True, help="agent: give the agent the shell tool too")
@click.option("--checkpoint-every", default=f"{checkpoint.CHECKPOINT_EVERY / 60:g}m", show_default=True,
              help="soak time between checkpoints `sinkchat soak resume DIR` goes on from after a kill (0: none)")
@common_options
@threshold_options
@click.pass_context
def soak_command(ctx: click.Context, duration: str | None, tokens: int | None, steps: int | None, scenario: str,
                 input_path: str | None, sample_every: float, out_dir: str | None, allow_shell: bool,
                 checkpoint_every: str, **kw: Any) -> None:
    """Run a scenario on the one persistent cache for hours; record metrics, then judge them (report.md, PNGs).

    Replies (chat, agent, summarize) default to 96 tokens; --max-tokens changes that.

    \b
    Exit status:
      0  PASS: the run reached its planned end and every criterion passed
      3  FAIL: a criterion failed
      4  INCOMPLETE: no criterion failed, but the run was stopped (SIGTERM, Ctrl-C) before its planned end
      5  INCONCLUSIVE: the run reached its --duration but was too short to judge a criterion (e.g. the RSS slope)
      1  runtime error, 2 bad usage
    `sinkchat soak report DIR` judges a run again (e.g. one that was killed); `sinkchat soak resume DIR` goes on
    with a stopped or killed run from its last checkpoint (every scenario but a stream from stdin).
    """
    if ctx.invoked_subcommand is not None:
        return
    opts = pop_common(kw)
    th = pop_thresholds(kw)
    setup_logging(opts["verbose"] or 0)
    secs = parse_duration(duration) if duration else (None if tokens or steps else 3600.0)
    every = 0.0 if re.fullmatch(r"\s*(off|0+(\.0*)?[smhd]?)\s*", checkpoint_every) else \
        parse_duration(checkpoint_every, "--checkpoint-every")
    with user_errors():
        settings = build_settings(opts)
        out = _make_out_dir(out_dir)
        with checkpoint.holding(out):  # one process at a time runs a directory
            input_path = _stream_input(scenario, input_path)
            engine = start(settings, None, lambda m: click.echo(m, err=True)).engine
            checkpoint.note_store(out, engine)
            scen = make_scenario(scenario, engine, input_path=input_path, workspace=out / "workspace",
                                 allow_shell=allow_shell, max_tokens=opts.get("max_tokens"))
            session = open_session(engine, settings, scenario)
            scen.slog = session
            rec = Recorder(out, session, warn=lambda m: click.echo(f"warning: {m}", err=True))
            limits = {"duration": secs, "tokens": tokens, "steps": steps}
            rec.write(_start_record(out, engine, scenario, sample_every, limits, th, input_path))
            soak = Soak(engine, scen, rec, sample_every=sample_every, duration=secs, tokens=tokens, steps=steps)
            checkpoint.arm(soak, out, {"settings": asdict(settings), "every": every, "allow_shell": allow_shell,
                                       "max_tokens": opts.get("max_tokens"), "session": session_ref(session)})
            reason = run_until_stopped(soak)
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


def _start_record(out: Path, engine: Any, scenario: str, sample_every: float, limits: dict[str, Any], th: Any,
                  input_path: str | None) -> dict[str, Any]:
    """What the run was: `soak report` judges a killed run later with the thresholds recorded here."""
    c = engine.cache_cfg
    return {"kind": "start", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pid": os.getpid(),
            "folder": folder_id(out),
            "scenario": scenario, "policy": c.policy, "capacity": c.capacity, "n_sink": c.n_sink,
            "evict_chunk": c.evict_chunk, "model": getattr(engine.loaded, "source", None),
            "quant": getattr(engine.loaded, "quant", None),
            "sample_every": sample_every, "limits": limits, "thresholds": asdict(th),
            "input": input_path if input_path in (None, "-") else str(Path(input_path).resolve()),
            "memory": _memory_record(engine)}


def _memory_record(engine: Any) -> dict[str, Any]:
    """The recall memory the run had (`--memory on`): the recall and memory-disk rows are n/a without it."""
    mem = getattr(engine, "memory", None)
    if mem is None:
        return {"mode": "off"}
    return {"mode": "on", "budget": mem.store.budget, "block": mem.B, "topk": mem.topk, "root": str(mem.store.root)}


def _end_records(rec: Recorder, soak: Soak, reason: str, input_path: str | None) -> None:
    """The end record, then close; a run that read no text or lost records is an error, not a verdict."""
    rec.write({"kind": "end", "reason": reason, "elapsed": round(time.monotonic() - soak.t0, 3), **soak.totals()})
    if reason in ENDED:  # nothing left to resume: the checkpoint's snapshot and memory links go
        shutil.rmtree(rec.path.parent / "checkpoint", ignore_errors=True)
    soak.tap.detach()
    rec.close()
    if soak.fatal is not None:
        raise soak.fatal
    if reason == "input exhausted" and soak.tokens == 0:
        raise click.ClickException(f"{input_path} held no text")
    if rec.failed:
        raise click.ClickException(f"the run ended ({reason}) but {rec.path} could not be written; "
                                   f"{len(rec.lost)} records were lost")


def _finish(out: Path, th: Any, headline: str) -> None:
    verdicts = write_report(out, th)
    header, _, end = load_run(out)
    word = overall(verdicts, header)
    text = f"{headline}\n{verdict_table(verdicts)}\nreport: {out / 'report.md'}: {word}"
    try:
        click.echo(text)
        sys.stdout.flush()
    except BrokenPipeError:  # stdout closed (| head): the report on disk is what counts
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if EXIT_CODES[word]:
        sys.exit(EXIT_CODES[word])


@soak_command.command("report")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@threshold_options
def report_command(directory: str, **kw: Any) -> None:
    """Judge the run in DIRECTORY again (a killed one too): rewrite report.md and the plots, print the verdicts."""
    th = pop_thresholds(kw, base=recorded_thresholds(load_run(directory)[0]))
    _finish(Path(directory), th, f"soak run {directory}")


@soak_command.command("resume")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--threads", type=click.IntRange(0, 256), default=None,
              help="threads for the native kernels (results identical at any count) [default: the run's]")
@click.option("-v", "--verbose", count=True, help="more log output (-vv: debug)")
def resume_command(directory: str, threads: int | None, verbose: int) -> None:
    """Go on with the run in DIRECTORY (stopped, killed, its machine taken back) from its last checkpoint, with the
    settings, limits and thresholds it was started with; its clock counts soak time only. Then judge it as a whole."""
    from sinkchat.apps.soak.resume import resume_run

    setup_logging(verbose)
    out = Path(directory)
    with user_errors(), checkpoint.holding(out):
        header, soak, reason = resume_run(out, threads, start, lambda m: click.echo(m, err=True))
        _end_records(soak.rec, soak, reason, header.get("input"))
        _finish(out, recorded_thresholds(header), f"soak ended: {reason} after {soak.steps} steps, {soak.tokens} "
                                                  "tokens")
