"""The recall memory in the chat REPL: what each reply read (a line after it, a log record, the jsonl record's
`recalled`), and the commands over it: /recall (the text of the blocks the last reply read), /forget (drop
everything it holds, reported as `forgotten` like evictions) and /memory on|off.

Acts on the running loop through `ChatHost`, like `session`; reads the memory only through
`sinkchat.memory.report`, so every figure shown is one the ledger's invariant counts
(`ledger.evicted == memory.tokens + memory.forgotten`, which /forget keeps).

/memory on mid-session opens a memory as `--memory on` does (`bootstrap.open_memory`) and moves the cache's
tokens into a fresh cache with the memory's region reserved in front of the stream (as a /window change moves
them into a cache of another size): from then on evicted tokens are kept; those evicted before stay gone.
/memory off drops what the memory holds (after a confirmation, reported as forgotten), closes it (its files go)
and moves the tokens back into a cache without the region: a paused memory would keep recalling nothing while its
region stayed in every call's buffers, so off means off.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from sinkchat.apps.chat.host import ChatHost
from sinkchat.apps.memory_view import memory_rows, plural, recall_header, recalled_line, window_stats
from sinkchat.config import ConfigError
from sinkchat.core.interrupts import deferred_sigint
from sinkchat.core.metrics import human_bytes
from sinkchat.memory import report

SHOWN = 12  # blocks /recall prints without `all` (a long paste can read dozens)

__all__ = ["take", "show_after_reply", "cmd_recall", "cmd_forget", "cmd_memory", "stats_rows"]


def take(loop: ChatHost) -> list[report.Recalled] | None:
    """The blocks read since the last take (None: the memory is off); the tally starts again."""
    mem = loop.engine.memory
    return None if mem is None else report.take_recalled(mem)


def show_after_reply(loop: ChatHost) -> list[dict[str, Any]] | None:
    """After a turn: what it read from the memory, as a line (shown like the evictions, after the reply), a
    'recalled' record in the session log, and the jsonl record's `recalled` list (None: memory off)."""
    got = take(loop)
    if got is None:
        return None
    loop.last_recalled = got
    if not got:
        return []
    loop.recall_tally[0] += 1
    loop.recall_tally[1] += len(got)
    now = time.time()
    line = recalled_line(got, now)
    loop.r.info(line, style="dim cyan")
    loop.slog.event("recalled", line.removeprefix("↺ recalled "), None, sum(r.last - r.first for r in got))
    return [{"block": r.bid, "first": r.first, "last": r.last, "age_seconds": round(r.age(now), 1),
             "layers": r.layers, "of": r.of, "reread": r.reread} for r in got]


def stats_rows(loop: ChatHost) -> list[tuple[str, str]]:
    """The /stats rows of the memory (`memory_view.memory_rows`), its region's KV beside the window's."""
    replies, reads = loop.recall_tally
    mem = loop.memory_stats()
    window_kv = window_stats(loop.stats(), mem).kv_bytes
    return memory_rows(mem, replies, reads, len(loop.last_recalled), window_kv)


# ------------------------------------------------------------------------------------------------ commands
def cmd_recall(loop: ChatHost, arg: str) -> None:
    """/recall: the text of the blocks the last reply read (decoded from the token ids the store holds), each with
    its stream range, its age and in how many layers it was chosen; past `SHOWN` blocks, the ones chosen in the
    most layers (in stream order), or every one with /recall all."""
    mem, got = loop.engine.memory, loop.last_recalled
    if arg not in ("", "all"):
        loop.r.error("usage: /recall [all]")
        return
    if not got:
        loop.r.info("the recall memory is off (/memory on)" if mem is None else
                    "the last reply read nothing from the memory" if loop.metrics.replies else "no reply yet")
        return
    now = time.time()
    shown = got if arg == "all" or len(got) <= SHOWN else sorted(
        sorted(got, key=lambda r: (-r.layers, r.first))[:SHOWN], key=lambda r: r.first)
    more = (f"; the {SHOWN} chosen in the most layers (/recall all for every one)" if len(shown) < len(got)
            else "")
    loop.r.info(f"the last reply read {plural(len(got), 'block')} from the memory{more}:")
    decode = lambda ids: loop.engine.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    for r in shown:
        loop.r.info(recall_header(r, now), style="bold cyan")
        text = report.block_text(mem, r.bid, decode) if mem is not None else None
        loop.r.info(text if text is not None else "(no longer in the memory: forgotten since)", style="")


