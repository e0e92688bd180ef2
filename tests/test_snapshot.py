"""Snapshots: save -> load gives the same next reply; damaged / foreign / mismatched files are refused with the
engine untouched; resume from an automatic snapshot or by re-feeding the transcript."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

from fakes import WordTokenizer, tiny_model
from sinkchat.config import CacheConfig, SamplingConfig
from sinkchat.core.engine import Engine
from sinkchat.store.resume import AutoSnapshot, resume_session
from sinkchat.store.snapshot import SnapshotError, load_snapshot, save_snapshot, snapshot_info, snapshot_path
from sinkchat.store.logdb import auto_snapshot_path
from sinkchat.store.sessionlog import SessionLog
from sinkchat.store.transcript import turns

GREEDY = SamplingConfig(temperature=0.0, max_tokens=8, repetition_penalty=1.0)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, seed=0)


def make(model, cap: int = 32, sinks: int = 4, sampling: SamplingConfig = GREEDY, tok=None) -> Engine:
    return Engine(model, tok or WordTokenizer(), CacheConfig(capacity=cap, n_sink=sinks, evict_chunk=4), sampling,
                  gauge_every=0)


def feed_text(eng: Engine, ids: list[int]) -> None:
    for _ in eng.feed(" ".join(map(str, ids))):
        pass


def reply(eng: Engine) -> tuple[int, ...]:
    done = list(eng.generate())[-1]
    eng.conv.add_reply(eng.reply_text())
    return done.token_ids


def session(eng: Engine, rounds: int = 3) -> None:
    """A few feed/reply rounds long enough to evict."""
    for r in range(rounds):
        feed_text(eng, [(7 * r + i) % 120 + 1 for i in range(14)])
        reply(eng)


def state_of(eng: Engine) -> dict:
    return {"cache": {k: v.clone() for k, v in eng.cache.state().items()}, "ledger": eng.ledger.state(),
            "messages": [dict(m) for m in eng.conv.messages], "fed": eng.conv.fed, "system": eng.conv.system,
            "logits": None if eng.last_logits is None else eng.last_logits.clone(), "cfg": eng.cache_cfg,
            "sampling": eng.sampling, "cap": eng.cache.capacity}


def assert_same_state(a: dict, b: dict) -> None:
    assert a["ledger"] == b["ledger"] and a["messages"] == b["messages"] and a["fed"] == b["fed"]
    assert a["cfg"] == b["cfg"] and a["sampling"] == b["sampling"] and a["cap"] == b["cap"]
    assert a["cache"].keys() == b["cache"].keys()
    assert all(torch.equal(a["cache"][k], b["cache"][k]) for k in a["cache"])
    assert (a["logits"] is None) == (b["logits"] is None)
    if a["logits"] is not None:
        assert torch.equal(a["logits"], b["logits"])


def test_roundtrip_greedy_identical_tiny(model, tmp_path):
    a = make(model)
    session(a)
    assert a.ledger.evicted > 0, "the cache must have evicted before the save"
    path = save_snapshot(a, tmp_path / "s.safetensors", {"session_id": 3})
    saved = state_of(a)
    feed_text(a, [5, 6, 7])
    expected = reply(a)
    b = make(model)
    session(b, 1)  # something else in it first: a load must replace it all, not merge into it
    head = load_snapshot(b, path)
    assert head["extra"] == {"session_id": 3}
    assert_same_state(saved, state_of(b))  # every cached key and value, the ledger, the logits: bit for bit
    feed_text(b, [5, 6, 7])
    assert reply(b) == expected
    assert b.ledger.state() == a.ledger.state()


def test_seeded_sampling_continues_identically(model, tmp_path):
    samp = SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, max_tokens=12, seed=11)
    a = make(model, sampling=samp)
    session(a, 2)
    path = save_snapshot(a, tmp_path / "r.safetensors")
    expected = reply(a)
    b = make(model, sampling=SamplingConfig(temperature=0.0, seed=99))  # the snapshot's sampling and RNG win
    load_snapshot(b, path)
    assert b.sampling == samp
    assert len(expected) > 1 and len(set(expected)) > 1  # a sampled reply: the RNG state decides every token
    assert reply(b) == expected


def _flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def _header_len(path) -> int:
    return struct.unpack("<Q", path.read_bytes()[:8])[0]


@pytest.mark.parametrize("damage", ["truncated", "flip_tensor", "flip_last_byte", "flip_header", "foreign_st",
                                    "text", "missing", "newer"])
def test_damaged_or_foreign_file_refused_engine_unchanged(model, tmp_path, damage):
    src = make(model)
    session(src, 2)
    path = save_snapshot(src, tmp_path / "s.safetensors")
    size, hlen = path.stat().st_size, _header_len(path)
    if damage == "truncated":
        os.truncate(path, size // 2)
    elif damage == "flip_tensor":
        _flip(path, 8 + hlen + (size - 8 - hlen) // 2)
    elif damage == "flip_last_byte":
        _flip(path, size - 1)
    elif damage == "flip_header":  # inside the JSON header text: a digit of a number keeps it valid JSON
        raw = path.read_bytes()
        _flip(path, raw.index(b'\\"cache_len\\": ') + len(b'\\"cache_len\\": '))
    elif damage == "foreign_st":
        from safetensors.torch import save_file

        save_file({"weight": torch.zeros(3)}, str(path), metadata={"format": "pt"})
    elif damage == "text":
        path.write_text("import os; os.system('echo pwned')\n")
    elif damage == "missing":
        path.unlink()
    elif damage == "newer":
        from safetensors import safe_open
        from safetensors.torch import save_file

        with safe_open(str(path), "pt") as f:
            meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
        save_file(tensors, str(path), metadata={**meta, "version": "99"})
    victim = make(model)
    session(victim, 1)
    before = state_of(victim)
    with pytest.raises(SnapshotError) as err:
        load_snapshot(victim, path)
    assert "\n" not in str(err.value)
    assert_same_state(before, state_of(victim))


@pytest.mark.parametrize("other", ["model", "capacity", "sinks", "kv_heads"])
def test_mismatched_session_refused(model, tmp_path, other):
    src = make(model)
    session(src, 2)
    path = save_snapshot(src, tmp_path / "s.safetensors")
    if other == "model":
        victim = make(tiny_model("llama", layers=2, seed=1))  # same shapes, other weights
    elif other == "capacity":
        victim = make(model, cap=48)
    elif other == "sinks":
        victim = make(model, sinks=2)
    else:
        victim = make(tiny_model("llama", layers=2, seed=0, num_key_value_heads=4))
    session(victim, 1)
    before = state_of(victim)
    with pytest.raises(SnapshotError, match="model|--cache|shape"):
        load_snapshot(victim, path)
    assert_same_state(before, state_of(victim))


def test_loaded_fingerprint_is_used(model, tmp_path):
    class L:
        fingerprint, quant = "SmolLM2:abc:nf4:float32", "nf4"

    src = make(model)
    src.loaded = L()
    session(src, 1)
    path = save_snapshot(src, tmp_path / "s.safetensors")
    assert snapshot_info(path)["fingerprint"] == L.fingerprint and snapshot_info(path)["quant"] == "nf4"
    victim = make(model)  # same weights, but no loader fingerprint: not provably the same model -> refused
    with pytest.raises(SnapshotError, match="model"):
        load_snapshot(victim, path)


def test_names_atomic_write_and_unwritable(model, tmp_path, monkeypatch):
    monkeypatch.setenv("SINKCHAT_HOME", str(tmp_path / "home"))
    assert snapshot_path("night1") == tmp_path / "home" / "snapshots" / "night1.safetensors"
    assert snapshot_path("./x.safetensors").name == "x.safetensors"
    with pytest.raises(SnapshotError):
        snapshot_path("bad name!")
    eng = make(model)
    session(eng, 1)
    p = save_snapshot(eng, snapshot_path("night1"))
    assert p.is_file() and [f.name for f in p.parent.iterdir()] == ["night1.safetensors"]  # no temp file left
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SnapshotError, match="cannot write"):
        save_snapshot(eng, blocker / "sub" / "s.safetensors")


def test_snapshot_holds_no_pickle(model, tmp_path):
    eng = make(model)
    session(eng, 1)
    p = save_snapshot(eng, tmp_path / "s.safetensors", {"note": "hi"})
    header = json.loads(p.read_bytes()[8 : 8 + _header_len(p)])
    assert header["__metadata__"]["format"] == "sinkchat-snapshot"
    assert all(v["dtype"] in ("F32", "I64", "U8") for k, v in header.items() if k != "__metadata__")


# ------------------------------------------------------------------------------------------------ resume
@pytest.fixture(scope="module")
def chat_parts(bundled):
    """A tiny random model with the real tokenizer's vocabulary, so chat templates work and runs stay fast."""
    m = tiny_model("llama", layers=2, seed=2, vocab_size=len(bundled.tokenizer))
    return m, bundled.tokenizer


