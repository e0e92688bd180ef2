"""Reading the session log back: sessions, their turns, a whole session as JSON, deleting one (`sinkchat logs`,
`chat --resume`). Every chat / agent / summarize / soak session is in one SQLite file (`logdb`), written by
`sessionlog`; `NullLog` and `SessionLog` are re-exported here for the callers that import them from this module.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sinkchat.memory import folders
from sinkchat.store import procs
from sinkchat.store.logdb import LogError, auto_snapshot_path, open_reader, transaction
from sinkchat.store.sessionlog import NullLog, SessionLog

__all__ = ["SessionInfo", "Turn", "LogEvent", "list_sessions", "get_session", "latest_session", "turns", "events",
           "export", "session_status", "delete_session", "NullLog", "SessionLog"]


@dataclass(frozen=True)
class SessionInfo:
    id: int
    started: float
    ended: float | None
    mode: str
    model: str | None
    settings: dict[str, Any]
    system: str | None
    turns: int = 0
    tokens: int = 0  # tokens the model processed (fed and generated); `turn_tokens` where they were not counted
    pid: int | None = None
    status: str = ""  # 'ended', or for an open session whether its process still runs (see `session_status`)
    turn_tokens: int = 0  # the tokens of the turns: fed for a prompt, generated for a reply
    tokens_counted: bool = False  # False: logged before sinkchat counted them (or by an engine double)


@dataclass(frozen=True)
class Turn:
    seq: int
    role: str
    text: str
    tokens: int
    seconds: float
    created: float
    reason: str | None = None
    cache_len: int | None = None


# ------------------------------------------------------------------------------------------------ queries
_SESSION_SQL = ("SELECT s.*, (SELECT COUNT(*) FROM turns t WHERE t.session_id = s.id) AS n_turns, "
                "(SELECT COALESCE(SUM(tokens), 0) FROM turns t WHERE t.session_id = s.id) AS n_tokens FROM sessions s")


@dataclass(frozen=True)
class LogEvent:
    """A logged event between turns (slash command, agent error feedback): after turn `turn_seq`."""

    turn_seq: int
    kind: str
    text: str
    detail: str | None
    tokens: int
    created: float


def session_status(ended: float | None, pid: int | None, pid_started: float | None, host: str | None) -> str:
    """'ended'; else 'running' while the process that opened it lives, 'crashed' once it is gone (or its pid was
    reused), 'other host' when it was opened on another machine, 'open/crashed' for a row with no pid (written by
    an older sinkchat: it cannot be told)."""
    if ended:
        return "ended"
    state = procs.liveness(pid, pid_started, host)
    return "open/crashed" if state == "unknown" else state


def _info(r: sqlite3.Row) -> SessionInfo:
    """One meaning for `tokens` in every mode: what the model processed. The turns alone say less wherever tokens
    are fed between them (an agent's tool results, summarize's log lines: 8,421 in the turns of a summarize run that
    processed 27,244); only a session logged before the total was counted falls back to them."""
    counted = r["tokens"] is not None
    return SessionInfo(r["id"], r["started"], r["ended"], r["mode"], r["model"], json.loads(r["settings"] or "{}"),
                       r["system"], r["n_turns"], int(r["tokens"]) if counted else r["n_tokens"], r["pid"],
                       session_status(r["ended"], r["pid"], r["pid_started"], r["host"]), r["n_tokens"], counted)


def list_sessions(mode: str | None = None, limit: int = 50, path: Path | str | None = None) -> list[SessionInfo]:
    """Newest first."""
    with contextlib.closing(open_reader(path)) as c:
        where, args = ("WHERE s.mode = ?", (mode,)) if mode else ("", ())
        rows = c.execute(f"{_SESSION_SQL} {where} ORDER BY s.id DESC LIMIT ?", (*args, limit)).fetchall()
    return [_info(r) for r in rows]


def get_session(session_id: int, path: Path | str | None = None) -> SessionInfo:
    with contextlib.closing(open_reader(path)) as c:
        r = c.execute(f"{_SESSION_SQL} WHERE s.id = ?", (session_id,)).fetchone()
    if r is None:
        raise LogError(f"no session {session_id} in the log")
    return _info(r)


def latest_session(mode: str | None = None, path: Path | str | None = None) -> SessionInfo | None:
    """The newest session (of `mode`), e.g. what a bare --resume continues; None if there is none."""
    try:
        found = list_sessions(mode, 1, path)
    except LogError:
        return None
    return found[0] if found else None


def turns(session_id: int, path: Path | str | None = None) -> list[Turn]:
    with contextlib.closing(open_reader(path)) as c:
        rows = c.execute("SELECT seq, role, text, tokens, seconds, created, reason, cache_len FROM turns "
                         "WHERE session_id = ? ORDER BY seq", (session_id,)).fetchall()
    return [Turn(*r) for r in rows]


def events(session_id: int, path: Path | str | None = None) -> list[LogEvent]:
    """The session's events in the order they happened."""
    with contextlib.closing(open_reader(path)) as c:
        rows = c.execute("SELECT turn_seq, kind, text, detail, tokens, created FROM events WHERE session_id = ? "
                         "ORDER BY id", (session_id,)).fetchall()
    return [LogEvent(*r) for r in rows]


def export(session_id: int, path: Path | str | None = None) -> dict[str, Any]:
    """Everything logged for a session as one JSON-able dict."""
    info = get_session(session_id, path)
    with contextlib.closing(open_reader(path)) as c:
        def rows(table: str) -> list[dict[str, Any]]:
            q = f"SELECT * FROM {table} WHERE session_id = ? ORDER BY id"
            return [{k: r[k] for k in r.keys() if k not in ("id", "session_id")} for r in c.execute(q, (session_id,))]
        tools, evs, mets, notes = rows("tool_calls"), rows("evictions"), rows("metrics"), rows("events")
    for m in mets:
        m["data"] = json.loads(m["data"])
    ts = turns(session_id, path)
    _place(evs, [(t.created, t.seq) for t in ts])
    return {"session": asdict(info), "turns": [asdict(t) for t in ts], "tool_calls": tools,
            "evictions": evs, "metrics": mets, "events": notes}


def _place(evictions: list[dict[str, Any]], turn_times: list[tuple[float, int]]) -> None:
    """An eviction logged before it carried its `turn_seq` (schema < 4) gets one from its time: the last turn logged
    before it happened (0: none). Its `created` is when it happened, though it was written with the next turn, and
    a turn's `created` is when it was logged (complete), so `logs show` lists old sessions in order too."""
    k, seq = 0, 0
    for ev in sorted(evictions, key=lambda e: e["created"]):
        while k < len(turn_times) and turn_times[k][0] <= ev["created"]:
            seq = turn_times[k][1]
            k += 1
        if ev.get("turn_seq") is None:
            ev["turn_seq"] = seq


def delete_session(session_id: int, path: Path | str | None = None) -> None:
    get_session(session_id, path)
    with contextlib.closing(open_reader(path)) as c, transaction(c):
        for table in ("turns", "tool_calls", "evictions", "metrics", "events"):
            c.execute(f"DELETE FROM {table} WHERE session_id = ?", (session_id,))
        c.execute("DELETE FROM sessions WHERE id = ?", (session_id,))
    snap = auto_snapshot_path(session_id, Path(path).parent if path is not None else None)
    snap.unlink(missing_ok=True)
    folders.prune(snap, None)  # and its recall memory's folder (the conversation's keys and values)
