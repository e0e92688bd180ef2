"""The session log: every chat / agent / summarize / soak session in one SQLite file, and `sinkchat logs`.

Why SQLite: a night-long session must survive a crash or kill -9 with every completed turn on disk, and several
sinkchat processes may log at once. WAL mode lets readers and one writer work together; `BEGIN IMMEDIATE` takes the
write lock up front so `busy_timeout` (not an instant "database is locked") governs contention; each turn is one
transaction with `synchronous=FULL`, so a committed turn survives even a power cut. Evictions and metrics are
buffered and written in the next turn's transaction (they are frequent and cheap to lose).

The log stores only what the user typed, what the model (or a tool) produced, and settings; values of environment
variables that look like secrets are redacted from anything written. If the database cannot be written (disk full,
read-only dir) the session warns once and carries on without a log rather than crash. No torch import here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from sinkchat.textutil import utf8_safe

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2
BUSY_TIMEOUT_MS = 30_000
FLUSH_EVERY = 256  # buffered evictions/metrics rows before a forced write
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH", re.I)

# Each step upgrades the schema from version i to i+1; a fresh file runs them all. Never edit a released step.
MIGRATIONS: list[str] = [
    # 0 -> 1: sessions and turns
    """
    CREATE TABLE sessions (id INTEGER PRIMARY KEY AUTOINCREMENT, started REAL NOT NULL, ended REAL,
        mode TEXT NOT NULL, model TEXT, settings TEXT NOT NULL DEFAULT '{}', system TEXT);
    CREATE TABLE turns (id INTEGER PRIMARY KEY AUTOINCREMENT,
        session_id INTEGER NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
        seq INTEGER NOT NULL, role TEXT NOT NULL, text TEXT NOT NULL, tokens INTEGER NOT NULL DEFAULT 0,
        seconds REAL NOT NULL DEFAULT 0, created REAL NOT NULL, UNIQUE (session_id, seq));
    """,
    # 1 -> 2: finish reason and cache length per turn; tool calls, evictions, metrics
    """
    ALTER TABLE turns ADD COLUMN reason TEXT;
    ALTER TABLE turns ADD COLUMN cache_len INTEGER;
    CREATE TABLE tool_calls (id INTEGER PRIMARY KEY AUTOINCREMENT,
        session_id INTEGER NOT NULL REFERENCES sessions(id) ON DELETE CASCADE, turn_seq INTEGER NOT NULL,
        name TEXT NOT NULL, args TEXT NOT NULL, result TEXT, ok INTEGER NOT NULL, created REAL NOT NULL);
    CREATE TABLE evictions (id INTEGER PRIMARY KEY AUTOINCREMENT,
        session_id INTEGER NOT NULL REFERENCES sessions(id) ON DELETE CASCADE, created REAL NOT NULL,
        count INTEGER NOT NULL, first INTEGER NOT NULL, last INTEGER NOT NULL, preview TEXT, policy TEXT,
        cache_len INTEGER);
    CREATE TABLE metrics (id INTEGER PRIMARY KEY AUTOINCREMENT,
        session_id INTEGER NOT NULL REFERENCES sessions(id) ON DELETE CASCADE, created REAL NOT NULL,
        data TEXT NOT NULL);
    CREATE INDEX turns_session ON turns(session_id, seq);
    """,
]


class LogError(RuntimeError):
    """The log cannot be read (missing, newer schema, unknown session); the CLI prints it as one line."""


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
    tokens: int = 0


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


# ------------------------------------------------------------------------------------------------ connection
def db_path() -> Path:
    from sinkchat.config import data_dir

    return data_dir() / "sinkchat.db"


def auto_snapshot_path(session_id: int, home: Path | None = None) -> Path:
    """Where the automatic snapshot of a session lives (one file, overwritten atomically every N turns)."""
    if home is None:
        from sinkchat.config import data_dir

        home = data_dir()
    return home / "snapshots" / "auto" / f"session-{int(session_id)}.safetensors"


def migrate(conn: sqlite3.Connection, target: int = SCHEMA_VERSION) -> int:
    """Bring the schema to `target` (each step in its own transaction); return the version found before."""
    found = conn.execute("PRAGMA user_version").fetchone()[0]
    if found > SCHEMA_VERSION:
        raise LogError(f"the log was written by a newer sinkchat (schema {found} > {SCHEMA_VERSION})")
    for v in range(found, target):
        conn.execute("BEGIN IMMEDIATE")
        try:
            if conn.execute("PRAGMA user_version").fetchone()[0] != v:  # another process migrated meanwhile
                conn.execute("ROLLBACK")
                continue
            for stmt in MIGRATIONS[v].split(";"):
                if stmt.strip():
                    conn.execute(stmt)
            conn.execute(f"PRAGMA user_version = {v + 1}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    return found


def connect(path: Path | str | None = None, create: bool = True) -> sqlite3.Connection:
    """Open (and migrate) the log database with WAL, a long busy timeout and foreign keys on."""
    p = Path(path) if path is not None else db_path()
    if not create and not p.exists():
        raise LogError(f"no sessions logged yet ({p} does not exist)")
    if create:
        p.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(str(p), timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False)
    try:
        conn.row_factory = sqlite3.Row
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("PRAGMA foreign_keys = ON")
        migrate(conn)
    except BaseException:
        conn.close()
        raise
    return conn


def _redactor() -> Callable[[str], str]:
    """Replace values of secret-looking environment variables (API keys, tokens) wherever they appear; make the
    text storable (lone surrogates, from undecodable input bytes, become U+FFFD: SQLite takes only UTF-8)."""
    secrets = sorted({v for k, v in os.environ.items() if SECRET_NAME.search(k) and len(v) >= 8}, key=len, reverse=True)
    pat = re.compile("|".join(re.escape(s) for s in secrets)) if secrets else None
    return lambda s: utf8_safe(pat.sub("[redacted]", s) if pat is not None else s)



def _clean_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """Settings as plain JSON scalars; keys that look like secrets are dropped."""
    out: dict[str, Any] = {}
    for k, v in settings.items():
        if SECRET_NAME.search(str(k)):
            continue
        if hasattr(v, "__dataclass_fields__"):
            v = asdict(v)
        if isinstance(v, dict):
            out[str(k)] = _clean_settings(v)
        elif v is None or isinstance(v, (str, int, float, bool)):
            out[str(k)] = v
        else:
            out[str(k)] = str(v)
    return out


# ------------------------------------------------------------------------------------------------ writers
class NullLog:
    """Same methods as SessionLog, stores nothing (--no-log, or the fallback when the database is unwritable)."""

    id: int | None = None
    path: Path | None = None
    turn_count = 0
    warning: str | None = None

    def turn(self, role: str, text: str, tokens: int = 0, seconds: float = 0.0, *, reason: str | None = None,
             cache_len: int | None = None) -> int:
        self.turn_count += 1
        return self.turn_count

    def tool_call(self, name: str, args: Any, result: Any, ok: bool) -> None: ...

    def eviction(self, ev: Any) -> None: ...

    def metrics(self, data: dict[str, Any]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...

    def pointer(self) -> dict[str, Any]:
        """What a snapshot records to find its place in the transcript."""
        return {"session_id": self.id, "turns_logged": self.turn_count}

    @property
    def enabled(self) -> bool:
        return False


class SessionLog(NullLog):
    """One session's writer. Thread-safe; any database error degrades it to a NullLog after one warning."""

    def __init__(self, conn: sqlite3.Connection, session_id: int, path: Path, turn_count: int,
                 warn: Callable[[str], None] | None = None) -> None:
        self._conn: sqlite3.Connection | None = conn
        self.id, self.path, self.turn_count = session_id, path, turn_count
        self._warn = warn or log.warning
        self._lock = threading.Lock()
        self._pending: list[tuple[str, tuple[Any, ...]]] = []
        self._redact = _redactor()

    @classmethod
    def open(cls, mode: str, model: str | None, settings: dict[str, Any] | None = None, *, system: str | None = None,
             path: Path | str | None = None, warn: Callable[[str], None] | None = None) -> NullLog:
        """Start a new session; returns a NullLog (after one warning via `warn`) if the database is unusable."""
        p = Path(path) if path is not None else None
        try:
            p = p or db_path()
            conn = connect(p)
            red = _redactor()
            with _tx(conn):
                cur = conn.execute(
                    "INSERT INTO sessions (started, mode, model, settings, system) VALUES (?, ?, ?, ?, ?)",
                    (time.time(), mode, model, red(json.dumps(_clean_settings(settings or {}))),
                     red(system) if system is not None else None))
            return cls(conn, int(cur.lastrowid), p, 0, warn)
        except (sqlite3.Error, OSError, LogError) as e:
            return _fallback(f"session log disabled: cannot write {p}: {e}", warn)

    @classmethod
    def resume(cls, session_id: int, *, path: Path | str | None = None,
               warn: Callable[[str], None] | None = None) -> NullLog:
        """Append to an existing session (after --resume); marks it open again."""
        p = Path(path) if path is not None else None
        try:
            p = p or db_path()
            conn = connect(p)
            row = conn.execute("SELECT MAX(seq) FROM turns WHERE session_id = ?", (session_id,)).fetchone()
            if conn.execute("SELECT 1 FROM sessions WHERE id = ?", (session_id,)).fetchone() is None:
                conn.close()
                raise LogError(f"no session {session_id} in {p}")
            with _tx(conn):
                conn.execute("UPDATE sessions SET ended = NULL WHERE id = ?", (session_id,))
            return cls(conn, session_id, p, int(row[0] or 0), warn)
        except (sqlite3.Error, OSError) as e:
            return _fallback(f"session log disabled: cannot write {p}: {e}", warn)

    @property
    def enabled(self) -> bool:
        return self._conn is not None

    def _write(self, fn: Callable[[sqlite3.Connection], None]) -> bool:
        with self._lock:
            if self._conn is None:
                return False
            try:
                with _tx(self._conn):
                    self._flush_pending(self._conn)
                    fn(self._conn)
                return True
            except (sqlite3.Error, OSError) as e:
                self._disable(f"session log stopped (continuing without it): {e}")
                return False

    def _flush_pending(self, conn: sqlite3.Connection) -> None:
        for sql, args in self._pending:
            conn.execute(sql, args)
        self._pending.clear()

    def _disable(self, msg: str) -> None:
        self.warning = msg
        self._warn(msg)
        try:
            self._conn.close()  # type: ignore[union-attr]
        except sqlite3.Error:
            pass
        self._conn = None

    def turn(self, role: str, text: str, tokens: int = 0, seconds: float = 0.0, *, reason: str | None = None,
             cache_len: int | None = None) -> int:
        """Log one completed turn in its own transaction (with any buffered evictions/metrics); returns its seq."""
        seq = self.turn_count + 1
        row = (self.id, seq, role, self._redact(text), int(tokens), float(seconds), time.time(), reason, cache_len)
        self._write(lambda c: c.execute(
            "INSERT INTO turns (session_id, seq, role, text, tokens, seconds, created, reason, cache_len) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", row))
        self.turn_count = seq
        return seq

    def tool_call(self, name: str, args: Any, result: Any, ok: bool) -> None:
        """A tool call and its result, written at once (tools have side effects worth a durable record)."""
        a = args if isinstance(args, str) else json.dumps(args, default=str)
        r = None if result is None else result if isinstance(result, str) else json.dumps(result, default=str)
        row = (self.id, self.turn_count, name, self._redact(a), None if r is None else self._redact(r), int(bool(ok)),
               time.time())
        self._write(lambda c: c.execute(
            "INSERT INTO tool_calls (session_id, turn_seq, name, args, result, ok, created) VALUES (?, ?, ?, ?, ?, ?, ?)",
            row))

    def _buffer(self, sql: str, args: tuple[Any, ...]) -> None:
        with self._lock:
            if self._conn is None:
                return
            self._pending.append((sql, args))
            full = len(self._pending) >= FLUSH_EVERY
        if full:
            self.flush()

    def eviction(self, ev: Any) -> None:
        """An EvictionEvent (buffered until the next turn)."""
        self._buffer("INSERT INTO evictions (session_id, created, count, first, last, preview, policy, cache_len) "
                     "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                     (self.id, time.time(), int(ev.count), int(ev.first), int(ev.last),
                      self._redact(str(getattr(ev, "preview", ""))), getattr(ev, "policy", None),
                      getattr(ev, "cache_len", None)))

    def metrics(self, data: dict[str, Any]) -> None:
        """A metrics sample (any JSON-able dict; buffered until the next turn)."""
        self._buffer("INSERT INTO metrics (session_id, created, data) VALUES (?, ?, ?)",
                     (self.id, time.time(), json.dumps(data, default=str)))

    def flush(self) -> None:
        self._write(lambda c: None)

    def close(self) -> None:
        """Write what is buffered, mark the session ended. Idempotent."""
        now = time.time()
        self._write(lambda c: c.execute("UPDATE sessions SET ended = ? WHERE id = ?", (now, self.id)))
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def _fallback(msg: str, warn: Callable[[str], None] | None) -> NullLog:
    (warn or log.warning)(msg)
    null = NullLog()
    null.warning = msg
    return null


