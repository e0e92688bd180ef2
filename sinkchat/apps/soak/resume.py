"""`sinkchat soak resume DIR`: a stopped or killed run rebuilt from its last checkpoint (checkpoint.py) in a fresh
process, in the order that keeps it exact: the run's lock, the engine from the recorded settings, the workspace as
it was, the scenario built on the fresh conversation (the agent takes its system prompt only from an empty one),
then the snapshot, the scenario's, runner's and probe's state; the records written after the checkpoint set aside;
the session log continued from the checkpoint's token count."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable

import click

from sinkchat.apps.soak import checkpoint
from sinkchat.apps.soak.records import Recorder, load_run
from sinkchat.apps.soak.runner import Soak, run_until_stopped
from sinkchat.apps.soak.scenario_stream import check_input
from sinkchat.apps.soak.scenarios import make_scenario
from sinkchat.textutil import plural

log = logging.getLogger(__name__)

ENDED = ("duration", "tokens", "steps", "input exhausted")  # end reasons of a run that reached its planned end


def resume_run(out: Path, threads: int | None, start: Callable[..., Any],
               say: Callable[[str], None]) -> tuple[dict[str, Any], Soak, str]:
    """Rebuild the run in `out` and run it to its end or the next stop; returns (start record, the runner, the end
    reason). CheckpointError / ClickException, nothing touched, for a run that cannot be resumed. Call it holding
    the run's lock (checkpoint.holding)."""
    header, _, end = load_run(out)
    if end is not None and end.get("reason") in ENDED:
        raise click.ClickException(f"{out} already ran to its planned end ({end['reason']}); nothing to resume")
    folder, state = checkpoint.load(out)
    checkpoint.check_writer(out, state)
    if header.get("input") not in (None, "-"):
        check_input(header["input"])  # before the model loads
    settings = checkpoint.settings_from(state["settings"])
    if threads is not None:
        settings = replace(settings, model=replace(settings.model, threads=threads))
    engine = start(settings, None, say).engine
    checkpoint.note_store(out, engine)
    checkpoint.restore_workspace(folder, out / "workspace")
    scen = make_scenario(header["scenario"], engine, input_path=header.get("input"), workspace=out / "workspace",
                         allow_shell=bool(state["allow_shell"]), max_tokens=state["max_tokens"])
    from sinkchat.store.snapshot import load_snapshot

    load_snapshot(engine, folder / "engine.safetensors")  # after the scenario took the fresh conversation
    if state.get("memory_root"):  # a checkpoint of 2026-12-03 morning named its writer's store itself
        checkpoint.note_root(out, state["memory_root"])
    checkpoint.remove_dead_stores(out, engine)
    scen.load_state(state["scenario"])
    session = _reopen_session(out, header, engine, settings, state.get("session"),
                              int(state["runner"]["tokens"]), state.get("taken"), say)
    scen.slog = session
    n, last = checkpoint.cut_records(out, int(state["metrics_bytes"]))
    rec = Recorder(out, session, warn=lambda m: say(f"warning: {m}"))
    lim = header.get("limits") or {}
    soak = Soak(engine, scen, rec, sample_every=float(header.get("sample_every") or 30.0),
                duration=lim.get("duration"), tokens=lim.get("tokens"), steps=lim.get("steps"))
    checkpoint.load_runner_state(soak, state["runner"])
    if soak.recall is not None and state.get("recall"):
        soak.recall.load_state(state["recall"])
    _announce(out, soak, rec, session, folder, float(state["runner"]["elapsed"]), n, last, state.get("taken"), say)
    checkpoint.arm(soak, out, {**{k: state[k] for k in ("settings", "every", "allow_shell", "max_tokens")},
                               "session": session_ref(session)})
    return header, soak, run_until_stopped(soak)


