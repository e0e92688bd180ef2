"""Models without a chat template (a base model's GGUF, e.g. Gemma 3 270M): named as such at start, replies that stop
at the next turn marker and leave the cache as the transcript renders it, control tokens never shown nor generated.

Replies are scripted (a sampler that picks given ids) over a tiny random model, so each case is exact; the cases come
from what Gemma 3 270M wrote (core/plain.py's module doc has the measurement)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import pytest
import torch

from fakes import EOS_ID, FakeTokenizer, save_tiny_chat_model, tiny_model
from sinkchat.config import CacheConfig, SamplingConfig
from sinkchat.core.engine import Engine
from sinkchat.core.events import DoneEvent, TokenEvent
from sinkchat.core.plain import NOTICE, classify, control_ids
from sinkchat.core.sampling import Sampler

torch.set_num_threads(1)


class ScriptSampler(Sampler):
    """Picks the scripted ids in order, as a model that wants them would. `obey=True`: the logits processors run
    first, and a scripted id they set to -inf is not picked (the processed argmax is, as greedy sampling would)."""

    def __init__(self, script: Sequence[int], obey: bool = True) -> None:
        super().__init__(SamplingConfig(temperature=0.0, repetition_penalty=1.0))
        self.script, self.obey = list(script), obey

    def __call__(self, logits: torch.Tensor, recent: list[int], cfg: Any = None, processors: Sequence[Any] = ()
                 ) -> int:
        want = self.script.pop(0) if self.script else EOS_ID
        if not self.obey:
            return want
        for proc in processors:
            logits = proc(recent, logits)
        return want if logits[want] > float("-inf") else int(torch.argmax(logits))


def plain_engine(script: str | Sequence[int], template: str | None = None, capacity: int = 512) -> Engine:
    """A tiny model over the chars tokenizer (no chat template unless given) whose replies follow `script`."""
    tok = FakeTokenizer(chat_template=template)
    model = tiny_model("llama", layers=1, max_pos=1024)
    model.config.eos_token_id = EOS_ID
    ids = tok.encode(script) if isinstance(script, str) else list(script)
    return Engine(model, tok, CacheConfig(capacity=capacity, n_sink=4), sampler=ScriptSampler(ids),
                  system="Be brief.")


def turn(eng: Engine, message: str) -> tuple[DoneEvent, str]:
    """One chat turn as the apps run it: the message, the reply, the reply recorded. Returns the DoneEvent and the
    text the TokenEvents streamed (what a user sees)."""
    list(eng.add_message("user", message))
    events = list(eng.generate(60))
    eng.conv.add_reply(eng.reply_text())
    return events[-1], "".join(e.text for e in events if isinstance(e, TokenEvent))


def cache_is_the_transcript(eng: Engine) -> bool:
    """The cache holds exactly the conversation as the plain transcript renders it (nothing evicted here)."""
    full = eng.conv._render(eng.conv.messages, True)  # each check follows a message with its generation prompt
    return eng.ledger.ids == eng.tokenizer.encode(full)


# ------------------------------------------------------------------------------------------------ turn markers
@pytest.mark.parametrize("script", [
    "Paris.\n\nUser: and Rome?\n\nAssistant: Italy.",  # the format's own label, as Gemma writes it 122 times in 60
    "Paris.\n\nStudent: 1.) Explain what the characters look like.",  # an invented speaker after a blank line
    "Paris.\nassistant: Germany",  # the format's own label in another case, after one newline
])
def test_a_plain_reply_stops_at_the_next_turn_and_the_cache_holds_the_transcript(script, caplog):
    """Before: the reply ran to max_tokens writing both sides of the dialogue, the marker and all shown, and the
    next turn was templated "not prefix-stable" (a warning) because the cache held more than the transcript."""
    eng = plain_engine(script)
    done, shown = turn(eng, "What is the capital of France?")
    assert (done.reason, done.text, shown) == ("stop", "Paris.", "Paris.")
    assert eng.tokenizer.decode(eng.last_reply_ids) == "Paris."  # the marker's tokens went back out of the cache
    with caplog.at_level(logging.WARNING):
        list(eng.add_message("user", "And Spain?"))
    assert cache_is_the_transcript(eng), eng.tokenizer.decode(eng.ledger.ids)
    assert "prefix-stable" not in caplog.text
    assert eng.tokenizer.decode(eng.ledger.ids).endswith("Assistant: Paris.\n\nUser: And Spain?\n\nAssistant: ")


@pytest.mark.parametrize("script", [
    "Name: Bob\nAge: 3",  # labels after a single newline: content
    "Ingredients:\n- flour\n- milk",  # a heading: nothing after its colon
    "Hi.\n\nNote the time. Answer the phone.",  # capitalised paragraphs without a label
])
def test_content_that_only_looks_like_a_label_is_not_cut(script):
    eng = plain_engine([*FakeTokenizer().encode(script), EOS_ID])
    done, shown = turn(eng, "hi")
    assert (done.reason, done.text, shown) == ("eos", script, script)


def test_an_eos_is_taken_back_out_so_the_next_turn_follows_the_reply(caplog):
    """Before: the EOS stayed in the cache and in the transcript's `fed`, but not in its rendering: every next turn
    logged "chat template is not prefix-stable" and was templated from the message alone."""
    eng = plain_engine([*FakeTokenizer().encode("Paris.\n"), EOS_ID])
    done, shown = turn(eng, "Capital of France?")
    with caplog.at_level(logging.WARNING):
        list(eng.add_message("user", "And Spain?"))
    assert cache_is_the_transcript(eng) and "prefix-stable" not in caplog.text
    assert EOS_ID not in eng.ledger.ids  # a base model reads an EOS as the end of a document, not of a turn
    assert (done.reason, shown) == ("eos", "Paris.")  # the trailing newline is the transcript's, not the reply's


def test_where_the_cache_cannot_drop_the_marker_it_stays_and_the_transcript_stays_prefix_stable(caplog):
    eng = plain_engine("Paris.\n\nUser: and Rome?")
    eng.cache.can_truncate = lambda length: False  # as a hybrid model's local ring that has let go of older tokens
    done, shown = turn(eng, "Capital of France?")
    assert (done.reason, shown) == ("stop", "Paris.")
    assert eng.tokenizer.decode(eng.last_reply_ids) == "Paris.\n\nUser:"  # still in the cache, recorded as such
    with caplog.at_level(logging.WARNING):
        list(eng.add_message("user", "And Spain?"))
    assert cache_is_the_transcript(eng) and "prefix-stable" not in caplog.text


def test_with_a_chat_template_nothing_changes():
    script = "Paris.\n\nUser: and Rome?"
    eng = plain_engine([*FakeTokenizer().encode(script), EOS_ID], template="fake")
    done, shown = turn(eng, "hi")
    assert (done.reason, shown) == ("eos", script) and getattr(eng, "plain", None) is None


def test_raw_text_after_a_document_is_not_a_turn():
    """`ppl`, `bench` and summaries fed without a generation prompt continue text: no marker applies."""
    script = "Paris.\n\nUser: and Rome?"
    eng = plain_engine([*FakeTokenizer().encode(script), EOS_ID])
    list(eng.feed("Some text."))
    done = list(eng.generate(60))[-1]
    assert (done.reason, done.text) == ("eos", script)


def test_marker_rule():
    assert classify("User:", False) == "marker" and classify("Us", False) == "maybe"
    assert classify("Student: why", True) == "marker" and classify("Student: why", False) == "no"
    assert classify("Student:", True) == "maybe" and classify("Dr Smith: hi", True) == "marker"
    assert classify("The sea is blue: very", True) == "no" and classify("(Note: x", True) == "no"


# ------------------------------------------------------------------------------------------------ control tokens
@pytest.fixture(scope="module")
def gemma_like_tokenizer() -> Any:
    """The bundled tokenizer without its template plus the kinds of added tokens Gemma 3's GGUF carries: a control
    token transformers does not mark special (<start_of_image>), a special unused one, an HTML tag, a whitespace
    run."""
    from transformers import AutoTokenizer

    from sinkchat.model.loader import resolve_source

    tok = AutoTokenizer.from_pretrained(resolve_source(None, lambda m: None)[1])
    tok.chat_template = None
    tok.add_tokens(["<start_of_image>", "<b>", "    "])
    tok.add_special_tokens({"additional_special_tokens": ["<unused0>"]})
    return tok


def test_control_ids_are_the_special_and_non_text_added_tokens(gemma_like_tokenizer):
    tok = gemma_like_tokenizer
    ids = control_ids(tok)
    ctl = tok.convert_tokens_to_ids(["<start_of_image>", "<unused0>", "<|im_start|>"])
    txt = tok.convert_tokens_to_ids(["<b>", "    "])
    assert set(ctl) <= ids and not set(txt) & ids and tok.encode("hello")[0] not in ids


def _control_engine(tok: Any, obey: bool) -> Engine:
    torch.manual_seed(0)
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=512, eos_token_id=tok.eos_token_id)).eval()
    img = tok.convert_tokens_to_ids("<start_of_image>")
    script = [img, *tok.encode("Hi", add_special_tokens=False), img, tok.eos_token_id]
    return Engine(model, tok, CacheConfig(capacity=256), sampler=ScriptSampler(script, obey=obey))


def test_a_control_token_is_never_printed(gemma_like_tokenizer):
    """Before: Gemma 3 270M's chat printed raw <start_of_image> (not special to transformers: decoded as text)."""
    eng = _control_engine(gemma_like_tokenizer, obey=False)  # generated anyway: the display must drop it
    done, shown = turn(eng, "hi")
    assert shown == done.text == "Hi"


