"""Sessions for the chat REPL: the SQLite log, snapshots (/save NAME, /load NAME, `--load`, the automatic ones
behind `--resume`), JSON transcripts (/save FILE.json, /load FILE.json), and the eviction figures that go with them.

Kept apart from repl.py so the loop stays about chatting; everything here is a thin layer over `sinkchat.store`
(the log, snapshots, transcript files). It acts on the running loop through `ChatHost` and never imports the REPL
or the commands: imports point one way, session <- commands <- repl.

Eviction figures have one source, the loop's `Metrics` (what `render.live_stats` shows). A snapshot carries them
in its `extra` (`eviction_record`), and loading one puts them back (`restore_evictions`), so after a load the
status counts the saved stream's evictions plus the ones since, never one total beside another's events.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable

from sinkchat.apps.chat.host import ChatHost
from sinkchat.apps.memory_view import plural
from sinkchat.config import ConfigError, Settings, data_dir
from sinkchat.core.events import Event
from sinkchat.core.metrics import Metrics, human_bytes
from sinkchat.errors import UserError
from sinkchat.store.atomic import atomic_write
from sinkchat.store.transcript_file import is_transcript_file, parse_transcript, transcript_data

__all__ = ["open_log", "settings_for_load", "check_resumable", "resume_target", "do_resume", "is_transcript_file",
           "save", "load", "save_transcript", "load_transcript", "log_turn", "eviction_record", "restore_evictions"]

EVICTIONS_KEY = "evictions"  # in a snapshot's `extra`: {"tokens": N, "count": K}


# ------------------------------------------------------------------------------------------------ eviction figures
def eviction_record(metrics: Metrics) -> dict[str, Any]:
    """The loop's eviction figures, for a snapshot's `extra`: a later load shows them again."""
    return {EVICTIONS_KEY: {"tokens": metrics.evicted, "count": metrics.eviction_count}}


def restore_evictions(metrics: Metrics, extra: dict[str, Any] | None) -> bool:
    """Another stream is now in the cache: forget the old stream's eviction events and take the figures the
    snapshot recorded. False when it recorded none (an older file, or saved by another client): then the figures
    count from zero, from this load on."""
    metrics.new_stream()
    record = (extra or {}).get(EVICTIONS_KEY)
    try:
        tokens, count = int(record["tokens"]), int(record["count"])  # type: ignore[index]
    except (TypeError, KeyError, ValueError):
        return False
    metrics.evicted, metrics.eviction_count = max(0, tokens), max(0, count)
    return True


def snapshot_extra(loop: ChatHost) -> dict[str, Any]:
    """What a chat snapshot records besides the engine: its place in the session log and the eviction figures."""
    return {**loop.slog.pointer(), **eviction_record(loop.metrics)}


# ------------------------------------------------------------------------------------------------ log and resume
def open_log(engine: Any, mode: str, no_log: bool, system: str | None, warn: Callable[[str], None],
             resume_id: int | None = None) -> Any:
    """A SessionLog (or NullLog with --no-log / an unusable log dir). Only settings and text are stored. With
    --no-log, `runlog.open_log`'s NullLog without importing the writer (sqlite3, psutil: `store/nulllog.py`)."""
    if no_log:
        from sinkchat.store.nulllog import NullLog

        return NullLog()
    from sinkchat.apps.runlog import open_log as _open

    return _open(engine, mode, no_log, system, warn, resume_id)


def settings_for_load(settings: Settings, name: str) -> Settings:
    """Before loading a snapshot at start-up: build the engine with the snapshot's cache shape (else it is refused)."""
    from sinkchat.store.snapshot import snapshot_info, snapshot_path

    head = snapshot_info(snapshot_path(name))
    cc = head.get("cache") or {}
    cache = replace(settings.cache, capacity=int(cc.get("capacity", settings.cache.capacity)),
                    n_sink=int(cc.get("n_sink", settings.cache.n_sink)))
    return replace(settings, cache=cache)


def check_resumable(session_id: int) -> None:
    from sinkchat.store.logdb import LogError
    from sinkchat.store.transcript import get_session

    try:
        get_session(session_id)
    except LogError as e:
        raise ConfigError(str(e)) from None


def resume_target(arg: str) -> int:
    """--resume with no value means the newest chat session."""
    from sinkchat.store.transcript import latest_session

    if arg:
        try:
            return int(arg)
        except ValueError:
            raise ConfigError(f"--resume takes a session id (see `sinkchat logs`), not {arg!r}") from None
    info = latest_session("chat")
    if info is None:
        raise ConfigError("no chat session to resume (see `sinkchat logs`)")
    return info.id


