"""`sinkchat summarize`: reader/filter/batcher units (no model), the Summarizer on a tiny random model, the CLI in
subprocesses on a tiny saved model (bad input, empty input, SIGPIPE, --follow + truncation + SIGINT) and one run of
the real bundled model on a real Debian changelog streamed through a pipe."""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from sinkchat.apps.summarize.batching import Batcher
from sinkchat.apps.summarize.digest import severities
from sinkchat.apps.summarize.reader import (
    End, LineSplitter, Line, Notice, Reader, clean_line, follow_chunks, stream_chunks,
)

from fakes import CharTokenizer as CharTok, tiny_model

WAIT = 240.0  # generous per-step timeout for subprocess output on a loaded 2-core box (never asserted on)


# ----------------------------------------------------------------------------------------------------- units
def test_splitter_keeps_bounded_prefix_of_a_huge_line_split_across_reads():
    sp = LineSplitter(100)
    out = []
    big = b"a" * 10_000_000
    for i in range(0, len(big), 65536):
        out += sp.feed(big[i : i + 65536])
    out += sp.feed(b"\nnext\npartial")
    assert [(len(k), t, m) for k, t, m in out] == [(100, 10_000_000, ""), (4, 4, "")]
    assert len(sp.buf) <= 100
    assert sp.flush() == (b"partial", 7, "")
    assert sp.flush() is None


def test_a_cut_line_keeps_its_end_and_names_the_severity_words_of_what_was_cut():
    """A long payload, then "-> ERROR upstream failed": the cut kept the payload and the summary said "no errors".
    The end is kept; a FATAL in a 10 MB middle, split across two reads, is named in the marker."""
    sp = LineSplitter(100, tail=40)
    line = b"INFO payload=" + b"a" * 5000 + b" -> ERROR upstream failed"
    (kept, total, middle), = sp.feed(line + b"\n")
    assert kept.endswith(b"-> ERROR upstream failed") and len(kept) == 140 and total == len(line) and middle == ""
    text, cut = clean_line(kept, total, 160, middle)
    assert cut and text.startswith("INFO payload=aaa") and text.endswith(" -> ERROR upstream failed"), text
    assert f"{len(line)} bytes]" in text and len(text) < 160 + 40, text
    big = b"x " * 2_000_000 + b"FATAL: worker lost " + b"y " * 2_000_000
    cut_at = big.index(b"FATAL") + 2  # "FA" | "TAL"
    out = sp.feed(big[:cut_at]) + sp.feed(big[cut_at:] + b"\n")
    (kept, total, middle), = out
    assert middle == "fatal" and len(kept) == 140 and total == len(big)
    text, _ = clean_line(kept, total, 60, middle)
    assert "the cut part holds fatal" in text and severities(text)["fatal"] == 1, text
    sp = LineSplitter(100, tail=40)  # a word the tail lets go of in two pieces, one read apart
    out = sp.feed(b"a" * 100 + b"x " * 250 + b" FATAL" + b" y" * 18 + b"y") + sp.feed(b" z" * 500 + b"\n")
    assert out[0][2] == "fatal", out[0][2]
    raw = b"INFO " + b"b" * 300 + b" WARNING x " + b"c" * 300 + b" end"
    text, cut = clean_line(raw, len(raw), 100)
    assert cut and "620 chars; the cut part holds warning]" in text and text.endswith("c end"), text


def test_clean_line_handles_crlf_invalid_utf8_control_bytes_ansi_and_length():
    assert clean_line(b"hello\r", 6, 50) == ("hello", False)
    text, cut = clean_line(b"bad \xff\xfe end", 10, 50)
    assert text == "bad \ufffd\ufffd end" and not cut
    raw = b"\x1b[31mred\x1b[0m\x00x\ty"
    assert clean_line(raw, len(raw), 50) == ("red\ufffdx\ty", False)
    text, cut = clean_line(b"x" * 40, 1000, 30)
    assert cut and text.startswith("x" * 23 + " …") and "1000 bytes" in text and "xxxx" * 8 not in text
    text, cut = clean_line("é".encode() * 40, 80, 30)
    assert cut and text.startswith("é" * 23 + " …") and "40 chars" in text


def _read_all(data: bytes, **kw) -> list:
    q: queue.Queue = queue.Queue()
    r = Reader(stream_chunks(io.BytesIO(data), threading.Event()), q, max_line_chars=kw.pop("max_chars", 50), **kw)
    r.start()
    r.join(10)
    items = []
    while not q.empty():
        items.append(q.get_nowait())
    return items


