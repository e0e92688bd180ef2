"""Everything the chat REPL shows, kept apart from the loop so both paths share it.

Two modes behind one `Renderer`: on a terminal, rich output with colours and a transient live status line under the
streaming reply; off a terminal, plain reply text on stdout and everything else (events, stats, messages) on stderr,
so `sinkchat chat < questions.txt > answers.txt` gives clean answers. A script that must split answers with several
lines asks for `fmt="jsonl"` (one JSON object per answer, nothing else on stdout) or a `separator` line after each
answer. Evictions during a reply are shown after it (the loop defers them), never between its lines. The toolbar text
is a pure function of `Stats` and, with the recall memory on, its `MemoryStats` (pgcli style), so tests can check it
without a terminal. How the memory itself is shown (its field, its /stats rows, the recall line, the KV its region
takes apart from the window's) is `memory_view`'s; ranges are written in its one notation (`span`, inclusive).

rich is imported only where something is drawn with it: on a terminal, a /stats table, or a line rich would print
otherwise than as itself. Off a terminal a message line is plain text, and a line with no tab, control character or
trailing space (`plain`) is written as rich writes it, itself and a newline, without importing rich (0.12 s of a
piped chat's start at load 2-3 on the 2-core box; `tests/test_startup_light.py` compares the two on many lines).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Sequence, TextIO

from sinkchat.apps.memory_view import (MemoryFigures, fit_memory, memory_variants, plural, span,
                                       window_stats)
from sinkchat.core.events import PREVIEW_CHARS, DoneEvent, EvictionEvent, ForgottenEvent
from sinkchat.core.metrics import (FIELDS, Metrics, Stats, gauge_bar, human_bytes, read_stats, status_line,
                                   status_variants)
from sinkchat.memory.report import MemoryStats

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
FORGOTTEN_WHY = {"budget": "over the memory budget", "disk": "the memory store could not write them",
                 "damaged": "their memory block failed its checksum"}


def clip_preview(text: str, limit: int = PREVIEW_CHARS) -> str:
    """An eviction's preview as shown: the engine cuts it at `limit` characters, which can fall inside a word or a
    special token (`...diversity<|i`); such a cut goes back to the last clean boundary (before the unclosed `<`,
    else the last space) and is marked with an ellipsis. A preview shorter than `limit` is the whole text."""
    if len(text) < limit:
        return text
    cut = text
    if cut.rfind("<") > cut.rfind(">"):  # a special token (`<|im_end|>`) cut inside: drop its start
        cut = cut[: cut.rfind("<")]
    elif " " in cut.strip():
        cut = cut[: cut.rstrip().rfind(" ")]  # the last word may be cut: drop it
    return cut.rstrip() + "…"


def eviction_text(ev: EvictionEvent | ForgottenEvent) -> str:
    """One line per eviction or forgotten range in the chat, its range in the chat's one notation (`span`,
    inclusive) and its preview cut cleanly (`clip_preview`): `⟂ evicted 64 tokens 26–89 to memory (sink, 41 left):
    'the first…'`. (`metrics.eviction_line`, which the agent and summarize print, still says [26,90).)"""
    if not isinstance(ev, EvictionEvent):
        return f"⟂ forgotten {plural(ev.count, 'token')} {span(ev.first, ev.last)} " \
               f"({FORGOTTEN_WHY.get(ev.reason, ev.reason)})"
    where = " to memory" if ev.to_memory else ""
    return (f"⟂ evicted {plural(ev.count, 'token')} {span(ev.first, ev.last)}{where} ({ev.policy}, "
            f"{ev.cache_len} left): {clip_preview(ev.preview)!r}")


def toolbar_fragments(s: Stats, width: int = 200, mem: MemoryStats | None = None) -> Fragments:
    """The bottom toolbar as prompt-toolkit (style, text) fragments: the status line's fields (`status_variants`,
    toolbar spelling), fitted to `width` columns by dropping lower-priority fields whole (`fit_fields`): the cache
    fill and the evictions stay longest, the gauge bar shrinks and goes first, never a field cut in the middle.
    `mem`: the recall memory's figures, shown right after the evictions (`fit_memory`); with its region's KV
    (`MemoryFigures`), the `kv` field shows the window's alone (`window_stats`) and the memory's field the region's."""
    texts, mtext = fit_memory(status_variants(window_stats(s, mem), toolbar=True), memory_variants(mem), width - 3, 2)
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


def status_text(s: Stats, mem: MemoryStats | None = None, width: int | None = None) -> str:
    """`status_line` with the recall memory's field after the evictions (`mem`: None when the memory is off); the
    `kv` field's bytes are the window's, those of the slots its fraction counts (`toolbar_fragments`)."""
    if mem is None:
        return status_line(s, width)
    texts, mtext = fit_memory(status_variants(window_stats(s, mem)), memory_variants(mem),
                              width if width is not None else 1 << 30, 3)
    parts = []
    for name in FIELDS:
        if texts[name]:
            parts.append(texts[name])
        if name == "seen" and mtext:
            parts.append(mtext)
    return " | ".join(parts)


def stats_table(s: Stats, memory: Sequence[tuple[str, str]] = (), mem: MemoryStats | None = None) -> Table:
    """The /stats table; `memory`: the recall memory's rows (`memory_rows`), after the tokens evicted. `mem`: its
    figures; with its region's KV (`MemoryFigures`) the cache row counts the window's KV alone, the region's in its
    own row (`memory KV`), so each KV figure is that of the slots beside it."""
    from rich.table import Table

    split = isinstance(mem, MemoryFigures) and mem.region_bytes > 0
    s = window_stats(s, mem)

    t = Table(title="sinkchat stats", show_header=False, box=None, pad_edge=False)
    t.add_column("what", style="bold")
    t.add_column("value")
    rows = [
        ("policy", f"{s.policy} ({plural(s.n_sink, 'sink')})" if s.policy == "sink" else s.policy),
        ("pinned", f"pinned {s.pinned} + window {s.capacity - s.pinned} (the system prompt, sinks included)"
         if s.pinned > s.n_sink else "-"),
        ("cache", f"{s.cache_len}/{s.capacity} tokens, {human_bytes(s.kv_bytes)} KV"
                  + (" in the window (+ memory KV)" if split else "")
                  + (f" ({s.kv_layout})" if s.kv_layout else "")
                  + (f", {human_bytes(s.kv_allocated)} allocated so far (the local rings grow to it with longer "
                     "chunks)" if 0 < s.kv_allocated < s.kv_bytes else "")),
        ("model", human_bytes(s.model_bytes)),
        ("rss", human_bytes(s.rss)),
        ("cuda", f"{human_bytes(s.cuda[0])} (peak {human_bytes(s.cuda[1])})" if s.cuda else "-"),
        ("tokens seen", str(s.seen)),
        ("tokens evicted", f"{s.evicted} in {plural(s.evictions, 'eviction')}"),
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
        line = eviction_text(ev)
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
