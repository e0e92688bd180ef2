"""Output a script can split: `chat --format jsonl` (one object per message line), `--separator LINE` in text
mode, and eviction lines that never land inside a streamed reply."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
import torch

from sinkchat.apps.chat.repl import ChatLoop, lines_reader
from sinkchat.apps.render import Renderer
from sinkchat.config import CacheConfig, SamplingConfig
from sinkchat.core.engine import Engine

from fakes import CharTokenizer, save_tiny_chat_model, tiny_model

torch.set_num_threads(1)


def chat_engine(capacity: int, max_tokens: int, policy: str = "sink") -> Engine:
    model = tiny_model("llama", layers=2, max_pos=512)
    model.config.eos_token_id = 96
    return Engine(model, CharTokenizer(), CacheConfig(policy=policy, n_sink=4, capacity=capacity),
                  SamplingConfig(temperature=0, max_tokens=max_tokens, repetition_penalty=1.0), system="be brief")


class Shared(io.StringIO):
    """stdout and stderr into one stream, as `2>&1` or a terminal shows them."""


def test_evictions_are_shown_after_the_reply_not_inside_it():
    """Before: an eviction during a reply printed its line between the reply's tokens."""
    both = Shared()
    eng = chat_engine(capacity=64, max_tokens=50)
    loop = ChatLoop(eng, Renderer(both, both, tty=False, live=False))
    loop.run(lines_reader(["hi", "tell me more", "and more"]))
    assert loop.metrics.eviction_count > 0
    replies = [m["content"] for m in eng.conv.messages if m["role"] == "assistant"]
    text = both.getvalue()
    for r in replies:
        shown = eng.tokenizer.decode(eng.tokenizer.encode(r))
        assert shown and shown in text, text  # each reply in one piece
    assert "⟂ evicted" in text


def test_jsonl_gives_one_object_per_message_including_errors():
    out, err = io.StringIO(), io.StringIO()
    eng = chat_engine(capacity=80, max_tokens=5, policy="dense")
    loop = ChatLoop(eng, Renderer(out, err, tty=False, fmt="jsonl"))
    loop.run(lines_reader(["hi", "/stats", "x" * 100, "/clear", "ok"]))  # dense: the long one overflows
    recs = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["question"] for r in recs] == ["hi", "x" * 100, "ok"]  # commands give no record
    assert recs[1]["finish_reason"] == "error" and "error" in recs[1] and recs[1]["answer"] == ""
    for r in (recs[0], recs[2]):
        assert r["tokens"] == 5 and r["finish_reason"] == "length" and r["seconds"] > 0 and r["prompt_tokens"] > 0
        assert set(r) == {"question", "answer", "tokens", "finish_reason", "seconds", "prompt_tokens",
                          "prefill_seconds"}


# ----------------------------------------------------------------------------------------------- a real subprocess
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return str(save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat") / "model"))


def _chat(tiny_dir: str, args: list[str], stdin: str, merge: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "sinkchat.cli", "chat", "--model", tiny_dir, "--quant", "none", "--cache", "96",
           "--temperature", "0", "--max-tokens", "24", "--no-log", *args]
    return subprocess.run(cmd, input=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge else
                          subprocess.PIPE, text=True, timeout=300, env=dict(os.environ))


QUESTIONS = "Name a color.\n/set max_tokens 40\nWrite two lines about the sea.\n\nAnd a third question?\n"


def test_piped_chat_jsonl_and_separator_agree(tiny_dir):
    """Before: `chat < questions.txt > answers.txt` wrote multi-line answers with nothing between them."""
    j = _chat(tiny_dir, ["--format", "jsonl"], QUESTIONS)
    assert j.returncode == 0, j.stderr[-2000:]
    recs = [json.loads(line) for line in j.stdout.splitlines()]
    assert [r["question"] for r in recs] == ["Name a color.", "Write two lines about the sea.", "And a third question?"]
    assert all(r["answer"] and r["tokens"] > 0 and r["finish_reason"] and r["seconds"] > 0 for r in recs)
    # the same run in text mode, stderr merged in (evictions included), split on the separator: the same answers
    t = _chat(tiny_dir, ["--separator", "=====#"], QUESTIONS, merge=True)
    assert t.returncode == 0, t.stdout[-2000:]
    assert "⟂ evicted" in t.stdout  # the small cache evicts during these replies
    for r in recs:
        assert r["answer"] in t.stdout  # every answer in one piece, nothing printed inside it
    plain = _chat(tiny_dir, ["--separator", "=====#"], QUESTIONS)
    blocks = plain.stdout.split("=====#\n")
    assert blocks[-1] == "" and [b.rstrip("\n") for b in blocks[:-1]] == [r["answer"].rstrip("\n") for r in recs]


def test_help_says_how_answers_are_delimited(tiny_dir):
    r = subprocess.run([sys.executable, "-m", "sinkchat.cli", "chat", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "--format" in r.stdout and "jsonl" in r.stdout and "--separator" in r.stdout
    assert "ends with one newline" in " ".join(r.stdout.split())


def test_a_reply_cut_at_max_tokens_names_the_flag_when_piped_and_the_command_at_a_prompt():
    import io
    from sinkchat.apps.render import Renderer
    from sinkchat.core.events import DoneEvent

    for tty, hint in ((False, "--max-tokens N"), (True, "/set max_tokens N")):
        out, err = io.StringIO(), io.StringIO()
        r = Renderer(out, err, tty=tty, live=False)
        r.end_reply(DoneEvent("length", 20, 0.0, "four"))
        assert hint in (out.getvalue() + err.getvalue()), tty