def test_reader_numbers_lines_and_ends_with_a_partial_line():
    items = _read_all(b"one\r\ntwo\n\n\x00\x01bin\nlast without newline")
    lines = [i for i in items if isinstance(i, Line)]
    assert [(l.no, l.text) for l in lines] == [(1, "one"), (2, "two"), (3, ""), (4, "\ufffd\ufffdbin"),
                                               (5, "last without newline")]
    assert items[-1] == End(5, 0, None)
    assert _read_all(b"") == [End(0, 0, None)]


def test_reader_drop_backpressure_accounts_every_line():
    n = 5000
    data = b"".join(b"line %d\n" % i for i in range(n))
    q: queue.Queue = queue.Queue(maxsize=7)
    r = Reader(stream_chunks(io.BytesIO(data), threading.Event()), q, max_line_chars=50, backpressure="drop")
    r.start()
    b = Batcher(lambda s: len(s.split()), chunk_lines=10**9, chunk_tokens=10**9, dedupe=False)
    seen = []
    while True:
        item = q.get(timeout=10)
        b.add(item)
        if isinstance(item, End):
            break
        seen.append(item.no)
        time.sleep(0.002)  # a slow consumer
    p = b.period
    assert p.skipped > 0  # the queue of 7 overflowed
    assert p.lines == n and p.first_line == 1 and p.last_line == n and p.consistent()
    assert p.summarized == len(seen) and seen == sorted(seen)
    assert len(b.chunk) == len(seen)  # every kept line would be fed


def test_batcher_filters_dedupes_and_chunks():
    b = Batcher(lambda s: len(s), chunk_lines=4, chunk_tokens=10**6,
                grep=re.compile("err|warn|dup"), exclude=re.compile("ignore"))
    texts = ["err a", "noise", "dup", "dup", "dup", "warn ignore me", "err b", "err b"]
    for i, t in enumerate(texts, 1):
        b.add(Line(i, t))
    p = b.period
    assert (p.summarized, p.filtered, p.deduped) == (3, 2, 3) and p.lines == 8 and p.consistent()
    assert b.chunk == ["err a", "dup", "(the line above repeated 2 more times)", "err b"] and b.full
    assert b.take_chunk() == "err a\ndup\n(the line above repeated 2 more times)\nerr b"
    b.end_run()  # a summary boundary closes the open run of "err b"
    assert b.chunk == ["(the line above repeated 1 more times)"]
    b.add(End(8, skipped_before=0))
    done = b.take_period()
    assert done.lines == 8 and b.period.lines == 0
    b.add(Line(12, "dup", skipped_before=3))  # lines 9-11 were dropped by the reader
    assert (b.period.first_line, b.period.skipped, b.period.summarized) == (9, 3, 1) and b.period.consistent()
    b2 = Batcher(lambda s: 5, chunk_lines=100, chunk_tokens=12)
    b2.add(Line(1, "a"))
    assert not b2.full
    b2.add(Line(2, "b"))
    assert b2.full  # 2 lines x (5 tokens + newline) >= 12


def test_follow_survives_append_truncation_and_rotation(tmp_path):
    path = tmp_path / "app.log"
    path.write_bytes(b"a1\na2\npart")
    stop = threading.Event()
    q: queue.Queue = queue.Queue()
    box: list = []
    r = Reader(follow_chunks(str(path), stop, lambda m: box[0].notice(m), poll=0.02), q, max_line_chars=50, stop=stop)
    box.append(r)
    r.start()

    def take(n):
        got = []
        while len(got) < n:
            got.append(q.get(timeout=10))
        return got

    assert [i.text for i in take(2)] == ["a1", "a2"]
    with open(path, "ab") as f:
        f.write(b"ial\na3\n")  # the partial line is completed, not split
    assert [i.text for i in take(2)] == ["partial", "a3"]
    path.write_bytes(b"b1\n")  # truncated and rewritten shorter
    got = take(2)
    assert isinstance(got[0], Notice) and "truncated" in got[0].message and got[1].text == "b1"
    os.rename(path, tmp_path / "app.log.1")
    path.write_bytes(b"c1\nc2\n")
    got = take(3)
    assert "replaced" in got[0].message and [g.text for g in got[1:]] == ["c1", "c2"]
    assert [g.no for g in got[1:]] == [6, 7]  # numbering runs on across files
    stop.set()
    r.join(5)
    assert not r.is_alive()
    q2: queue.Queue = queue.Queue()  # --from-end: only what is appended after we start
    stop2 = threading.Event()
    r2 = Reader(follow_chunks(str(path), stop2, print, from_end=True, poll=0.02), q2, max_line_chars=50, stop=stop2)
    r2.start()
    for _ in range(300):  # append until the reader (which may start late) sees something
        with open(path, "ab") as f:
            f.write(b"new\n")
        try:
            first = q2.get(timeout=0.1)
            break
        except queue.Empty:
            continue
    assert first == Line(1, "new")  # what the file held before (c1, c2) was skipped
    stop2.set()
    r2.join(5)


