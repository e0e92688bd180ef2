"""What a later start no longer does (issue #33 item 3), each check failing on the regression that would bring the
cost back: rich imported for a piped chat's plain lines, the KV cache's pages all written at allocation, the
tokenizer read from its slower JSON form. Never wall-clock time here (benchmarks/startup.py measures that)."""

from __future__ import annotations

import io
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sinkchat.apps.render import Renderer, plain
from sinkchat.core.kv_cache import SinkLayer, lazy_zeros
from sinkchat.model import gguf_convert, light_tokenizer


# ------------------------------------------------------------------------------------------ plain lines, no rich
def _lines(n: int, seed: int = 0) -> list[str]:
    """Message lines of every kind: plain text, wide and combining characters, tabs, control characters, trailing
    and leading spaces, several lines, long ones."""
    rng = random.Random(seed)
    pool = (list("abc XYZ 019 .,:;[]()/\\|=-_'\"!?%") + ["█", "░", "·", "↺", "–", "é", "日本", "👍🏽", "e\u0301",
            "\u200b", "\t", "\r", "\x1b[0m", "\x07", "\x00", "\x7f", "\n", "  ", "\u2028", "\u00a0", "[bold]", ":smile:"])
    out = ["", " ", "a ", " a", "\n", "a\n", "\na", "x" * 300, "x" * 300 + " ", "[reply cut at max_tokens=1; "
           "--max-tokens N to change]", "sink(4) pinned 26 + window 2022 | rss 398.5 MiB | sink ██████░░░░ 0.56"]
    printable = [c for c in pool if c.isprintable()]
    for i in range(n):
        out.append("".join(rng.choice(printable if i % 2 else pool) for _ in range(rng.randrange(0, 60))))
    return out


@pytest.mark.parametrize("columns", ["20", "80", "200"])
def test_plain_lines_are_written_as_rich_writes_them(columns, monkeypatch):
    """Off a terminal, `Renderer.say` writes a `plain` line itself; every line, plain or not, comes out exactly as
    through rich's Console (made first, so it prints everything), at any terminal width."""
    monkeypatch.setenv("COLUMNS", columns)
    lines = _lines(400)
    assert 50 < sum(map(plain, lines)) < len(lines) - 50  # both paths taken
    for text in lines:
        ours, theirs = io.StringIO(), io.StringIO()
        fast, rich = Renderer(io.StringIO(), ours, tty=False), Renderer(io.StringIO(), theirs, tty=False)
        rich.console("err")
        fast.say("err", text, "bold red")
        rich.say("err", text, "bold red")
        assert ours.getvalue() == theirs.getvalue(), repr(text)
        assert ("err" in fast._consoles) != plain(text)  # a plain line made no Console


