"""`sinkchat logs` for served sessions (audit): `--mode serve` is accepted (the choices are the logged modes, one
list), a served session's TOKENS are counted (what the engine processed while that session was installed, no `+`),
and its X-Session-Id is in the table's NAME column."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

from fakes import save_tiny_chat_model
from test_serve import post, start_server, stop


def test_shared_tally_counts_each_session_while_installed():
    from sinkchat.apps.runlog import SharedTally

    eng = SimpleNamespace(processed=100, take_peak=lambda: 0)
    tally = SharedTally(eng)
    tally.switch("a")
    a = tally.counter("a")
    eng.processed += 10
    tally.switch(None)  # a stateless request: nobody's
    eng.processed += 7
    tally.switch("b")
    b = tally.counter("b")
    eng.processed += 5
    tally.switch("a")
    eng.processed += 3
    assert (a(), b()) == (13, 5)
    again = tally.counter("a")  # a session resumed: counts from now on, on top of what its log holds
    eng.processed += 2
    assert (again(), a()) == (2, 15)
    assert SharedTally(SimpleNamespace()).counter("a") is None  # an engine double: not counted


def test_logs_mode_serve_tokens_counted_and_named(tmp_path):
    model = save_tiny_chat_model(tmp_path / "model")
    home = tmp_path / "home"
    proc, url = start_server(model, home)
    try:
        for sid, text in (("alpha-1", "hello"), ("beta-2", "hi there"), (None, "stateless")):
            body = {"model": "sinkchat", "messages": [{"role": "user", "content": text}]}
            assert post(url, body, sid).status_code == 200
        body = {"model": "sinkchat", "messages": [{"role": "user", "content": "hello"}]}
        assert post(url, body, "alpha-1").status_code == 200  # a second request on alpha-1
    finally:
        stop(proc)
    env = {**os.environ, "SINKCHAT_HOME": str(home)}
    run = [sys.executable, "-m", "sinkchat", "logs", "--mode", "serve"]
    table = subprocess.run(run, env=env, capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    rows = table.stdout.splitlines()
    assert rows[0].split()[-1] == "NAME" and len(rows) == 3, table.stdout
    assert rows[1].split()[-1] == "beta-2" and rows[2].split()[-1] == "alpha-1", table.stdout
    assert "+" not in table.stdout, table.stdout
    data = json.loads(subprocess.run(run + ["--json"], env=env, capture_output=True, text=True, timeout=60).stdout)
    assert all(s["tokens_counted"] and s["tokens"] >= s["turn_tokens"] > 0 for s in data), data