def test_render_block_formats():
    from sinkchat.apps.summarize.output import render_block

    b = {"time": "T", "first_line": 3, "last_line": 9, "lines": 7, "summarized": 5, "filtered": 1, "deduped": 0,
         "skipped": 1, "tokens_fed": 10, "tokens_evicted": 2, "final": True, "summary": "it broke"}
    assert json.loads(render_block(b, "jsonl")) == b and render_block(b, "jsonl").count("\n") == 1
    assert render_block(b, "text").startswith("[T] lines 3-9 (final) (7 lines: 5 summarized, 1 filtered, 1 skipped)\nit broke")
    assert "### T · lines 3–9" in render_block(b, "markdown")


# ----------------------------------------------------------------------------------------------------- tiny model
def test_summarizer_feeds_once_keeps_memory_flat_and_accounts_lines():
    from sinkchat.config import CacheConfig, SamplingConfig
    from sinkchat.core.engine import Engine
    from sinkchat.apps.summarize.summarizer import Output, Status, Summarizer

    eng = Engine(tiny_model(max_pos=4096), CharTok(), CacheConfig(capacity=96, n_sink=4),
                 SamplingConfig(temperature=0, max_tokens=3))
    out = io.StringIO()
    b = Batcher(lambda s: len(s), chunk_lines=3, chunk_tokens=10**6, exclude=re.compile("skip"))
    s = Summarizer(eng, b, Output("jsonl", out), Status(io.StringIO(), quiet=True), prompt="sum {first_line}-{last_line}",
                   every=10, interval=0, max_tokens=3)
    q: queue.Queue = queue.Queue()
    n = 95
    for i in range(1, n + 1):
        q.put(Line(i, "skip me" if i % 7 == 0 else f"event {i // 3}"))
    q.put(End(n, skipped_before=0))
    s.run(q)
    blocks = [json.loads(l) for l in out.getvalue().splitlines()]
    assert [(x["first_line"], x["last_line"]) for x in blocks] == [(i, min(i + 9, n)) for i in range(1, n + 1, 10)]
    assert blocks[-1]["final"] and not any(x["final"] for x in blocks[:-1])
    assert sum(x["lines"] for x in blocks) == n
    assert sum(x["filtered"] for x in blocks) == n // 7 and sum(x["deduped"] for x in blocks) > 0
    assert sum(x["tokens_fed"] for x in blocks) == eng.ledger.seen >= 10 * 96  # >= 10x capacity went through
    # kv_bytes is the preallocated size (constant by construction); what a leak moves is what the cache holds
    assert all(x["cache_len"] <= 96 for x in blocks)
    assert eng.ledger.seen - eng.ledger.evicted - eng.ledger.cleared == eng.cache.length == len(eng.ledger.ids) <= 96
    assert len(eng.conv.messages) <= 2  # the conversation is trimmed, not growing with the log


