"""The Python API (`sinkchat.load`, issue 31 item 7) on a tiny random model with the bundled tokenizer: chat, stream,
feed + generate, stats, save / resume (the resumed session continues exactly), unknown settings named, the README
example run as written, and `import sinkchat` without torch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from fakes import save_tiny_chat_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("api") / "model")


def _load(tiny_dir: Path, **kw):
    import sinkchat

    kw = {"cache": 96, "quant": "none", "temperature": 0, "max_tokens": 6, "sinks": 4, **kw}
    return sinkchat.load(str(tiny_dir), **kw)


def test_import_sinkchat_is_light():
    """`import sinkchat` must not import torch (the CLI's --help and scripts that only read __version__)."""
    code = "import sys, sinkchat; assert callable(sinkchat.__getattr__); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_chat_stream_feed_generate_stats(tiny_dir):
    s = _load(tiny_dir)
    reply = s.chat("hello there")
    st = s.stats()
    assert st["messages"] == 2 and st["capacity"] == 96 and st["last_reply"]["tokens"] == 6
    assert s.engine.conv.messages[1]["content"] == reply
    pieces = list(s.stream("and again"))
    assert "".join(pieces) == s.engine.conv.messages[-1]["content"] and len(s.engine.conv.messages) == 4
    before = s.stats()["seen"]
    n = s.feed(" plain text fed raw")
    assert n > 0 and s.stats()["seen"] == before + n
    assert isinstance(s.generate(max_tokens=3), str) and s.stats()["last_reply"]["tokens"] == 3
    for _ in range(8):  # a 96-token cache overflows: evictions, and the cache stays within its capacity
        s.chat("one more message to fill the cache up " * 2)
    st = s.stats()
    assert st["evicted"] > 0 and st["evictions"] > 0 and st["cache_len"] <= 96


def test_stop_strings_are_left_out_of_the_text(tiny_dir):
    """`generate(stop=...)` and `chat(stop=...)` return the text up to the first stop string, without it (as OpenAI's
    API and the server do); the same greedy reply without a stop shows where it would have been."""
    whole = _load(tiny_dir, max_tokens=24)
    whole.feed("a raw document to continue")
    text = whole.generate()
    assert len(text) >= 6, text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = _load(tiny_dir, max_tokens=24)
    cut.feed("a raw document to continue")
    assert cut.generate(stop=[stop]) == text[:text.find(stop)]
    reply = _load(tiny_dir, max_tokens=24).chat("hello there")
    assert len(reply) >= 6, reply
    stop = reply[len(reply) // 2:len(reply) // 2 + 3]
    pieces = list(_load(tiny_dir, max_tokens=24).stream("hello there", stop=[stop]))
    assert "".join(pieces) == reply[:reply.find(stop)] and all(pieces)


def test_save_and_resume_continue_exactly(tiny_dir, tmp_path):
    s = _load(tiny_dir)
    s.chat("remember the number seven")
    path = s.save(tmp_path / "talk.safetensors")
    expected = s.chat("what was it?")
    r = _load(tiny_dir, cache=None, resume=path)  # the snapshot's cache size applies
    assert r.stats()["capacity"] == 96 and r.stats()["messages"] == 2
    assert r.chat("what was it?") == expected
    assert r.engine.ledger.ids == s.engine.ledger.ids


def test_unknown_setting_is_named(tiny_dir):
    from sinkchat.config import ConfigError

    with pytest.raises(ConfigError, match=r"'memroy' \(did you mean 'memory'\?\)"):
        _load(tiny_dir, memroy="on")
    s = _load(tiny_dir)
    with pytest.raises(ConfigError, match="'temprature'"):
        s.chat("hi", temprature=0.5)
    with pytest.raises(ConfigError, match="must be a string, not int"):
        s.feed(5)


def test_engine_states_swap_without_mixing(tiny_dir):
    """capture / install / fresh_state (what `sinkchat serve` keeps per session): two conversations on one engine
    never see each other's tokens, and swapping back continues where each left off."""
    from sinkchat.api import capture, fresh_state, install

    s = _load(tiny_dir)
    eng = s.engine
    s.chat("first conversation")
    a_ids, a = list(eng.ledger.ids), capture(eng)
    install(eng, fresh_state(eng, None))
    assert eng.cache.length == 0 and eng.ledger.ids == [] and eng.conv.messages == []
    s.chat("second one, different")
    b = capture(eng)
    install(eng, a)
    assert eng.ledger.ids == a_ids and eng.cache.length == len(a_ids)
    assert eng.conv.messages[0]["content"] == "first conversation"
    install(eng, b)
    assert eng.conv.messages[0]["content"] == "second one, different"


def readme_example() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"## Python API.*?```python\n(.*?)```", text, re.S)
    assert m, "README.md has no '## Python API' section with a python example"
    return m.group(1)


def test_readme_example_runs(tiny_dir, tmp_path, monkeypatch):
    """The README's example, run as written (the model comes from SINKCHAT_MODEL: the tiny one here)."""
    code = readme_example()
    assert len(code.strip().splitlines()) <= 12
    monkeypatch.setenv("SINKCHAT_MODEL", str(tiny_dir))
    monkeypatch.setenv("SINKCHAT_QUANT", "none")
    monkeypatch.setenv("SINKCHAT_MAX_TOKENS", "5")
    monkeypatch.chdir(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "talk.safetensors").is_file()


@pytest.mark.parametrize("bad, match", [
    ({"temperature": -1}, "temperature must be between 0 and 10"),
    ({"temprature": 0}, "'temprature'"),
    ({"top_p": 5}, r"top_p must be in \(0, 1\]"),
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"max_tokens": -3}, "max_tokens must be >= 1"),
    ({"temperature": "x"}, "temperature must be a number, not 'x'"),
    ({"max_tokens": 2.5}, "max_tokens must be a whole number"),
    ({"stop": [""]}, "stop must be"),
    ({"stop": 5}, "stop must be"),
    ({"role": "bogus"}, "role must be one of user, system, assistant"),
])
def test_a_refused_call_changes_nothing(tiny_dir, bad, match):
    """A user audit: `s.chat(..., temperature=-1)` raised ConfigError after the message was fed: the cache grew
    42 -> 59 and the conversation gained the message and a copy of the previous reply; `max_tokens=0` gave a
    full reply, `temperature="x"` a raw TypeError."""
    from sinkchat.config import ConfigError

    s = _load(tiny_dir)
    s.chat("Name a planet.")
    before = (s.stats()["seen"], s.stats()["cache_len"], [dict(m) for m in s.engine.conv.messages])
    with pytest.raises(ConfigError, match=match):
        s.chat("Tell me about Jupiter please.", **bad)
    with pytest.raises(ConfigError, match=match):
        list(s.stream("Tell me about Jupiter please.", **bad))
    assert (s.stats()["seen"], s.stats()["cache_len"], [dict(m) for m in s.engine.conv.messages]) == before
    if "role" not in bad:
        with pytest.raises(ConfigError, match=match):
            s.generate(**bad)
        assert s.stats()["seen"] == before[0]


