"""Slash commands of the chat REPL: one table (name -> handler, usage, help) drives dispatch, /help and completion.

Every handler validates before it changes anything, so a bad value leaves the engine exactly as it was, and reports
user mistakes as one message (never a traceback).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from prompt_toolkit.completion import CompleteEvent, Completer, Completion, PathCompleter
from prompt_toolkit.document import Document

from sinkchat.config import POLICIES, CacheConfig, ConfigError, SamplingConfig
from sinkchat.core.metrics import human_bytes
from sinkchat.apps.chat import session
from sinkchat.apps.render import eviction_line, stats_table

if TYPE_CHECKING:
    from sinkchat.apps.chat.repl import ChatLoop

TRANSCRIPT_FORMAT = "sinkchat-transcript"
SET_KEYS: dict[str, Callable[[str], Any]] = {
    "temperature": float, "top_p": float, "top_k": int, "max_tokens": int, "repetition_penalty": float,
    "seed": int,
}


class Exit(Exception):
    """Raised by /bye to leave the loop."""


@dataclass(frozen=True)
class Command:
    handler: Callable[["ChatLoop", str], None]
    usage: str
    help: str
    choices: tuple[str, ...] = ()
    paths: bool = False


def cmd_help(loop: "ChatLoop", arg: str) -> None:
    lines = ["commands:"]
    lines += [f"  {c.usage:<34} {c.help}" for c in COMMANDS.values()]
    lines += ['  """ ... """                        multi-line message (also Alt-Enter / Esc-Enter for a newline)',
              "  Ctrl-C                             stop a reply / clear the line;  Ctrl-D or /bye: exit"]
    loop.r.info("\n".join(lines), style="")


def cmd_stats(loop: "ChatLoop", arg: str) -> None:
    loop.r.table(stats_table(loop.stats()))


def _reconfigure(loop: "ChatLoop", **changes: Any) -> None:
    events = loop.engine.reconfigure(**changes)  # ConfigError before any change
    for ev in events:
        loop.metrics.fold(ev)
        loop.r.eviction(ev)
    c = loop.engine.cache_cfg
    shape = (f"{c.n_sink} sinks + window {c.window} = capacity {c.capacity}" if c.policy == "sink" else
             f"capacity {c.capacity}, nothing pinned" if c.policy == "window" else f"capacity {c.capacity}, no eviction")
    loop.r.info(f"cache: {c.policy}, {shape} ({loop.engine.cache.length} tokens held)")


def cmd_policy(loop: "ChatLoop", arg: str) -> None:
    if arg not in POLICIES:
        loop.r.error(f"usage: /policy {'|'.join(POLICIES)}  (now {loop.engine.cache_cfg.policy})")
        return
    _reconfigure(loop, policy=arg)


def _int_arg(loop: "ChatLoop", arg: str, usage: str, minimum: int) -> int | None:
    try:
        n = int(arg)
    except ValueError:
        loop.r.error(f"usage: {usage}  ({arg!r} is not a whole number)")
        return None
    if n < minimum:
        loop.r.error(f"usage: {usage}  (must be >= {minimum})")
        return None
    return n


def cmd_sinks(loop: "ChatLoop", arg: str) -> None:
    n = _int_arg(loop, arg, "/sinks N", 0)
    if n is not None:  # keep the window of recent tokens, so only the pinned part changes
        _reconfigure(loop, n_sink=n, capacity=n + loop.engine.cache_cfg.window)


def cmd_window(loop: "ChatLoop", arg: str) -> None:
    n = _int_arg(loop, arg, "/window N", 8)
    if n is not None:
        _reconfigure(loop, capacity=loop.engine.cache_cfg.n_sink + n)


def cmd_system(loop: "ChatLoop", arg: str) -> None:
    eng = loop.engine
    if not arg:
        loop.r.info(f"system prompt: {eng.conv.system!r}")
        return
    if not eng.conv.fed:  # nothing in the cache yet: it becomes the conversation's system prompt
        eng.conv.system = arg
        loop.r.info("system prompt set")
        return
    # History is never re-encoded: a new system prompt enters the stream as a system message, from now on.
    try:
        n = loop.feed_message("system", arg)
    except ConfigError as e:
        loop.r.error(f"/system: {e}; nothing changed (/clear, then /system TEXT, starts over with it)")
        return
    loop.r.info(f"system message added to the conversation ({n} tokens); /clear to start over with it alone")


def cmd_set(loop: "ChatLoop", arg: str) -> None:
    key, _, raw = arg.partition(" ")
    raw = raw.strip()
    if key not in SET_KEYS or not raw:
        cur = ", ".join(f"{k}={getattr(loop.engine.sampling, k)}" for k in SET_KEYS)
        loop.r.error(f"usage: /set {'|'.join(SET_KEYS)} VALUE  (now {cur})")
        return
    try:
        value = SET_KEYS[key](raw)
        SamplingConfig(**{**asdict(loop.engine.sampling), key: value})  # validates; raises ConfigError
    except ValueError as e:  # ConfigError is a ValueError too
        msg = str(e) if isinstance(e, ConfigError) else f"{raw!r} is not a valid {SET_KEYS[key].__name__}"
        loop.r.error(f"/set {key}: {msg}; nothing changed")
        return
    loop.engine.set_sampling(**{key: value})
    loop.r.info(f"{key} = {value}")


def cmd_clear(loop: "ChatLoop", arg: str) -> None:
    loop.engine.clear()
    loop.metrics.gauge = None  # it measured a cache that is gone; the next reply measures again
    loop.r.info("cache and conversation cleared")


def cmd_evictions(loop: "ChatLoop", arg: str) -> None:
    evs = list(loop.metrics.evictions)[-20:]
    if not evs:
        loop.r.info("no evictions yet")
        return
    total = loop.engine.ledger.evicted
    loop.r.info(f"last {len(evs)} of {loop.metrics.eviction_count} evictions ({total} tokens evicted in all):")
    for ev in evs:
        loop.r.info("  " + eviction_line(ev), style="yellow")


def transcript(loop: "ChatLoop") -> dict[str, Any]:
    eng = loop.engine
    return {"format": TRANSCRIPT_FORMAT, "version": 1, "system": eng.conv.system,
            "messages": [dict(m) for m in eng.conv.messages],
            "settings": {"cache": asdict(eng.cache_cfg), "sampling": asdict(eng.sampling)}}


def write_atomic(path: Path, text: str) -> None:
    """Write via a temp file in the same folder and rename, so a crash never leaves half a transcript. The folder
    must exist: a mistyped path is an error, not a new directory tree."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cmd_save(loop: "ChatLoop", arg: str) -> None:
    if not arg:
        loop.r.error("usage: /save NAME (snapshot) or /save FILE.json (transcript)")
        return
    if not arg.lower().endswith(".json"):
        session.save(loop, arg)
        return
    path = Path(arg).expanduser()
    data = transcript(loop)
    try:
        write_atomic(path, json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    except OSError as e:
        loop.r.error(f"cannot write {path}: {e.strerror or e}")
        return
    loop.r.info(f"saved {len(data['messages'])} messages to {path}")


def _parse_transcript(data: Any, max_positions: int) -> tuple[str | None, list[dict[str, str]], dict, SamplingConfig]:
    if not isinstance(data, dict) or data.get("format") != TRANSCRIPT_FORMAT:
        raise ConfigError("not a sinkchat transcript (missing \"format\": \"sinkchat-transcript\")")
    msgs = data.get("messages")
    if not isinstance(msgs, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in msgs):
        raise ConfigError("transcript messages must be a list of {role, content} strings")
    system = data.get("system")
    if system is not None and not isinstance(system, str):
        raise ConfigError("transcript system prompt must be a string or null")
    settings = data.get("settings") or {}
    try:
        cache = {k: v for k, v in (settings.get("cache") or {}).items() if k in ("policy", "n_sink", "capacity")}
        CacheConfig(**cache).resolved(max_positions)
        sampling = SamplingConfig(**(settings.get("sampling") or {}))
    except TypeError as e:
        raise ConfigError(f"bad transcript settings: {e}") from None
    return system, [{"role": m["role"], "content": m["content"]} for m in msgs], cache, sampling


def cmd_load(loop: "ChatLoop", arg: str) -> None:
    if not arg:
        loop.r.error("usage: /load NAME (snapshot) or /load FILE.json (transcript)")
        return
    if not session.is_transcript_file(arg):
        session.load(loop, arg)
        return
    try:
        load_transcript(loop, arg)
    except ConfigError as e:
        loop.r.error(str(e))


def load_transcript(loop: "ChatLoop", arg: str) -> None:
    """Replay a JSON transcript's messages into a fresh cache. The current settings stay (what the user chose for
    this run wins over what the file was saved with); the ones saved in the file are only mentioned."""
    path = Path(arg).expanduser()
    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
        system, msgs, cache, sampling = _parse_transcript(data, loop.engine.max_positions)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
    except (ValueError, ConfigError) as e:  # JSONDecodeError is a ValueError
        raise ConfigError(f"cannot load {path}: {e}") from None
    eng = loop.engine
    eng.clear()
    loop.metrics.new_stream()
    eng.conv.system = system
    seen0, ev0 = eng.ledger.seen, eng.ledger.evicted
    loop.r.info(f"replaying {len(msgs)} messages from {path} into the cache ...")
    for m in msgs:
        loop.feed_message(m["role"], m["content"], quiet=True)
    loop.r.info(f"loaded: {eng.ledger.seen - seen0} tokens fed, {eng.ledger.evicted - ev0} evicted, "
                f"{eng.cache.length}/{eng.cache_cfg.capacity} in cache ({human_bytes(eng.cache.nbytes)})")
    saved = {**cache, **{k: v for k, v in asdict(sampling).items() if k in ("temperature", "max_tokens")}}
    now = {**asdict(eng.cache_cfg), **asdict(eng.sampling)}
    differ = [f"{k} {v}" for k, v in saved.items() if now.get(k) != v]
    if differ:
        loop.r.info(f"kept this run's settings; the transcript was saved with {', '.join(differ)} "
                    "(/policy, /window, /set to change)", style="dim")


def cmd_edit(loop: "ChatLoop", arg: str) -> None:
    if not loop.interactive:
        loop.r.error("/edit needs a terminal")
        return
    import click

    try:
        text = click.edit(arg or "", extension=".md", require_save=True)
    except click.ClickException as e:
        loop.r.error(f"/edit: {e.format_message()} (set $EDITOR)")
        return
    if text is None or not text.strip():
        loop.r.info("nothing sent")
        return
    text = text.rstrip("\n")
    loop.r.info(text, style="dim")  # show what is being sent; it was typed outside the prompt
    loop.turn(text)


def cmd_bye(loop: "ChatLoop", arg: str) -> None:
    raise Exit()


COMMANDS: dict[str, Command] = {
    "/help": Command(cmd_help, "/help", "this list"),
    "/stats": Command(cmd_stats, "/stats", "memory, cache, speed and sink-gauge table"),
    "/policy": Command(cmd_policy, "/policy sink|window", "switch the cache policy live", POLICIES),
    "/sinks": Command(cmd_sinks, "/sinks N", "pinned sink tokens (the window stays)"),
    "/window": Command(cmd_window, "/window N", "recent-token window (capacity = sinks + N)"),
    "/system": Command(cmd_system, "/system TEXT", "set the system prompt (a system message mid-conversation)"),
    "/set": Command(cmd_set, "/set KEY VALUE", f"sampling: {', '.join(SET_KEYS)}", tuple(SET_KEYS)),
    "/clear": Command(cmd_clear, "/clear", "empty the cache and start over"),
    "/evictions": Command(cmd_evictions, "/evictions", "recent eviction events"),
    "/save": Command(cmd_save, "/save NAME|FILE.json", "snapshot the session incl. KV cache (or a JSON transcript)",
                     paths=True),
    "/load": Command(cmd_load, "/load NAME|FILE.json", "restore a snapshot (or replay a JSON transcript)", paths=True),
    "/edit": Command(cmd_edit, "/edit", "compose a message in $EDITOR"),
    "/bye": Command(cmd_bye, "/bye", "exit"),
}
ALIASES = {"/exit": "/bye", "/quit": "/bye", "/?": "/help"}


def dispatch(loop: "ChatLoop", line: str) -> None:
    """Run one slash command line; raises Exit for /bye."""
    name, _, arg = line.strip().partition(" ")
    name = ALIASES.get(name.lower(), name.lower())
    cmd = COMMANDS.get(name)
    if cmd is None:
        near = [c for c in COMMANDS if c.startswith(name[:3])] if len(name) > 1 else []
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        loop.r.error(f"unknown command {name}{hint}; /help lists the commands")
        return
    try:
        cmd.handler(loop, arg.strip())
    except ConfigError as e:
        loop.r.error(f"{name}: {e}; nothing changed")


class SlashCompleter(Completer):
    """Completes command names, then their fixed choices (/policy, /set) or paths (/save, /load)."""

    def __init__(self) -> None:
        self.paths = PathCompleter(expanduser=True)

    def get_completions(self, document: Document, event: CompleteEvent) -> Iterable[Completion]:
        text = document.text_before_cursor
        if not text.startswith("/"):
            return
        if " " not in text:
            for name, cmd in COMMANDS.items():
                if name.startswith(text):
                    yield Completion(name, -len(text), display_meta=cmd.help)
            return
        name, _, arg = text.partition(" ")
        cmd = COMMANDS.get(name)
        if cmd is None or " " in arg:
            return
        if cmd.paths:
            yield from self.paths.get_completions(Document(arg, len(arg)), event)
        for choice in cmd.choices:
            if choice.startswith(arg):
                yield Completion(choice, -len(arg))