# ----------------------------------------------------------------------------------------------------- subprocesses
def _cli(*args: str, model: str | None, stdin=subprocess.PIPE, **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sinkchat.cli", "summarize", "--format", "jsonl", "--temperature", "0",
           "--interval", "0", *args]
    if model:
        cmd += ["--model", model, "--quant", "none"]
    return subprocess.Popen(cmd, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


class Lines:
    """Reads a pipe line by line in a thread, so a test can wait for the next line with a timeout."""

    def __init__(self, pipe) -> None:
        self.q: queue.Queue = queue.Queue()
        self.all: list[str] = []
        threading.Thread(target=self._run, args=(pipe,), daemon=True).start()

    def _run(self, pipe) -> None:
        for raw in pipe:
            line = raw.decode("utf-8", "replace")
            self.all.append(line)
            self.q.put(line)
        self.q.put(None)

    def next(self) -> str | None:
        return self.q.get(timeout=WAIT)

    def until(self, pred) -> str:
        while True:
            line = self.next()
            assert line is not None, "stream ended early"
            if pred(line):
                return line


def _check_accounting(blocks: list[dict], total: int) -> None:
    assert blocks and blocks[0]["first_line"] == 1 and blocks[-1]["last_line"] == total
    for a, b in zip(blocks, blocks[1:]):
        assert b["first_line"] == a["last_line"] + 1
    for x in blocks:
        assert x["lines"] == x["last_line"] - x["first_line"] + 1
        assert x["lines"] == x["summarized"] + x["filtered"] + x["deduped"] + x["skipped"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    """A tiny random Llama with the bundled model's real tokenizer and chat template, saved as a model folder."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from sinkchat.model.loader import resolve_source

    _, src = resolve_source(None, lambda m: None)
    tok = AutoTokenizer.from_pretrained(src)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id)
    d = tmp_path_factory.mktemp("tiny-model")
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


@pytest.fixture
def run_inprocess(monkeypatch):
    """Runs `sinkchat summarize` in this process (click's runner) on a tiny random model: the whole command, minus
    a second interpreter and a model load."""
    from click.testing import CliRunner

    import sinkchat.apps.summarize.command as pipe
    from sinkchat.core.engine import Engine

    def fake_open_engine(settings, system=None, progress=None):
        return Engine(tiny_model(max_pos=4096), CharTok(), settings.cache, settings.sampling, system=system)

    monkeypatch.setattr("sinkchat.api.open_engine", fake_open_engine)

    def run(data: bytes, *args: str):
        res = CliRunner().invoke(pipe.summarize_command, ["--format", "jsonl", "--temperature", "0", *args],
                                 input=data)
        blocks = [json.loads(l) for l in res.stdout.splitlines()]
        return res, blocks

    return run


def test_cli_bad_input_binary_utf8_crlf_and_a_10mb_line(run_inprocess):
    data = (b"same\n" * 5 + b"start\r\nwindows line\r\n" + bytes(range(256)) + b"\nbad utf8 \xff\xfe\xc3\x28 end\n"
            + b"x" * 10_000_000 + b"\nafter the long line\nno newline at the end")
    total = data.count(b"\n") + 1
    res, blocks = run_inprocess(data, "--every", "6", "--cache", "64", "--max-tokens", "3", "--backpressure", "block")
    assert res.exit_code == 0 and res.exception is None, res.output
    _check_accounting(blocks, total)
    assert sum(x["truncated"] for x in blocks) == 1 and sum(x["deduped"] for x in blocks) == 4
    assert all(x["cache_len"] <= x["capacity"] == 64 for x in blocks)  # (kv_bytes: the allocation, constant)


def test_summarize_sessions_are_logged(run_inprocess, tmp_path, monkeypatch):
    from sinkchat.store import transcript
    monkeypatch.setenv("SINKCHAT_HOME", str(tmp_path))
    res, blocks = run_inprocess(b"".join(b"event %d\n" % i for i in range(12)), "--every", "6", "--cache", "64",
                                "--max-tokens", "3", "--backpressure", "block")
    assert res.exit_code == 0 and len(blocks) == 2, res.output
    s = transcript.latest_session("summarize")
    assert s is not None and s.turns == 4 and s.ended
    turns = transcript.turns(s.id)
    assert [t.role for t in turns] == ["user", "assistant"] * 2
    assert "1" in turns[0].text and "6" in turns[0].text  # the question names its line range
    assert [t.text for t in turns[1::2]] == [b["summary"] for b in blocks]
    assert len(transcript.export(s.id)["metrics"]) == 2  # one figures row per summary
    res, _ = run_inprocess(b"x\n", "--no-log", "--cache", "64", "--max-tokens", "2")
    assert res.exit_code == 0 and transcript.latest_session("summarize").id == s.id


def test_cli_empty_input_bad_regex_and_filters(run_inprocess):
    res, blocks = run_inprocess(b"")  # JSONL ends with a final record, on empty input too (docs/summarize.md)
    assert res.exit_code == 0 and res.exception is None and "no input lines" in res.stderr
    assert [(b["lines"], b["final"], b["summary"]) for b in blocks] == [(0, True, "")]
    for args, said in [(("--follow", "a.log", "b.log"), "--follow reads one file: a.log (and b.log given too)"),
                       (("--from-end",), "--from-end goes with --follow FILE")]:
        res, _ = run_inprocess(b"x\n", *args)
        assert res.exit_code == 2 and said in res.stderr and "Traceback" not in res.stderr, res.stderr
    res, _ = run_inprocess(b"x\n", "--grep", "([")
    assert res.exit_code == 2 and "not a valid regular expression" in res.stderr and res.exception is not None
    assert isinstance(res.exception, SystemExit)  # a usage error, not a crash
    res, blocks = run_inprocess(b"ok 1\nERROR disk\nok 2\nERROR net\n", "--grep", "ERROR", "--every", "2",
                                "--cache", "64", "--max-tokens", "2")
    assert res.exit_code == 0 and [(b["summarized"], b["filtered"]) for b in blocks] == [(1, 1), (1, 1)]
    res, blocks = run_inprocess(b"a\nb\n", "--exclude", ".", "--cache", "64")
    assert res.exit_code == 0 and blocks[0]["summarized"] == 0 and blocks[0]["filtered"] == 2
    assert blocks[0]["summary"] == "" and blocks[0]["tokens_fed"] == 0  # nothing left: the model is not asked


def test_cli_closed_stdout_exits_quietly(tiny_dir):
    p = _cli("--every", "1", "--cache", "64", "--max-tokens", "2", model=tiny_dir)
    errs = Lines(p.stderr)
    p.stdin.write(b"one\ntwo\n")
    p.stdin.flush()
    first = p.stdout.readline()
    assert first and json.loads(first)["first_line"] == 1, (first, errs.all)
    p.stdout.close()  # the reader of our output goes away (like `| head -1`)
    try:
        for i in range(50):
            p.stdin.write(b"more %d\n" % i)
            p.stdin.flush()
        p.stdin.close()
    except BrokenPipeError:
        pass  # it already exited
    rc = p.wait(timeout=WAIT)
    time.sleep(0.2)
    assert rc == 0, (rc, errs.all)
    assert not any("Traceback" in l or "Error" in l for l in errs.all), errs.all


def _follow(tiny_dir, tmp_path, text: str):
    """`summarize --follow` on a fresh log holding `text`: (log path, process, stdout lines, stderr lines)."""
    log = tmp_path / "app.log"
    log.write_text(text)
    p = _cli("--follow", str(log), "--every", "10", "--cache", "64", "--max-tokens", "2", model=tiny_dir,
             stdin=subprocess.DEVNULL)
    return log, p, Lines(p.stdout), Lines(p.stderr)


def _signal_and_collect(p, outs, sig) -> list[dict]:
    p.send_signal(sig)
    return [json.loads(line) for line in iter(outs.next, None)]


def test_cli_follow_append_truncate_then_ctrl_c(tiny_dir, tmp_path):
    log, p, outs, errs = _follow(tiny_dir, tmp_path, "".join(f"boot step {i}\n" for i in range(1, 26)))
    blocks = [json.loads(outs.next()) for _ in range(2)]  # 1-10, 11-20: before any EOF (there is none)
    with open(log, "a") as f:
        f.write("".join(f"late line {i}\n" for i in range(26, 31)))
    blocks.append(json.loads(outs.next()))  # 21-30: the appended lines were read
    log.write_text("".join(f"after truncation {i}\n" for i in range(1, 9)))  # shorter than before
    errs.until(lambda l: "truncated" in l)
    time.sleep(1.0)  # let the reader queue lines 31-38 before Ctrl-C
    blocks += _signal_and_collect(p, outs, signal.SIGINT)
    assert p.wait(timeout=WAIT) == 130
    assert not any("Traceback" in l for l in errs.all), errs.all
    _check_accounting(blocks, 30 + 8)
    assert [(b["first_line"], b["last_line"]) for b in blocks] == [(1, 10), (11, 20), (21, 30), (31, 38)]
    assert blocks[-1]["final"]


def test_cli_sigterm_gives_the_final_summary_too(tiny_dir, tmp_path):
    """`kill` (or a service manager stopping it) must not lose the pending lines: final summary, exit 143."""
    _, p, outs, errs = _follow(tiny_dir, tmp_path, "".join(f"job {i} done\n" for i in range(1, 16)))
    blocks = [json.loads(outs.next())]  # lines 1-10
    time.sleep(1.0)  # lines 11-15 are queued, below --every
    blocks += _signal_and_collect(p, outs, signal.SIGTERM)
    assert p.wait(timeout=WAIT) == 143
    assert not any("Traceback" in l for l in errs.all), errs.all
    assert [(b["first_line"], b["last_line"]) for b in blocks] == [(1, 10), (11, 15)]
    assert blocks[-1]["final"]


# ----------------------------------------------------------------------------------------------------- real model
def _changelog(min_lines: int) -> tuple[str, list[bytes]]:
    for path in sorted(glob.glob("/usr/share/doc/*/changelog.Debian.gz")):
        with gzip.open(path) as f:
            lines = f.read().splitlines(keepends=True)
        if len(lines) >= min_lines:
            return path, lines
    pytest.skip("no Debian changelog with enough lines on this machine")


@pytest.mark.slow  # the bundled model over a real changelog, ~8 s idle; a real log: the dpkg test
def test_real_model_summarizes_a_debian_changelog_through_a_pipe():
    path, lines = _changelog(400)
    lines = lines[:120]
    cap = 128
    p = _cli("--every", "40", "--cache", str(cap), "--max-tokens", "16", "--backpressure", "block", model=None)
    outs = Lines(p.stdout)
    errs = Lines(p.stderr)
    p.stdin.write(b"".join(lines[:90]))
    p.stdin.flush()
    early = [json.loads(outs.next()) for _ in range(2)]  # the pipe is still open: no EOF yet
    assert p.poll() is None
    assert [(b["first_line"], b["last_line"]) for b in early] == [(1, 40), (41, 80)]
    p.stdin.write(b"".join(lines[90:]))
    p.stdin.close()
    blocks = early
    while (line := outs.next()) is not None:
        blocks.append(json.loads(line))
    assert p.wait(timeout=WAIT) == 0, "".join(errs.all)[-2000:]
    _check_accounting(blocks, 120)
    assert [(b["first_line"], b["last_line"]) for b in blocks] == [(1, 40), (41, 80), (81, 120)]
    assert all(b["summary"].strip() for b in blocks), blocks  # the model said something for each
    fed = sum(b["tokens_fed"] for b in blocks)
    assert fed >= 10 * cap, (path, fed)
    assert blocks[0]["kv_bytes"] > 0  # the allocation; what must stay bounded is cache_len:
    assert all(b["cache_len"] <= cap and b["capacity"] == cap for b in blocks)
    assert not any("Traceback" in l for l in errs.all)


# ----------------------------------------------------------------------------------------------------- queue figure
def test_line_queue_counts_lines_not_the_end_marker_or_notices():
    from sinkchat.apps.summarize.reader import LineQueue

    q = LineQueue(maxsize=10)
    r = Reader(iter(()), q, max_line_chars=50)
    for i in (1, 2, 3):
        q.put(Line(i, f"l{i}"))
    r.notice("file truncated")  # past the bound, like the reader's own notices
    q.put(End(3))
    assert q.qsize() == 5 and q.lines == 3  # qsize() counts the marker and the notice too: not a line count
    assert isinstance(q.get(), Line) and q.lines == 2
    while not q.empty():
        q.get_nowait()
    assert q.lines == 0


def test_status_queue_figure_plus_lines_read_never_exceeds_the_input(run_inprocess, monkeypatch):
    """The status line's "queue N" is lines waiting, so lines read + queued is at most the input's line count; it
    was one higher once the reader had queued its End marker (q.qsize() counted it)."""
    import sinkchat.apps.summarize.command as pipe
    import sinkchat.apps.summarize.status as summarize_status

    monkeypatch.setattr(summarize_status, "PLAIN_EVERY", 0.0)  # a status line at every tick (stderr is not a terminal)
    import sinkchat.api as api

    loaded = api.open_engine

    def slow_open(*args, **kw):
        time.sleep(0.5)  # the reader thread queues every line and the End marker meanwhile
        return loaded(*args, **kw)

    monkeypatch.setattr("sinkchat.api.open_engine", slow_open)
    n = 30
    res, blocks = run_inprocess(b"".join(b"event %d\n" % i for i in range(n)), "--every", "10", "--chunk-lines", "3",
                                "--cache", "64", "--max-tokens", "2")
    assert res.exit_code == 0 and len(blocks) == 3, res.output
    figs = [(int(a), int(b)) for a, b in re.findall(r"^lines (\d+):.*? queue (\d+) \|", res.stderr, re.M)]
    assert any(read < n for read, _ in figs), figs  # shown while lines were still waiting
    assert all(read + queued <= n for read, queued in figs), figs
    assert any(read < n and read + queued == n for read, queued in figs), figs


# ----------------------------------------------------------------------------------------------------- stopping
def test_batcher_skip_and_drop_chunk_keep_every_line_accounted():
    b = Batcher(lambda s: 1, chunk_lines=100, chunk_tokens=10**6)
    for i, t in enumerate(["a", "b", "b", "b", "c"], 1):
        b.add(Line(i, t, truncated=i == 5))
    assert b.chunk_summarized == 3 and b.chunk == ["a", "b", "(the line above repeated 2 more times)", "c"]
    assert b.drop_chunk() == 3  # stopped: the pending chunk never reaches the model
    p = b.period
    # the repeats of "b" stand for a line the model never read: skipped too, not deduped
    assert (p.summarized, p.deduped, p.skipped, p.truncated) == (0, 0, 5, 0) and b.chunk == [] and p.consistent()
    assert b.digest.record()["lines"] == 0
    b.skip(Line(8, "x", skipped_before=2))  # queued, never fed; lines 6-7 were dropped by the reader
    b.skip_to(11)  # the reader numbered lines up to 11 but never queued 9-11
    b.skip(End(11))  # nothing new
    assert (p.first_line, p.last_line, p.skipped, p.lines) == (1, 11, 11, 11) and p.consistent()
    b2 = Batcher(lambda s: 1, chunk_lines=2, chunk_tokens=10**6)
    b2.add(Line(1, "a"))
    b2.add(Line(2, "b"))
    n = b2.chunk_summarized
    assert b2.take_chunk() == "a\nb" and b2.chunk_summarized == 0
    b2.unfeed(n, 0)  # that chunk's feed was taken back
    assert (b2.period.summarized, b2.period.skipped) == (0, 2)


def _stopping_summarizer(n_lines: int, halt_in_feed: int):
    """A Summarizer on a tiny model whose `halt_in_feed`-th chunk feed is interrupted after its first prefill
    chunk (as a signal handler would, mid-message); the queue holds `n_lines` lines, no End (a live pipe)."""
    from sinkchat.config import CacheConfig, SamplingConfig
    from sinkchat.core.engine import Engine
    from sinkchat.apps.summarize.summarizer import Output, Status, Summarizer

    eng = Engine(tiny_model(max_pos=4096), CharTok(), CacheConfig(capacity=4096, n_sink=4),
                 SamplingConfig(temperature=0, max_tokens=3), prefill_chunk=8)
    out = io.StringIO()
    b = Batcher(lambda s: len(s), chunk_lines=5, chunk_tokens=10**6, dedupe=False)
    s = Summarizer(eng, b, Output("jsonl", out), Status(io.StringIO(), quiet=True), prompt="sum {first_line}-{last_line}",
                   every=0, interval=0, max_tokens=3)
    feeds = [0]
    feed_ids = eng.feed_ids

    def interrupted_feed(ids, all_logits=False):
        feeds[0] += 1
        for ev in feed_ids(ids, all_logits):
            if feeds[0] == halt_in_feed:
                s.halt.set()
            yield ev

    eng.feed_ids = interrupted_feed
    q: queue.Queue = queue.Queue()
    for i in range(1, n_lines + 1):
        q.put(Line(i, f"event number {i}"))
    return s, eng, q, out


def test_summarizer_stop_mid_feed_takes_the_chunk_back_and_skips_the_backlog():
    from sinkchat.apps.summarize.summarizer import Interrupted

    n = 200
    s, eng, q, out = _stopping_summarizer(n, halt_in_feed=3)
    with pytest.raises(Interrupted):
        s.run(q)  # two chunks fed, the third stopped after its first prefill chunk: the backlog is not fed
    assert eng.message_taken_back and q.qsize() > 150
    seen = eng.ledger.seen
    s.finish_stopped(q, lines_read=n + 7)  # the reader had numbered 7 more lines it never queued
    blocks = [json.loads(l) for l in out.getvalue().splitlines()]
    assert len(blocks) == 1 and blocks[0]["final"]
    b = blocks[0]
    assert (b["first_line"], b["last_line"], b["summarized"], b["skipped"]) == (1, n + 7, 10, n + 7 - 10)
    _check_accounting(blocks, n + 7)
    after = eng.tokenizer.decode(eng.ledger.ids[seen:])  # the capacity is never reached: nothing was evicted
    assert f"sum 1-{n + 7}" in after and "event" not in after  # the question about what the cache holds; no line


def test_summarizer_stop_between_summaries_emits_a_skipped_only_final_block():
    from sinkchat.apps.summarize.summarizer import Interrupted

    s, eng, q, out = _stopping_summarizer(12, halt_in_feed=10**9)
    s.every = 10
    q.put(End(12))
    s.halt.set()  # the stop came before the loop took anything
    with pytest.raises(Interrupted):
        s.run(q)
    s.finish_stopped(q, lines_read=12)
    blocks = [json.loads(l) for l in out.getvalue().splitlines()]
    assert [(b["lines"], b["skipped"], b["summarized"], b["summary"], b["tokens_fed"]) for b in blocks] == [
        (12, 12, 0, "", 0)]  # nothing was fed, so the model is not asked
    assert eng.ledger.seen == 0


def _write_quietly(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.flush()
    except (BrokenPipeError, ValueError, OSError):
        pass


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow)],
                         ids=["sigterm", "ctrl-c"])  # ctrl-c: ~15 s idle, the same path as SIGTERM but for the signal
def test_cli_stop_with_a_large_backlog_skips_it_and_exits_within_10s(tiny_dir, sig, code):
    """A stop must not feed the queued backlog first: with ~1 MB of binary lines queued it used to feed for minutes
    (tens of seconds on this tiny model) while a process manager sends SIGKILL after 10-90 s. Now: the final
    summary at once, the backlog counted as skipped in it, exit 143 / 130 within 10 s."""
    import random

    data = random.Random(0).randbytes(1_000_000)  # ~3,900 lines of binary garbage, ~200 tokens each
    p = _cli("--every", "20", "--cache", "64", "--max-tokens", "2", model=tiny_dir)
    outs, errs = Lines(p.stdout), Lines(p.stderr)
    writer = threading.Thread(target=_write_quietly, args=(p.stdin, data), daemon=True)
    writer.start()
    try:
        blocks = [json.loads(outs.next())]  # lines 1-20: the model is loaded and busy with the backlog
        writer.join(WAIT)  # the pipe took it all: the reader has queued (nearly) the whole backlog
        t0 = time.monotonic()
        p.send_signal(sig)
        rc = p.wait(timeout=10)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
        _write_quietly(p.stdin, b"")
    blocks += [json.loads(line) for line in iter(outs.next, None)]
    assert rc == code and took < 10, (rc, took)
    assert not any("Traceback" in l for l in errs.all), errs.all
    final = blocks[-1]
    assert final["final"] and final["last_line"] > 1000, final
    _check_accounting(blocks, final["last_line"])  # every line read is in a block, the backlog as skipped
    assert final["skipped"] > final["lines"] // 2, final


# ----------------------------------------------------------------------------------------------------- digest, fit
def test_cli_real_dpkg_log_gets_an_exact_digest_window_sized_chunks_and_binary_skipped(tiny_dir):
    """A real log (this machine's dpkg.log) plus a burst of binary through a real subprocess: every block carries
    the exact digest, the model read every summarized line in full (the window, not --every, sizes the chunks),
    the binary lines are skipped and reported, and the JSONL ends with a final record."""
    import random
    from pathlib import Path

    path = Path("/var/log/dpkg.log")
    if not path.exists():
        pytest.skip("no /var/log/dpkg.log on this machine")
    lines = path.read_bytes().splitlines(keepends=True)[:300]
    binary = [b.replace(b"\n", b"") + b"\n" for b in random.Random(1).randbytes(38 * 200).split(b"\n") if len(b) > 20]
    data = b"".join(lines[:150]) + b"".join(binary[:38]) + b"".join(lines[150:])
    total = data.count(b"\n")
    p = _cli("--every", "1000", "--cache", "1024", "--max-tokens", "8", "--backpressure", "block", model=tiny_dir)
    out, err = p.communicate(data, timeout=WAIT)
    assert p.returncode == 0, err.decode()[-2000:]
    blocks = [json.loads(l) for l in out.decode().splitlines()]
    _check_accounting(blocks, total)
    assert len(blocks) > 1 and blocks[-1]["final"]  # asked more often than --every 1000
    assert sum(b["binary"] for b in blocks) == min(38, len(binary)) and b"skipped" in err and b"binary" in err
    for b in blocks:
        assert b["lines_in_full"] == b["summarized"] and b["lines_digest_only"] == 0, b
        assert b["digest"]["lines"] == b["summarized"] + b["deduped"]
        assert sum(t["count"] for t in b["digest"]["templates"]) == b["digest"]["lines"]
    assert not any(b"Traceback" in l for l in err.splitlines())


def test_a_file_named_like_ppl_FILE_is_read_as_with_file(run_inprocess, tmp_path):
    """`sinkchat summarize app.log` said "Got unexpected extra argument (app.log)" (`ppl FILE` takes one)."""
    log = tmp_path / "app.log"
    log.write_bytes(b"".join(b"event %d\n" % i for i in range(12)))
    res, blocks = run_inprocess(b"", str(log), "--every", "6", "--cache", "64", "--max-tokens", "3")
    assert res.exit_code == 0 and [(b["first_line"], b["last_line"]) for b in blocks] == [(1, 6), (7, 12)], res.output
    res, _ = run_inprocess(b"", str(log), "--file", str(tmp_path / "other.log"))
    assert res.exit_code == 2 and "two files given" in res.output
