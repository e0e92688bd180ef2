"""Sessions that never end: one sink cache per `X-Session-Id`, swapped in and out of the one Engine.

A session is an `api.EngineState` (its own cache buffers, ledger, template state) plus what the client has sent and
been answered (`history`, normalized `Msg`s) and `marks`: the cache length after each message, so a request that
diverges from the history can go back to the common prefix while its tokens are still in the cache (a truncation;
when older tokens were evicted since, the prefix's last token is fed again: `rollback`). Every session is written through to its snapshot file (`<store>/<id>.safetensors`, the chat REPL's
snapshot format, with the history and the marks in its `extra`) after each request, so:

- at most `max_ram` sessions stay in RAM; the least recently used one is simply dropped and reloaded on demand;
- a server restarted, or killed -9 and restarted, continues each session exactly (the file is replaced atomically);
- a second server on the same store continues a session the first served: before a request, a file newer than
  what this server last wrote or read is loaded again (run several behind a router with session affinity, so two
  servers never write one session at the same time).

All of it runs on the one generation thread (app.py), never concurrently.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from sinkchat.api import EngineState, capture, fresh_state, install, release
from sinkchat.apps.serve.requests import ApiError, Msg
from sinkchat.memory import folders

log = logging.getLogger(__name__)

SESSION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
EXTRA_KEY = "serve"


@dataclass
class Mark:
    """The engine's conversation right after message i of the history was fed (i = 0: nothing fed)."""

    cache_len: int
    evicted: int
    seen: int
    messages: list[dict[str, str]]
    fed: str
    last_logits: Any
    reply_turn: bool


@dataclass
class ServeSession:
    sid: str | None  # None: a stateless request's throwaway session
    state: EngineState
    key: str = ""  # hash of the system prompt + tools the history was started with
    history: list[Msg] = field(default_factory=list)
    marks: dict[int, Mark] = field(default_factory=dict)
    evictions: int = 0
    gauge: float | None = None  # the share of attention on the sinks at the latest measurement (a reply's)
    recalled: float | None = None  # ... and on the recalled memory blocks (None: memory off or not measured)
    requests: int = 0
    mtime: int = 0  # of the snapshot file as last written or read here
    log: Any = None  # the session's SessionLog (or NullLog)
    log_id: int | None = None


def conversation_key(system: str | None, tools: list[dict[str, Any]]) -> str:
    import json

    return hashlib.sha256(json.dumps([system, tools], sort_keys=True).encode()).hexdigest()[:24]


def mark(engine: Any) -> Mark:
    led, conv = engine.ledger, engine.conv
    return Mark(engine.cache.length, led.evicted, led.seen, [dict(m) for m in conv.messages], conv.fed,
                engine.last_logits, engine.reply_turn)


def refeed_slot(engine: Any, m: Mark) -> int | None:
    """Where `m`'s last token sits in the cache when something was evicted since `m` but not it nor anything fed
    after it (None: gone, or in the pinned prefix)."""
    led = engine.ledger
    at = len(led.abs_index) - (led.seen - m.seen) - 1
    ok = m.seen > 0 and at >= engine.pinned_slots() and led.abs_index[at] == m.seen - 1
    return at if ok else None


def reachable(engine: Any, m: Mark) -> bool:
    """Whether `rollback` can go back to `m`."""
    return m.evicted == engine.ledger.evicted or refeed_slot(engine, m) is not None


def rollback(engine: Any, m: Mark) -> bool:
    """Back to `m`: exactly when nothing was evicted since. When something was (once the cache is full a reply's
    first token evicts the oldest tokens, so regenerating or editing the last turn was a 409 from turn 4 on), the
    tokens fed after `m` are taken off the end and `m`'s last token is fed again, so the next token's logits are
    this cache's own (the evicted tokens stay evicted). False where it cannot (the cache cannot drop its tail, or
    tokens fed after `m` were evicted)."""
    eng, led = engine, engine.ledger
    if led.evicted == m.evicted:
        if not eng.cache.can_truncate(m.cache_len):
            return False
        eng.cache.truncate(m.cache_len)
        led.truncate(m.cache_len)
        last = m.last_logits
    else:
        at = refeed_slot(eng, m)
        if at is None or not eng.cache.can_truncate(at):
            return False
        tok = led.ids[at]
        eng.cache.truncate(at)
        led.truncate(at)
        for _ in eng.feed_ids([tok]):
            pass
        last = eng.last_logits
    eng.conv.messages[:] = [dict(x) for x in m.messages]
    eng.conv.fed, eng.last_logits, eng.reply_turn = m.fed, last, m.reply_turn
    return True


