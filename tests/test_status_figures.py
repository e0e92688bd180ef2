"""The status line's figures (issue 32): what a new user saw that did not add up.

- mid-feed the line read `kv 1689/2048 | seen 1433 evicted 0`: the cache's length runs a chunk ahead of the ledger
  while that chunk is computed (and the live line is read on another thread right then);
- the rate stayed the last reply's decode rate through a 10-second feed;
- on Gemma at 160 columns the line was cut at the edge (`sink ██████`): the local layers' figure never showed;
- Gemma's KV figure went from 15.4 to 19.0 MiB mid-session (the local rings grow with the longest chunk).
"""

from __future__ import annotations

import io
import re

import pytest
import torch

from sinkchat.apps.render import toolbar_text
from sinkchat.apps.summarize import status as summarize_status
from sinkchat.apps.summarize import summarizer
from sinkchat.config import CacheConfig
from sinkchat.core.events import DoneEvent, PrefillEvent, TokenEvent
from sinkchat.core.metrics import Metrics, Stats, read_stats, status_line

from test_hybrid import F, S, engine, gemma3, random_ids, stream

torch.set_num_threads(1)


def _inside_forwards(eng, metrics: Metrics) -> list[Stats]:
    """What a status read on another thread sees while each model call runs: the cache already holds the chunk
    being computed (`SinkLayer.update` / `advance`), the ledger not yet."""
    seen: list[Stats] = []
    run = eng._run

    def spying(ids, L, all_logits):
        out = run(ids, L, all_logits)
        assert eng.cache.length == L + len(ids) > len(eng.ledger)  # the moment the issue describes
        seen.append(read_stats(eng, metrics, model_nbytes=0))
        return out

    eng._run = spying
    return seen


def test_the_figures_add_up_while_a_chunk_is_computed():
    eng = engine(gemma3([S, F]), CacheConfig("sink", 4, 64, 6))
    m = Metrics()
    during = _inside_forwards(eng, m)
    eng.prefill_chunk = 16
    for ev in eng.feed_ids(random_ids(150)):
        m.fold(ev)
    assert len(during) == 10 and eng.ledger.evicted > 0
    for s in during:  # was: cache_len = the cache's length, a chunk (16) more than seen - evicted
        assert s.cache_len == s.seen - s.evicted - s.cleared <= s.capacity
        assert f"{s.cache_len}/64" in s.kv_layout  # the global figure of the layout too
        assert s.feeding  # a chunk in flight: the rate shown is the feed's


def test_after_a_clear_the_line_says_where_the_rest_went():
    eng = engine(gemma3([S, F]), CacheConfig("sink", 4, 64, 6))
    stream(eng, random_ids(100), chunk=9, singles=3)
    eng.clear()
    stream(eng, random_ids(30, seed=2), chunk=9, singles=3)
    s = read_stats(eng, Metrics(), model_nbytes=0)
    assert s.cache_len == 30 == s.seen - s.evicted - s.cleared and s.cleared > 0
    assert f"seen 130 evicted {s.evicted} cleared {s.cleared}" in status_line(s)


def test_during_a_feed_the_rate_is_the_feeds_own():
    m = Metrics()
    for _ in range(50):
        m.fold(TokenEvent(1, "x", 1 / 80, 10))  # a reply at 80 tok/s
    m.fold(DoneEvent("eos", 50, 0.6))
    assert "80.0 tok/s" in status_line(_stats(m))
    m.fold(PrefillEvent(256, 0.5, 266))
    m.fold(PrefillEvent(256, 1.5, 522))  # this feed: 512 tokens in 2 s
    line = status_line(_stats(m))
    assert "prefill 256.0 tok/s" in line and "80.0" not in line  # was: 80.0 tok/s through the whole feed
    m.fold(TokenEvent(1, "y", 1 / 40, 523))
    assert "prefill" not in status_line(_stats(m))
    m.fold(PrefillEvent(100, 0.1, 623))  # the next feed starts its own figure, not an average with the last
    assert "prefill 1000.0 tok/s" in status_line(_stats(m))


def _stats(m: Metrics, **over) -> Stats:
    """A Stats with the Metrics' rates and a Gemma 3 270M-like session's figures."""
    base = dict(policy="sink", n_sink=4, cache_len=2048, capacity=2048, kv_bytes=int(19.0 * 2**20),
                model_bytes=0, rss=int(1.2 * 2**30), cuda=None, seen=27244, evicted=25000, evictions=98,
                decode_tok_s=m.decode_tok_s, prefill_tok_s=m.prefill_tok_s, p50_ms=0, p99_ms=0, gauge=0.62,
                gauge_recent=0.1, gauge_uniform=0.01, holds_start=True, pinned=212,
                kv_layout="global 3 layers 2048/2048, local 15 layers 511/511", gauge_local=0.05,
                gauge_local_uniform=0.01, feeding=m.feeding, feed_tok_s=m.feed_tok_s if m.feeding else 0.0)
    return Stats(**{**base, **over})


def _whole(text: str, variants: dict[str, list[str]], sep: str) -> bool:
    """Every part of `text` is one whole variant of some field."""
    allowed = {v for vs in variants.values() for v in vs if v}
    return all(part.strip() in allowed for part in text.split(sep) if part.strip())


