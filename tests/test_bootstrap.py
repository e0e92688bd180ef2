"""The bootstrap: user errors map to one line and their exit code in one place, and settings that cannot fit the
model fail before its weights load."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest

from sinkchat.bootstrap import user_errors
from sinkchat.config import ConfigError
from sinkchat.core.cache_policy import ContextFull
from sinkchat.errors import UserError
from sinkchat.model.loader import LoadError
from sinkchat.model.spec import UnsupportedModel


@pytest.mark.parametrize("err,code", [(ConfigError("bad flag"), 2), (LoadError("no file"), 1),
                                      (UnsupportedModel("no rope"), 1), (ContextFull("full"), 1),
                                      (UserError("plain"), 1)])
def test_every_user_error_becomes_one_line_with_its_exit_code(err, code):
    with pytest.raises(click.ClickException) as e:
        with user_errors():
            raise err
    assert e.value.exit_code == code and e.value.format_message() == str(err)


def test_a_bug_keeps_its_traceback():
    with pytest.raises(KeyError):
        with user_errors():
            raise KeyError("bug")


def test_a_cache_larger_than_the_context_fails_before_the_weights_load(tmp_path):
    """The bundled model's context is 8192: --cache 9000 must be refused from its config, before any weight is read
    (the loader reports "loaded ..." only after the weights are in)."""
    r = subprocess.run([sys.executable, "-m", "sinkchat.cli", "--cache", "9000", "ppl", "/etc/hostname"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "--cache 9000 exceeds the model's trained context (8192 tokens)" in r.stderr
    assert "loaded" not in r.stderr and "Traceback" not in r.stderr
