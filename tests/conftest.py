"""Shared fixtures: a fresh SINKCHAT_HOME per test, the words-preset tokenizer, the real bundled model (session-scoped).

Helper classes and functions (fake tokenizer, scripted engine, tiny models) live in tests/fakes.py, imported
explicitly.
"""

from __future__ import annotations

import os
import signal
import tempfile

import pytest

from fakes import WordTokenizer, tiny_model  # noqa: F401 - tiny_model: for the modules that still import it from here

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# A shell's background job (`.ci/run &`) starts with SIGINT ignored; Python then never installs its Ctrl-C handler,
# and every child process inherits the ignore. The Ctrl-C tests need the usual disposition, however pytest started.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# Outside a test (session fixtures, collection) sinkchat's data dir is this one; each test gets its own (below).
os.environ.setdefault("SINKCHAT_HOME", tempfile.mkdtemp(prefix="sinkchat-test-home-"))
os.environ.setdefault("SINKCHAT_DECODER", "native")  # no background compiles in test processes (test_fastdecode builds one)


@pytest.fixture(autouse=True)
def sinkchat_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """Every test gets an empty data dir (session log, history, snapshots, agent workspaces) as SINKCHAT_HOME, which
    its subprocesses inherit: no test sees another's sessions, none touches the user's."""
    home = tmp_path_factory.mktemp("sinkchat-home")
    monkeypatch.setenv("SINKCHAT_HOME", str(home))
    return home


@pytest.fixture
def word_tok():
    return WordTokenizer()


@pytest.fixture(scope="session")
def bundled():
    """The real bundled SmolLM2-135M-Instruct (fp32, unquantized for exactness tests), loaded once per session."""
    from sinkchat.config import ModelConfig
    from sinkchat.model.loader import load

    return load(ModelConfig(quant="none", threads=1))


@pytest.fixture(scope="session")
def bundled_nf4():
    from sinkchat.config import ModelConfig
    from sinkchat.model.loader import load

    return load(ModelConfig(quant="nf4", threads=1))