def chat_engine(parts, cap: int = 96) -> Engine:
    m, tok = parts
    return Engine(m, tok, CacheConfig(capacity=cap, n_sink=4, evict_chunk=8), GREEDY, system="Be brief.",
                  gauge_every=0)


def logged_chat(eng: Engine, slog, text: str) -> str:
    slog.turn("user", text, len(eng.encode(text)))
    done = list(eng.chat(text))[-1]
    slog.turn("assistant", done.text, done.tokens, done.seconds, reason=done.reason)
    return done.text


def test_resume_from_auto_snapshot_then_replays_later_turns(chat_parts, tmp_path):
    db = tmp_path / "sinkchat.db"
    a = chat_engine(chat_parts)
    slog = SessionLog.open("chat", "tiny", {"cache": 96}, system="Be brief.", path=db)
    auto = AutoSnapshot(every=2)
    for q in ("hello there", "what is a sink token?", "tell me more"):
        logged_chat(a, slog, q)
        auto.after_turn(a, slog)
    assert auto_snapshot_path(slog.id, tmp_path).is_file()  # written after exchange 2 (log turn 4)
    slog.turn("user", "and a crash now")  # no reply: the process died mid-reply
    b = chat_engine(chat_parts)
    res = resume_session(b, None, slog.id, path=db)
    assert res.method == "snapshot" and res.pending == "and a crash now"
    assert res.turns_replayed == 2  # turns 5 and 6 were logged after the snapshot
    assert b.conv.messages == a.conv.messages
    # the replayed reply is re-tokenized text, so compare the conversation, and that chatting goes on
    done = list(b.chat(res.pending))[-1]
    assert done.tokens > 0 and done.reason == ("length" if done.tokens == GREEDY.max_tokens else "eos")
    assert b.conv.messages[-2:] == [{"role": "user", "content": res.pending},
                                    {"role": "assistant", "content": done.text}]


