"""What a new user read in the chat that did not match (the audit after issue 30):

- `/window 50` confirmed `4 sinks + window 50 = capacity 54`, and /stats right after said `pinned 26 + window 28`:
  the pinned system prompt took 22 of the 50;
- `1 more forgotten blocks`, `1 blocks`;
- ranges in two notations side by side, `tokens 26–89` (the recall line) under `[26,90)` (the eviction line);
- an eviction's preview cut inside a special token with nothing to say so: `...diversity<|i`.

Every figure is checked against the engine (its pinned slots, its capacity, the ledger's evictions), never against the
code that prints it.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import torch
from rich.console import Console

from sinkchat.apps.chat.repl import MAX_EVICTION_LINES, lines_reader
from sinkchat.apps.render import Renderer, stats_table
from sinkchat.core.events import EvictionEvent, ForgottenEvent

from test_memory_ui import LONG, make
from test_repl import fake_engine, make_loop

torch.set_num_threads(1)


def table_text(table: object) -> str:
    con = Console(record=True, width=200, file=io.StringIO())
    con.print(table)
    return con.export_text()


# ----------------------------------------------------------------------------------------------- /window, /sinks
@pytest.mark.parametrize("fed_first", [False, True], ids=["before-the-first-message", "mid-conversation"])
def test_window_n_is_the_window_stats_then_shows(fed_first: bool):
    eng = fake_engine(capacity=96, max_tokens=6)  # its system prompt is pinned: more leading slots than 4 sinks
    loop, _, err = make_loop(eng)
    if fed_first:
        loop.run(lines_reader(["hello there"]))
    mark = len(err.getvalue())
    loop.run(lines_reader(["/window 50"]))
    said = err.getvalue()[mark:]
    loop.run(lines_reader(["tell me more"]))  # the prompt is pinned by now either way
    s = loop.stats()
    assert s.pinned > s.n_sink == 4  # the case of the audit: a prompt pinned beyond the sinks
    m = re.search(r"pinned (\d+) .*\+ window (\d+) = capacity (\d+)", said)
    assert m, said  # was: "4 sinks + window 50 = capacity 54", with 50 - (pinned - 4) the real window
    assert (int(m.group(1)), int(m.group(2)), int(m.group(3))) == (s.pinned, 50, s.capacity)
    assert s.capacity - s.pinned == 50 == eng.cache_cfg.capacity - eng.pinned_slots()
    assert f"pinned {s.pinned} + window 50" in table_text(stats_table(s))  # /stats says the same


def test_every_cache_confirmation_names_the_window_it_leaves():
    """/sinks and /policy share the confirmation: its window is always capacity - the slots kept in front."""
    eng = fake_engine(capacity=96, max_tokens=6)
    loop, _, err = make_loop(eng)
    loop.run(lines_reader(["hello there"]))
    for cmd in ["/sinks 2", "/window 40", "/sinks 6", "/policy window", "/policy sink"]:
        mark = len(err.getvalue())
        loop.run(lines_reader([cmd]))
        said = err.getvalue()[mark:]
        c = eng.cache_cfg
        if c.policy == "sink":
            assert f"+ window {c.capacity - eng.pinned_slots()} = capacity {c.capacity}" in said, (cmd, said)
        else:
            assert f"capacity {c.capacity}, nothing pinned" in said
    assert "sinks + N" not in err.getvalue()


# ----------------------------------------------------------------------------------------------- words and ranges
@pytest.mark.parametrize("kind", ["eviction", "forgotten range"])
def test_the_turn_summary_counts_in_words_and_one_notation(kind: str):
    """Past `MAX_EVICTION_LINES` a turn's evictions (or forgotten ranges) are summed in one line."""
    loop, _, err = make_loop(fake_engine(capacity=96))
    n = MAX_EVICTION_LINES
    events = ([EvictionEvent(3, 10 * i, 10 * i + 3, "x", "sink", 60) for i in range(n + 1)] if kind == "eviction"
              else [ForgottenEvent(8, 100 + 8 * i, 108 + 8 * i, "budget") for i in range(n + 1)])
    loop._deferred = list(events)
    loop._show_turn_evictions()
    text, last = err.getvalue(), events[-1]
    # was: `1 more evictions ... [60,63)` / `1 more forgotten blocks ... [148,156)`, under lines saying 0–2
    assert text.endswith(f"and 1 more {kind} this turn: {last.count} tokens {last.first}–{last.last - 1}\n"), text
    assert not re.search(r"\[\d+,\d+\)", text)


def test_the_chat_shows_every_range_in_one_notation(tmp_path: Path):
    """Evictions, the recall line and /recall: inclusive ranges only, each the ledger's [first, last)."""
    loop, _, err = make(tmp_path / "m")
    loop.run(lines_reader([LONG, "tell me more about things", "/recall", "/evictions"]))
    text = err.getvalue()
    assert "⟂ evicted" in text and "↺ recalled" in text and re.search(r"block \d+ · tokens", text)
    assert not re.search(r"\[[\d,]+, ?[\d,]+\)", text), text  # was: `[18,64)` beside `tokens 18–65`
    for ev in loop.metrics.evictions:
        assert f"⟂ evicted {ev.count} tokens {ev.first:,}–{ev.last - 1:,} to memory (" in text


def test_one_of_a_kind_reads_in_the_singular(tmp_path: Path):
    from sinkchat.apps.memory_view import memory_rows, recalled_line
    from sinkchat.memory.report import MemoryStats, Recalled

    rows = dict(memory_rows(MemoryStats(1, 1, 1, 512, 1 << 20, 64, 64), replies=1, reads=1, last=1))
    assert rows["recall memory"].startswith("1 block, 1 token, ")  # was: 1 blocks, 1 tokens
    assert rows["forgotten"].startswith("1 token ") and rows["recalled"].startswith("1 block read in 1 reply;")
    assert recalled_line([Recalled(0, 64, 128, 0.0, 1, 2)], now=5.0) == "↺ recalled 1 block: tokens 64–127, 5 s ago"
    loop, _, err = make_loop(fake_engine(capacity=96))
    loop.run(lines_reader(["hi", "/evictions", "/clear"]))
    assert not re.search(r"\b1 (tokens|blocks|evictions|messages|ranges|replies)\b", err.getvalue())


# ----------------------------------------------------------------------------------------------- the preview
CUT = "the study measured genetic and ecological diversity<|im_end|> more"[:60]  # as the engine cuts it


@pytest.mark.parametrize("preview,shown", [
    (CUT, "the study measured genetic and ecological diversity…"),  # was: ...diversity<|im_end| (no >)
    ("lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod"[:60],
     "lorem ipsum dolor sit amet consectetur adipiscing elit sed…"),  # `d` of `do`: a word cut, dropped
    ("a short preview <|im_end|>", "a short preview <|im_end|>"),  # the whole text: no cut, no mark
])
def test_an_eviction_preview_is_cut_at_a_clean_boundary_and_says_so(preview: str, shown: str):
    err = io.StringIO()
    Renderer(io.StringIO(), err, tty=False).eviction(EvictionEvent(64, 26, 90, preview, "sink", 41))
    assert err.getvalue() == f"⟂ evicted 64 tokens 26–89 (sink, 41 left): {shown!r}\n"


def test_the_preview_cut_is_the_engines():
    from sinkchat.apps.render import PREVIEW_CHARS
    from sinkchat.core.engine import PREVIEW_CHARS as ENGINE_CUT

    assert PREVIEW_CHARS == ENGINE_CUT
