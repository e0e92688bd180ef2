"""Slash commands of the chat REPL: one table (name -> handler, usage, help) drives dispatch, /help and completion.

Every handler validates before it changes anything, so a bad value leaves the engine exactly as it was, and reports
user mistakes as one message (never a traceback). A handler that changed the session returns what it did, and
`dispatch` logs that as an event after the last turn: `sinkchat logs show` then tells why the turns after it read as
they do (a new system prompt, a cleared cache, a loaded snapshot, another policy).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from sinkchat.apps.chat import recall, session
from sinkchat.apps.chat.host import ChatHost
from sinkchat.apps.memory_view import plural
from sinkchat.apps.render import eviction_text, stats_table
from sinkchat.config import POLICIES, ConfigError, SamplingConfig
from sinkchat.errors import UserError

SET_KEYS: dict[str, Callable[[str], Any]] = {
    "temperature": float, "top_p": float, "top_k": int, "max_tokens": int, "repetition_penalty": float,
    "seed": int,
}


class Exit(Exception):
    """Raised by /bye to leave the loop."""


@dataclass(frozen=True)
class Command:
    handler: Callable[[ChatHost, str], str | None]  # returns what it changed (logged), None if nothing
    usage: str
    help: str
    choices: tuple[str, ...] = ()
    paths: bool = False


def cmd_help(loop: ChatHost, arg: str) -> None:
    lines = ["commands:"]
    lines += [f"  {c.usage:<34} {c.help}" for c in COMMANDS.values()]
    lines += ['  """ ... """                        multi-line message (also Alt-Enter / Esc-Enter for a newline)',
              "  Ctrl-C                             stop a reply / clear the line;  Ctrl-D or /bye: exit"]
    loop.r.info("\n".join(lines), style="")


def cmd_stats(loop: ChatHost, arg: str) -> None:
    loop.r.table(stats_table(loop.stats(), recall.stats_rows(loop), loop.memory_stats()))


def pinned_after(eng: Any, cfg: Any) -> int:
    """Leading slots `cfg` keeps in front of the window: the sinks, or the pinned system prompt where it is longer
    (`Engine.pinned_slots`). With nothing fed yet, the prompt the first message will pin (`messages.pinned_prefix`
    pins it then), so a /window typed before the first message sizes the window the conversation will get."""
    if eng.cache.length or cfg.policy != "sink" or cfg.pin != "system" or not eng.conv.system:
        return int(eng.pinned_slots(cfg))
    from sinkchat.core.cache_policy import pinned_slots

    block = eng.conv.system_block()
    return pinned_slots(cfg, len(eng.encode(block)) if block else 0)


def cache_shape(eng: Any) -> str:
    """The cache's layout in the words /stats uses (`pinned 26 + window 50`): the window is what the pinned slots
    leave of the capacity, so the figure shown is the one /stats and the status line then show."""
    c = eng.cache_cfg
    if c.policy != "sink":
        return f"capacity {c.capacity}, " + ("nothing pinned" if c.policy == "window" else "no eviction")
    pinned = pinned_after(eng, c)
    if pinned > c.n_sink:
        return (f"pinned {pinned} (the system prompt, {plural(c.n_sink, 'sink')} included) + window "
                f"{c.capacity - pinned} = capacity {c.capacity}")
    return f"{plural(c.n_sink, 'sink')} + window {c.capacity - pinned} = capacity {c.capacity}"


def _reconfigure(loop: ChatHost, **changes: Any) -> str:
    events = loop.engine.reconfigure(**changes)  # ConfigError before any change
    for ev in events:  # folded, logged (a /window's were not, a user audit) and shown as a turn's are
        loop.on_event(ev)
    c = loop.engine.cache_cfg
    what = f"cache: {c.policy}, {cache_shape(loop.engine)} ({plural(loop.engine.cache.length, 'token')} held)"
    loop.r.info(what)
    return what + (f", {plural(sum(ev.count for ev in events), 'token')} evicted" if events else "")


def cmd_policy(loop: ChatHost, arg: str) -> str | None:
    if arg not in POLICIES:
        loop.r.error(f"usage: /policy {'|'.join(POLICIES)}  (now {loop.engine.cache_cfg.policy})")
        return None
    if arg != "sink" and loop.engine.memory is not None:  # as at start (the sinks and system prompt went to it)
        loop.r.error(f"/policy {arg}: the recall memory keeps what the sink policy evicts: /memory off first")
        return None
    return _reconfigure(loop, policy=arg)


def _int_arg(loop: ChatHost, arg: str, usage: str, minimum: int) -> int | None:
    try:
        n = int(arg)
    except ValueError:
        loop.r.error(f"usage: {usage}  ({arg!r} is not a whole number)")
        return None
    if n < minimum:
        loop.r.error(f"usage: {usage}  (must be >= {minimum})")
        return None
    return n


def cmd_sinks(loop: ChatHost, arg: str) -> str | None:
    n = _int_arg(loop, arg, "/sinks N", 0)
    if n is None:
        return None  # keep the window of recent tokens, so only the pinned part changes
    return _reconfigure(loop, n_sink=n, capacity=n + loop.engine.cache_cfg.window)


def cmd_window(loop: ChatHost, arg: str) -> str | None:
    """/window N: N recent tokens behind whatever is pinned (the sinks, or the pinned system prompt), so the
    window /stats shows is the N asked for: capacity = pinned + N."""
    n = _int_arg(loop, arg, "/window N", 8)
    if n is None:
        return None
    eng = loop.engine
    return _reconfigure(loop, capacity=pinned_after(eng, eng.cache_cfg) + n)


def cmd_system(loop: ChatHost, arg: str) -> str | None:
    eng = loop.engine
    if not arg:
        loop.r.info(f"system prompt: {eng.conv.system!r}")
        return None
    if not eng.conv.fed:  # nothing in the cache yet: it becomes the conversation's system prompt
        eng.conv.system = arg
        loop.slog.set_system(arg)  # what a resume that rebuilds the cache starts from
        loop.r.info("system prompt set")
        return "system prompt set (nothing fed yet: the conversation starts with it)"
    # History is never re-encoded: a new system prompt enters the stream as a system message, from now on. It is
    # in the cache like a prompt, so it is logged as a turn (a resume feeds it again), not as an event.
    t0 = time.perf_counter()
    try:
        n = loop.feed_message("system", arg)
    except ConfigError as e:
        loop.r.error(f"/system: {e}; nothing changed (/clear, then /system TEXT, starts over with it)")
        return None
    session.log_turn(loop, "system", arg, n, seconds=time.perf_counter() - t0)
    loop.r.info(f"system message added to the conversation ({plural(n, 'token')}); /clear to start over with it "
                "alone")
    return None


def cmd_set(loop: ChatHost, arg: str) -> str | None:
    key, _, raw = arg.partition(" ")
    raw = raw.strip()
    if key not in SET_KEYS or not raw:
        cur = ", ".join(f"{k}={getattr(loop.engine.sampling, k)}" for k in SET_KEYS)
        loop.r.error(f"usage: /set {'|'.join(SET_KEYS)} VALUE  (now {cur})")
        return None
    try:
        value = SET_KEYS[key](raw)
        SamplingConfig(**{**asdict(loop.engine.sampling), key: value})  # validates; raises ConfigError
    except ValueError as e:  # ConfigError is a ValueError too
        msg = str(e) if isinstance(e, ConfigError) else f"{raw!r} is not a valid {SET_KEYS[key].__name__}"
        loop.r.error(f"/set {key}: {msg}; nothing changed")
        return None
    loop.engine.set_sampling(**{key: value})
    if key in loop.sampling_flags:  # the user's latest word on it: a /load after this keeps it, as a flag
        loop.sampling_flags[key] = value
    loop.r.info(f"{key} = {value}")
    return f"{key} = {value}"


def cmd_clear(loop: ChatHost, arg: str) -> str:
    """Empty the cache (and the recall memory, which held the same conversation). Cleared tokens are not
    evictions: no event is folded, so the eviction figures stay."""
    n = loop.engine.cache.length
    mem = loop.engine.memory
    held = mem.tokens if mem is not None else 0
    loop.engine.clear()
    loop.metrics.gauge = None  # it measured a cache that is gone; the next reply measures again
    loop.last_recalled = []
    also = f"; the recall memory's {plural(held, 'token')} too" if held else ""
    loop.r.info(f"cache and conversation cleared ({plural(n, 'token')} dropped, not counted as evicted{also})")
    return f"cache and conversation cleared ({plural(n, 'token')} dropped{also})"


def cmd_evictions(loop: ChatHost, arg: str) -> None:
    m = loop.metrics
    evs = list(m.evictions)[-20:]
    if not evs:
        loop.r.info("no evictions yet" if not m.eviction_count else
                    f"no evictions since this stream was loaded ({m.eviction_count} before, "
                    f"{plural(m.evicted, 'token')})")
        return
    loop.r.info(f"last {len(evs)} of {plural(m.eviction_count, 'eviction')} ({plural(m.evicted, 'token')} evicted "
                "in all):")
    for ev in evs:
        loop.r.info("  " + eviction_text(ev), style="yellow")


def cmd_save(loop: ChatHost, arg: str) -> str | None:
    if not arg:
        loop.r.error("usage: /save NAME (snapshot) or /save FILE.json (transcript)")
        return None
    if arg.lower().endswith(".json"):
        return session.save_transcript(loop, arg)
    return session.save(loop, arg)


def cmd_load(loop: ChatHost, arg: str) -> str | None:
    if not arg:
        loop.r.error("usage: /load NAME (snapshot) or /load FILE.json (transcript)")
        return None
    if not session.is_transcript_file(arg):
        return session.load(loop, arg)
    try:
        return session.load_transcript(loop, arg)
    except UserError as e:  # a missing or broken file (ConfigError: a setting it holds): one line, nothing changed
        loop.r.error(str(e))
        return None


def cmd_edit(loop: ChatHost, arg: str) -> None:
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


def cmd_bye(loop: ChatHost, arg: str) -> None:
    raise Exit()


COMMANDS: dict[str, Command] = {
    "/help": Command(cmd_help, "/help", "this list"),
    "/stats": Command(cmd_stats, "/stats", "memory, cache, speed and sink-gauge table"),
    "/policy": Command(cmd_policy, "/policy sink|window", "switch the cache policy live", POLICIES),
    "/sinks": Command(cmd_sinks, "/sinks N", "pinned sink tokens (the capacity moves with N)"),
    "/window": Command(cmd_window, "/window N", "recent-token window (capacity = pinned + N: the sinks, or the "
                       "system prompt with them)"),
    "/system": Command(cmd_system, "/system TEXT", "set the system prompt (a system message mid-conversation)"),
    "/set": Command(cmd_set, "/set KEY VALUE", f"sampling: {', '.join(SET_KEYS)}", tuple(SET_KEYS)),
    "/clear": Command(cmd_clear, "/clear", "empty the cache and start over"),
    "/evictions": Command(cmd_evictions, "/evictions", "recent eviction events"),
    "/recall": Command(recall.cmd_recall, "/recall [all]", "the text of the memory blocks the last reply read",
                       ("all",)),
    "/forget": Command(recall.cmd_forget, "/forget", "drop what the recall memory holds (asks first)", ("yes",)),
    "/memory": Command(recall.cmd_memory, "/memory [on|off]", "the recall memory: its figures, or turn it on / off",
                       ("on", "off")),
    "/save": Command(cmd_save, "/save NAME|FILE.json", "snapshot the session incl. KV cache (or a JSON transcript)",
                     paths=True),
    "/load": Command(cmd_load, "/load NAME|FILE.json", "restore a snapshot (or replay a JSON transcript)", paths=True),
    "/edit": Command(cmd_edit, "/edit", "compose a message in $EDITOR"),
    "/bye": Command(cmd_bye, "/bye", "exit"),
}
ALIASES = {"/exit": "/bye", "/quit": "/bye", "/?": "/help"}


def dispatch(loop: ChatHost, line: str) -> None:
    """Run one slash command line; raises Exit for /bye. What a command changed is logged as a 'command' event."""
    name, _, arg = line.strip().partition(" ")
    name = ALIASES.get(name.lower(), name.lower())
    cmd = COMMANDS.get(name)
    if cmd is None:
        near = [c for c in COMMANDS if c.startswith(name[:3])] if len(name) > 1 else []
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        loop.r.error(f"unknown command {name}{hint}; /help lists the commands")
        return
    try:
        outcome = cmd.handler(loop, arg.strip())
    except ConfigError as e:
        loop.r.error(f"{name}: {e}; nothing changed")
        return
    if outcome:
        loop.slog.event("command", f"{name} {arg.strip()}".strip(), outcome)