def test_a_plain_reply_never_generates_a_control_token(gemma_like_tokenizer):
    tok = gemma_like_tokenizer
    eng = _control_engine(tok, obey=True)
    turn(eng, "hi")
    assert not set(eng.last_reply_ids) & (control_ids(tok) - eng.stop_ids)
    assert tok.convert_tokens_to_ids("<start_of_image>") not in eng.last_reply_ids


# ------------------------------------------------------------------------------------------------ the notice
def test_the_engine_names_plain_completion_once(caplog):
    with caplog.at_level(logging.WARNING):
        plain_engine("x")
    assert [r.getMessage() for r in caplog.records].count(NOTICE) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        plain_engine("x", template="fake")
    assert NOTICE not in caplog.text


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny model with the bundled tokenizer, with its chat template and without (as a base model's GGUF)."""
    import shutil

    with_tmpl = save_tiny_chat_model(tmp_path_factory.mktemp("tmpl") / "model")
    base = tmp_path_factory.mktemp("base") / "model"
    shutil.copytree(with_tmpl, base)
    (base / "chat_template.jinja").unlink()
    return with_tmpl, base


def _chat(model: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "sinkchat.cli", "chat", "--model", str(model), "--quant", "none", "--cache", "96",
           "--temperature", "0", "--max-tokens", "8", "--no-log"]
    return subprocess.run(cmd, input="Hello there\n", capture_output=True, text=True, timeout=300,
                          env=dict(os.environ))


def test_piped_chat_says_once_on_stderr_that_the_model_has_no_chat_template(dirs):
    with_tmpl, base = dirs
    r = _chat(base)
    assert r.returncode == 0, r.stderr[-2000:]
    assert [NOTICE in line for line in r.stderr.splitlines()].count(True) == 1, r.stderr
    assert NOTICE not in r.stdout and r.stdout.strip()
    r = _chat(with_tmpl)
    assert r.returncode == 0 and NOTICE not in r.stderr + r.stdout


def test_on_a_terminal_the_notice_comes_after_the_load_spinner_not_inside_its_line(monkeypatch, capsys):
    """Before: the notice, logged while the spinner ran, printed as "⠧ loading gemma-3-270m-q4_k_m.gguf (q4,
    cpu)WARNING sinkchat.core.plain: no chat template: ..." on one line."""
    import sinkchat.apps.chat.repl as repl

    def fake_open(settings: Any, system: Any, progress: Any = None) -> str:
        progress("loading model.gguf (q4, cpu)")
        logging.getLogger("sinkchat.core.plain").warning(NOTICE)
        return "engine"

    monkeypatch.setattr("sinkchat.api.open_engine", fake_open)
    assert repl.load_engine(None, "system", tty=True) == "engine"
    lines = capsys.readouterr().err.splitlines()
    assert [line.strip() for line in lines if NOTICE in line] == [NOTICE]
    assert logging.getLogger("sinkchat").propagate and not logging.getLogger("sinkchat").handlers
