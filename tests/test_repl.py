"""The chat REPL driven end to end without a terminal: a real Engine on a tiny random model (fast) and on the real
bundled model, through prompt-toolkit's pipe input (the interactive path) and click's CliRunner (the pipe path)."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
import torch

from sinkchat.config import CacheConfig, SamplingConfig
from sinkchat.core.engine import Engine
from sinkchat.core.events import PrefillEvent, TokenEvent
from sinkchat.apps.chat.commands import COMMANDS
from sinkchat.apps.chat.completion import SlashCompleter
from sinkchat.apps.render import Renderer, toolbar_text
from sinkchat.apps.chat.repl import ChatLoop, lines_reader, make_prompt_session, prompt_reader, stream_reader

from fakes import CharTokenizer, tiny_model

torch.set_num_threads(1)  # tiny models: thread hand-offs cost more than the math on a busy 2-core box


def fake_engine(capacity: int = 64, max_tokens: int = 6, policy: str = "sink") -> Engine:
    model = tiny_model("llama", layers=2, max_pos=512)
    model.config.eos_token_id = 96
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.eos_token_id = 96
    return Engine(model, CharTokenizer(), CacheConfig(policy=policy, n_sink=4, capacity=capacity),
                  SamplingConfig(temperature=0, max_tokens=max_tokens, repetition_penalty=1.0), system="be brief")


def make_loop(engine: Any, tty: bool = False) -> tuple[ChatLoop, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    return ChatLoop(engine, Renderer(out, err, tty=tty, live=False)), out, err


def consistent(engine: Engine) -> bool:
    led = engine.ledger
    return engine.cache.length == len(led.ids) == led.seen - led.evicted - getattr(led, "cleared", 0)


# ----------------------------------------------------------------------------------------------- fast fake engine
def test_multi_turn_and_empty_line_sends_nothing():
    eng = fake_engine(capacity=256)
    loop, out, err = make_loop(eng)
    loop.run(lines_reader(["", "   "]))
    assert eng.ledger.seen == 0 and eng.conv.messages == []
    loop.run(lines_reader(["hello", "", "how are you"]))
    roles = [m["role"] for m in eng.conv.messages]
    assert roles == ["user", "assistant", "user", "assistant"]
    assert eng.conv.messages[2]["content"] == "how are you"
    # the cache holds exactly the template text fed so far (one char = one token in this tokenizer)
    assert eng.cache.length == len(eng.encode(eng.conv.fed))
    assert consistent(eng)
    # off a terminal, stdout holds only the replies; the status line goes to stderr
    replies = [eng.tokenizer.decode(eng.tokenizer.encode(m["content"])) for m in eng.conv.messages[1::2]]
    assert out.getvalue() == "".join(r + "\n" for r in replies)
    assert "sink(4)" in err.getvalue() and "seen" in err.getvalue()


def test_ctrl_c_during_reply_keeps_cache_consistent(monkeypatch):
    eng = fake_engine(capacity=256, max_tokens=20)
    loop, out, err = make_loop(eng)
    loop.run(lines_reader(["first"]))
    seen0 = eng.ledger.seen
    real_generate = eng.generate
    counts = {"prefill": 0, "tokens": 0}

    def interrupted_generate(*a, **k):
        for ev in real_generate(*a, **k):
            if isinstance(ev, TokenEvent):
                counts["tokens"] += 1
                if counts["tokens"] == 3:
                    raise KeyboardInterrupt
            yield ev

    orig_on_event = loop.on_event

    def on_event(ev):
        if isinstance(ev, PrefillEvent):
            counts["prefill"] += ev.tokens
        orig_on_event(ev)

    monkeypatch.setattr(eng, "generate", interrupted_generate)
    monkeypatch.setattr(loop, "on_event", on_event)
    loop.run(lines_reader(["second question"]))
    assert "reply stopped" in err.getvalue()
    # the prompt and the 3 generated tokens are in the cache, nothing else
    assert eng.cache.length == seen0 + counts["prefill"] + 3 == len(eng.ledger.ids)
    assert eng.conv.messages[-1]["role"] == "assistant"
    assert eng.conv.messages[-1]["content"] == eng.reply_text() and len(eng.last_reply_ids) == 3
    monkeypatch.setattr(eng, "generate", real_generate)
    loop.run(lines_reader(["third"]))  # the next turn works and extends the conversation by prefix
    assert [m["role"] for m in eng.conv.messages] == ["user", "assistant"] * 3
    assert eng.cache.length == len(eng.encode(eng.conv.fed)) and consistent(eng)
    # piped input (`sinkchat chat < file`): Ctrl-C stops the reply consistently, then ends the run
    monkeypatch.setattr(eng, "generate", interrupted_generate)
    counts["tokens"] = 0
    loop.exit_on_interrupt = True
    with pytest.raises(KeyboardInterrupt):
        loop.run(lines_reader(["fourth", "never read"]))
    assert consistent(eng) and eng.conv.messages[-2]["content"] == "fourth"
    assert eng.conv.messages[-1]["role"] == "assistant"


def test_ctrl_c_during_prompt_prefill_takes_the_message_back(monkeypatch):
    eng = fake_engine(capacity=256)
    loop, _, err = make_loop(eng)
    loop.run(lines_reader(["first"]))
    before = (eng.cache.length, list(eng.conv.messages), eng.conv.fed)
    real_add = eng.add_message

    def cut_add(*a, **k):
        for ev in real_add(*a, **k):
            yield ev
            raise KeyboardInterrupt

    eng.prefill_chunk = 4
    monkeypatch.setattr(eng, "add_message", cut_add)
    loop.run(lines_reader(["a long enough message to need several chunks"]))
    assert consistent(eng) and (eng.cache.length, eng.conv.messages, eng.conv.fed) == before
    assert "message not sent" in err.getvalue()
    monkeypatch.setattr(eng, "add_message", real_add)
    loop.run(lines_reader(["next"]))
    assert consistent(eng) and [m["content"] for m in eng.conv.messages[::2]] == ["first", "next"]


def test_ctrl_c_during_a_prompt_that_already_evicted_closes_its_turn(monkeypatch):
    eng = fake_engine(capacity=32)
    loop, _, err = make_loop(eng)
    real_add = eng.add_message

    def cut_late(*a, **k):
        for i, ev in enumerate(real_add(*a, **k)):
            yield ev
            if eng.ledger.evicted and i > 3:
                raise KeyboardInterrupt

    eng.prefill_chunk = 4
    monkeypatch.setattr(eng, "add_message", cut_late)
    loop.run(lines_reader(["a message long enough to evict part of itself from a small cache"]))
    assert consistent(eng) and eng.conv.messages[-1] == {"role": "assistant", "content": ""}
    assert "the part already fed stays" in err.getvalue()
    monkeypatch.setattr(eng, "add_message", real_add)
    loop.run(lines_reader(["next"]))
    assert consistent(eng) and eng.conv.messages[-2]["content"] == "next"


def test_slash_commands_each_kind(tmp_path):
    eng = fake_engine(capacity=64)
    loop, out, err = make_loop(eng)
    before = eng.sampling
    loop.run(lines_reader(["/help", "/set temperature abc", "/set top_p 5", "/set nonsense 1", "/frobnicate"]))
    e = err.getvalue()
    assert all(c in e for c in COMMANDS)  # /help lists every command
    assert "not a valid float" in e and "top_p must be in (0, 1]" in e and "usage: /set" in e
    assert "unknown command /frobnicate" in e
    assert eng.sampling == before  # bad values changed nothing
    loop.run(lines_reader(["/set temperature 0.5", "/set top_k 7", "/set max_tokens 3"]))
    assert (eng.sampling.temperature, eng.sampling.top_k, eng.sampling.max_tokens) == (0.5, 7, 3)
    loop.run(lines_reader(["/set temperature 0", "hi there", "/stats", "/evictions"]))
    assert "tokens seen" in err.getvalue() and eng.conv.messages
    loop.run(lines_reader(["/sinks 2"]))
    assert (eng.cache_cfg.n_sink, eng.cache_cfg.capacity) == (2, 62)
    loop.run(lines_reader(["/window 40"]))  # 40 behind the pinned system prompt (sinks included)
    cap = eng.pinned_slots() + 40
    assert eng.cache_cfg.capacity == cap and eng.cache.capacity == cap and consistent(eng)
    loop.run(lines_reader(["/window 3", "/sinks x", "/policy bogus"]))
    assert eng.cache_cfg.capacity == cap and eng.cache_cfg.policy == "sink"
    # /save then /clear then /load: the transcript comes back and the cache holds it again
    path = tmp_path / "t.json"
    msgs = [dict(m) for m in eng.conv.messages]
    loop.run(lines_reader([f"/save {path}"]))
    data = json.loads(path.read_text())
    assert data["messages"] == msgs and data["settings"]["sampling"]["top_k"] == 7
    assert not list(tmp_path.glob(".*tmp"))  # temp file renamed away
    loop.metrics.gauge = loop.metrics.gauge or object()  # as if a reply had measured it
    loop.run(lines_reader(["/clear"]))
    assert eng.cache.length == 0 and eng.conv.messages == [] and loop.metrics.gauge is None
    loop.metrics.evictions.append("an event of the stream the load replaces")
    loop.run(lines_reader(["/set top_k 1", "/set temperature 0.3", f"/load {path}"]))
    assert "an event of the stream the load replaces" not in loop.metrics.evictions
    # the messages come back; this run's settings stay, and the ones saved in the file are named
    assert eng.conv.messages == msgs and eng.cache.length > 0 and consistent(eng)
    assert (eng.sampling.top_k, eng.sampling.temperature) == (1, 0.3)
    assert "transcript was saved with temperature 0.0" in err.getvalue()
    loop.run(lines_reader(["/load /nonexistent/x.json"]))
    assert "cannot read" in err.getvalue() and eng.conv.messages == msgs
    # /system: mid-conversation it enters the stream as a system message
    loop.run(lines_reader(["/system speak like a pirate"]))
    assert eng.conv.messages[-1] == {"role": "system", "content": "speak like a pirate"} and consistent(eng)
    loop.run(lines_reader(["/clear", "/system new prompt", "hello"]))
    assert eng.conv.system == "new prompt" and eng.conv.fed.startswith("<system>new prompt")
    loop.run(lines_reader(["/edit"]))
    assert "/edit needs a terminal" in err.getvalue()
    loop.run(lines_reader(["/bye", "never sent"]))
    assert eng.conv.messages[-2]["content"] == "hello"


def test_policy_switch_live_and_evictions_show():
    eng = fake_engine(capacity=48, max_tokens=12)
    loop, out, err = make_loop(eng)
    loop.run(lines_reader(["tell me a story about the sea", "and then?", "/policy window"]))
    assert eng.ledger.evicted > 0 and loop.metrics.eviction_count > 0
    assert "⟂ evicted" in err.getvalue()
    assert eng.cache_cfg.policy == "window" and eng.ledger.holds_stream_start()  # sinks kept so far
    loop.run(lines_reader(["more please"]))
    assert not eng.ledger.holds_stream_start()  # the window evicted the stream's first tokens
    assert "(start gone)" in toolbar_text(loop.stats())
    loop.run(lines_reader(["/policy sink", "go on"]))
    assert eng.cache_cfg.policy == "sink" and consistent(eng) and eng.cache.length <= 48
    s = loop.stats()
    text = toolbar_text(s)
    assert f"evicted {eng.ledger.evicted} ({loop.metrics.eviction_count}x)" in text
    assert f"{eng.cache.length}/48" in text and "RSS" in text and "sink" in text and "tok/s" in text
    loop.run(lines_reader(["/evictions"]))
    assert "evictions (" in err.getvalue()


def _paste(size: int, capacity: int) -> None:
    eng = fake_engine(capacity=capacity, max_tokens=2)
    eng.prefill_chunk = 4096
    loop, out, err = make_loop(eng)
    big = ("lorem ipsum dolor sit amet " * (size // 20))[:size]  # one line, pasted
    loop.run(stream_reader(io.BytesIO(big.encode() + b"\n")))
    assert eng.ledger.seen > size and eng.cache.length <= capacity and consistent(eng)
    assert eng.ledger.evicted >= size - capacity
    assert "more evictions this turn" in err.getvalue()  # the flood is summarised, not printed line by line
    assert eng.conv.messages[-1]["role"] == "assistant"


def test_big_paste_fed_through_eviction():
    _paste(1 << 17, 512)


@pytest.mark.slow
def test_one_mib_paste():
    _paste(1 << 20, 512)


def test_multiline_and_invalid_utf8():
    eng = fake_engine(capacity=64, max_tokens=2)
    loop, out, err = make_loop(eng)
    loop.run(stream_reader(io.BytesIO(b'"""first line\nsecond \xff\xfe line\nlast"""\n/bye\n')))
    assert eng.conv.messages[-2]["content"] == "first line\nsecond \ufffd\ufffd line\nlast"


def test_prompt_toolkit_pipe_input(tmp_path):
    from prompt_toolkit.application import create_app_session
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    eng = fake_engine(capacity=64)
    loop, out, err = make_loop(eng, tty=True)
    with create_pipe_input() as inp, create_app_session(input=inp, output=DummyOutput()):
        session = make_prompt_session(loop, tmp_path / "hist")
        inp.send_text("hello\r")
        inp.send_text("line one\x1b\rline two\r")  # Esc-Enter inserts a newline
        inp.send_text("\x03")  # Ctrl-C at the prompt: just a new prompt
        inp.send_text('"""\rblock a\rblock b"""\r')
        inp.send_text("/set max_tokens zz\r")
        inp.send_text("\x04")  # Ctrl-D exits
        loop.run(prompt_reader(session))
    users = [m["content"] for m in eng.conv.messages if m["role"] == "user"]
    assert users == ["hello", "line one\nline two", "block a\nblock b"]
    assert "not a valid int" in out.getvalue()  # on a terminal, feedback is shown on stdout
    assert "hello" in (tmp_path / "hist").read_text()
    frag = loop.toolbar()
    assert any("KV" in t for _, t in frag) and any("evicted" in t for _, t in frag)
    comps = [c.text for c in SlashCompleter().get_completions(
        __import__("prompt_toolkit").document.Document("/po"), None)]
    assert comps == ["/policy"]
    comps = [c.text for c in SlashCompleter().get_completions(
        __import__("prompt_toolkit").document.Document("/policy w"), None)]
    assert comps == ["window"]


def test_cli_pipe_path_invalid_utf8(monkeypatch, tmp_path):
    """CliRunner through `chat_command` with open_engine swapped for the fake engine: plain stdout, no traceback."""
    from click.testing import CliRunner

    import sinkchat.apps.chat.repl as repl

    monkeypatch.setattr("sinkchat.api.open_engine", lambda settings, system, progress=None: fake_engine())
    res = CliRunner().invoke(repl.chat_command, ["--system", "x"], input=b"hi \xff\xfe\n/nope\n\nbye\n")
    assert res.exit_code == 0, res.output
    assert res.exception is None and "\x1b[" not in res.stdout
    assert "unknown command /nope" in res.stderr
    res = CliRunner().invoke(repl.chat_command, ["--system", "x", "--system-file", "y"], input="")
    assert res.exit_code == 2 and "not both" in res.stderr and "Traceback" not in res.output
    systems = []
    monkeypatch.setattr("sinkchat.api.open_engine", lambda settings, system, progress=None: systems.append(system) or
                        fake_engine(max_tokens=int(settings.sampling.max_tokens)))
    (tmp_path / "sys.txt").write_text("  from a file \n")
    res = CliRunner().invoke(repl.chat_command, ["--system-file", str(tmp_path / "sys.txt"), "--max-tokens", "3"],
                             input="")
    assert res.exit_code == 0 and systems[-1] == "from a file"
    res = CliRunner().invoke(repl.chat_command, [], input="")
    assert res.exit_code == 0 and systems[-1] == repl.read_prompt("system") and systems[-1]
    res = CliRunner().invoke(repl.chat_command, ["--system-file", str(tmp_path / "missing.txt")], input="")
    assert res.exit_code == 2 and "cannot read --system-file" in res.stderr


# ----------------------------------------------------------------------------------------------- real model
@pytest.fixture(scope="module")
def real_engine(bundled):
    return lambda **kw: Engine(bundled.model, bundled.tokenizer, CacheConfig(n_sink=4, capacity=kw.get("cap", 96)),
                               SamplingConfig(temperature=0, max_tokens=kw.get("max_tokens", 10)),
                               system="You are a helpful assistant.")


def test_real_model_conversation_commands_ctrl_c(real_engine, monkeypatch):
    eng = real_engine(cap=48, max_tokens=10)
    loop, out, err = make_loop(eng)
    loop.run(lines_reader(["What is the capital of France?", "/set max_tokens 8", "And of Italy?"]))
    replies = [m["content"] for m in eng.conv.messages if m["role"] == "assistant"]
    assert len(replies) == 2 and all(r.strip() for r in replies)
    assert "Paris" in out.getvalue()
    assert eng.ledger.evicted > 0 and "⟂ evicted" in err.getvalue() and consistent(eng)
    loop.run(lines_reader(["/policy window", "Say hi.", "/policy sink", "Say bye."]))
    assert eng.cache_cfg.policy == "sink" and not eng.ledger.holds_stream_start() and consistent(eng)
    # Ctrl-C after two tokens: exactly those two stay in the cache
    real_generate = eng.generate

    def cut(*a, **k):
        n = 0
        for ev in real_generate(*a, **k):
            yield ev
            n += isinstance(ev, TokenEvent)
            if n == 2:
                raise KeyboardInterrupt

    monkeypatch.setattr(eng, "generate", cut)
    loop.run(lines_reader(["Count to ten."]))
    assert len(eng.last_reply_ids) == 2 and consistent(eng)
    assert eng.ledger.ids[-2:] == eng.last_reply_ids
    monkeypatch.setattr(eng, "generate", real_generate)
    loop.run(lines_reader(["What is 1+1?"]))
    assert eng.conv.messages[-1]["role"] == "assistant" and eng.conv.messages[-1]["content"].strip()
    assert consistent(eng) and "evicted" in toolbar_text(loop.stats())


def test_system_message_refused_by_template_changes_nothing():
    from jinja2 import TemplateError

    class StrictTokenizer(CharTokenizer):
        def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=False) -> str:
            if any(m["role"] == "system" for m in msgs[1:]):
                raise TemplateError("System role only allowed first")
            return super().apply_chat_template(msgs, tokenize, add_generation_prompt)

    eng = fake_engine(capacity=128)
    eng.tokenizer = eng.conv.tokenizer = StrictTokenizer()
    loop, out, err = make_loop(eng)
    loop.run(lines_reader(["hi"]))
    msgs, fed, length = [dict(m) for m in eng.conv.messages], eng.conv.fed, eng.cache.length
    loop.run(lines_reader(["/system be a pirate"]))
    assert "refused a system message" in err.getvalue() and "nothing changed" in err.getvalue()
    assert eng.conv.messages == msgs and eng.conv.fed == fed and eng.cache.length == length
    loop.run(lines_reader(["still works"]))
    assert eng.conv.messages[-2]["content"] == "still works" and consistent(eng)


def test_save_into_a_missing_folder_is_an_error_not_a_new_tree(tmp_path):
    eng = fake_engine(capacity=64)
    loop, _, err = make_loop(eng)
    loop.run(lines_reader(["hi"]))
    missing = tmp_path / "no" / "such"
    loop.run(lines_reader([f"/save {missing / 't.json'}", f"/save {missing / 's.safetensors'}"]))
    assert not (tmp_path / "no").exists()
    assert err.getvalue().count("No such file or directory") + err.getvalue().count("does not exist") == 2
    loop.run(lines_reader(["/save named1"]))  # a plain name goes to the snapshots folder, made on demand
    assert "saved snapshot" in err.getvalue()


# ----------------------------------------------------------------------------------------------- eviction figures
def _story(capacity: int = 48):
    """A loop whose cache has evicted a few times."""
    eng = fake_engine(capacity=capacity, max_tokens=12)
    loop, out, err = make_loop(eng)
    loop.run(lines_reader(["tell me a story about the sea", "and then?"]))
    assert loop.metrics.eviction_count > 0
    return eng, loop, err


def test_clear_is_not_counted_as_evicted():
    from sinkchat.core.metrics import status_line

    eng = fake_engine(capacity=256)
    loop, _, err = make_loop(eng)
    loop.run(lines_reader(["hello", "/clear"]))
    s = loop.stats()
    assert s.evicted == 0 and s.evictions == 0 and "evicted 0 (0x)" in toolbar_text(s)
    eng, loop, err = _story()
    before = loop.stats()
    assert before.evicted == sum(e.count for e in loop.metrics.evictions) > 0
    loop.run(lines_reader(["/clear", "/stats"]))
    s = loop.stats()
    assert eng.cache.length == 0 and (s.evicted, s.evictions) == (before.evicted, before.evictions)
    assert f"evicted {before.evicted} ({before.evictions}x)" in toolbar_text(s)
    assert f"seen {s.seen} evicted {before.evicted} " in status_line(s)
    assert f"{before.evicted} in {before.evictions} evictions" in err.getvalue()  # /stats


def test_snapshot_load_shows_the_snapshots_figures_then_counts_on(tmp_path):
    from sinkchat.store.snapshot import save_snapshot

    snap = tmp_path / "s.safetensors"
    _, a, _ = _story()
    a.run(lines_reader([f"/save {snap}"]))
    saved = a.stats()
    b = fake_engine(capacity=48, max_tokens=12)
    loop, _, err = make_loop(b)
    loop.run(lines_reader(["some other talk that fills the cache and evicts a bit first", f"/load {snap}"]))
    s = loop.stats()
    assert (s.seen, s.evicted, s.evictions) == (saved.seen, saved.evicted, saved.evictions)
    assert f"{saved.evicted} tokens evicted in {saved.evictions} evictions before it" in err.getvalue()
    loop.run(lines_reader(["/evictions"]))
    assert f"no evictions since this stream was loaded ({saved.evictions} before" in err.getvalue()
    loop.run(lines_reader(["more please, and make it long"]))
    new, s = list(loop.metrics.evictions), loop.stats()
    assert new and s.evictions == saved.evictions + len(new)
    assert s.evicted == saved.evicted + sum(e.count for e in new)
    # a snapshot without the figures (older file, another client): they count from the load on, never mixed
    save_snapshot(b, tmp_path / "bare.safetensors")
    loop.run(lines_reader([f"/load {tmp_path / 'bare.safetensors'}"]))
    s = loop.stats()
    assert (s.evicted, s.evictions) == (0, 0) and "evictions count from here" in err.getvalue()


def test_resume_restores_the_eviction_figures(tmp_path):
    from sinkchat.apps.chat import session
    from sinkchat.store.resume import AutoSnapshot
    from sinkchat.store.sessionlog import SessionLog

    db = tmp_path / "log.db"
    eng = fake_engine(capacity=48, max_tokens=12)
    slog = SessionLog.open("chat", None, {}, path=db)
    loop = ChatLoop(eng, Renderer(io.StringIO(), io.StringIO(), tty=False, live=False), slog=slog,
                    auto_snapshot=AutoSnapshot(1))
    loop.run(lines_reader(["tell me a story about the sea", "and then?"]))
    saved = loop.stats()
    assert saved.evictions > 0
    slog.close()
    err = io.StringIO()
    loop2 = ChatLoop(fake_engine(capacity=48, max_tokens=12), Renderer(io.StringIO(), err, tty=False, live=False),
                     slog=SessionLog.resume(slog.id, path=db))
    session.do_resume(loop2, slog.id)
    assert "restored from its automatic snapshot" in err.getvalue()
    s = loop2.stats()
    assert (s.seen, s.evicted, s.evictions) == (saved.seen, saved.evicted, saved.evictions)