def _announce(out: Path, soak: Soak, rec: Recorder, session: Any, folder: Path, at: float, n: int,
              last: float | None, taken: float | None, say: Callable[[str], None]) -> None:
    """The resume record, the session log's event and the line on stderr: where the run goes on, what is redone."""
    redo = max(0.0, float(last) - at) if last is not None else 0.0
    rec.write({"kind": "resume", "elapsed": round(at, 3), "segment": soak.segment, "checkpoint": folder.name,
               "resumed": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "pid": os.getpid(), "folder": folder_id(out),
               "discarded_records": n,
               "discarded_s": round(redo, 3)})
    n_turns = session.dropped
    gone = ("the work after it is done again in this new log" if not session.resumed else
            "the turns logged after it are done again" if not taken else  # a checkpoint from before `taken`
            f"{plural(n_turns, 'turn')} logged after it {'was' if n_turns == 1 else 'were'} taken out of this log, "
            "to be done again")
    session.event("resume", f"resumed from the checkpoint at {at:.0f} s of soak time; {gone} ({redo:.0f} s of "
                            "work)")
    say(f"resuming {out} at {at / 60:.1f} min of soak time (process {soak.segment + 1}); {redo / 60:.1f} min of "
        f"work after the checkpoint is done again ({plural(n, 'record')} set aside)")


def _reopen_session(out: Path, header: dict[str, Any], engine: Any, settings: Any, ref: Any, tokens: int,
                    taken: float | None, say: Callable[[str], None]) -> Any:
    """The run's session log, continued from the checkpoint's token count (`sinkchat logs show` tells the whole
    run once: what it logged after the checkpoint `taken`, done again now, is deleted); a new one where that log
    is not here (another data dir: a session of that id there is another's)."""
    from sinkchat.apps.runlog import open_log
    from sinkchat.store.transcript import get_session

    warn = lambda m: say(f"warning: {m}")  # noqa: E731
    if isinstance(ref, int):  # a checkpoint of 2026-12-03 morning: the id alone
        ref = {"id": ref, "started": None}
    if isinstance(ref, dict):
        try:
            info = get_session(int(ref["id"]))
            started = ref["started"]
            mine = info.mode == "soak" and (started is None or abs(info.started - float(started)) < 1e-3)
            ours = info.pid is None or info.pid in run_pids(out, header)  # not a copy of this folder, resumed elsewhere
            if mine and ours and info.status not in ("running", "other host"):
                return open_log(engine, "soak", False, None, warn=warn, resume_id=info.id, tokens_before=tokens,
                                drop_after=taken)
            why = ("that id names another session here" if not mine else
                   f"process {info.pid}, which did not run this folder, continued it (a copy of the run resumed "
                   "elsewhere?)" if not ours else
                   "a process still writes it (a copy of the run resumed beside the original?)")
        except Exception as e:  # noqa: BLE001 - the log is evidence, never a reason not to go on
            why = str(e)
        warn(f"the run's session log {ref.get('id')} cannot be continued ({why}); a new one is opened")
    return open_session(engine, settings, header["scenario"])


def folder_id(out: Path) -> str | None:
    """The run folder's identity (device and inode: a copy, `cp -a`, has its own), in its start and resume
    records."""
    try:
        st = os.stat(out)
    except OSError:
        return None
    return f"{st.st_dev}:{st.st_ino}"


def run_pids(out: Path, header: dict[str, Any]) -> set[int]:
    """The processes that ran the soak in this very folder: its start and resume records (`load_run`'s header; a
    record copied from another folder names that folder). The session log is continued, and what it holds past
    the checkpoint taken out, only when one of them held it last (the last holder's record is always among them:
    a resume sets records aside only after it took the log over itself)."""
    here = folder_id(out)
    return {int(r["pid"]) for r in [header, *header.get("resumes", [])]
            if isinstance(r.get("pid"), int) and r.get("folder") in (None, here)}  # None: before folders were named


def open_session(engine: Any, settings: Any, scenario: str) -> Any:
    """The session log, opened as the other apps open theirs: the scenario logs its turns (and tool calls, faults,
    evictions) there, the Recorder its samples."""
    from sinkchat.apps.runlog import open_log

    return open_log(engine, "soak", False, None, warn=lambda m: click.echo(f"warning: {m}", err=True),
                    extra={"scenario": scenario, **asdict(settings)})


def session_ref(session: Any) -> dict[str, Any] | None:
    """Which session log a checkpoint continues: its id and start time (an id alone could name another data
    dir's session)."""
    sid = getattr(session, "id", None)
    if sid is None:
        return None
    from sinkchat.store.transcript import get_session

    try:
        return {"id": sid, "started": get_session(sid, getattr(session, "path", None)).started}
    except Exception:  # noqa: BLE001 - the log is evidence, never a reason to stop
        return None
