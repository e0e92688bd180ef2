"""`sinkchat soak`: run a scenario for hours on the one persistent cache and record evidence that it stays sane.

The command line: the options, the run directory and its start and end records around the run loop (runner.py),
then the verdicts (criteria.py) and report.md (report.py); `sinkchat soak report DIR` judges a recorded run again.
Scenarios live in scenarios.py and its scenario_* modules.
"""

from __future__ import annotations

import logging
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
from sinkchat.apps.soak.runner import Soak, run_until_stopped
from sinkchat.apps.soak.scenario_stream import check_input
from sinkchat.apps.soak.scenarios import SCENARIOS, make_scenario
from sinkchat.apps.soak.thresholds import pop_thresholds, recorded_thresholds, threshold_options
from sinkchat.api import start
from sinkchat.bootstrap import build_settings, common_options, pop_common, setup_logging, user_errors
from sinkchat.errors import UserError

log = logging.getLogger(__name__)

ENDED = ("duration", "tokens", "steps", "input exhausted")  # end reasons of a run that reached its planned end
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
@click.option("--checkpoint-every", default="10m", show_default=True,
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
    every = 0.0 if checkpoint_every.strip() in ("0", "off") else parse_duration(checkpoint_every, "--checkpoint-every")
    with user_errors():
        settings = build_settings(opts)
        out = _make_out_dir(out_dir)
        input_path = _stream_input(scenario, input_path)
        engine = start(settings, None, lambda m: click.echo(m, err=True)).engine
        scen = make_scenario(scenario, engine, input_path=input_path, workspace=out / "workspace",
                             allow_shell=allow_shell, max_tokens=opts.get("max_tokens"))
        session = _open_session(engine, settings, scenario)
        scen.slog = session
        rec = Recorder(out, session, warn=lambda m: click.echo(f"warning: {m}", err=True))
        limits = {"duration": secs, "tokens": tokens, "steps": steps}
        rec.write(_start_record(engine, scenario, sample_every, limits, th, input_path))
        soak = Soak(engine, scen, rec, sample_every=sample_every, duration=secs, tokens=tokens, steps=steps)
        _arm_checkpoints(soak, out, {"settings": asdict(settings), "every": every, "allow_shell": allow_shell,
                                     "max_tokens": opts.get("max_tokens"), "session": getattr(session, "id", None)})
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


def _start_record(engine: Any, scenario: str, sample_every: float, limits: dict[str, Any], th: Any,
                  input_path: str | None) -> dict[str, Any]:
    """What the run was: `soak report` judges a killed run later with the thresholds recorded here."""
    c = engine.cache_cfg
    return {"kind": "start", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pid": os.getpid(),
            "scenario": scenario, "policy": c.policy, "capacity": c.capacity, "n_sink": c.n_sink,
            "evict_chunk": c.evict_chunk, "model": getattr(engine.loaded, "source", None),
            "quant": getattr(engine.loaded, "quant", None),
            "sample_every": sample_every, "limits": limits, "thresholds": asdict(th), "input": input_path,
            "memory": _memory_record(engine)}


def _memory_record(engine: Any) -> dict[str, Any]:
    """The recall memory the run had (`--memory on`): the recall and memory-disk rows are n/a without it."""
    mem = getattr(engine, "memory", None)
    if mem is None:
        return {"mode": "off"}
    return {"mode": "on", "budget": mem.store.budget, "block": mem.B, "topk": mem.topk, "root": str(mem.store.root)}


def _arm_checkpoints(soak: Soak, out: Path, run: dict[str, Any]) -> None:
    """Take a checkpoint every run["every"] seconds of soak time (checkpoint.py); `run`: what a resume needs
    besides the state of the runner, the scenario and the probe. A stream from stdin is not checkpointed (what was
    read is gone). A checkpoint that cannot be written is a warning and a record; the run goes on."""
    scen = soak.scenario
    if not run["every"] or not hasattr(scen, "state") or not getattr(scen, "resumable", True):
        return

    def take(s: Soak) -> None:
        if soak.rec.failed:  # records were lost: a checkpoint could not say which it covers
            return
        state = {**run, "runner": checkpoint.runner_state(s), "scenario": scen.state(),
                 "recall": s.recall.state() if s.recall is not None else None, "metrics_bytes": s.rec.size(),
                 **checkpoint.owner(s.engine)}
        try:
            checkpoint.save(out, s.engine, state, getattr(scen, "workspace", None))
        except (UserError, OSError) as e:
            log.warning("soak checkpoint failed: %s", e)
            s.rec.write({"kind": "checkpoint_failed", "elapsed": round(state["runner"]["elapsed"], 3),
                         "detail": str(e)[:300]})

    soak.on_checkpoint, soak.checkpoint_every = take, float(run["every"])


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


def _open_session(engine: Any, settings: Any, scenario: str) -> Any:
    """The session log, opened as the other apps open theirs: the scenario logs its turns (and tool calls, faults,
    evictions) there, the Recorder its samples."""
    from sinkchat.apps.runlog import open_log

    return open_log(engine, "soak", False, None, warn=lambda m: click.echo(f"warning: {m}", err=True),
                    extra={"scenario": scenario, **asdict(settings)})


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
@click.option("-v", "--verbose", count=True, help="more log output (-vv: debug)")
def resume_command(directory: str, verbose: int) -> None:
    """Go on with the run in DIRECTORY (stopped, killed, its machine taken back) from its last checkpoint, with the
    settings, limits and thresholds it was started with; its clock counts soak time only. Then judge it as a whole."""
    setup_logging(verbose)
    out = Path(directory)
    with user_errors():
        header, _, end = load_run(out)
        if end is not None and end.get("reason") in ENDED:
            raise click.ClickException(f"{out} already ran to its planned end ({end['reason']}); nothing to resume")
        folder, state = checkpoint.load(out)
        checkpoint.check_stopped(out, state)
        settings = checkpoint.settings_from(state["settings"])
        engine = start(settings, None, lambda m: click.echo(m, err=True)).engine
        workspace = out / "workspace"
        checkpoint.restore_workspace(folder, workspace)
        scen = make_scenario(header["scenario"], engine, input_path=header.get("input"), workspace=workspace,
                             allow_shell=bool(state["allow_shell"]), max_tokens=state["max_tokens"])
        from sinkchat.store.snapshot import load_snapshot

        load_snapshot(engine, folder / "engine.safetensors")  # after the scenario took the fresh conversation
        checkpoint.remove_dead_store(state, engine)
        scen.load_state(state["scenario"])
        session = _reopen_session(engine, settings, header["scenario"], state.get("session"))
        scen.slog = session
        n, last = checkpoint.cut_records(out, int(state["metrics_bytes"]))
        rec = Recorder(out, session, warn=lambda m: click.echo(f"warning: {m}", err=True))
        lim = header.get("limits") or {}
        soak = Soak(engine, scen, rec, sample_every=float(header.get("sample_every") or 30.0),
                    duration=lim.get("duration"), tokens=lim.get("tokens"), steps=lim.get("steps"))
        checkpoint.load_runner_state(soak, state["runner"])
        if soak.recall is not None and state.get("recall"):
            soak.recall.load_state(state["recall"])
        at = float(state["runner"]["elapsed"])
        redo = max(0.0, float(last) - at) if last is not None else 0.0
        rec.write({"kind": "resume", "elapsed": round(at, 3), "segment": soak.segment, "checkpoint": folder.name,
                   "resumed": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pid": os.getpid(), "discarded_records": n,
                   "discarded_s": round(redo, 3)})
        session.event("resume", f"resumed from the checkpoint at {at:.0f} s of soak time; {redo:.0f} s of work "
                                "after it is done again")
        click.echo(f"resuming {out} at {at / 60:.1f} min of soak time (segment {soak.segment}); {redo / 60:.1f} min "
                   f"of work after the checkpoint is done again", err=True)
        _arm_checkpoints(soak, out, {k: state[k] for k in ("settings", "every", "allow_shell", "max_tokens",
                                                           "session")})
        reason = run_until_stopped(soak)
        _end_records(rec, soak, reason, header.get("input"))
        th = recorded_thresholds(header)
        _finish(out, th, f"soak ended: {reason} after {soak.steps} steps, {soak.tokens} tokens")


def _reopen_session(engine: Any, settings: Any, scenario: str, session_id: int | None) -> Any:
    """The run's session log, continued (`sinkchat logs show` tells the whole run); a new one where that log is
    not here (another data dir)."""
    from sinkchat.apps.runlog import open_log

    warn = lambda m: click.echo(f"warning: {m}", err=True)  # noqa: E731
    if session_id is not None:
        try:
            return open_log(engine, "soak", False, None, warn=warn, resume_id=int(session_id))
        except Exception as e:  # noqa: BLE001 - the log is evidence, never a reason not to go on
            warn(f"the run's session log {session_id} cannot be continued ({e}); a new one is opened")
    return _open_session(engine, settings, scenario)
