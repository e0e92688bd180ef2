"""The recall memory's view in the chat (`sinkchat/apps/memory_view.py`): its KV apart from the window's, and the
module split out of render.py.

With `--memory on` the status line read `kv 9.8 MiB 41/128` against `kv 2.8 MiB 41/128` off, and /stats `9.8 MiB
KV`, with no word why: the memory reserves slots in front of the window in every memory layer (its region), which
the fraction does not count. Now the `kv` field is the window's (the same bytes as with the memory off), the memory's
field and /stats show the region's, and the two add up to the buffers. The region's figure is checked against the
buffers' own slots in front of the window, not against the code that prints it.
"""

from __future__ import annotations

import inspect
import io
import re
from pathlib import Path

import torch
from rich.console import Console

from sinkchat.apps import memory_view, render
from sinkchat.apps.chat import recall
from sinkchat.apps.chat.repl import lines_reader
from sinkchat.apps.render import stats_table, toolbar_text
from sinkchat.core.metrics import human_bytes

from test_memory_ui import LONG, make

torch.set_num_threads(1)


def region_in_buffers(eng) -> int:
    """The bytes of the slots in front of the window in the memory's layers, read off the buffers themselves."""
    layers = [eng.cache.layers[i] for i in eng.memory.layers]
    return sum(layer.keys[:, :, : layer.base].nbytes + layer.values[:, :, : layer.base].nbytes for layer in layers)


def table_text(table: object) -> str:
    con = Console(record=True, width=250, file=io.StringIO())
    con.print(table)
    return con.export_text()


def last_status(err: io.StringIO) -> str:
    return [line for line in err.getvalue().splitlines() if line.startswith("sink(")][-1]


def test_the_kv_field_is_the_windows_and_the_memory_shows_its_region(tmp_path: Path):
    on, _, err_on = make(tmp_path / "m")
    off, _, err_off = make(tmp_path / "n", memory=False)
    before = on.memory_stats()  # nothing fed: the buffers do not exist yet
    for loop in (on, off):
        loop.run(lines_reader([LONG, "tell me more about things"]))
    eng, mem, s_on, s_off = on.engine, on.memory_stats(), on.stats(), off.stats()
    region = region_in_buffers(eng)
    assert region > 0 and eng.memory.region > 0  # the memory reserved slots in front of the window
    assert s_on.kv_bytes == eng.cache.nbytes == s_off.kv_bytes + region  # the buffers: window + region
    line_on, line_off = last_status(err_on), last_status(err_off)
    kv_on = re.search(r"kv ([\d.]+ \w+) (\d+)/(\d+)", line_on).groups()
    kv_off = re.search(r"kv ([\d.]+ \w+) (\d+)/(\d+)", line_off).groups()
    assert kv_on[0] == kv_off[0] == human_bytes(s_off.kv_bytes)  # was: 3.5x off's, beside the same fraction
    assert int(kv_on[2]) == eng.cache_cfg.capacity
    assert f"disk · {human_bytes(region)} KV" in line_on
    tb = toolbar_text(s_on, 220, mem)
    assert f"KV {human_bytes(s_off.kv_bytes)} " in tb and f"{human_bytes(region)} KV" in tb
    assert (mem.region, mem.region_bytes, before.region_bytes) == (eng.memory.region, region, region)  # all along


def test_stats_splits_the_kv_and_the_parts_add_up(tmp_path: Path):
    loop, _, err = make(tmp_path / "m")
    loop.run(lines_reader([LONG, "more"]))
    eng, s = loop.engine, loop.stats()
    region = region_in_buffers(eng)
    window = s.kv_bytes - region
    text = table_text(stats_table(s, recall.stats_rows(loop), loop.memory_stats()))
    cache = re.search(r"cache +(\d+)/(\d+) tokens, ([\d.]+ \w+) KV in the window", text)
    assert cache and cache.group(3) == human_bytes(window), text  # was: the buffers' 3.5x, beside 62/64
    kv = re.compile(r"memory KV:? +([\d.]+ \w+): (\d+) slots a layer .*?with the window's ([\d.]+ \w+), "
                    r"([\d.]+ \w+) KV in all")
    want = (human_bytes(region), str(eng.memory.region), human_bytes(window), human_bytes(s.kv_bytes))
    assert kv.search(text) and kv.search(text).groups() == want, text
    mark = len(err.getvalue())
    loop.run(lines_reader(["/memory"]))  # the same rows
    assert kv.search(err.getvalue()[mark:]).groups() == want


def test_without_a_region_the_figures_are_as_before(tmp_path: Path):
    loop, _, _ = make(tmp_path / "n", memory=False)
    loop.run(lines_reader([LONG]))
    s = loop.stats()
    assert memory_view.window_stats(s, None) is s
    assert re.search(rf"cache +\d+/64 tokens, {human_bytes(s.kv_bytes)} KV *$", table_text(stats_table(s)), re.M)


def test_the_memory_helpers_live_in_their_own_module():
    moved = ["age_text", "memory_variants", "fit_memory", "token_ranges", "ages", "recalled_line", "recall_header",
             "memory_rows"]
    for name in moved:
        assert inspect.getmodule(getattr(memory_view, name)) is memory_view
        assert name not in vars(render) or inspect.getmodule(vars(render)[name]) is memory_view
    assert len(inspect.getsource(render).splitlines()) <= 400  # was 406
    assert len(inspect.getsource(memory_view).splitlines()) <= 400
