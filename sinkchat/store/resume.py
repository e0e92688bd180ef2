"""Automatic snapshots (`--snapshot-every N`) and resuming a logged session after a crash (`chat --resume`).

A session is brought back from its automatic snapshot plus the turns logged after it, or, without a usable snapshot,
rebuilt by re-feeding the newest logged turns that fit the cache. Built on `snapshot` (the file format) and
`transcript` (the log's turns).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from sinkchat.store.logdb import auto_snapshot_path
from sinkchat.store.sessionlog import NullLog
from sinkchat.store.snapshot import SnapshotError, load_snapshot, save_snapshot, snapshot_info
from sinkchat.store.transcript import LogEvent, Turn, events, get_session, turns

log = logging.getLogger(__name__)

REPLAY_ROLES = ("user", "assistant", "tool", "system")

__all__ = ["AutoSnapshot", "ResumeResult", "resume_session", "auto_snapshot_path"]


class AutoSnapshot:
    """`--snapshot-every N`: call `after_turn(engine, log)` after each completed exchange (reply logged); every Nth
    call rewrites the session's automatic snapshot. A failed write warns once and never stops the session. `extra`
    (JSON-able, the client's own figures) is stored beside the log pointer and comes back in `ResumeResult.extra`."""

    def __init__(self, every: int, warn: Callable[[str], None] | None = None) -> None:
        self.every, self._warn, self._warned, self.calls = every, warn or log.warning, False, 0

    def after_turn(self, engine: Any, session_log: NullLog, extra: dict[str, Any] | None = None) -> Path | None:
        self.calls += 1
        if self.every <= 0 or self.calls % self.every:
            return None
        return self.save(engine, session_log, extra)

    def save(self, engine: Any, session_log: NullLog, extra: dict[str, Any] | None = None) -> Path | None:
        """Write the automatic snapshot now (also useful on a clean exit)."""
        if session_log.id is None:
            return None
        home = session_log.path.parent if session_log.path is not None else None
        try:
            p = save_snapshot(engine, auto_snapshot_path(session_log.id, home), {**(extra or {}),
                                                                                  **session_log.pointer()})
        except SnapshotError as e:
            if not self._warned:
                self._warned = True
                self._warn(f"automatic snapshot failed (continuing): {e}")
            return None
        return p


@dataclass
class ResumeResult:
    """How a session was resumed: method 'snapshot' (auto snapshot + any turns logged after it were re-fed),
    'rebuild' (newest turns re-fed), or 'empty'. `pending` is a last user message that never got a reply (the
    crash hit mid-reply): it is NOT in the cache; the client may send it again with engine.chat (already logged).
    `extra`: what the loaded snapshot's client stored with it (empty unless method is 'snapshot')."""

    method: str
    session_id: int
    turns_replayed: int = 0
    turns_total: int = 0
    pending: str | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        what = {"snapshot": "restored from its automatic snapshot", "rebuild": "rebuilt the cache from the transcript",
                "empty": "nothing logged yet"}[self.method]
        s = f"session {self.session_id}: {what}"
        if self.method != "empty":
            s += f", {self.turns_replayed} of {self.turns_total} turns re-fed"
        return s + (f" ({self.note})" if self.note else "")


def resume_session(engine: Any, session_log: NullLog | None, session_id: int | None = None, *,
                   path: str | os.PathLike[str] | None = None,
                   on_event: Callable[[Any], None] | None = None) -> ResumeResult:
    """Bring `engine` back to where session `session_id` (default: session_log.id) stopped.

    With an automatic snapshot: load it, then re-feed the turns logged after it. Without one (or if it is refused):
    clear the engine and re-feed the newest turns that fit the window, in order, after the session's system prompt
    (so the sinks are the system prompt again). `on_event` gets every engine event of the re-feeding (evictions
    included), so a client can count them like its own."""
    sid = session_id if session_id is not None else getattr(session_log, "id", None)
    if sid is None:
        raise SnapshotError("no session to resume")
    db = Path(path) if path is not None else getattr(session_log, "path", None)
    try:
        info, log_turns, log_events = get_session(sid, db), turns(sid, db), events(sid, db)
    except Exception as e:  # LogError / sqlite3.Error: the log is the user's, say it in one line
        raise SnapshotError(f"cannot resume session {sid}: {e}") from None
    reset = last_reset(log_events)  # turns up to it were cleared (or replaced by a load): never re-feed them
    log_turns = [t for t in log_turns if t.role in REPLAY_ROLES and t.seq > reset]
    snap, note = auto_snapshot_path(sid, db.parent if db is not None else None), ""
    if snap.is_file():
        try:
            if snapshot_info(snap).get("extra", {}).get("session_id") not in (None, sid):
                raise SnapshotError(f"{snap} belongs to another session")
            # automatic snapshots are taken right after a turn is logged, before a command can follow it
            if reset and int(snapshot_info(snap).get("extra", {}).get("turns_logged", 0)) <= reset:
                raise SnapshotError("it was taken before the session's last /clear or /load")
            head = load_snapshot(engine, snap)
            after = int(head.get("extra", {}).get("turns_logged", 0))
            rest = [t for t in log_turns if t.seq > after]
            fed, pending = _replay(engine, rest, on_event)
            return ResumeResult("snapshot", sid, fed, len(log_turns), pending, extra=dict(head.get("extra") or {}))
        except SnapshotError as e:
            note = f"automatic snapshot refused: {e}"
            log.warning("%s; rebuilding from the transcript", note)
    if not log_turns:
        return ResumeResult("empty", sid, note=note)
    engine.clear()
    if info.system is not None:
        engine.conv.system = info.system
    chosen = _newest_that_fit(engine, log_turns)
    fed, pending = _replay(engine, chosen, on_event)
    return ResumeResult("rebuild", sid, fed, len(log_turns), pending, note)


RESET_COMMANDS = ("/clear", "/load", "--load")  # logged 'command' events after which the earlier turns are gone


def last_reset(log_events: list[LogEvent]) -> int:
    """The turn number after which the session's last /clear or /load happened (0: none): what the cache held
    before it is not the session's state any more."""
    seqs = [e.turn_seq for e in log_events if e.kind == "command" and e.text.split()[:1] and
            e.text.split()[0] in RESET_COMMANDS]
    return max(seqs, default=0)


def _newest_that_fit(engine: Any, items: list[Turn]) -> list[Turn]:
    """The longest suffix of whole turns that fits the cache (minus the system prompt and room for a reply),
    starting at a non-assistant turn so the replay opens with a prompt, not half an exchange."""
    c = engine.cache_cfg
    system = len(engine.encode(engine.conv.system)) + 8 if engine.conv.system else 0
    budget = c.capacity - max(system, c.n_sink) - min(engine.sampling.max_tokens, c.capacity // 4)
    used, start = 0, len(items)
    for i in range(len(items) - 1, -1, -1):
        used += len(engine.encode(items[i].text)) + 8  # + template tokens (role header, end marker)
        if used > budget:
            break
        start = i
    while start < len(items) and items[start].role == "assistant":
        start += 1
    return items[start:]


def _replay(engine: Any, items: list[Turn], on_event: Callable[[Any], None] | None = None) -> tuple[int, str | None]:
    """Feed logged turns as the live session did: prompts through the chat template, replies as generated text;
    every engine event goes to `on_event`. A trailing prompt without a reply is returned as pending, not fed."""
    pending = None
    if items and items[-1].role != "assistant":
        pending, items = items[-1].text, items[:-1]
    for i, t in enumerate(items):
        if t.role == "assistant":
            events = engine.feed(t.text)
        else:
            nxt_is_reply = i + 1 < len(items) and items[i + 1].role == "assistant"
            events = engine.add_message(t.role, t.text, add_generation_prompt=nxt_is_reply)
        for ev in events:
            if on_event is not None:
                on_event(ev)
        if t.role == "assistant":
            engine.conv.add_reply(t.text)
    return len(items), pending