def test_resume_rebuilds_from_transcript_without_snapshot(chat_parts, tmp_path):
    db = tmp_path / "sinkchat.db"
    a = chat_engine(chat_parts, cap=64)
    slog = SessionLog.open("chat", "tiny", {}, system="Be brief.", path=db)
    for i in range(5):
        logged_chat(a, slog, f"question number {i} about attention sinks and caches")
    slog.close()
    b = chat_engine(chat_parts, cap=64)
    b.conv.system = None  # the session's system prompt comes from the log
    res = resume_session(b, None, slog.id, path=db)
    assert res.method == "rebuild" and res.pending is None
    assert 0 < res.turns_replayed < res.turns_total == 10  # only the newest turns fit 64 tokens
    assert b.conv.system == "Be brief."
    assert b.conv.messages[0]["role"] == "user"
    assert b.conv.messages == a.conv.messages[-res.turns_replayed :]
    assert b.cache.length <= 64 and b.last_logits is not None
    assert b.ledger.ids[:3] == b.encode(b.conv.fed)[:3]  # sinks = start of the system prompt
    assert len(turns(slog.id, db)) == 10


def test_corrupt_auto_snapshot_falls_back_to_rebuild(chat_parts, tmp_path):
    db = tmp_path / "sinkchat.db"
    a = chat_engine(chat_parts)
    slog = SessionLog.open("chat", "tiny", {}, path=db)
    logged_chat(a, slog, "hi")
    p = AutoSnapshot(every=1).after_turn(a, slog)
    os.truncate(p, 100)
    res = resume_session(chat_engine(chat_parts), slog, None)
    assert res.method == "rebuild" and "refused" in res.note and res.turns_replayed == 2


