"""Everything the chat REPL shows, kept apart from the loop so both paths share it.

Two modes behind one `Renderer`: on a terminal, rich output with colours and a transient live status line under the
streaming reply; off a terminal, plain reply text on stdout and everything else (events, stats, messages) on stderr,
so `sinkchat chat < questions.txt > answers.txt` gives clean answers. A script that must split answers with several
lines asks for `fmt="jsonl"` (one JSON object per answer, nothing else on stdout) or a `separator` line after each
answer. Evictions during a reply are shown after it (the loop defers them), never between its lines. The toolbar text
is a pure function of `Stats` and, with the recall memory on, its `MemoryStats` (pgcli style), so tests can check it
without a terminal.

rich is imported only where something is drawn with it: on a terminal, a /stats table, or a line rich would print
otherwise than as itself. Off a terminal a message line is plain text, and a line with no tab, control character or
trailing space (`plain`) is written as rich writes it, itself and a newline, without importing rich (0.12 s of a
piped chat's start at load 2-3 on the 2-core box; `tests/test_startup_light.py` compares the two on many lines).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Sequence, TextIO

from sinkchat.core.events import DoneEvent, EvictionEvent, ForgottenEvent
from sinkchat.core.metrics import (FIELDS, Metrics, Stats, eviction_line, fit_fields, gauge_bar, human_bytes,
                                   read_stats, status_line, status_variants)
from sinkchat.memory.report import MemoryStats, Recalled

if TYPE_CHECKING:
    from rich.console import Console, Group
    from rich.live import Live
    from rich.table import Table

Fragments = list[tuple[str, str]]


def plain(text: str) -> bool:
    """Whether a rich Console off a terminal (no colour, soft wrap, no markup, highlighting or emoji: `Renderer`'s)
    prints `Text(text)` as `text` and a newline: no tab (expanded), no control character (some stripped), no
    trailing whitespace (rich may crop it at the width) on any line."""
    return all(line.isprintable() and line == line.rstrip() for line in text.split("\n"))


def live_stats(engine: Any, metrics: Metrics, model_nbytes: int | None = None) -> Stats:
    """The Stats a client shows. Both eviction figures, tokens and count, come from one source, the client's
    `Metrics` fold of EvictionEvents: a /clear drops tokens without evicting them, and after a snapshot load the
    Metrics are seeded with the snapshot's own figures, so the tokens never mix one count with another's events."""
    return replace(read_stats(engine, metrics, model_nbytes), evicted=metrics.evicted)


# ------------------------------------------------------------------------------------------------- pure text pieces
def toolbar_fragments(s: Stats, width: int = 200, mem: MemoryStats | None = None) -> Fragments:
    """The bottom toolbar as prompt-toolkit (style, text) fragments: the status line's fields (`status_variants`,
    toolbar spelling), fitted to `width` columns by dropping lower-priority fields whole (`fit_fields`): the cache
    fill and the evictions stay longest, the gauge bar shrinks and goes first, never a field cut in the middle.
    `mem`: the recall memory's figures, shown right after the evictions (`fit_memory`)."""
    texts, mtext = fit_memory(status_variants(s, toolbar=True), memory_variants(mem), width - 3, 2)
    if texts["seen"].startswith("seen "):  # tokens seen and evicted apart, the evictions in their own colour
        seen, _, evicted = texts["seen"].partition(" evicted ")
        parts = [("class:toolbar", seen), ("class:toolbar.evicted", f"evicted {evicted}")]
    else:
        parts = [("class:toolbar.evicted", texts["seen"])] if texts["seen"] else []
    style = {"policy": "class:toolbar.policy", "kv": "class:toolbar.kv", "gauge": "class:toolbar.gauge"}
    frags: Fragments = []
    for name in FIELDS:
        if name == "seen":
            frags += [(st, f" {t} ") for st, t in parts]
            if mtext:
                frags.append(("class:toolbar.memory", f" {mtext} "))
        elif texts[name]:
            frags.append((style.get(name, "class:toolbar"), f" {texts[name]} "))
    return frags


def toolbar_text(s: Stats, width: int = 200, mem: MemoryStats | None = None) -> str:
    """The toolbar as one plain string (what a test or a screen capture reads)."""
    return "".join(t for _, t in toolbar_fragments(s, width, mem))


# ------------------------------------------------------------------------------------------------- the recall memory
def count(n: int) -> str:
    """A figure with thousands separators: 52,123."""
    return f"{n:,}"


