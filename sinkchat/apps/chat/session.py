"""Sessions for the chat REPL: the SQLite log, automatic snapshots, `--load`, `--resume` and /save, /load.

Kept apart from repl.py so the loop stays about chatting; everything here is a thin layer over
`sinkchat.store.transcript` (the log) and `sinkchat.store.snapshot` (KV-cache snapshots).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from sinkchat.config import ConfigError, Settings, data_dir

if TYPE_CHECKING:
    from sinkchat.apps.chat.repl import ChatLoop


def open_log(engine: Any, mode: str, no_log: bool, system: str | None, warn: Callable[[str], None],
             resume_id: int | None = None) -> Any:
    """A SessionLog (or NullLog with --no-log / an unusable log dir). Only settings and text are stored."""
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
    from sinkchat.store.transcript import LogError, get_session

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


def do_resume(loop: "ChatLoop", session_id: int) -> None:
    from sinkchat.store.snapshot import resume_session

    res = resume_session(loop.engine, loop.slog, session_id)
    loop.r.info(f"resumed {res.describe()}")
    if res.pending:
        loop.r.info("re-sending the last message, which never got a reply")
        loop.turn(res.pending, log_user=False)


def is_transcript_file(arg: str) -> bool:
    """A JSON transcript (vs. a snapshot name or .safetensors file)."""
    p = Path(arg).expanduser()
    if p.suffix.lower() == ".json":
        return True
    try:
        with open(p, "rb") as f:
            return f.read(1) in (b"{", b"[")
    except OSError:
        return False


def save(loop: "ChatLoop", arg: str) -> None:
    """/save NAME|FILE.safetensors: a full snapshot (cache, conversation, settings)."""
    from sinkchat.store.snapshot import SnapshotError, save_snapshot, snapshot_path

    try:
        target = snapshot_path(arg)
        if not target.parent.is_dir() and target.parent != data_dir() / "snapshots":
            raise SnapshotError(f"cannot write {target}: folder {target.parent} does not exist")
        path = save_snapshot(loop.engine, target, loop.slog.pointer())
    except (SnapshotError, OSError) as e:
        loop.r.error(f"/save: {e}")
        return
    loop.r.info(f"saved snapshot ({loop.engine.cache.length} tokens in cache) to {path}; /load {arg} restores it")


def load(loop: "ChatLoop", arg: str, strict: bool = False) -> None:
    """/load NAME|FILE: a snapshot; the next reply is what the saved session would have said. `strict` (for --load)
    raises instead of reporting, so a bad start-up snapshot ends the program with a one-line error."""
    from sinkchat.store.snapshot import SnapshotError, load_snapshot, snapshot_path

    before = loop.engine.cache_cfg
    try:
        head = load_snapshot(loop.engine, snapshot_path(arg))
    except SnapshotError as e:
        if strict:
            raise
        loop.r.error(f"/load: {e}")
        return
    eng = loop.engine
    loop.metrics.new_stream()
    loop.r.info(f"loaded snapshot {head.get('path', arg)}: {len(eng.conv.messages)} messages, "
                f"{eng.cache.length}/{eng.cache_cfg.capacity} tokens in cache")
    after = eng.cache_cfg
    changed = [f"{k} {getattr(before, k)} -> {getattr(after, k)}" for k in ("policy", "n_sink", "capacity", "evict_chunk")
               if getattr(before, k) != getattr(after, k)]
    if changed:
        loop.r.info(f"the snapshot's cache settings apply (its KV cache was built with them): {', '.join(changed)}",
                    style="dim")


def log_turn(loop: "ChatLoop", role: str, text: str, tokens: int, done: Any = None, seconds: float = 0.0) -> None:
    """A user turn (no `done`), a finished reply, or a reply cut by Ctrl-C (`seconds` given, no `done`)."""
    if done is None and seconds:
        loop.slog.turn(role, text, tokens, seconds, reason="interrupted", cache_len=loop.engine.cache.length)
    elif done is None:
        loop.slog.turn(role, text, tokens)
    else:
        loop.slog.turn(role, text, tokens, done.seconds, reason=done.reason, cache_len=loop.engine.cache.length)
