"""Snapshots carry the recall memory (sinkchat/memory/persist.py): a loaded or resumed session recalls exactly what
the saved one would have, a damaged or missing memory folder is refused before anything changes, and the folders of
earlier saves go."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fakes import tiny_model
from sinkchat.store.snapshot import SnapshotError, load_snapshot, save_snapshot
from test_memory import IDS, engine, memory


def _run(eng: Any, ids: list[int]) -> list[torch.Tensor]:
    out = []
    for t in ids:  # one token a call: the memory keeps its choice for `every` calls, which the snapshot must carry
        list(eng.feed_ids([t]))
        out.append(eng.last_logits.clone())
    return out


@pytest.mark.parametrize("at", [61, 66])  # two points of the choice's 8-call cycle
def test_a_loaded_session_continues_exactly_as_the_saved_one(tmp_path: Path, at: int) -> None:
    model = tiny_model("llama", layers=2, score_std=3.0)
    eng = engine(model, memory(model, tmp_path / "a"))
    list(eng.feed_ids(IDS[:48]))
    _run(eng, IDS[48:at])
    assert eng.memory.blocks >= 2 and eng.memory.queue
    snap = save_snapshot(eng, tmp_path / "s.safetensors")
    want = _run(eng, IDS[at:150])
    other = engine(model, memory(model, tmp_path / "b"))
    list(other.feed_ids(IDS[100:130]))  # a session with a memory of its own, replaced by the load
    load_snapshot(other, snap)
    got = _run(other, IDS[at:150])
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert other.memory.index_ids == eng.memory.index_ids
    assert other.ledger.evicted == other.memory.tokens + other.memory.forgotten


def test_a_missing_or_damaged_memory_folder_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    model = tiny_model("llama", layers=1, score_std=3.0)
    eng = engine(model, memory(model, tmp_path / "a"))
    list(eng.feed_ids(IDS[:70]))
    snap = save_snapshot(eng, tmp_path / "s.safetensors")
    folder = next(tmp_path.glob("s.memory-*"))
    seg = sorted(folder.glob("seg-*.mem"))[0]
    other = engine(model, memory(model, tmp_path / "b"))
    list(other.feed_ids(IDS[80:130]))
    before = (list(other.ledger.ids), other.memory.index_ids[:], other.memory.tokens, other.memory.store.root)
    data = seg.read_bytes()
    seg.write_bytes(data[: len(data) // 2])  # cut: a block listed past the end
    with pytest.raises(SnapshotError, match="short|outside"):
        load_snapshot(other, snap)
    seg.write_bytes(b"X" * 8 + data[8:])  # the first record's header overwritten
    with pytest.raises(SnapshotError, match="no block 0 where it says"):
        load_snapshot(other, snap)
    seg.write_bytes(data)
    folder.rename(folder.with_name("elsewhere"))
    with pytest.raises(SnapshotError, match="missing"):
        load_snapshot(other, snap)
    assert (list(other.ledger.ids), other.memory.index_ids, other.memory.tokens, other.memory.store.root) == before
    assert other.memory.store.root.is_dir() and len(list(tmp_path.glob("b-*"))) == 0  # no stray store folders


def test_saving_again_replaces_the_memory_folder_and_a_memory_off_session_says_it_left_it(
        tmp_path: Path, caplog: Any) -> None:
    model = tiny_model("llama", layers=1, score_std=3.0)
    eng = engine(model, memory(model, tmp_path / "a"))
    list(eng.feed_ids(IDS[:70]))
    snap = save_snapshot(eng, tmp_path / "s.safetensors")
    first = {p.name for p in tmp_path.glob("s.memory-*")}
    list(eng.feed_ids(IDS[70:100]))
    save_snapshot(eng, snap)
    second = {p.name for p in tmp_path.glob("s.memory-*")}
    assert len(first) == len(second) == 1 and first != second
    folder = tmp_path / second.pop()
    assert oct(folder.stat().st_mode & 0o777) == "0o700"
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in folder.iterdir())
    off = engine(model, None)
    with caplog.at_level("WARNING"):
        load_snapshot(off, snap)
    assert off.ledger.ids == eng.ledger.ids
    assert any("recall memory" in r.message and "--memory off" in r.message for r in caplog.records)


def test_save_then_load_through_the_cli_carries_the_memory(tmp_path: Path) -> None:
    """The real CLI on the bundled model, memory on, a cache small enough that the first message is evicted into
    the memory: /save, then --load gives the same next reply, and the snapshot's memory folder holds its blocks."""
    from test_resume import run_chat

    mem = ["--memory", "on", "--memory-block", "8", "--format", "jsonl"]
    story = ("My locker code is 4417 and my cat is called Pixel. " + "The weather report said rain again. " * 12)
    a = run_chat(mem, f"{story}\nName a color.\n/save snapm\nWhat is my locker code?\n", tmp_path)
    assert a.returncode == 0, a.stderr[-1500:]
    folders = list((tmp_path / "snapshots").glob("snapm.memory-*"))
    assert len(folders) == 1 and list(folders[0].glob("seg-*.mem"))
    b = run_chat(mem + ["--load", "snapm"], "What is my locker code?\n", tmp_path)
    assert b.returncode == 0, b.stderr[-1500:]
    want = [json.loads(ln)["answer"] for ln in a.stdout.splitlines()][-1]
    assert json.loads(b.stdout.splitlines()[-1])["answer"] == want and want.strip()
    assert "not in the recall memory" not in b.stderr
    c = run_chat(["--format", "jsonl", "--load", "snapm"], "What is my locker code?\n", tmp_path)  # memory off
    assert c.returncode == 0, c.stderr[-1500:]
    line = [ln for ln in c.stderr.splitlines() if "recall memory" in ln]
    assert line and line[0].startswith("warning: the snapshot's recall memory (") and "--memory on" in line[0], line