def test_a_message_that_is_not_text_is_refused():
    import sinkchat.api as api
    from sinkchat.config import ConfigError

    s = api.Session(engine=None)  # refused before the engine is touched
    with pytest.raises(ConfigError, match="the message must be a string, not NoneType"):
        s.chat(None)  # type: ignore[arg-type]


def test_resume_takes_sampling_settings_and_refuses_another_cache(tiny_dir, tmp_path):
    """`load(resume=..., **settings)`: sampling settings given replace the snapshot's, cache settings that differ
    are a ConfigError, and `settings` says what runs. Before, all were ignored: `temperature=1.5` replied greedily,
    `cache=256` ran at the snapshot's size, and `settings` claimed both (a new user's audit)."""
    import sinkchat
    from sinkchat.config import ConfigError

    s = _load(tiny_dir)  # temperature 0, max_tokens 6, cache 96
    s.chat("remember the number seven")
    path = s.save(tmp_path / "talk.safetensors")
    r = _load(tiny_dir, cache=None, resume=path, max_tokens=3)
    r.chat("what was it?")
    assert r.stats()["last_reply"]["tokens"] == 3 and r.settings.sampling.max_tokens == 3
    own = sinkchat.load(str(tiny_dir), resume=path, quant="none")  # nothing given: the snapshot's own settings
    assert (own.settings.sampling.temperature, own.settings.sampling.max_tokens) == (0, 6)
    assert own.settings.cache.capacity == own.stats()["capacity"] == 96
    for kw, name in (({"cache": 256}, "cache=256"), ({"sinks": 8}, "sinks=8"), ({"policy": "window"}, "policy=")):
        with pytest.raises(ConfigError, match=name):
            _load(tiny_dir, **{"cache": None, **kw}, resume=path)
    assert _load(tiny_dir, cache=96, sinks=4, policy="sink", resume=path).stats()["capacity"] == 96  # the same: fine