def compact(n: int) -> str:
    """A figure for a narrow line: 3,840 below ten thousand, then 52k, 1.2M."""
    return count(n) if n < 10_000 else f"{n / 1000:.0f}k" if n < 1_000_000 else f"{n / 1e6:.1f}M"


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
    d = s // 86400
    return f"{d} day{'s' if d > 1 else ''} ago"


def memory_variants(mem: MemoryStats | None) -> list[str]:
    """The memory's status field, longest first ("" = not shown): `mem 412 blk · 52,123 tok · 310.0 MiB` (blocks
    indexed, tokens held, bytes on disk), then `mem 52k tok`. Memory off: nothing."""
    if mem is None:
        return [""]
    return [f"mem {count(mem.blocks)} blk · {count(mem.tokens)} tok · {human_bytes(mem.disk_bytes)}",
            f"mem {compact(mem.tokens)} tok", ""]


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


def status_text(s: Stats, mem: MemoryStats | None = None, width: int | None = None) -> str:
    """`status_line` with the recall memory's field after the evictions (`mem`: None when the memory is off)."""
    if mem is None:
        return status_line(s, width)
    texts, mtext = fit_memory(status_variants(s), memory_variants(mem), width if width is not None else 1 << 30, 3)
    parts = []
    for name in FIELDS:
        if texts[name]:
            parts.append(texts[name])
        if name == "seen" and mtext:
            parts.append(mtext)
    return " | ".join(parts)


def token_ranges(recalled: Sequence[Recalled], most: int = 4) -> str:
    """The stream ranges of recalled blocks, consecutive blocks joined, inclusive ends: `3,100–3,483` (blocks
    [3100, 3164) ... [3420, 3484)); past `most` + 1 ranges, the first `most` and how many more."""
    runs: list[list[int]] = []
    for r in sorted(recalled, key=lambda r: r.first):
        if runs and runs[-1][1] == r.first:
            runs[-1][1] = r.last
        else:
            runs.append([r.first, r.last])
    shown = runs if len(runs) <= most + 1 else runs[:most]  # "and 1 more range" would be as long as the range
    text = ", ".join(f"{count(a)}–{count(b - 1)}" for a, b in shown)
    return text + (f" and {len(runs) - most} more ranges" if len(shown) < len(runs) else "")


def ages(recalled: Sequence[Recalled], now: float | None = None) -> str:
    """`41 min ago`, or the span `2 min ago – 41 min ago` when the blocks were stored at different times."""
    now = time.time() if now is None else now
    newest, oldest = age_text(min(r.age(now) for r in recalled)), age_text(max(r.age(now) for r in recalled))
    return oldest if newest == oldest else f"{newest} – {oldest}"


def recalled_line(recalled: Sequence[Recalled], now: float | None = None) -> str:
    """After a reply: what it read from the memory. `↺ recalled 3 blocks: tokens 3,100–3,483, 41 min ago`."""
    n = len(recalled)
    return (f"↺ recalled {n} block{'s' if n != 1 else ''}: tokens {token_ranges(recalled)}, "
            f"{ages(recalled, now)}")


def recall_header(r: Recalled, now: float | None = None) -> str:
    """One block in /recall: `block 12 · tokens 3,100–3,163 · 41 min ago · in 27/30 layers`."""
    age = age_text(r.age(time.time() if now is None else now))
    return f"block {r.bid} · tokens {count(r.first)}–{count(r.last - 1)} · {age} · in {r.layers}/{r.of} layers"


def memory_rows(mem: MemoryStats | None, replies: int = 0, reads: int = 0, last: int = 0) -> list[tuple[str, str]]:
    """/stats rows of the recall memory: what it holds, what it forgot, its RAM, what the replies read from it
    (`reads` block reads over `replies` replies, `last` in the last one)."""
    if mem is None:
        return [("recall memory", "off (/memory on, or --memory on at start)")]
    return [
        ("recall memory", f"{count(mem.blocks)} blocks, {count(mem.tokens)} tokens, {human_bytes(mem.disk_bytes)} on "
                          f"disk (budget {human_bytes(mem.budget)})"),
        ("forgotten", f"{count(mem.forgotten)} tokens (over the budget, unreadable, or /forget)"),
        ("memory RAM", f"index {human_bytes(mem.index_bytes)}, recalled blocks {human_bytes(mem.ram_bytes)}"),
        ("recalled", f"{count(reads)} blocks read in {count(replies)} replies; the last reply {count(last)} "
                     "(/recall shows them)"),
    ]