def _as_format(version: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Snapshots saved from now on as an older sinkchat wrote them: format 1 named no rule (it was "far", 4 keys)."""
    from sinkchat.memory import persist

    real = persist.save

    def save(memory: Any, folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        head, tensors = real(memory, folder)
        head["version"] = version
        for k in ("rule", "reps"):
            head.get("index", {}).pop(k, None)
        return head, tensors

    monkeypatch.setattr(persist, "save", save)


def test_an_index_saved_under_another_rule_or_an_older_format_is_rebuilt_and_an_unknown_one_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The index's rows depend on the rule: a session saved under "far" (or by format 1, which was "far") and
    loaded under "mass" gets its index made again from its blocks, row for row what its own memory would have
    made, and goes on recalling; loaded under "far" it takes the saved rows; an unknown format is one line."""
    model = tiny_model("llama", layers=2, score_std=3.0)
    eng = engine(model, memory(model, tmp_path / "a", rule="far"))
    list(eng.feed_ids(IDS[:70]))
    _as_format(1, monkeypatch)
    snap = save_snapshot(eng, tmp_path / "s.safetensors")
    for rule in ("mass", "far"):
        other = engine(model, memory(model, tmp_path / f"b-{rule}", rule=rule))
        load_snapshot(other, snap)
        mem, ix = other.memory, other.memory.index
        assert mem.index_ids == eng.memory.index_ids and mem.rule == rule
        assert mem.lexicon.blocks == eng.memory.lexicon.blocks and mem.lexical is None  # format 1: no prior saved
        want = torch.stack([mem.index_rows(mem.store.read(b)) for b in mem.index_ids])  # [NB, M, H_kv, r, W]
        m, h, r, w = ix.shape
        got = ix.buf[:, ix.lo * r : ix.hi * r].reshape(m, h, -1, r, w).permute(2, 0, 1, 3, 4)
        assert torch.equal(got, want.to(got.dtype))
        list(other.feed_ids(IDS[70:100]))
        assert mem.blocks > eng.memory.blocks and all(len(c) == mem.topk for c in mem.chosen)
        assert other.ledger.evicted == mem.tokens + mem.forgotten
    _as_format(99, monkeypatch)
    snap = save_snapshot(eng, tmp_path / "t.safetensors")
    other = engine(model, memory(model, tmp_path / "c"))
    with pytest.raises(SnapshotError, match=r"format 99; this sinkchat reads 1, 2, 3$"):
        load_snapshot(other, snap)


def test_a_loaded_store_fills_its_last_segment_and_forgets_as_the_saved_one_would(tmp_path: Path) -> None:
    """Over its budget the store drops whole segments, so where a loaded store puts its next block decides which
    tokens are forgotten later: it goes on filling the saved session's last segment (rolled over instead, a resumed
    soak forgot other tokens than an uninterrupted one)."""
    model = tiny_model("llama", layers=1, score_std=3.0)

    def small(mem: Any) -> Any:
        mem.store.budget = 44_320  # 20 blocks of this model; segments of budget / 8: two blocks each
        mem.store.segment_bytes = mem.store.budget // 8
        return mem

    eng = engine(model, small(memory(model, tmp_path / "a")))
    list(eng.feed_ids(IDS[:78]))
    assert len(eng.memory.store.sizes) >= 2 and sum(w.segment == eng.memory.store.current
                                                    for w in eng.memory.store.where.values()) == 1
    snap = save_snapshot(eng, tmp_path / "s.safetensors")
    more = IDS[78:] + IDS + IDS
    list(eng.feed_ids(more))
    other = engine(model, small(memory(model, tmp_path / "b")))
    load_snapshot(other, snap)
    list(other.feed_ids(more))
    a, b = eng.memory, other.memory
    assert a.forgotten > 0  # the budget dropped segments
    assert {k: (w.segment, w.first) for k, w in b.store.where.items()} == \
        {k: (w.segment, w.first) for k, w in a.store.where.items()}
    assert (b.forgotten, b.tokens, b.store.sizes) == (a.forgotten, a.tokens, a.store.sizes)


def test_saving_a_session_leaves_the_memory_of_one_whose_name_extends_it(tmp_path: Path) -> None:
    """Saving `zed` removed `zed.memory-1.memory-<hex>/` (session `zed.memory-1`'s memory): earlier saves were found
    by the glob `zed.memory-*`. A stem holding glob characters ("a[1]") is matched as written."""
    model = tiny_model("llama", layers=1, score_std=3.0)
    eng = engine(model, memory(model, tmp_path / "a"))
    list(eng.feed_ids(IDS[:70]))
    other = save_snapshot(eng, tmp_path / "zed.memory-1.safetensors")
    brackets = save_snapshot(eng, tmp_path / "a[1].safetensors")
    theirs = {p.name for p in tmp_path.iterdir() if p.is_dir() and ".memory-" in p.name}
    save_snapshot(eng, tmp_path / "zed.safetensors")
    save_snapshot(eng, tmp_path / "zed.safetensors")
    save_snapshot(eng, tmp_path / "a.safetensors")
    now = {p.name for p in tmp_path.iterdir() if p.is_dir() and ".memory-" in p.name}
    assert theirs <= now and len(now) == len(theirs) + 2, (theirs, now)
    for snap in (other, brackets):
        fresh = engine(model, memory(model, tmp_path / f"b-{snap.stem}"))
        load_snapshot(fresh, snap)
        assert fresh.ledger.ids == eng.ledger.ids


def test_a_snapshot_saved_again_with_the_memory_off_lets_its_memory_folder_go(tmp_path: Path, caplog: Any) -> None:
    """A memory-on snapshot overwritten by a memory-off session left `s.memory-<hex>/` (the old conversation's
    keys and values) on disk, named by no snapshot; the load's warning now says the next save lets it go."""
    model = tiny_model("llama", layers=1, score_std=3.0)
    eng = engine(model, memory(model, tmp_path / "a"))
    list(eng.feed_ids(IDS[:70]))
    snap = save_snapshot(eng, tmp_path / "s.safetensors")
    assert len(list(tmp_path.glob("s.memory-*"))) == 1
    off = engine(model, None)
    with caplog.at_level("WARNING"):
        load_snapshot(off, snap)
    assert any("saved again with the memory off" in r.message for r in caplog.records)
    save_snapshot(off, snap)
    assert list(tmp_path.glob("s.memory-*")) == []
    load_snapshot(engine(model, None), snap)  # the snapshot itself names no memory: it loads
