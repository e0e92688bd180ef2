"""Everything the chat REPL shows, kept apart from the loop so both paths share it.

Two modes behind one `Renderer`: on a terminal, rich output with colours and a transient live status line under the
streaming reply; off a terminal, plain reply text on stdout and everything else (events, stats, messages) on stderr,
so `sinkchat chat < questions.txt > answers.txt` gives clean answers. A script that must split answers with several
lines asks for `fmt="jsonl"` (one JSON object per answer, nothing else on stdout) or a `separator` line after each
answer. Evictions during a reply are shown after it (the loop defers them), never between its lines. The toolbar text
is a pure function of `Stats` (pgcli style), so tests can check it without a terminal.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Callable, TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from sinkchat.core.events import DoneEvent, EvictionEvent, ForgottenEvent
from sinkchat.core.metrics import (FIELDS, Metrics, Stats, eviction_line, fit_fields, gauge_bar, human_bytes,
                                   read_stats, status_line, status_variants)

Fragments = list[tuple[str, str]]


def live_stats(engine: Any, metrics: Metrics, model_nbytes: int | None = None) -> Stats:
    """The Stats a client shows. Both eviction figures, tokens and count, come from one source, the client's
    `Metrics` fold of EvictionEvents: a /clear drops tokens without evicting them, and after a snapshot load the
    Metrics are seeded with the snapshot's own figures, so the tokens never mix one count with another's events."""
    return replace(read_stats(engine, metrics, model_nbytes), evicted=metrics.evicted)


# ------------------------------------------------------------------------------------------------- pure text pieces
def toolbar_fragments(s: Stats, width: int = 200) -> Fragments:
    """The bottom toolbar as prompt-toolkit (style, text) fragments: the status line's fields (`status_variants`,
    toolbar spelling), fitted to `width` columns by dropping lower-priority fields whole (`fit_fields`): the cache
    fill and the evictions stay longest, the gauge bar shrinks and goes first, never a field cut in the middle."""
    texts = fit_fields(status_variants(s, toolbar=True), width - 3, 2)  # a space each side (+1: seen / evicted split)
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
        elif texts[name]:
            frags.append((style.get(name, "class:toolbar"), f" {texts[name]} "))
    return frags


def toolbar_text(s: Stats, width: int = 200) -> str:
    """The toolbar as one plain string (what a test or a screen capture reads)."""
    return "".join(t for _, t in toolbar_fragments(s, width))


def stats_table(s: Stats) -> Table:
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
        ("decode", f"{s.decode_tok_s:.1f} tok/s (p50 {s.p50_ms:.0f} ms, p99 {s.p99_ms:.0f} ms)"),
        ("prefill", f"{s.prefill_tok_s:.1f} tok/s"),
        ("decoder", s.decoder or "-"),
        ("sink gauge", "n/a" if s.gauge is None else
         f"{gauge_bar(s.gauge)} {s.gauge:.3f} (recent {s.gauge_recent:.3f}, uniform {s.gauge_uniform:.3f})"
         + (" on the global layers" if s.kv_layout else "")),
        *([("local layers", f"{s.gauge_local:.3f} on the first tokens of their window (uniform "
                            f"{s.gauge_local_uniform:.3f})")] if s.gauge_local is not None else []),
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
        self.out = Console(file=out, force_terminal=tty, no_color=not tty, highlight=False, markup=False,
                           soft_wrap=True, emoji=False)
        self.err = Console(file=err, force_terminal=tty, no_color=not tty, highlight=False, markup=False,
                           soft_wrap=True, emoji=False, stderr=True)
        self.use_live = tty if live is None else live
        self.stats = stats
        self._live: Live | None = None
        self._partial = ""
        self.at_line_start = True

    # -- messages (command feedback goes to stderr off a terminal so stdout stays reply-only)
    @property
    def msg(self) -> Console:
        return self.out if self.tty else self.err

    def info(self, text: str, style: str = "cyan") -> None:
        self.msg.print(Text(text, style=style))

    def error(self, text: str) -> None:
        self.msg.print(Text(text, style="bold red"))

    def table(self, table: Any) -> None:
        self.msg.print(table)

    def status(self, s: Stats) -> None:
        """After a reply off a terminal: the one-line status on stderr."""
        if not self.tty:
            self.err.print(Text(status_line(s)))

    # -- streaming a reply
    def begin_reply(self) -> None:
        self._partial = ""
        self.at_line_start = True
        if self.use_live and self.stats is not None:
            self._live = Live(get_renderable=self._live_view, console=self.out, transient=True,
                              refresh_per_second=6, redirect_stdout=False, redirect_stderr=False)
            self._live.start()

    def token(self, text: str) -> None:
        if not text or self.fmt == "jsonl":
            return
        if self._live is None:
            self._write(text)
            return
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
            self.err.print(Text(line))
        elif self._live is not None:
            self.out.print(Text(line, style="dim yellow"))
        else:
            if not self.at_line_start:
                self._write("\n")
            self.out.print(Text(line, style="dim yellow"))
            self.at_line_start = True

    def end_reply(self, done: DoneEvent | None, interrupted: bool = False, unsent: str | None = None) -> None:
        """Close the reply. `unsent`: why the prompt itself was cut (interrupted while being fed), if it was."""
        if self._live is not None:
            live, self._live = self._live, None
            live.stop()
            if self._partial:
                self.out.print(Text(self._partial, style="green"), end="")
                self.at_line_start = False
            self._partial = ""
        if not self.at_line_start:
            self._write("\n")
        if unsent:
            self.msg.print(Text(f"^C {unsent}", style="yellow"))
        elif interrupted:
            self.msg.print(Text("^C reply stopped (the partial reply stays in the cache)", style="yellow"))
        elif done is not None and done.reason == "length":
            how = "/set max_tokens N" if self.tty else "--max-tokens N"  # piped: there is no prompt to type at
            self.msg.print(Text(f"[reply cut at max_tokens={done.tokens}; {how} to change]", style="dim"))

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
            self.out.print(Text(text, style="green"), end="")
        else:
            self.out_file.write(text)
        self.out_file.flush()
        self.at_line_start = text.endswith("\n")

    def _live_view(self) -> Group:
        partial = self._partial
        try:  # runs on rich's refresh thread while the engine works: never let a reading error kill it
            status = status_line(self.stats(), max(20, self.out.width - 1)) if self.stats else ""
            self._last_status = status
        except Exception:  # noqa: BLE001
            status = getattr(self, "_last_status", "")
        return Group(Text(partial, style="green"), Text(status, style="reverse dim", no_wrap=True, overflow="ellipsis"))
