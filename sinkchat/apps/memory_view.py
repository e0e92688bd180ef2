"""How the chat shows the recall memory: its status field, its /stats rows, the line after a reply that read it,
/recall's block headers, and the KV the memory's region takes in the cache, apart from the window's.

Kept apart from `render` (which imports this module, never the other way) so the renderer stays about drawing. The
figure spelling shared by both (`compact`, `span`; `count` and `plural` from textutil) lives here for that reason.

One notation for stream ranges everywhere the chat shows one: inclusive, with thousands separators (`3,100–3,163`,
the tokens a person would count), turned from the engine's half-open [first, last) at the last moment (`span`).

The KV split (`MemoryFigures`, `window_stats`): a memory reserves `region` slots in front of the window in every
memory layer, so with it on the cache's buffers are about 3.5x the window's (`kv 9.8 MiB 41/128` against 2.8 MiB
off, the fraction counting the window's slots only). The status line's `kv` field then shows the window's bytes,
the ones its fraction counts, and the memory's field and /stats show the region's; the two add up to the buffers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Sequence

from sinkchat.core.metrics import Stats, fit_fields, human_bytes
from sinkchat.memory.report import MemoryStats, Recalled
from sinkchat.textutil import count, plural  # noqa: F401 - re-exported: the apps' figure spelling


# ------------------------------------------------------------------------------------------------- figures, words
def compact(n: int) -> str:
    """A figure for a narrow line: 3,840 below ten thousand, then 52k, 1.2M."""
    return count(n) if n < 10_000 else f"{n / 1000:.0f}k" if n < 1_000_000 else f"{n / 1e6:.1f}M"


def span(first: int, last: int) -> str:
    """The stream range [first, last) as a person reads it, inclusive: `3,100–3,163`, or `3,100` for one token."""
    return count(first) if last - first <= 1 else f"{count(first)}–{count(last - 1)}"


def age_text(seconds: float) -> str:
    """How long ago, for a person: 12 s ago, 41 min ago, 2 h 5 min ago, 3 days ago."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s} s ago"
    if s < 3600:
        return f"{s // 60} min ago"
    if s < 86400:
        h, m = divmod(s // 60, 60)
        return f"{h} h {m} min ago" if m else f"{h} h ago"
    return plural(s // 86400, "day") + " ago"


# ------------------------------------------------------------------------------------------------- the KV split
@dataclass(frozen=True)
class MemoryFigures(MemoryStats):
    """`MemoryStats` and what the memory's region takes in the cache: `region` slots a memory layer reserves in
    front of the window, `region_bytes` their KV in all memory layers, `region_allocated` the part of those
    already in the cache's buffers (so in `Stats.kv_bytes` / `kv_allocated`: 0 before the first model call)."""

    region: int = 0
    region_bytes: int = 0
    region_allocated: int = 0


def memory_figures(engine: Any, stats: MemoryStats) -> MemoryFigures:
    """`stats` with the region's KV read from the engine's cache: per memory layer, its reserved slots' share of
    its buffers once allocated, else the bytes a slot will take (the model's spec at the cache's dtype), so the
    figure is the same all session long, as `metrics.session_kv_bytes` keeps the window's."""
    mem, cache = engine.memory, engine.cache
    if mem is None or not cache.layers:
        return MemoryFigures(**vars(stats))
    spec, store = getattr(engine, "spec", None), getattr(engine, "kv_store", None)
    slot = 0
    if spec is not None and store is not None:
        from sinkchat.core.metrics import torch_bits

        slot = spec.kv_bytes_per_token(torch_bits(store)) // len(cache.layers)
    total = allocated = 0
    for i in mem.layers:
        layer = cache.layers[i]
        base = int(getattr(layer, "base", 0))
        if layer.nbytes:
            share = layer.nbytes * base // (base + layer.capacity)
            total, allocated = total + share, allocated + share
        else:
            total += slot * base
    return MemoryFigures(**vars(stats), region=int(mem.region), region_bytes=total, region_allocated=allocated)


def window_stats(s: Stats, mem: MemoryStats | None) -> Stats:
    """`s` with the window's KV alone (the buffers less the memory's region), so the `kv` field's bytes are those
    of the slots its fraction counts; unchanged without a region."""
    if not isinstance(mem, MemoryFigures) or not mem.region_allocated:
        return s
    return replace(s, kv_bytes=max(0, s.kv_bytes - mem.region_allocated),
                   kv_allocated=max(0, s.kv_allocated - mem.region_allocated))


# ------------------------------------------------------------------------------------------------- the status field
def memory_variants(mem: MemoryStats | None) -> list[str]:
    """The memory's status field, longest first ("" = not shown): `mem 412 blk · 52,123 tok · 310.0 MiB` (blocks
    indexed, tokens held, bytes on disk), with the region's KV (`MemoryFigures`) `mem 412 blk · 52,123 tok ·
    310.0 MiB disk · 7.0 MiB KV`; then `mem 52k tok`. Memory off: nothing."""
    if mem is None:
        return [""]
    head = f"mem {count(mem.blocks)} blk · {count(mem.tokens)} tok · {human_bytes(mem.disk_bytes)}"
    kv = mem.region_bytes if isinstance(mem, MemoryFigures) else 0
    longest = [f"{head} disk · {human_bytes(kv)} KV", f"{head} disk"] if kv else [head]
    return [*longest, f"mem {compact(mem.tokens)} tok", ""]


def fit_memory(core: dict[str, list[str]], mem: list[str], width: int, sep: int) -> tuple[dict[str, str], str]:
    """`fit_fields` with the memory's field beside the core ones: the memory keeps its longest text that leaves the
    other fields room to fit with the evictions unshortened; the lower-priority core fields (gauge bar, policy,
    RSS, KV bytes, rate) give way first, then the memory shrinks, then it goes."""

    def total(texts: dict[str, str], extra: str) -> int:
        shown = [t for t in [*texts.values(), extra] if t]
        return sum(len(t) for t in shown) + sep * max(0, len(shown) - 1)

    for m in mem:
        texts = fit_fields(core, width - (len(m) + sep if m else 0), sep)
        if not m or (total(texts, m) <= width and texts["seen"] == core["seen"][0]):
            return texts, m
    return fit_fields(core, width, sep), ""


# ------------------------------------------------------------------------------------------------- what replies read
def token_ranges(recalled: Sequence[Recalled], most: int = 4) -> str:
    """The stream ranges of recalled blocks, consecutive blocks joined (`span`): `3,100–3,483` (blocks
    [3100, 3164) ... [3420, 3484)); past `most` + 1 ranges, the first `most` and how many more."""
    runs: list[list[int]] = []
    for r in sorted(recalled, key=lambda r: r.first):
        if runs and runs[-1][1] == r.first:
            runs[-1][1] = r.last
        else:
            runs.append([r.first, r.last])
    shown = runs if len(runs) <= most + 1 else runs[:most]  # "and 1 more range" would be as long as the range
    text = ", ".join(span(a, b) for a, b in shown)
    return text + (f" and {plural(len(runs) - most, 'more range')}" if len(shown) < len(runs) else "")


def ages(recalled: Sequence[Recalled], now: float | None = None) -> str:
    """`41 min ago`, or the span `2 min ago – 41 min ago` when the blocks were stored at different times."""
    now = time.time() if now is None else now
    newest, oldest = age_text(min(r.age(now) for r in recalled)), age_text(max(r.age(now) for r in recalled))
    return oldest if newest == oldest else f"{newest} – {oldest}"


def recalled_line(recalled: Sequence[Recalled], now: float | None = None) -> str:
    """After a reply: what it read from the memory. `↺ recalled 3 blocks: tokens 3,100–3,483, 41 min ago`, and
    `; read again: 3,100–3,291` when the message named some of them (`Engine.feed_query`: fed again as text)."""
    again = [r for r in recalled if r.reread]
    tail = f"; read again: {token_ranges(again)}" if again else ""
    return f"↺ recalled {plural(len(recalled), 'block')}: tokens {token_ranges(recalled)}, {ages(recalled, now)}{tail}"


def recall_header(r: Recalled, now: float | None = None) -> str:
    """One block in /recall: `block 12 · tokens 3,100–3,163 · 41 min ago · in 27/30 layers`, and `· read again as
    text` for a block the message named (`Engine.feed_query`)."""
    age = age_text(r.age(time.time() if now is None else now))
    again = " · read again as text" if r.reread else ""
    return f"block {r.bid} · tokens {span(r.first, r.last)} · {age} · in {r.layers}/{r.of} layers{again}"


# ------------------------------------------------------------------------------------------------- /stats, /memory
def _forgotten_text(mem: MemoryStats) -> str:
    """The forgotten row: the tokens, and of them the copies of blocks read again (let go, the originals held)."""
    why = "over the budget, unreadable, /forget, /memory off or /clear"
    if not mem.copies:
        return f"{plural(mem.forgotten, 'token')} ({why})"
    return (f"{plural(mem.forgotten, 'token')}: {count(mem.copies)} of them copies of blocks read again, let go while "
            "the memory held their blocks" + ("" if mem.copies == mem.forgotten else f", the rest {why}"))


def memory_rows(mem: MemoryStats | None, replies: int = 0, reads: int = 0, last: int = 0,
                window_kv: int | None = None) -> list[tuple[str, str]]:
    """/stats rows of the recall memory: what it holds, what it forgot, its RAM, its region's KV in the cache
    (with `window_kv`, the window's, the sum the buffers hold), what the replies read from it (`reads` block reads
    over `replies` replies, `last` in the last one)."""
    if mem is None:
        return [("recall memory", "off (/memory on, or --memory on at start)")]
    rows = [
        ("recall memory", f"{plural(mem.blocks, 'block')}, {plural(mem.tokens, 'token')}, "
                          f"{human_bytes(mem.disk_bytes)} on disk (budget {human_bytes(mem.budget)})"),
        ("forgotten", _forgotten_text(mem)),
        ("memory RAM", f"index {human_bytes(mem.index_bytes)}, recalled blocks {human_bytes(mem.ram_bytes)}"),
    ]
    if isinstance(mem, MemoryFigures) and mem.region_bytes:
        total = "" if window_kv is None else (f"; with the window's {human_bytes(window_kv)}, "
                                              f"{human_bytes(window_kv + mem.region_bytes)} KV in all")
        rows.append(("memory KV", f"{human_bytes(mem.region_bytes)}: {plural(mem.region, 'slot')} a layer in front "
                                  f"of the window for the recalled blocks{total}"))
    rows.append(("recalled", f"{plural(reads, 'block')} read in {plural(replies, 'reply', 'replies')}; the last "
                             f"reply {count(last)} (/recall shows them)"))
    return rows