def do_resume(loop: ChatHost, session_id: int) -> None:
    """Resume a logged session; the eviction figures are the automatic snapshot's plus those of the turns re-fed
    after it (the turns' own evictions are in the log already, so they are counted, not logged again)."""
    from sinkchat.store.resume import resume_session

    replayed: list[Event] = []
    before = loop.engine.sampling
    res = resume_session(loop.engine, loop.slog, session_id, on_event=replayed.append)
    if loop.engine.memory is not None:  # what the replay read is no reply's: the next reply's report starts here
        from sinkchat.memory.report import take_recalled

        take_recalled(loop.engine.memory)
    restore_evictions(loop.metrics, res.extra)
    for ev in replayed:
        loop.metrics.fold(ev)
    loop.r.info(f"resumed {res.describe()}")
    _sampling_after_load(loop, before)
    loop.slog.event("resume", res.describe())
    if res.pending:
        loop.r.info("re-sending the last message, which never got a reply")
        loop.turn(res.pending, log_user=False)


def log_turn(loop: ChatHost, role: str, text: str, tokens: int, done: Any = None, seconds: float = 0.0) -> None:
    """A prompt (role 'user' or 'system': `seconds` spent feeding it), a finished reply (`done`), or a reply cut by
    Ctrl-C (role 'assistant', no `done`: `seconds` spent generating it)."""
    if role != "assistant":
        loop.slog.turn(role, text, tokens, seconds)
    elif done is None:
        loop.slog.turn(role, text, tokens, seconds, reason="interrupted", cache_len=loop.engine.cache.length)
    else:
        loop.slog.turn(role, text, tokens, done.seconds, reason=done.reason, cache_len=loop.engine.cache.length)


# ------------------------------------------------------------------------------------------------ snapshots
def save(loop: ChatHost, arg: str) -> str | None:
    """/save NAME|FILE.safetensors: a full snapshot (cache, conversation, settings, eviction figures). Returns
    what was saved where (None if nothing was), for the session log."""
    from sinkchat.store.snapshot import SnapshotError, save_snapshot, snapshot_path

    try:
        target = snapshot_path(arg)
        if not target.parent.is_dir() and target.parent != data_dir() / "snapshots":
            raise SnapshotError(f"cannot write {target}: folder {target.parent} does not exist")
        path = save_snapshot(loop.engine, target, snapshot_extra(loop))
    except (SnapshotError, OSError) as e:
        loop.r.error(f"/save: {e}")
        return None
    held = plural(loop.engine.cache.length, "token") + " in cache"
    mem = loop.engine.memory
    if mem is not None and mem.tokens:  # saved beside it, in its own folder
        held += f", the recall memory's {plural(mem.blocks, 'block')} ({plural(mem.tokens, 'token')}) beside it"
    loop.r.info(f"saved snapshot ({held}) to {path}; /load {arg} restores it")
    return f"saved snapshot ({held}) to {path}"


def load(loop: ChatHost, arg: str, strict: bool = False) -> str | None:
    """/load NAME|FILE: a snapshot; the next reply is what the saved session would have said. `strict` (for --load)
    raises instead of reporting, so a bad start-up snapshot ends the program with a one-line error. Returns what
    was loaded (None if nothing was), for the session log."""
    from sinkchat.store.snapshot import SnapshotError, load_snapshot, snapshot_path

    before, before_sampling = loop.engine.cache_cfg, loop.engine.sampling
    held = loop.engine.memory.tokens if loop.engine.memory is not None else 0
    try:
        head = load_snapshot(loop.engine, snapshot_path(arg))
    except SnapshotError as e:
        if strict:
            raise
        loop.r.error(f"/load: {e}")
        return None
    eng, m = loop.engine, loop.metrics
    # the blocks the last reply read were this conversation's: /recall showed the loaded store's blocks under
    # their ids (another conversation's text, with these ranges and ages)
    loop.last_recalled = []
    loop.metrics.gauge = None
    known = restore_evictions(m, head.get("extra"))
    figures = (f"; {plural(m.evicted, 'token')} evicted in {plural(m.eviction_count, 'eviction')} before it"
               if known
               else "; it records no eviction figures, so evictions count from here")
    if held:
        figures += f"; the recall memory's {plural(held, 'token')} of the conversation before it were let go"
    what = (f"loaded snapshot {head.get('path', arg)}: {plural(len(eng.conv.messages), 'message')}, "
            f"{eng.cache.length}/{eng.cache_cfg.capacity} tokens in cache")
    loop.r.info(what + figures)
    after = eng.cache_cfg
    changed = [f"{k} {getattr(before, k)} -> {getattr(after, k)}" for k in ("policy", "n_sink", "capacity", "evict_chunk")
               if getattr(before, k) != getattr(after, k)]
    if changed:
        loop.r.info(f"the snapshot's cache settings apply (its KV cache was built with them): {', '.join(changed)}",
                    style="dim")
    _sampling_after_load(loop, before_sampling)
    return what