def stats_table(s: Stats, memory: Sequence[tuple[str, str]] = ()) -> Table:
    """The /stats table; `memory`: the recall memory's rows (`memory_rows`), after the tokens evicted."""
    from rich.table import Table

    t = Table(title="sinkchat stats", show_header=False, box=None, pad_edge=False)
    t.add_column("what", style="bold")
    t.add_column("value")
    rows = [
        ("policy", f"{s.policy} ({s.n_sink} sinks)" if s.policy == "sink" else s.policy),
        ("pinned", f"pinned {s.pinned} + window {s.capacity - s.pinned} (the system prompt, sinks included)"
         if s.pinned > s.n_sink else "-"),
        ("cache", f"{s.cache_len}/{s.capacity} tokens, {human_bytes(s.kv_bytes)} KV"
                  + (f" ({s.kv_layout})" if s.kv_layout else "")
                  + (f", {human_bytes(s.kv_allocated)} allocated so far (the local rings grow to it with longer "
                     "chunks)" if 0 < s.kv_allocated < s.kv_bytes else "")),
        ("model", human_bytes(s.model_bytes)),
        ("rss", human_bytes(s.rss)),
        ("cuda", f"{human_bytes(s.cuda[0])} (peak {human_bytes(s.cuda[1])})" if s.cuda else "-"),
        ("tokens seen", str(s.seen)),
        ("tokens evicted", f"{s.evicted} in {s.evictions} evictions"),
        *([("tokens cleared", f"{s.cleared} (/clear or a load: dropped, not evicted)")] if s.cleared else []),
        *memory,
        ("decode", f"{s.decode_tok_s:.1f} tok/s (p50 {s.p50_ms:.0f} ms, p99 {s.p99_ms:.0f} ms)"),
        ("prefill", f"{s.prefill_tok_s:.1f} tok/s"),
        ("decoder", s.decoder or "-"),
        ("sink gauge", "n/a" if s.gauge is None else
         f"{gauge_bar(s.gauge)} {s.gauge:.3f} (recent {s.gauge_recent:.3f}, uniform {s.gauge_uniform:.3f})"
         + (" on the global layers" if s.kv_layout else "")),
        *([("local layers", f"{s.gauge_local:.3f} on the first tokens of their window (uniform "
                            f"{s.gauge_local_uniform:.3f})")] if s.gauge_local is not None else []),
        *([("recalled share", f"{gauge_bar(s.gauge_memory)} {s.gauge_memory:.3f} of the newest token's attention on "
                              "the recalled memory blocks")] if s.gauge_memory is not None else []),
        ("holds stream start", "yes" if s.holds_start else "no"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    return t


# ------------------------------------------------------------------------------------------------- the renderer
class Renderer:
    """Output for the chat loop. `tty=False` means: no colours, no live display, replies alone on `out`.
    `fmt="jsonl"` (implies no tty): replies are not streamed; each answer is one JSON line on `out` (`answer`).
    `separator`: in text mode, a line printed after every answer, so multi-line answers can be told apart."""

    def __init__(self, out: TextIO, err: TextIO, tty: bool, live: bool | None = None,
                 stats: Callable[[], Stats] | None = None, fmt: str = "text", separator: str | None = None) -> None:
        if fmt not in ("text", "jsonl"):
            raise ValueError(f"unknown output format {fmt!r}")
        tty = tty and fmt == "text"
        self.fmt, self.separator = fmt, separator
        self.tty = tty
        self.out_file, self.err_file = out, err
        self._consoles: dict[str, Console] = {}  # "out" / "err": made on first use (`console`)
        self.use_live = tty if live is None else live
        self.stats = stats
        self.memory: Callable[[], MemoryStats | None] = lambda: None  # the recall memory's figures (chat sets it)
        self._live: Live | None = None
        self._partial = ""
        self.at_line_start = True

    # -- the two rich Consoles, made on first use
    def console(self, which: str) -> Console:
        """The rich Console writing to `out` ("out") or `err` ("err")."""
        con = self._consoles.get(which)
        if con is None:
            from rich.console import Console

            tty = self.tty
            con = self._consoles[which] = Console(
                file=self.out_file if which == "out" else self.err_file, force_terminal=tty, no_color=not tty,
                highlight=False, markup=False, soft_wrap=True, emoji=False, stderr=which == "err")
        return con

    out = property(lambda self: self.console("out"), doc="the Console on `out`")
    err = property(lambda self: self.console("err"), doc="the Console on `err`")

    def say(self, which: str, text: str, style: str = "") -> None:
        """`console(which).print(Text(text, style=style))`; off a terminal a `plain` line is written as rich writes
        it (then flushed, as rich does), without importing rich, until that Console exists."""
        if not self.tty and which not in self._consoles and plain(text):
            f = self.out_file if which == "out" else self.err_file
            try:
                f.write(text + "\n")
                f.flush()
                return
            except BrokenPipeError:
                self.console(which).on_broken_pipe()  # rich's own answer: quiet, stdout to /dev/null, exit 1
            except UnicodeEncodeError:
                pass  # (nothing was written) rich raises it, with its hint
        from rich.text import Text

        self.console(which).print(Text(text, style=style))

    # -- messages (command feedback goes to stderr off a terminal so stdout stays reply-only)
    @property
    def msg(self) -> Console:
        return self.console(self._msg)

    @property
    def _msg(self) -> str:
        return "out" if self.tty else "err"

    def info(self, text: str, style: str = "cyan") -> None:
        self.say(self._msg, text, style)

    def error(self, text: str) -> None:
        self.say(self._msg, text, "bold red")

    def table(self, table: Any) -> None:
        self.msg.print(table)

    def status(self, s: Stats) -> None:
        """After a reply off a terminal: the one-line status on stderr."""
        if not self.tty:
            self.say("err", status_text(s, self.memory()))

    # -- streaming a reply
    def begin_reply(self) -> None:
        self._partial = ""
        self.at_line_start = True
        if self.use_live and self.stats is not None:
            from rich.live import Live

            self._live = Live(get_renderable=self._live_view, console=self.out, transient=True,
                              refresh_per_second=6, redirect_stdout=False, redirect_stderr=False)
            self._live.start()

    def token(self, text: str) -> None:
        if not text or self.fmt == "jsonl":
            return
        if self._live is None:
            self._write(text)
            return
        from rich.text import Text

        # Only this thread writes _partial; the live refresh thread just reads the (immutable) string.
        partial = self._partial + text
        done, nl, partial = partial.rpartition("\n")
        if nl:
            self.out.print(Text(done, style="green"))  # printed above the live status
        width = max(20, self.out.width - 1)
        while len(partial) > width:  # flush soft-wrapped rows so the live area stays small
            cut = partial.rfind(" ", 0, width)
            cut = cut if cut > width // 2 else width
            self.out.print(Text(partial[:cut], style="green"))
            partial = partial[cut:].lstrip(" ")
        self._partial = partial
        self._live.refresh()

    def eviction(self, ev: EvictionEvent | ForgottenEvent) -> None:
        line = eviction_line(ev)
        if not self.tty:
            self.say("err", line)
        elif self._live is not None:
            self.say("out", line, "dim yellow")
        else:
            if not self.at_line_start:
                self._write("\n")
            self.say("out", line, "dim yellow")
            self.at_line_start = True

    def end_reply(self, done: DoneEvent | None, interrupted: bool = False, unsent: str | None = None) -> None:
        """Close the reply. `unsent`: why the prompt itself was cut (interrupted while being fed), if it was."""
        if self._live is not None:
            live, self._live = self._live, None
            live.stop()
            if self._partial:
                from rich.text import Text

                self.out.print(Text(self._partial, style="green"), end="")
                self.at_line_start = False
            self._partial = ""
        if not self.at_line_start:
            self._write("\n")
        if unsent:
            self.say(self._msg, f"^C {unsent}", "yellow")
        elif interrupted:
            self.say(self._msg, "^C reply stopped (the partial reply stays in the cache)", "yellow")
        elif done is not None and done.reason == "length":
            how = "/set max_tokens N" if self.tty else "--max-tokens N"  # piped: there is no prompt to type at
            self.say(self._msg, f"[reply cut at max_tokens={done.tokens}; {how} to change]", "dim")

    def answer(self, record: dict[str, Any]) -> None:
        """The end of one answer: its JSON line (jsonl), or the separator line (text, if one was asked for)."""
        if self.fmt == "jsonl":
            self.out_file.write(json.dumps(record, ensure_ascii=False) + "\n")
        elif self.separator is not None:
            self._write(self.separator + "\n")
        else:
            return
        self.out_file.flush()

    def _write(self, text: str) -> None:
        if self.tty:
            from rich.text import Text

            self.out.print(Text(text, style="green"), end="")
        else:
            self.out_file.write(text)
        self.out_file.flush()
        self.at_line_start = text.endswith("\n")

    def _live_view(self) -> Group:
        from rich.console import Group
        from rich.text import Text

        partial = self._partial
        try:  # runs on rich's refresh thread while the engine works: never let a reading error kill it
            status = status_text(self.stats(), self.memory(), max(20, self.out.width - 1)) if self.stats else ""
            self._last_status = status
        except Exception:  # noqa: BLE001
            status = getattr(self, "_last_status", "")
        return Group(Text(partial, style="green"), Text(status, style="reverse dim", no_wrap=True, overflow="ellipsis"))