def marks_to_json(marks: dict[int, Mark], conv: Any) -> list[dict[str, Any]]:
    """The marks for the snapshot, so that a session reloaded from disk can still go back to a common prefix. Each
    mark's template state is usually a prefix of the conversation's current one: then only its length is stored
    (the whole of it otherwise, e.g. after the template bookkeeping trimmed old messages). No logits: a mark
    reloaded is only gone back to with a message to feed after it (runner._sync)."""
    out = []
    for i, m in sorted(marks.items()):
        msgs: Any = len(m.messages) if conv.messages[:len(m.messages)] == m.messages else m.messages
        fed: Any = len(m.fed) if conv.fed.startswith(m.fed) else m.fed
        out.append({"i": i, "cache_len": m.cache_len, "evicted": m.evicted, "seen": m.seen, "messages": msgs,
                    "fed": fed, "reply_turn": m.reply_turn})
    return out


def marks_from_json(items: list[dict[str, Any]], conv: Any) -> dict[int, Mark]:
    marks = {}
    for d in items:
        msgs, fed = d["messages"], d["fed"]
        marks[int(d["i"])] = Mark(int(d["cache_len"]), int(d["evicted"]), int(d["seen"]),
                                  [dict(x) for x in (conv.messages[:msgs] if isinstance(msgs, int) else msgs)],
                                  conv.fed[:fed] if isinstance(fed, int) else str(fed), None, bool(d["reply_turn"]))
    return marks


def msg_to_json(m: Msg) -> dict[str, Any]:
    return {"role": m.role, "text": m.text, "calls": [list(c) for c in m.calls], "call_id": m.call_id}


def msg_from_json(d: dict[str, Any]) -> Msg:
    return Msg(str(d["role"]), str(d["text"]), tuple((str(a), str(b)) for a, b in d.get("calls", [])),
               d.get("call_id"))


