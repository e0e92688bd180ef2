"""Settings precedence (flags > environment > .env > defaults) and the documented setting list."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sinkchat import config
from sinkchat.bootstrap import build_settings
from sinkchat.config import ENV_SETTINGS, ConfigError, settings_from_env

ROOT = Path(__file__).resolve().parent.parent


def test_env_example_lists_every_setting_with_its_default():
    text = (ROOT / ".env.example").read_text()
    for key, (default, _) in ENV_SETTINGS.items():
        assert f"\n{key}={default}\n" in text, key


def test_precedence_flag_env_dotenv(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("SINKCHAT_SINKS=2\nSINKCHAT_CACHE=300\nexport SINKCHAT_POLICY=window\n")
    monkeypatch.setattr(config, "_dotenv_loaded", False)
    for k in ("SINKCHAT_SINKS", "SINKCHAT_CACHE", "SINKCHAT_POLICY"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SINKCHAT_CACHE", "500")  # the real environment beats .env
    s = build_settings({"sinks": 8})  # a flag beats both
    assert (s.cache.n_sink, s.cache.capacity, s.cache.policy) == (8, 500, "window")
    for k in ("SINKCHAT_SINKS", "SINKCHAT_POLICY"):
        os.environ.pop(k, None)


def test_bad_env_value_is_a_config_error(monkeypatch):
    monkeypatch.setenv("SINKCHAT_CACHE", "lots")
    with pytest.raises(ConfigError, match="SINKCHAT_CACHE"):
        settings_from_env()


@pytest.mark.parametrize("name,value,says", [
    ("SINKCHAT_MEMORY", "maybe", "SINKCHAT_MEMORY='maybe': must be on or off"),
    ("SINKCHAT_THREADS", "-1", "SINKCHAT_THREADS='-1': must be >= 0"),
    ("SINKCHAT_MEMORY_TOPK", "0", "SINKCHAT_MEMORY_TOPK='0': must be between 1 and 64"),
    ("SINKCHAT_EVICT_CHUNK", "-2", "SINKCHAT_EVICT_CHUNK='-2': must be >= 0"),
])
def test_a_refused_env_value_is_named_as_the_user_set_it(monkeypatch, name, value, says):
    """A user audit: SINKCHAT_MEMORY=maybe said `--memory must be on or off`, naming a flag never passed."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as e:
        settings_from_env()
    assert str(e.value).startswith(says) and "--" not in str(e.value)


def test_a_bad_value_from_dotenv_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("SINKCHAT_CACHE=lots\n")
    monkeypatch.setattr(config, "_dotenv_loaded", False)
    monkeypatch.delenv("SINKCHAT_CACHE", raising=False)
    try:
        with pytest.raises(ConfigError, match=r"^SINKCHAT_CACHE='lots' \(set in \.env\) is not a valid value"):
            settings_from_env()
    finally:
        os.environ.pop("SINKCHAT_CACHE", None)
        config._from_dotenv.discard("SINKCHAT_CACHE")


def test_a_bad_prefill_mode_is_refused_before_any_model_loads(monkeypatch):
    monkeypatch.setenv("SINKCHAT_PREFILL", "fast")
    with pytest.raises(ConfigError, match="SINKCHAT_PREFILL must be auto or hf"):
        settings_from_env()
    monkeypatch.setenv("SINKCHAT_PREFILL", "hf")
    settings_from_env()


def test_evict_chunk_larger_than_the_window_and_too_many_sinks_are_refused():
    from sinkchat.config import CacheConfig

    with pytest.raises(ConfigError, match="smaller than the window"):
        CacheConfig(capacity=64, evict_chunk=1000).resolved(8192)
    assert CacheConfig(capacity=64, evict_chunk=59).resolved(8192).evict_chunk == 59
    assert CacheConfig(capacity=128).resolved(8192).evict_chunk == (128 - 4) // 16
    with pytest.raises(ConfigError, match="between 0 and 64"):
        CacheConfig(n_sink=200)  # /sinks 200 in the REPL hits the same rule as --sinks


def test_chat_options_work_without_the_chat_word():
    from click.testing import CliRunner

    from sinkchat.cli import main

    res = CliRunner().invoke(main, ["--cache", "128", "--no-log", "--help"])
    assert res.exit_code == 0 and "--snapshot-every" in res.output  # chat's help: routed to chat
    res = CliRunner().invoke(main, ["logs", "--mode", "bogus"])
    assert res.exit_code == 2 and "bogus" in res.output


def test_unknown_setting_is_named_with_a_hint():
    with pytest.raises(ConfigError, match=r"unknown setting 'memroy' \(did you mean 'memory'\?\)"):
        build_settings({"memroy": "on"})


def test_memory_settings_from_flags_and_env(monkeypatch):
    monkeypatch.setenv("SINKCHAT_MEMORY_TOPK", "6")
    s = build_settings({"memory": "on", "memory_budget": 5, "memory_ram": 3})
    assert (s.memory.mode, s.memory.budget_mb, s.memory.topk, s.memory.ram_mb, s.memory.on) == ("on", 5, 6, 3, True)
    monkeypatch.setenv("SINKCHAT_MEMORY", "maybe")
    with pytest.raises(ConfigError, match="SINKCHAT_MEMORY='maybe': must be on or off"):
        build_settings({})
    monkeypatch.delenv("SINKCHAT_MEMORY")
    with pytest.raises(ConfigError, match="--memory must be on or off"):  # a value passed as a flag: the flag
        build_settings({"memory": "maybe"})