@pytest.mark.parametrize("width", [60, 80, 100, 120, 160, 200])
def test_the_status_line_fits_by_dropping_whole_fields(width):
    s = _stats(Metrics())
    from sinkchat.core.metrics import status_variants

    line = status_line(s, width)
    assert len(line) <= width and _whole(line, status_variants(s), " | ")
    assert "2048/2048" in line and "511/511" in line and "evicted 25000" in line  # fill and evictions stay
    if width >= 80:  # then the local layers' figure (was: cut at `sink ██████` on 160 columns)
        assert "local 0.05" in line
    if width >= 160:
        assert "19.0 MiB" in line
    full = status_line(s)
    assert "rss 1.2 GiB" in full and "sink ██████░░░░ 0.62" in full and "pinned 212" in full  # with room, all


@pytest.mark.parametrize("width", [60, 80, 110, 160, 200])
def test_the_toolbar_fits_by_dropping_whole_fields(width):
    s = _stats(Metrics())
    text = toolbar_text(s, width)
    assert len(text) <= width and "evicted 25000" in text and "2048/2048" in text
    if width >= 80:
        assert "local 0.05" in text and "2048/2048" in text


def test_summarize_shows_the_local_figure_at_160_columns(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(summarize_status, "_term_width", lambda: 160)
    eng = engine(gemma3([S, S, F]), CacheConfig("sink", 4, 64, 6))
    stream(eng, random_ids(100), chunk=9, singles=3)
    m = Metrics()
    m.fold(_gauge())
    tty = Tty()
    status = summarizer.Status(tty, quiet=False)
    head = "lines 91234: fed 90000 filt 1000 dup 200 skip 34 queue 0 | summaries 12 | "
    status.line = lambda width=None: head + status_line(read_stats(eng, m, model_nbytes=0),
                                                   None if width is None else width - len(head))
    status.tick(force=True)
    shown = tty.getvalue().removeprefix("\r\x1b[K")
    assert len(shown) <= 159 and "local 0.05" in shown and "local 7/7" in shown  # was: cut mid-gauge


def _gauge():
    from sinkchat.core.events import GaugeEvent

    return GaugeEvent(share=0.62, per_layer=(0.62,), recent=0.1, uniform=0.06, n=4, holds_start=True, local=0.05,
                      local_per_layer=(0.05, 0.05), local_uniform=0.8)


def test_the_kv_figure_is_the_same_all_session_long():
    """Gemma 3-like: 2 local ring layers (window 6) and 1 global. The buffers are allocated at the first forward and
    a ring grows with the longest chunk so far; the figure shown is their size for the session from the start."""
    eng = engine(gemma3([S, S, F], window=6), CacheConfig("sink", 4, 64, 6), prefill_chunk=24)
    m = Metrics()
    figures = [read_stats(eng, m, model_nbytes=0).kv_bytes]  # before anything is fed
    for chunk in (3, 9, 24):  # small chunks first, then the longest the engine feeds
        stream(eng, random_ids(60, seed=chunk), chunk=chunk, singles=2)
        eng.prefill_chunk = 24
        s = read_stats(eng, m, model_nbytes=0)
        figures.append(s.kv_bytes)
        assert 0 < s.kv_allocated <= s.kv_bytes
    assert len(set(figures)) == 1  # was: 0, then the allocation as the rings grew
    assert figures[0] == eng.cache.nbytes  # once a ring has taken the longest chunk, it is what is allocated


@pytest.mark.parametrize("width", [60, 80, 120, 160, 250])
def test_with_the_recall_memory_the_kv_field_is_the_windows_at_every_width(width):
    """Audit after issue 30: `kv 9.8 MiB 41/128` with the memory on against 2.8 MiB off, the fraction counting the
    window's slots only. The `kv` field now shows the bytes of the slots its fraction counts; the region's are the
    memory field's; shown or not, no width mixes them."""
    from sinkchat.apps.memory_view import MemoryFigures
    from sinkchat.apps.render import status_text

    window, region = int(2.8 * 2**20), int(7.0 * 2**20)
    s = _stats(Metrics(), cache_len=41, capacity=128, kv_bytes=window + region, kv_allocated=window + region,
               kv_layout="", pinned=0)
    mem = MemoryFigures(9, 289, 0, int(6.3 * 2**20), 1 << 30, 1 << 16, 1 << 16, region=319, region_bytes=region,
                        region_allocated=region)
    for line in (status_text(s, mem, width), toolbar_text(s, width, mem)):
        assert len(line) <= width and "41/128" in line and "9.8 MiB" not in line  # the sum is never the kv figure
        kv = re.search(r"(?:kv|KV) ([\d.]+ MiB) 41/128", line)
        assert kv is None or kv.group(1) == "2.8 MiB"
        if "disk" in line:
            assert "· 7.0 MiB KV" in line or line.rstrip().endswith("disk")
    full = status_text(s, mem)  # with room: window 2.8 + region 7.0 = the buffers' 9.8, each beside its slots
    assert "kv 2.8 MiB 41/128" in full and "mem 9 blk · 289 tok · 6.3 MiB disk · 7.0 MiB KV" in full
