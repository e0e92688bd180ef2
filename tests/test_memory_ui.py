"""The recall memory as the chat user sees it (issue 30, item 1): its figures in the status line, the toolbar and
/stats; after each reply the line of what it recalled (and the jsonl record's `recalled`, the session log's
'recalled' record); /recall's text; /forget and /memory on|off, which keep every token accounted for.

Every figure is checked against the memory or the ledger, never against the code that prints it: the blocks a
reply read are gathered by watching each call's choice; /recall's text against the tokens the ledger took in; the
tokens /forget reports against what the memory held.
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from fakes import CharTokenizer, tap_ledger, tiny_model
from sinkchat.apps.chat.repl import ChatLoop, lines_reader
from sinkchat.apps.logs import format_transcript
from sinkchat.apps.memory_view import age_text, fit_memory, memory_variants, recalled_line
from sinkchat.apps.render import Renderer, status_text, toolbar_text
from sinkchat.config import CacheConfig, MemoryConfig, SamplingConfig
from sinkchat.core.engine import Engine
from sinkchat.core.metrics import human_bytes, status_variants
from sinkchat.memory import report
from sinkchat.memory.recall import RecallMemory
from sinkchat.memory.report import MemoryStats, Recalled
from sinkchat.model.spec import ModelSpec
from sinkchat.store.sessionlog import SessionLog
from sinkchat.store.transcript import export

torch.set_num_threads(1)

LONG = "hello there how are you " * 4  # 96 characters: one char is one token, the cache holds 64
MEM_FIELD = re.compile(r"mem ([\d,]+) blk · ([\d,]+) tok · ([\d.]+ \w+)")


def mem_engine(root: Path, capacity: int = 64, memory: bool = True) -> Engine:
    model = tiny_model("llama", layers=2, max_pos=512)
    model.config.eos_token_id = 96
    mem = (RecallMemory.for_spec(MemoryConfig("on", 64, 8, 2, 64), ModelSpec.from_model(model), root)
           if memory else None)
    return Engine(model, CharTokenizer(), CacheConfig(policy="sink", n_sink=4, capacity=capacity),
                  SamplingConfig(temperature=0, max_tokens=6, repetition_penalty=1.0), system="be brief", memory=mem)


class Shown:
    """What the loop showed through the renderer's `info` (text, style), beside the streams."""

    def __init__(self, loop: ChatLoop) -> None:
        self.items: list[tuple[str, str]] = []
        real = loop.r.info

        def info(text: str, style: str = "cyan") -> None:
            self.items.append((text, style))
            real(text, style)

        loop.r.info = info  # type: ignore[method-assign]

    def texts(self) -> list[str]:
        return [t for t, _ in self.items]