SAMPLING_FLAGS = {"temperature": "--temperature", "max_tokens": "--max-tokens", "top_p": "--top-p",
                  "top_k": "--top-k", "repetition_penalty": "--repetition-penalty"}  # not --seed: the RNG's state is


def sampling_flags(opts: dict[str, Any]) -> dict[str, Any]:
    """The sampling settings typed for this run (flags, not the environment or defaults): a loaded snapshot's own
    do not replace them."""
    return {k: opts[k] for k in SAMPLING_FLAGS if opts.get(k) is not None}


def _sampling_after_load(loop: ChatHost, before: Any) -> None:
    """A snapshot brings its sampling settings (the next reply is the one the saved session would have given), but
    a flag typed for this run wins (`--max-tokens 16` then `--load` cut replies at the snapshot's 12); both said."""
    eng = loop.engine
    saved = eng.sampling
    eng.sampling = replace(saved, **loop.sampling_flags)
    kept = [f"{SAMPLING_FLAGS[k]} {v} (the snapshot's {getattr(saved, k)})"
            for k, v in loop.sampling_flags.items() if getattr(saved, k) != v]
    took = [f"{k} {getattr(before, k)} -> {getattr(saved, k)}" for k in SAMPLING_FLAGS
            if k not in loop.sampling_flags and getattr(before, k) != getattr(saved, k)]
    if kept:
        loop.r.info(f"kept this run's {', '.join(kept)}", style="dim")
    if took:
        loop.r.info(f"the snapshot's sampling settings apply: {', '.join(took)} (/set to change)", style="dim")


# ------------------------------------------------------------------------------------------------ JSON transcripts
def save_transcript(loop: ChatHost, arg: str) -> str | None:
    """/save FILE.json: the conversation and settings, no cache (replayed by /load FILE.json). Returns what was
    saved (None if nothing was), for the session log."""
    path = Path(arg).expanduser()
    data = transcript_data(loop.engine)
    try:
        # whole or not at all (the folder must exist: a mistyped path is an error, not a new tree); the user's alone
        atomic_write(path, (json.dumps(data, indent=1, ensure_ascii=False) + "\n").encode("utf-8"), 0o600)
    except OSError as e:
        loop.r.error(f"cannot write {path}: {e.strerror or e}")
        return None
    saved = plural(len(data["messages"]), "message")
    loop.r.info(f"saved {saved} to {path}")
    return f"saved {saved} to {path}"


def read_transcript(path: Path, max_positions: int | None = None) -> Any:
    """The JSON transcript at `path`, checked (`--load FILE.json` calls it before the model loads, so a missing or
    broken file is told in a second); a UserError in one line (exit 1, as a missing snapshot)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
        return parse_transcript(data, max_positions if max_positions is not None else sys.maxsize)
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None
    except (ValueError, ConfigError) as e:  # JSONDecodeError is a ValueError
        raise UserError(f"cannot load {path}: {e}") from None


def load_transcript(loop: ChatHost, arg: str) -> str:
    """Replay a JSON transcript's messages into a fresh cache. The current settings stay (what the user chose for
    this run wins over what the file was saved with); the ones saved in the file are only mentioned. The replay is
    a new stream: its eviction figures are those of the replay itself."""
    path = Path(arg).expanduser()
    tf = read_transcript(path, loop.engine.max_positions)
    eng = loop.engine
    eng.clear()
    loop.metrics.new_stream()
    eng.conv.system = tf.system
    seen0 = eng.ledger.seen
    loop.r.info(f"replaying {plural(len(tf.messages), 'message')} from {path} into the cache ...")
    for m in tf.messages:
        loop.feed_message(m["role"], m["content"], quiet=True)
    what = (f"replayed {plural(len(tf.messages), 'message')} from {path}: "
            f"{plural(eng.ledger.seen - seen0, 'token')} fed, "
            f"{loop.metrics.evicted} evicted, {eng.cache.length}/{eng.cache_cfg.capacity} in cache")
    loop.r.info(f"loaded: {plural(eng.ledger.seen - seen0, 'token')} fed, {loop.metrics.evicted} evicted, "
                f"{eng.cache.length}/{eng.cache_cfg.capacity} in cache ({human_bytes(eng.cache.nbytes)})")
    saved = {**tf.cache, **{k: v for k, v in asdict(tf.sampling).items() if k in ("temperature", "max_tokens")}}
    now = {**asdict(eng.cache_cfg), **asdict(eng.sampling)}
    differ = [f"{k} {v}" for k, v in saved.items() if now.get(k) != v]
    if differ:
        loop.r.info(f"kept this run's settings; the transcript was saved with {', '.join(differ)} "
                    "(/policy, /window, /set to change)", style="dim")
    return what