def test_a_piped_renderer_imports_no_rich():
    """A piped chat's messages, replies, evictions and status line are written without importing rich (0.12 s of
    a start at load 2-3), which a terminal, a /stats table or a line rich would change still import."""
    code = """if True:
        import io, sys
        from sinkchat.apps.render import Renderer
        from sinkchat.core.events import DoneEvent, EvictionEvent
        r = Renderer(io.StringIO(), io.StringIO(), tty=False)
        r.info("loading"); r.begin_reply(); r.token("Hello"); r.eviction(EvictionEvent(first=4, last=132, count=128,
            cache_len=300, policy="sink", preview="x")); r.end_reply(DoneEvent(tokens=1, reason="length", seconds=0.1)); r.error("e")
        assert "rich" not in sys.modules, "plain lines imported rich"
        r.info("tab\\there")
        assert "rich" in sys.modules
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


# ------------------------------------------------------------------------------------------ the KV cache's pages
def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


@pytest.mark.skipif(not Path("/proc/self/statm").is_file(), reason="no /proc (RSS read from statm)")
def test_kv_buffers_are_zero_without_being_written():
    """A layer's buffers read 0 everywhere, as `torch.zeros` made them, but their pages come into RSS only when
    written: allocating 256 MiB of cache adds far less (torch.zeros wrote every byte: 0.26 s for the bundled
    model's 45 MiB on the busy box)."""
    layer = SinkLayer(capacity=1 << 18, dtype=torch.float32)  # 2 x [1, 2, 2^18, 64] fp32 = 256 MiB
    before = _rss()
    layer.lazy_initialization(torch.zeros(1, 2, 0, 64), torch.zeros(1, 2, 0, 64))
    grew = _rss() - before
    assert grew < 16 << 20, f"allocating the cache wrote {grew >> 20} MiB"
    k = torch.randn(1, 2, 3, 64)
    got, _ = layer.update(k, k + 1)
    assert torch.equal(got, k) and layer.keys.shape == (1, 2, 1 << 18, 64) and layer.keys.is_contiguous()
    assert not layer.keys[:, :, 3:].any() and not layer.values[:, :, 3:].any()
    assert layer.nbytes == 256 << 20
    half = lazy_zeros((1 << 20,), torch.bfloat16, torch.device("cpu"))
    assert half.dtype == torch.bfloat16 and half.numel() == 1 << 20 and not half.any()
    assert lazy_zeros((0, 4), torch.float32, torch.device("cpu")).shape == (0, 4)


# ------------------------------------------------------------------------------------------ the tokenizer's file
@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled GGUF's converted folder (tokenizer and config only)."""
    from sinkchat.model.loader import bundled_gguf

    with pytest.MonkeyPatch.context() as m:
        m.setenv("SINKCHAT_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return gguf_convert.prepare(bundled_gguf(), lambda msg: None)


def test_the_tokenizer_is_read_from_its_quicker_form(folder, monkeypatch):
    """`describe` writes tokenizer-light.json (merges as strings) and a later start reads it: the very tokenizer of
    tokenizer.json (`to_str` equal, the same ids); a changed or missing file is not read (tokenizer.json is)."""
    import tokenizers
    from transformers import AutoTokenizer

    real = AutoTokenizer.from_pretrained(str(folder))
    info = light_tokenizer.describe(real, folder)
    assert info is not None and info["fast"] is not None and (folder / light_tokenizer.FAST).is_file()
    read: list[str] = []
    from_file = tokenizers.Tokenizer.from_file
    monkeypatch.setattr(tokenizers.Tokenizer, "from_file", lambda path: read.append(Path(path).name) or from_file(path))
    light = light_tokenizer.LightTokenizer.load(folder, info)
    assert light is not None and read == [light_tokenizer.FAST]
    assert '"merges":[["' not in (folder / light_tokenizer.FAST).read_text(encoding="utf-8")[-2_000_000:]
    assert light.backend_tokenizer.to_str() == real.backend_tokenizer.to_str()
    for text in ("Hello, world!", "  spaces\tand\nlines ", "héllo 日本語 👍🏽", "<|im_start|>user\nhi<|im_end|>"):
        assert light.encode(text) == real.encode(text)
    (folder / light_tokenizer.FAST).write_text("{}", encoding="utf-8")  # changed since: not read
    assert light_tokenizer.LightTokenizer.load(folder, info) is not None and read[-1] == light_tokenizer.FILE
    unreadable = {**info, "fast": light_tokenizer._stat(folder, light_tokenizer.FAST)}  # unchanged, yet unreadable
    got = light_tokenizer.LightTokenizer.load(folder, unreadable)  # (another tokenizers version): tokenizer.json
    assert got is not None and read[-2:] == [light_tokenizer.FAST, light_tokenizer.FILE]
    assert got.encode("Hello, world!") == real.encode("Hello, world!")
    (folder / light_tokenizer.FAST).unlink()
    assert light_tokenizer.LightTokenizer.load(folder, info) is not None and read[-1] == light_tokenizer.FILE
    assert light_tokenizer.LightTokenizer.load(folder, {**info, "fast": None}) is not None  # an older sidecar


def test_no_quicker_form_where_it_would_differ(tmp_path):
    """A merge part holding a space (the string form would split it elsewhere), a merge line `tokenizers` would skip
    as a header, or a model that is not BPE: no tokenizer-light.json."""
    base = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]]}}
    assert light_tokenizer._write_fast(tmp_path, json.dumps(base)) is not None
    for merges in ([["a b", "c"]], [["#version", "b"]]):
        data = {"model": {**base["model"], "merges": merges}}
        (tmp_path / light_tokenizer.FAST).unlink(missing_ok=True)
        assert light_tokenizer._write_fast(tmp_path, json.dumps(data)) is None
        assert not (tmp_path / light_tokenizer.FAST).exists()
    assert light_tokenizer._write_fast(tmp_path, json.dumps({"model": {"type": "WordPiece", "vocab": {}}})) is None


# ------------------------------------------------------------------------------------------ the garbage collector
def test_the_collector_is_paused_then_frozen_once():
    """`pause` turns the collector off, `resume` freezes what is alive and turns it on, once; a collector a caller
    turned off stays off; `resume(freeze=False)` (a command that loaded no model) freezes nothing."""
    import gc

    from sinkchat.model import collector

    assert gc.isenabled()
    before = gc.get_freeze_count()
    try:
        collector.pause()
        assert not gc.isenabled() and collector.paused()
        collector.resume()
        assert gc.isenabled() and gc.get_freeze_count() > before and not collector.paused()
        frozen = gc.get_freeze_count()
        collector.resume()  # a later load: nothing (frozen objects may be freed meanwhile: the count only falls)
        assert gc.isenabled() and gc.get_freeze_count() <= frozen
        gc.disable()
        collector.pause()
        collector.resume()
        assert not gc.isenabled()  # the caller's own setting
        gc.enable()
        collector.pause()
        collector.resume(freeze=False)
        assert gc.isenabled() and gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
        gc.enable()