class SessionStore:
    """The sessions this server holds, least recently used first, and the engine's one active conversation."""

    def __init__(self, engine: Any, root: Path, max_ram: int = 8, open_log: Any = None) -> None:
        self.engine, self.root, self.max_ram = engine, root, max(1, max_ram)
        self.ram: OrderedDict[str, ServeSession] = OrderedDict()
        self.active: ServeSession | None = None
        self.idle = capture(engine)  # the engine's own (empty) conversation, installed when no session is active
        self.open_log = open_log  # (sid) -> SessionLog for a new session; None: no logging

    def path(self, sid: str) -> Path:
        return self.root / f"{sid}.safetensors"

    def activate(self, sid: str | None, system: str | None) -> ServeSession:
        """The session `sid` installed in the engine (loaded from its file, or new); sid None: a fresh throwaway
        one. `system` is the system prompt of a new conversation."""
        if sid is not None and not SESSION_ID.match(sid):
            raise ApiError(400, "X-Session-Id must be 1-128 letters, digits, '.', '_', ':' or '-', starting with a "
                                "letter or digit", param="X-Session-Id", code="invalid_session_id")
        self._park()
        if hasattr(self.open_log, "switch"):  # the tokens the engine processes from now on are sid's (its log)
            self.open_log.switch(sid)
        if sid is None:
            sess = ServeSession(None, fresh_state(self.engine, system))
        else:
            sess = self._lookup(sid, system)
        install(self.engine, sess.state)
        self.active = sess
        if not sess.marks:
            sess.marks[len(sess.history)] = mark(self.engine)
        return sess

    def _park(self) -> None:
        """Capture the active conversation (its counters moved on) and put the idle one back."""
        if self.active is not None:
            self.active.state = capture(self.engine)
            if self.active.sid is None:  # a stateless request's conversation is over
                release(self.active.state)
            self.active = None
        install(self.engine, self.idle)

    def _lookup(self, sid: str, system: str | None) -> ServeSession:
        p = self.path(sid)
        sess = self.ram.get(sid)
        disk = p.stat().st_mtime_ns if p.is_file() else 0
        if sess is None or disk > sess.mtime:
            if sess is not None:  # another server wrote it since: the copy here goes
                del self.ram[sid]
                if sess.log is not None:
                    sess.log.close()
                release(sess.state)
            sess = self._load(sid, p, disk) if disk else self._new(sid, system)
            self.ram[sid] = sess
        self.ram.move_to_end(sid)
        while len(self.ram) > self.max_ram:
            old_id, old = self.ram.popitem(last=False)
            if old.log is not None:
                old.log.close()
            release(old.state)  # its memory lives on in its snapshot's folder
            log.info("session %s dropped from RAM (its snapshot stays on disk)", old_id)
        return sess

    def _new(self, sid: str, system: str | None) -> ServeSession:
        sess = ServeSession(sid, fresh_state(self.engine, system))
        if self.open_log is not None:
            sess.log = self.open_log(sid, None)
            sess.log_id = getattr(sess.log, "id", None) if getattr(sess.log, "enabled", False) else None
        return sess

    def _load(self, sid: str, p: Path, mtime: int) -> ServeSession:
        """A session from its snapshot file: the engine state, history and counters it recorded."""
        from sinkchat.store.snapshot import SnapshotError, load_snapshot

        fresh = fresh_state(self.engine, None)
        install(self.engine, fresh)
        try:
            head = load_snapshot(self.engine, p)
        except SnapshotError as e:  # was a 500 on every request to the id, for good
            install(self.engine, self.idle)
            release(fresh)
            raise unreadable(sid, e) from None
        extra = (head.get("extra") or {}).get(EXTRA_KEY) or {}
        sess = ServeSession(sid, capture(self.engine), str(extra.get("key", "")),
                            [msg_from_json(m) for m in extra.get("history", [])],
                            evictions=int(extra.get("evictions", 0)), requests=int(extra.get("requests", 0)),
                            mtime=mtime, log_id=extra.get("log_id"))
        sess.marks = marks_from_json(extra.get("marks", []), self.engine.conv)
        sess.marks[len(sess.history)] = mark(self.engine)  # the end, with the logits the snapshot kept
        install(self.engine, self.idle)
        if sess.log_id is not None and self.open_log is not None:
            sess.log = self.open_log(sid, sess.log_id)
        log.info("session %s loaded from %s (%d messages)", sid, p, len(sess.history))
        return sess

    def reset(self, sess: ServeSession, system: str | None) -> Callable[[bool], None]:
        """Start the session's conversation over (a new system prompt or tools, nothing evicted yet). Returns
        `end(keep)`: keep=True lets the old conversation go; keep=False puts it back, as it was (a request refused
        while its first messages were fed, e.g. a system prompt too large to pin, wiped the session it was sent to)."""
        old = (sess.state, sess.history, sess.marks, sess.key)
        sess.state = fresh_state(self.engine, system)
        install(self.engine, sess.state)
        sess.history, sess.marks = [], {0: mark(self.engine)}

        def end(keep: bool) -> None:
            if keep:
                release(old[0])
                return
            new = sess.state
            sess.state, sess.history, sess.marks, sess.key = old
            install(self.engine, sess.state)
            release(new)
        return end

    def save(self, sess: ServeSession) -> None:
        """Write the active session through to its snapshot file (and forget marks that can no longer be used)."""
        from sinkchat.store.snapshot import save_snapshot

        evicted = self.engine.ledger.evicted
        sess.marks = {i: m for i, m in sess.marks.items() if reachable(self.engine, m)}
        if sess.sid is None:  # a stateless request is over: its conversation (and memory) goes now
            if sess is self.active:
                self._park()
            return
        extra = {EXTRA_KEY: {"key": sess.key, "history": [msg_to_json(m) for m in sess.history],
                             "marks": marks_to_json(sess.marks, self.engine.conv),
                             "evictions": sess.evictions, "requests": sess.requests, "log_id": sess.log_id},
                 "evictions": {"tokens": int(evicted), "count": sess.evictions}}
        p = save_snapshot(self.engine, self.path(sess.sid), extra)
        sess.mtime = p.stat().st_mtime_ns

    def close(self) -> None:
        """At shutdown: close the session logs (`sinkchat logs` then lists them ended, not crashed)."""
        for sess in self.ram.values():
            if sess.log is not None:
                sess.log.close()
                sess.log = None
            if sess is not self.active:
                release(sess.state)
        if self.active is not None:
            release(capture(self.engine))

    def exists(self, sid: str) -> bool:
        """Whether session `sid` is held, in RAM or on disk."""
        return sid in self.ram or (bool(SESSION_ID.match(sid)) and self.path(sid).is_file())

    def delete(self, sid: str) -> bool:
        """DELETE /v1/sessions/{id}: the session goes from RAM and disk (its snapshot, its recall memory's folders,
        its log closed); False if there was none. Run between requests (the generation thread)."""
        if not SESSION_ID.match(sid):
            return False
        sess = self.ram.pop(sid, None)
        if sess is not None:
            if sess is self.active:
                self._park()
            if sess.log is not None:
                sess.log.close()
            release(sess.state)
        p = self.path(sid)
        on_disk = p.is_file()
        p.unlink(missing_ok=True)
        folders.prune(p, None)
        log.info("session %s deleted", sid)
        return sess is not None or on_disk

    def status(self, sid: str) -> dict[str, Any] | None:
        """GET /v1/sessions/{id}: the session's figures, from RAM or from its file's header."""
        sess = self.ram.get(sid)
        if sess is not None:
            st = capture(self.engine) if sess is self.active else sess.state
            return figures(sess, st)
        p = self.path(sid) if SESSION_ID.match(sid) else None
        if p is None or not p.is_file():
            return None
        from sinkchat.store.snapshot import SnapshotError, snapshot_info

        try:
            head = snapshot_info(p)
        except SnapshotError as e:
            raise unreadable(sid, e) from None
        extra = (head.get("extra") or {}).get(EXTRA_KEY) or {}
        led = head.get("ledger") or {}
        return {"id": sid, "object": "session", "in_ram": False, "cache_len": head.get("cache_len"),
                "capacity": (head.get("cache") or {}).get("capacity"), "evicted": led.get("evicted", 0),
                "evictions": extra.get("evictions", 0), "messages": len(extra.get("history", [])),
                "requests": extra.get("requests", 0), "seen": led.get("seen", 0)}