@pytest.mark.slow  # the bundled model twice, ~9 s idle; the CLI's save / load: test_resume
def test_bundled_save_load_next_greedy_reply_identical(bundled, tmp_path):
    """The issue's acceptance test: real model, small cache (evictions before the save), greedy."""
    samp = SamplingConfig(temperature=0.0, max_tokens=12)

    def fresh() -> Engine:
        e = Engine(bundled.model, bundled.tokenizer, CacheConfig(capacity=64, n_sink=4, evict_chunk=8), samp,
                   system="You are a helpful assistant.", gauge_every=0)
        e.loaded = bundled
        return e

    a = fresh()
    for q in ("Name a color.", "Name an animal.", "Name a fruit."):
        list(a.chat(q))
    assert a.ledger.evicted > 0
    path = save_snapshot(a, tmp_path / "b.safetensors", {"turns_logged": 6})
    expected = list(a.chat("Name a country."))[-1]
    b = fresh()
    assert load_snapshot(b, path)["extra"] == {"turns_logged": 6}
    got = list(b.chat("Name a country."))[-1]
    assert got.token_ids == expected.token_ids and got.text == expected.text
    assert torch.equal(b.last_logits, a.last_logits)
    for e in (a, b):
        e.gauge.remove()


CRASHER = """
import sys, time
sys.path.insert(0, sys.argv[3])
from transformers import AutoTokenizer
from fakes import tiny_model
from sinkchat.config import CacheConfig, SamplingConfig
from sinkchat.core.engine import Engine
from sinkchat.store.resume import AutoSnapshot
from sinkchat.store.sessionlog import SessionLog
tok = AutoTokenizer.from_pretrained(sys.argv[2])
m = tiny_model("llama", layers=2, seed=2, vocab_size=len(tok))
eng = Engine(m, tok, CacheConfig(capacity=96, n_sink=4, evict_chunk=8),
             SamplingConfig(temperature=0.0, max_tokens=8, repetition_penalty=1.0), system="Be brief.", gauge_every=0)
slog = SessionLog.open("chat", "tiny", {}, system="Be brief.", path=sys.argv[1])
auto = AutoSnapshot(every=2)
print("SESSION", slog.id, flush=True)
for i, q in enumerate(["one", "two", "three", "four"]):
    slog.turn("user", q)
    for ev in eng.chat(q, max_tokens=8 if i < 3 else 10_000):
        if i == 3:
            print("TOKEN", flush=True)
            time.sleep(0.05)
    done = ev
    slog.turn("assistant", done.text, done.tokens, done.seconds, reason=done.reason)
    auto.after_turn(eng, slog)
print("FINISHED", flush=True)
"""


@pytest.mark.slow  # a crashing bundled-model process, ~8 s idle; the CLI's kill -9 resume: test_resume
def test_kill_9_mid_reply_then_resume(chat_parts, bundled, tmp_path):
    """Library-level crash test: a process is SIGKILLed mid-reply; every completed turn is in the log and the
    session resumes from its automatic snapshot (plus the turns logged after it)."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    db = tmp_path / "sinkchat.db"
    tests_dir = str(Path(__file__).parent)
    p = subprocess.Popen([sys.executable, "-c", CRASHER, str(db), str(bundled.path), tests_dir],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sid = None
    for line in p.stdout:
        if line.startswith("SESSION"):
            sid = int(line.split()[1])
        if line.startswith(("TOKEN", "FINISHED")):
            break
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    assert p.returncode == -signal.SIGKILL, p.stderr.read()
    logged = turns(sid, db)
    assert [t.role for t in logged] == ["user", "assistant"] * 3 + ["user"]  # all completed turns, no partial one
    b = chat_engine(chat_parts)
    slog = SessionLog.resume(sid, path=db)
    res = resume_session(b, slog)
    assert res.method == "snapshot" and res.turns_replayed == 2 and res.pending == "four"
    assert [m["content"] for m in b.conv.messages if m["role"] == "user"] == ["one", "two", "three"]
    assert b.conv.messages[-1]["role"] == "assistant"
    done = list(b.chat(res.pending))[-1]
    slog.turn("assistant", done.text, done.tokens)
    assert [t.seq for t in turns(sid, db)] == list(range(1, 9))