def cmd_forget(loop: ChatHost, arg: str) -> str | None:
    """/forget: asks; /forget yes drops everything the memory holds (the window stays). Reported per range as
    `forgotten`, like an eviction; the memory stays on."""
    mem = loop.engine.memory
    if mem is None:
        loop.r.info("the recall memory is off: nothing to forget")
        return None
    held = mem.tokens
    if not held:
        loop.r.info("the recall memory holds nothing")
        return None
    if arg != "yes":
        if arg:
            loop.r.error(f"usage: /forget, then /forget yes to confirm ({arg!r} is not yes)")
            return None
        loop.r.info(f"/forget drops the memory's {_held(mem)} for good; the conversation in the window stays. "
                    "Type /forget yes to confirm.", style="yellow")
        return None
    events = _drop(loop, "/forget")
    what = f"memory forgotten: {plural(held, 'token')} in {plural(len(events), 'range')}"
    loop.r.info(what + "; tokens evicted from now on go to it again")
    return what


def cmd_memory(loop: ChatHost, arg: str) -> str | None:
    """/memory: what it holds; /memory on: start one; /memory off: drop it (asks first when it holds anything)."""
    eng = loop.engine
    mem = eng.memory
    if not arg:
        rows = stats_rows(loop)
        loop.r.info("\n".join(f"{k}: {v}" for k, v in rows))
        return None
    if arg == "on":
        if mem is not None:
            loop.r.info("the recall memory is already on")
            return None
        return _turn_on(loop)
    if arg.startswith("off ") and arg != "off yes":  # `/memory off no`: said why, as /forget says it
        loop.r.error(f"usage: /memory off, then /memory off yes to confirm ({arg[4:].strip()!r} is not yes)")
        return None
    if arg not in ("off", "off yes"):
        loop.r.error(f"usage: /memory on|off  (now {'on' if mem is not None else 'off'})")
        return None
    if mem is None:
        loop.r.info("the recall memory is already off")
        return None
    held = mem.tokens
    if held and arg != "off yes":
        loop.r.info(f"turning the memory off drops its {_held(mem)} for good. Type /memory off yes to confirm.",
                    style="yellow")
        return None
    _drop(loop, "/memory off")
    mem.close()
    eng.use_memory(None)
    loop.last_recalled = []
    what = "recall memory off" + (f": {plural(held, 'token')} forgotten" if held else "") + \
        "; tokens evicted from now on are dropped"
    loop.r.info(what)
    return what


def _held(mem: Any) -> str:
    """`9 blocks (289 tokens)`, or `30 tokens` while they are all still queued (not yet a block)."""
    tokens = plural(mem.tokens, "token")
    return f"{plural(mem.blocks, 'block')} ({tokens})" if mem.blocks else tokens


def _drop(loop: ChatHost, reason: str) -> list[Any]:
    """Everything the memory holds, forgotten (`Engine.forget_memory`): each range shown and logged like an
    eviction."""
    with deferred_sigint():
        events = loop.engine.forget_memory(reason)
    for ev in events:
        loop.on_event(ev)
    loop.last_recalled = []
    g = loop.metrics.gauge
    if g is not None and getattr(g, "memory", None):  # its share on recalled slots measured a memory now gone
        loop.metrics.gauge = replace(g, memory=0.0, memory_per_layer=tuple(0.0 for _ in g.memory_per_layer))
    return events


def _turn_on(loop: ChatHost) -> str | None:
    from sinkchat.bootstrap import build_settings, open_memory

    eng = loop.engine
    settings = loop.settings if loop.settings is not None else build_settings({})
    if eng.cache_cfg.policy != "sink":
        loop.r.error(f"/memory on: the memory keeps what the sink policy evicts (now {eng.cache_cfg.policy}); "
                     "/policy sink first")
        return None
    settings = replace(settings, memory=replace(settings.memory, mode="on"), cache=eng.cache_cfg)
    try:
        mem = open_memory(settings, eng.spec)
    except ConfigError as e:
        loop.r.error(f"/memory on: {e}")
        return None
    eng.use_memory(mem)
    before = mem.forgotten  # dropped before the memory existed: forgotten, and counted so
    c = settings.memory
    what = (f"recall memory on: blocks of {plural(c.block, 'token')}, top {c.topk} per layer, disk budget "
            f"{human_bytes(c.budget_mb << 20)}")
    loop.r.info(what + (f"; the {plural(before, 'token')} evicted before stay gone" if before else ""))
    return what