def unreadable(sid: str, e: Exception) -> ApiError:
    """A session whose file this server cannot load (damaged, or saved with another --cache or model): a 409 that
    says why and how to go on."""
    return ApiError(409, f"session {sid!r} cannot be loaded: {e}; DELETE /v1/sessions/{sid} removes it, or use "
                         "another X-Session-Id", type_="invalid_request_error", code="session_unreadable")


def figures(sess: ServeSession, st: EngineState) -> dict[str, Any]:
    """A session's cache fill, evictions and size, for `x_sinkchat` and GET /v1/sessions/{id}."""
    cfg = st.cache_cfg
    return {"id": sess.sid, "object": "session", "in_ram": True, "cache_len": int(st.cache.length),
            "capacity": int(cfg.capacity), "sinks": int(cfg.n_sink), "policy": cfg.policy,
            "evicted": int(st.ledger["evicted"]), "evictions": sess.evictions, "messages": len(sess.history),
            "requests": sess.requests, "seen": int(st.ledger["seen"]), "sink_share": sess.gauge,
            **({"memory": memory_figures(st.memory), "recalled_share": sess.recalled} if st.memory is not None
               else {})}


def memory_figures(memory: Any) -> dict[str, int]:
    """The session's recall memory: what it holds, what it had to forget, its bytes on disk."""
    return {"blocks": memory.blocks, "tokens": memory.tokens, "forgotten": memory.forgotten,
            "disk_bytes": memory.disk_bytes}
