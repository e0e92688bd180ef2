"""Writing the session log: one `SessionLog` per chat / agent / summarize / soak / serve session, or a `NullLog`.

The log stores only what the user typed, what the model (or a tool) produced, and settings. Each turn is one
transaction (durable on return); evictions and metrics are buffered and written in the next turn's transaction
(they are frequent and cheap to lose). If the database cannot be written (disk full, read-only dir) the session
warns once and carries on without a log rather than crash.

The session's token total (`sessions.tokens`: what the model processed, fed and generated, between turns too) comes
from a counter the opener passes (`apps/runlog.ForwardTally`); every write stores its current value, so a running
or crashed session shows what it had processed by its last write.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable

from sinkchat.store import procs
from sinkchat.store.nulllog import NullLog  # (also `sessionlog.NullLog`, as before)
from sinkchat.store.logdb import LogError, clean_settings, connect, db_path, redactor, transaction

log = logging.getLogger(__name__)

FLUSH_EVERY = 256  # buffered evictions/metrics rows before a forced write
MODES = ("chat", "agent", "summarize", "soak", "serve")  # the modes sessions are logged with (`logs --mode`)


class SessionLog(NullLog):
    """One session's writer. Thread-safe; any database error degrades it to a NullLog after one warning."""

    def __init__(self, conn: sqlite3.Connection, session_id: int, path: Path, turn_count: int,
                 warn: Callable[[str], None] | None = None, tokens: Callable[[], int] | None = None,
                 tokens_before: int = 0) -> None:
        self._conn: sqlite3.Connection | None = conn
        self.id, self.path, self.turn_count = session_id, path, turn_count
        self._warn = warn or log.warning
        self._lock = threading.Lock()
        self._pending: list[tuple[str, tuple[Any, ...]]] = []
        self._redact = redactor()
        self._tokens, self._tokens_before = tokens, tokens_before  # counter since opened; the total before that
        self._tokens_stored: int | None = None

    @classmethod
    def open(cls, mode: str, model: str | None, settings: dict[str, Any] | None = None, *, system: str | None = None,
             path: Path | str | None = None, warn: Callable[[str], None] | None = None,
             tokens: Callable[[], int] | None = None) -> NullLog:
        """Start a new session; returns a NullLog (after one warning via `warn`) if the database is unusable.
        `tokens`: the tokens the model has processed since the session opened (None: not counted, and `logs`
        shows the tokens of the turns instead)."""
        p = Path(path) if path is not None else None
        try:
            p = p or db_path()
            conn = connect(p)
            red, me = redactor(), procs.current()
            with transaction(conn):
                cur = conn.execute(
                    "INSERT INTO sessions (started, mode, model, settings, system, pid, pid_started, host, tokens) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (time.time(), mode, model, red(json.dumps(clean_settings(settings or {}))),
                     red(system) if system is not None else None, me.pid, me.started, me.host,
                     0 if tokens is not None else None))
            return cls(conn, int(cur.lastrowid), p, 0, warn, tokens)
        except (sqlite3.Error, OSError, LogError) as e:
            return _fallback(f"session log disabled: cannot write {p}: {e}", warn)

    @classmethod
    def resume(cls, session_id: int, *, path: Path | str | None = None, warn: Callable[[str], None] | None = None,
               tokens: Callable[[], int] | None = None, tokens_before: int | None = None,
               drop_after: float | None = None) -> NullLog:
        """Append to an existing session (after --resume); marks it open again, held by this process. The tokens
        counted from now on add to the session's total (for an older session, to the tokens of its turns), or to
        `tokens_before` (a soak resumed from a checkpoint: the work after it, done again, is not counted twice).
        `drop_after` (a soak's checkpoint, wall-clock seconds): what was logged after it is deleted first, since
        the resumed run does it again (its turns would show twice); `dropped` then says how many turns went."""
        p = Path(path) if path is not None else None
        try:
            p = p or db_path()
            conn = connect(p)
            held = conn.execute("SELECT tokens FROM sessions WHERE id = ?", (session_id,)).fetchone()
            if held is None:
                conn.close()
                raise LogError(f"no session {session_id} in {p}")
            me = procs.current()
            with transaction(conn):
                dropped = _drop_after(conn, session_id, drop_after) if drop_after is not None else 0
                conn.execute("UPDATE sessions SET ended = NULL, pid = ?, pid_started = ?, host = ? WHERE id = ?",
                             (me.pid, me.started, me.host, session_id))
            row = conn.execute("SELECT MAX(seq), COALESCE(SUM(tokens), 0) FROM turns WHERE session_id = ?",
                               (session_id,)).fetchone()
            before = int(held[0] if held[0] is not None else row[1]) if tokens_before is None else tokens_before
            out = cls(conn, session_id, p, int(row[0] or 0), warn, tokens, before)
            out.resumed, out.dropped = True, dropped
            return out
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
                with transaction(self._conn):
                    self._flush_pending(self._conn)
                    fn(self._conn)
                    self._store_tokens(self._conn)
                return True
            except (sqlite3.Error, OSError) as e:
                self._disable(f"session log stopped (continuing without it): {e}")
                return False

    def _store_tokens(self, conn: sqlite3.Connection) -> None:
        """The session's token total as of now, in the transaction of whatever is written (when it changed)."""
        if self._tokens is None:
            return
        n = self._tokens_before + int(self._tokens())
        if n != self._tokens_stored:
            conn.execute("UPDATE sessions SET tokens = ? WHERE id = ?", (n, self.id))
            self._tokens_stored = n

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

    def event(self, kind: str, text: str, detail: str | None = None, tokens: int = 0) -> None:
        """Something that changed the session without being a turn: a slash command (/system, /clear, /load,
        /policy, ...) or the agent's error feedback to the model. Placed after the last turn logged, so `logs show`
        tells the story in order; written at once (rare, and what the turns after it mean depends on it)."""
        row = (self.id, self.turn_count, kind, self._redact(text), None if detail is None else self._redact(detail),
               int(tokens), time.time())
        self._write(lambda c: c.execute(
            "INSERT INTO events (session_id, turn_seq, kind, text, detail, tokens, created) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)", row))

    def set_system(self, text: str | None) -> None:
        """The system prompt the conversation now starts with (set before anything was fed): what a resume that
        rebuilds the cache from the turns feeds first."""
        value = None if text is None else self._redact(text)
        self._write(lambda c: c.execute("UPDATE sessions SET system = ? WHERE id = ?", (value, self.id)))

    def _buffer(self, sql: str, args: tuple[Any, ...]) -> None:
        with self._lock:
            if self._conn is None:
                return
            self._pending.append((sql, args))
            full = len(self._pending) >= FLUSH_EVERY
        if full:
            self.flush()

    def eviction(self, ev: Any) -> None:
        """An EvictionEvent (buffered until the next turn), placed after the last turn logged, as an event is:
        `logs show` lists it there, in order among the turns. A recall memory's ForgottenEvent goes in the same
        table, its policy column "forgotten:<reason>"."""
        self._buffer("INSERT INTO evictions (session_id, created, count, first, last, preview, policy, cache_len, "
                     "turn_seq) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                     (self.id, time.time(), int(ev.count), int(ev.first), int(ev.last),
                      self._redact(str(getattr(ev, "preview", ""))), _policy(ev),
                      getattr(ev, "cache_len", None), self.turn_count))

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


def _policy(ev: object) -> str | None:
    """The policy column of an eviction row: the policy that evicted, or "forgotten:<reason>" for tokens the
    recall memory let go (a ForgottenEvent has a reason, no policy)."""
    policy = getattr(ev, "policy", None)
    return policy if policy is not None else "forgotten:" + str(getattr(ev, "reason", ""))


def _drop_after(conn: sqlite3.Connection, session_id: int, when: float) -> int:
    """Delete the session's rows logged after `when` (turns, tool calls, events, evictions, metrics); the number
    of turns deleted."""
    n = conn.execute("DELETE FROM turns WHERE session_id = ? AND created > ?", (session_id, when)).rowcount
    for table in ("tool_calls", "events", "evictions", "metrics"):  # fixed names, not input
        conn.execute(f"DELETE FROM {table} WHERE session_id = ? AND created > ?", (session_id, when))  # noqa: S608
    return int(n)