@contextlib.contextmanager
def _tx(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """BEGIN IMMEDIATE ... COMMIT (rollback on error): the write lock is taken up front, so waits use busy_timeout."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


# ------------------------------------------------------------------------------------------------ queries
_SESSION_SQL = ("SELECT s.*, (SELECT COUNT(*) FROM turns t WHERE t.session_id = s.id) AS n_turns, "
                "(SELECT COALESCE(SUM(tokens), 0) FROM turns t WHERE t.session_id = s.id) AS n_tokens FROM sessions s")


def _info(r: sqlite3.Row) -> SessionInfo:
    return SessionInfo(r["id"], r["started"], r["ended"], r["mode"], r["model"], json.loads(r["settings"] or "{}"),
                       r["system"], r["n_turns"], r["n_tokens"])


def _reader(path: Path | str | None) -> sqlite3.Connection:
    try:
        return connect(path, create=False)
    except sqlite3.Error as e:
        raise LogError(f"cannot read the session log: {e}") from None


def list_sessions(mode: str | None = None, limit: int = 50, path: Path | str | None = None) -> list[SessionInfo]:
    """Newest first."""
    with contextlib.closing(_reader(path)) as c:
        where, args = ("WHERE s.mode = ?", (mode,)) if mode else ("", ())
        rows = c.execute(f"{_SESSION_SQL} {where} ORDER BY s.id DESC LIMIT ?", (*args, limit)).fetchall()
    return [_info(r) for r in rows]


def get_session(session_id: int, path: Path | str | None = None) -> SessionInfo:
    with contextlib.closing(_reader(path)) as c:
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
    with contextlib.closing(_reader(path)) as c:
        rows = c.execute("SELECT seq, role, text, tokens, seconds, created, reason, cache_len FROM turns "
                         "WHERE session_id = ? ORDER BY seq", (session_id,)).fetchall()
    return [Turn(*r) for r in rows]


def export(session_id: int, path: Path | str | None = None) -> dict[str, Any]:
    """Everything logged for a session as one JSON-able dict."""
    info = get_session(session_id, path)
    with contextlib.closing(_reader(path)) as c:
        def rows(table: str) -> list[dict[str, Any]]:
            q = f"SELECT * FROM {table} WHERE session_id = ? ORDER BY id"
            return [{k: r[k] for k in r.keys() if k not in ("id", "session_id")} for r in c.execute(q, (session_id,))]
        tools, evs, mets = rows("tool_calls"), rows("evictions"), rows("metrics")
    for m in mets:
        m["data"] = json.loads(m["data"])
    return {"session": asdict(info), "turns": [asdict(t) for t in turns(session_id, path)], "tool_calls": tools,
            "evictions": evs, "metrics": mets}


def delete_session(session_id: int, path: Path | str | None = None) -> None:
    get_session(session_id, path)
    with contextlib.closing(_reader(path)) as c, _tx(c):
        for table in ("turns", "tool_calls", "evictions", "metrics"):
            c.execute(f"DELETE FROM {table} WHERE session_id = ?", (session_id,))
        c.execute("DELETE FROM sessions WHERE id = ?", (session_id,))
    snap = auto_snapshot_path(session_id, Path(path).parent if path is not None else None)
    snap.unlink(missing_ok=True)