def make(root: Path, fmt: str = "text", slog: Any = None, **kw: Any) -> tuple[ChatLoop, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    loop = ChatLoop(mem_engine(root, **kw), Renderer(out, err, tty=False, live=False, fmt=fmt), slog=slog)
    return loop, out, err


def watch_choices(eng: Engine) -> list[set[int]]:
    """Every call's chosen blocks, gathered per reply: calls `mark()` to start the next reply's set."""
    mem = eng.memory
    per_turn: list[set[int]] = [set()]
    real = mem.prepare

    def prepare(cache: Any, position: int, single: bool = False, **kw: Any) -> Any:
        out = real(cache, position, single, **kw)
        for c in mem.chosen:
            per_turn[-1].update(c)
        per_turn[-1].update(mem.reread)  # blocks read again before the message (`Engine.feed_query`)
        return out

    mem.prepare = prepare  # type: ignore[method-assign]
    return per_turn


def ranges(blocks: list[tuple[int, int]]) -> str:
    """Expected `a–b, c–d` from [first, last) pairs, consecutive ones joined, past five ranges the first four and
    how many more (written apart from render's)."""
    out: list[list[int]] = []
    for a, b in sorted(blocks):
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    text = [f"{a:,}–{b - 1:,}" for a, b in out]
    return ", ".join(text) if len(text) <= 5 else ", ".join(text[:4]) + f" and {len(text) - 4} more ranges"


# ----------------------------------------------------------------------------------------------- pure text
def test_the_recall_line_reads_as_the_issue_writes_it():
    now = 1_000_000.0
    born = now - 41 * 60 - 5
    blocks = [Recalled(i, 3100 + 128 * i, 3228 + 128 * i, born, 27, 30) for i in range(3)]
    assert recalled_line(blocks, now) == "↺ recalled 3 blocks: tokens 3,100–3,483, 41 min ago"
    two = [Recalled(0, 0, 64, now - 30, 3, 30), Recalled(9, 12_800, 12_864, now - 7300, 30, 30)]
    assert recalled_line(two, now) == ("↺ recalled 2 blocks: tokens 0–63, 12,800–12,863, "
                                       "30 s ago – 2 h 1 min ago")
    assert [age_text(s) for s in (0, 59, 60, 3599, 3600, 86_399, 86_400, 3 * 86_400)] == [
        "0 s ago", "59 s ago", "1 min ago", "59 min ago", "1 h ago", "23 h 59 min ago", "1 day ago", "3 days ago"]


def test_the_memory_field_gives_way_after_the_evictions_never_cut():
    loop, _, _ = make(Path("/nonexistent-unused"), memory=False)
    s = loop.stats()
    mem = MemoryStats(412, 52_123, 0, 310 << 20, 1 << 30, 1 << 20, 1 << 20)
    wide = status_text(s, mem)
    assert "mem 412 blk · 52,123 tok · 310.0 MiB" in wide
    assert wide.index("evicted") < wide.index("mem 412") < wide.index("tok/s")  # after the evictions
    core = status_variants(s, toolbar=True)
    for width in range(40, 220, 3):
        texts, m = fit_memory(core, memory_variants(mem), width, 2)
        assert m in ("mem 412 blk · 52,123 tok · 310.0 MiB", "mem 52k tok", "")
        if m:  # the memory is shown only while the evictions keep their longest text
            assert texts["seen"] == core["seen"][0]
        tb = toolbar_text(s, width + 3, mem)
        assert ("mem" in tb) == bool(m)
    assert toolbar_text(s, 200, None) == toolbar_text(s, 200)  # memory off: the toolbar as it was


# ----------------------------------------------------------------------------------------------- live figures
def test_status_line_and_toolbar_carry_the_memorys_own_figures(tmp_path):
    loop, out, err = make(tmp_path / "m")
    eng = loop.engine
    loop.run(lines_reader([LONG, "tell me more about things"]))
    mem = eng.memory
    assert mem.blocks >= 8 and eng.ledger.evicted == mem.tokens + mem.forgotten
    last = [line for line in err.getvalue().splitlines() if line.startswith("sink(")][-1]
    blk, tok, disk = MEM_FIELD.search(last).groups()
    assert (int(blk.replace(",", "")), int(tok.replace(",", ""))) == (mem.blocks, mem.tokens)
    assert disk == human_bytes(mem.disk_bytes) and mem.disk_bytes > 0
    assert int(re.search(r"evicted (\d+)", last).group(1)) == mem.tokens + mem.forgotten
    blk, tok, disk = MEM_FIELD.search(toolbar_text(loop.stats(), 200, loop.memory_stats())).groups()
    assert (int(blk), int(tok)) == (mem.blocks, mem.tokens)


def test_each_reply_says_what_it_recalled_and_jsonl_carries_it(tmp_path):
    loop, out, err = make(tmp_path / "m", fmt="jsonl")
    eng = loop.engine
    per_turn = watch_choices(eng)
    shown = Shown(loop)
    expected_lines, expected_recs = [], []
    for q in [LONG, "tell me more about things", "and then"]:
        per_turn.append(set())
        loop.run(lines_reader([q]))
        where = eng.memory.store.where
        blocks = sorted(per_turn[-1])
        assert blocks, "a reply with blocks in memory recalls some"
        expected_recs.append([(b, where[b].first, where[b].last) for b in blocks])
        expected_lines.append(f"↺ recalled {len(blocks)} blocks: tokens "
                              f"{ranges([(where[b].first, where[b].last) for b in blocks])}, ")
    recs = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [[(r["block"], r["first"], r["last"]) for r in rec["recalled"]] for rec in recs] == expected_recs
    assert all(0 <= r["age_seconds"] < 60 and (1 <= r["layers"] or r["reread"]) and r["layers"] <= r["of"] == 2
               for rec in recs for r in rec["recalled"])
    lines = [t for t in shown.texts() if t.startswith("↺")]
    assert len(lines) == 3
    for got, want in zip(lines, expected_lines):
        assert got.startswith(want) and re.search(r" s ago(; read again: [0-9,–]+(, [0-9,–]+)*)?$", got), (got, want)
    # off: no key, no line
    off, out2, _ = make(tmp_path / "n", fmt="jsonl", memory=False)
    off.run(lines_reader([LONG]))
    assert "recalled" not in json.loads(out2.getvalue())


@pytest.mark.parametrize("limit", [None, 3])
def test_recall_prints_the_evicted_text_of_the_blocks_the_last_reply_read(tmp_path, monkeypatch, limit):
    """Every block the last reply read, its text the tokens the ledger took in at its range; with more than
    `SHOWN`, the ones chosen in the most layers (`/recall all`: every one)."""
    from sinkchat.apps.chat import recall

    # the "far" rule: on this tiny model it reads some blocks in both layers and some in one, which the cut below
    # needs (the default "mass" happened to read every block in one layer only here)
    monkeypatch.setattr("sinkchat.memory.recall.RULE", "far")
    loop, _, _ = make(tmp_path / "m")
    eng = loop.engine
    assert eng.memory.rule == "far"
    stream = tap_ledger(eng)
    per_turn = watch_choices(eng)
    layers: dict[int, int] = {}
    real = eng.memory.prepare

    # the most layers at one call, per block
    def prepare(cache: Any, position: int, single: bool = False, **kw: Any) -> Any:
        out = real(cache, position, single, **kw)
        for bid in set(b for c in eng.memory.chosen for b in c):
            layers[bid] = max(layers.get(bid, 0), sum(bid in c for c in eng.memory.chosen))
        return out

    eng.memory.prepare = prepare
    loop.run(lines_reader([LONG]))  # its blocks are read in one layer or in both
    read = sorted(per_turn[-1])
    want = read
    if limit is not None:
        monkeypatch.setattr(recall, "SHOWN", limit)
        want = sorted(sorted(read, key=lambda b: (-layers[b], b))[:limit])
        assert len(read) > limit and len({layers[b] for b in read}) > 1, layers  # the choice must matter
    for cmd in ["/recall"] + (["/recall all"] if limit else []):
        shown = Shown(loop)
        loop.run(lines_reader([cmd]))
        items = shown.items
        cut = limit is not None and cmd == "/recall"
        assert items[0][0] == f"the last reply read {len(read)} blocks from the memory" + (
            f"; the {limit} chosen in the most layers (/recall all for every one):" if cut else ":")
        pairs = list(zip(items[1::2], items[2::2]))
        assert len(items) == 1 + 2 * len(pairs)
        seen = []
        for (head, _), (text, _) in pairs:
            m = re.fullmatch(r"block (\d+) · tokens ([\d,]+)–([\d,]+) · \d+ s ago · in ([12])/2 layers", head)
            assert m, head
            bid, a, b = int(m.group(1)), int(m.group(2).replace(",", "")), int(m.group(3).replace(",", ""))
            seen.append(bid)
            assert int(m.group(4)) == layers[bid]
            assert b - a + 1 == 8  # a block of 8
            assert text == eng.tokenizer.decode(stream[a : b + 1], skip_special_tokens=False)  # the evicted text
        assert seen == (want if cut else read)


def test_stats_shows_the_memory_totals(tmp_path):
    loop, _, _ = make(tmp_path / "m")
    loop.run(lines_reader([LONG, "more"]))
    shown = Shown(loop)
    loop.run(lines_reader(["/memory"]))
    mem = loop.engine.memory
    text = "\n".join(shown.texts())
    assert (f"recall memory: {mem.blocks} blocks, {mem.tokens:,} tokens, {human_bytes(mem.disk_bytes)} on disk "
            f"(budget 64.0 MiB)") in text
    assert f"forgotten: {mem.forgotten} tokens" in text
    assert f"{loop.recall_tally[1]} blocks read in 2 replies; the last reply {len(loop.last_recalled)}" in text
    err = io.StringIO()
    loop.r.err.file = err  # /stats' table: the same rows
    loop.run(lines_reader(["/stats"]))
    assert re.search(rf"recall memory +{mem.blocks} blocks, {mem.tokens:,} tokens", err.getvalue())


# ----------------------------------------------------------------------------------------------- /forget, /memory
def test_forget_asks_then_reports_every_token_and_the_memory_goes_on(tmp_path):
    slog = SessionLog.open("chat", "tiny", {}, system="be brief")
    loop, _, err = make(tmp_path / "m", slog=slog)
    eng = loop.engine
    loop.run(lines_reader([LONG, "tell me more about things"]))
    mem = eng.memory
    held, spans = mem.tokens, report.spans(mem)
    assert held > 0 and sum(n for _, _, n in spans) == held
    loop.run(lines_reader(["/forget"]))  # asks, changes nothing
    copies = mem.copies  # blocks read again before a message, let go as they left the window
    assert mem.tokens == held and mem.forgotten == copies and "Type /forget yes to confirm" in err.getvalue()
    mark = len(err.getvalue())
    loop.run(lines_reader(["/forget yes"]))
    gone = re.findall(r"⟂ forgotten (\d+) tokens? (\d+)(?:–(\d+))? \(/forget\)", err.getvalue()[mark:])  # inclusive
    assert [(int(n), int(a), int(b or a) + 1) for n, a, b in gone] == [(n, a, b) for a, b, n in spans]
    assert sum(int(n) for n, _, _ in gone) == held
    assert mem.tokens == 0 and mem.blocks == 0 and mem.disk_bytes == 0 and mem.forgotten == held + copies
    assert eng.ledger.evicted == mem.tokens + mem.forgotten
    assert not list(Path(mem.store.root).glob("*.mem"))  # the files went
    loop.run(lines_reader(["/recall"]))
    loop.run(lines_reader(["again " * 12, "and more " * 8]))  # evictions go to it again, the invariant holds
    assert mem.blocks > 0 and eng.ledger.evicted == mem.tokens + mem.forgotten
    assert f"memory forgotten: {held:,} tokens" in err.getvalue()
    slog.close()
    shown = format_transcript(export(slog.id))
    assert f"<forgotten {held} tokens [{spans[0][0]},{spans[-1][1]}) (/forget)>" in shown
    recalls = [m.start() for m in re.finditer(r"<recalled \d+ blocks?: tokens ", shown)]
    assert len(recalls) == 4  # one per reply, in order with the turns
    turns = [m.start() for m in re.finditer(r"\n\[assistant\]", shown)]
    assert all(t < r for t, r in zip(turns, recalls)) and all(r < t for r, t in zip(recalls, turns[1:]))
    assert "4 replies read the recall memory" in shown


def test_memory_off_then_on_mid_session_moves_the_cache_exactly(tmp_path, monkeypatch):
    monkeypatch.setenv("SINKCHAT_MEMORY_BLOCK", "8")
    loop, _, err = make(tmp_path / "m")
    eng = loop.engine
    loop.run(lines_reader([LONG]))
    mem = eng.memory
    root, held = Path(mem.store.root), mem.tokens
    assert held and root.is_dir() and loop.stats().gauge_memory is not None
    loop.run(lines_reader(["/memory off"]))  # asks first: it would drop what it holds
    assert eng.memory is mem and "Type /memory off yes" in err.getvalue()
    before = {k: v.clone() for k, v in eng.cache.state().items()}
    loop.run(lines_reader(["/memory off yes"]))
    assert eng.memory is None and not root.exists()
    assert f"⟂ forgotten {held} tokens" in err.getvalue()
    assert all(layer.base == 0 for layer in eng.cache.layers)  # no region left in the buffers
    assert loop.stats().gauge_memory is None  # the last reply's share on recalled blocks is no figure of now
    after = eng.cache.state()
    assert after.keys() == before.keys() and all(torch.equal(before[k], after[k]) for k in before)
    mark = len(err.getvalue())
    loop.run(lines_reader(["x" * 40]))
    assert "to memory" not in err.getvalue()[mark:] and "⟂ evicted" in err.getvalue()[mark:]
    assert "mem " not in err.getvalue()[mark:] and "↺" not in err.getvalue()[mark:]
    before = {k: v.clone() for k, v in eng.cache.state().items()}
    loop.run(lines_reader(["/memory on"]))
    mem = eng.memory
    assert mem is not None and mem.B == 8 and all(eng.cache.layers[i].base == mem.region for i in mem.layers)
    after = eng.cache.state()
    assert all(torch.equal(before[k], after[k]) for k in before)
    evicted_at_on = eng.ledger.evicted
    loop.run(lines_reader([LONG, "and then"]))
    # evicted before the memory: counted forgotten, as are blocks read again as text once they leave the window
    assert mem.blocks > 2 and mem.forgotten == evicted_at_on + mem.copies
    assert eng.ledger.evicted == mem.tokens + mem.forgotten
    assert "↺ recalled" in err.getvalue()[mark:]
    loop.run(lines_reader(["/memory on"]))
    assert eng.memory is mem and "already on" in err.getvalue()


def test_memory_on_needs_the_sink_policy(tmp_path):
    loop, _, err = make(tmp_path / "m", memory=False)
    loop.run(lines_reader(["/policy window", "/memory on"]))
    assert loop.engine.memory is None and "/policy sink first" in err.getvalue()


@pytest.mark.parametrize("cmd", ["/recall", "/forget", "/forget yes", "/memory off"])
def test_memory_commands_with_the_memory_off_say_so(tmp_path, cmd):
    loop, _, err = make(tmp_path / "m", memory=False)
    loop.run(lines_reader(["hi", cmd]))
    assert "off" in err.getvalue().splitlines()[-1] and "Traceback" not in err.getvalue()
    assert loop.engine.memory is None


def test_a_live_policy_switch_away_from_sink_is_refused_with_the_memory_on(tmp_path):
    """`/policy window` was taken live with the memory on (refused at start): the sinks and the system prompt then
    went to the memory, and a block's header named one token of the two ranges it held."""
    loop, _, err = make(tmp_path / "m")
    loop.run(lines_reader(["/policy window"]))
    assert loop.engine.cache_cfg.policy == "sink" and "/memory off first" in err.getvalue()
    loop.run(lines_reader(["/memory off yes", "/policy window"]))
    assert loop.engine.memory is None and loop.engine.cache_cfg.policy == "window"


def test_a_load_lets_the_last_replys_recalled_blocks_go_and_says_what_memory_it_replaced(tmp_path):
    """After `/load`, /recall showed the loaded store's blocks under this session's ids, ranges and ages (another
    conversation's text); and the memory the session held went without a word."""
    loop, _, err = make(tmp_path / "m")
    loop.run(lines_reader(["hi", f"/save {tmp_path / 'early'}", LONG]))
    assert loop.last_recalled and loop.engine.memory.tokens > 0
    held = loop.engine.memory.tokens
    shown = Shown(loop)
    loop.run(lines_reader([f"/load {tmp_path / 'early'}", "/recall"]))
    text = "\n".join(shown.texts())
    assert f"the recall memory's {held} tokens of the conversation before it were let go" in text, text
    assert not re.search(r"block \d+ · tokens", text), text
    assert loop.last_recalled == []


def test_a_memory_budget_that_holds_no_block_is_refused_at_start(tmp_path):
    """`--memory-budget 1` (MiB) on the bundled model's shape: every block was then reported forgotten with a raw
    `[Errno 27] ... exceeds the memory budget`; the check's size is a real block's (a tiny model's, stored)."""
    from types import SimpleNamespace

    from sinkchat.bootstrap import block_bytes, check_budget
    from sinkchat.config import ConfigError

    smol = SimpleNamespace(global_layers=range(30), n_kv=3, head_dim=64)
    with pytest.raises(ConfigError, match=r"--memory-budget 1 MiB holds no block: a block of 64 tokens takes at least 1\.4 MiB"):
        check_budget(MemoryConfig("on", 1), smol)
    check_budget(MemoryConfig("on", 2), smol)
    check_budget(MemoryConfig("on", 1, bits=8), smol)  # 0.74 MiB a block
    with pytest.raises(ConfigError, match=r"takes at least 2\.8 MiB"):  # a float32 cache: 4 bytes a value
        check_budget(MemoryConfig("on", 2), smol, "float32")
    loop, _, _ = make(tmp_path / "m")
    loop.run(lines_reader([LONG]))
    mem = loop.engine.memory
    spec = ModelSpec.from_model(loop.engine.model)
    record = mem.disk_bytes // mem.blocks
    wide = next(loop.engine.model.parameters()).element_size() // 2  # this tiny model's cache is float32
    assert mem.blocks and 0 <= record - wide * block_bytes(mem.cfg, spec) <= 8 * 8 + 512, (record, wide)


def test_memory_on_with_another_policy_is_refused_before_the_model_loads():
    from sinkchat.bootstrap import build_settings
    from sinkchat.config import ConfigError

    with pytest.raises(ConfigError, match="use --policy sink"):
        build_settings({"memory": "on", "policy": "window"})
    assert build_settings({"memory": "on"}).memory.on


def test_a_blocks_age_is_its_texts_not_the_time_it_was_stored(tmp_path, monkeypatch):
    """A fact typed at 10:32:21 showed `1 s ago` when it left the window at 10:33:30: the age was the block's
    storing time. It is the time its first token was fed (a fake clock: each message fed at its own minute)."""
    import time as time_module

    clock = {"now": 1_000_000.0}
    monkeypatch.setattr(time_module, "time", lambda: clock["now"])
    loop, _, _ = make(tmp_path / "m")
    eng = loop.engine
    fed_at: list[tuple[int, float]] = []
    for i, text in enumerate(["my locker code is XK-4471 and more", LONG, LONG, LONG]):
        clock["now"] = 1_000_000.0 + 60 * i
        fed_at.append((int(eng.ledger.seen), clock["now"]))
        loop.run(lines_reader([text]))
    mem = eng.memory
    assert mem.blocks >= 2
    for bid, w in mem.store.where.items():
        want = max(t for start, t in fed_at if start <= w.first)
        assert mem.born[bid] == want, (bid, w.first, mem.born[bid], want)
    assert len({mem.born[b] for b in mem.store.where}) > 1  # blocks of different messages, different ages
    assert len(mem.fed) <= 8  # entries no block needs any more went


def test_memory_words_a_user_audit_found_wrong(tmp_path):
    """`/memory off no` printed the usage line; /save did not say the memory's blocks were saved beside the
    snapshot; /stats said copies let go were held by "the memory" after /forget had emptied it."""
    loop, _, err = make(tmp_path / "m")
    loop.run(lines_reader([LONG, "tell me more about things"]))
    mem = loop.engine.memory
    shown = Shown(loop)
    loop.run(lines_reader(["/memory off no", f"/save {tmp_path / 's'}"]))
    assert "('no' is not yes)" in err.getvalue() and loop.engine.memory is mem
    assert any(f"the recall memory's {mem.blocks} blocks ({mem.tokens} tokens) beside it" in t for t in shown.texts())
    loop.metrics.gauge = replace(loop.metrics.gauge, memory=0.24)  # as measured at the last reply
    loop.run(lines_reader(["/forget yes", "/memory"]))
    assert loop.metrics.gauge.memory == 0.0  # the toolbar showed `mem 0.24` beside `mem 0 blk`
    text = "\n".join(shown.texts())
    assert "the memory holds those" not in text and ("let go while the memory held their blocks" in text
                                                      or not mem.copies)
