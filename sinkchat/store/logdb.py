"""The session log's SQLite file: schema and migrations, opening a connection, transactions, and what is never
stored (secrets).

Why SQLite: a night-long session must survive a crash or kill -9 with every completed turn on disk, and several
sinkchat processes may log at once. WAL mode lets readers and one writer work together; `BEGIN IMMEDIATE` takes the
write lock up front so `busy_timeout` (not an instant "database is locked") governs contention; each turn is one
transaction with `synchronous=FULL`, so a committed turn survives even a power cut. Values of environment variables
that look like secrets are redacted from anything written. No torch import here.

The writers are in `sessionlog`, the queries (and `sinkchat logs`' data) in `transcript`.
"""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterator

from sinkchat.errors import UserError
from sinkchat.private import private_dir, private_file
from sinkchat.textutil import utf8_safe

SCHEMA_VERSION = 4
BUSY_TIMEOUT_MS = 30_000
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
    # 2 -> 3: who holds a session open (pid, its start time, host: `logs` tells running from crashed); events
    # that change the session without being a turn (slash commands, the agent's error feedback), placed after
    # turn `turn_seq` (0 = before the first)
    """
    ALTER TABLE sessions ADD COLUMN pid INTEGER;
    ALTER TABLE sessions ADD COLUMN pid_started REAL;
    ALTER TABLE sessions ADD COLUMN host TEXT;
    CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT,
        session_id INTEGER NOT NULL REFERENCES sessions(id) ON DELETE CASCADE, turn_seq INTEGER NOT NULL,
        kind TEXT NOT NULL, text TEXT NOT NULL, detail TEXT, tokens INTEGER NOT NULL DEFAULT 0, created REAL NOT NULL);
    CREATE INDEX events_session ON events(session_id, turn_seq);
    """,
    # 3 -> 4: the tokens the model processed in the session (fed and generated, between turns too: tool results,
    # summarize's log lines), kept up to date with every write, NULL for a session logged before it was counted;
    # the turn each eviction came after, as for events (NULL in older rows: placed by their time)
    """
    ALTER TABLE sessions ADD COLUMN tokens INTEGER;
    ALTER TABLE evictions ADD COLUMN turn_seq INTEGER;
    """,
]


class LogError(UserError, RuntimeError):
    """The log cannot be read (missing, newer schema, unknown session); the CLI prints it as one line."""


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
    if create:  # the user's conversations: 0600 (SQLite gives the -wal and -shm files the database's mode)
        private_file(private_dir(p.parent) / p.name)
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


def redactor() -> Callable[[str], str]:
    """Replace values of secret-looking environment variables (API keys, tokens) wherever they appear; make the
    text storable (lone surrogates, from undecodable input bytes, become U+FFFD: SQLite takes only UTF-8)."""
    secrets = sorted({v for k, v in os.environ.items() if SECRET_NAME.search(k) and len(v) >= 8}, key=len, reverse=True)
    pat = re.compile("|".join(re.escape(s) for s in secrets)) if secrets else None
    return lambda s: utf8_safe(pat.sub("[redacted]", s) if pat is not None else s)


def clean_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """Settings as plain JSON scalars; keys that look like secrets are dropped."""
    out: dict[str, Any] = {}
    for k, v in settings.items():
        if SECRET_NAME.search(str(k)):
            continue
        if hasattr(v, "__dataclass_fields__"):
            v = asdict(v)
        if isinstance(v, dict):
            out[str(k)] = clean_settings(v)
        elif v is None or isinstance(v, (str, int, float, bool)):
            out[str(k)] = v
        else:
            out[str(k)] = str(v)
    return out


@contextlib.contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """BEGIN IMMEDIATE ... COMMIT (rollback on error): the write lock is taken up front, so waits use busy_timeout."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def open_reader(path: Path | str | None) -> sqlite3.Connection:
    """A connection for queries: never creates the file (LogError if there is no log yet)."""
    try:
        return connect(path, create=False)
    except sqlite3.Error as e:
        raise LogError(f"cannot read the session log: {e}") from None
