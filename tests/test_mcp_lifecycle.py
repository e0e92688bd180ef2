"""MCP server processes never outlive the agent (audit: a server skipped for hanging stayed alive, parent 1): a raw
stdio server written here that ignores SIGTERM and stdin's end, hanging on `initialize`, on `tools/list` or on a
call, is gone once `McpServers.close` / the agent run returns (normal end, error); a server's stderr goes to a file
under the data dir, named in the one-line warning, not to the user's terminal."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from fakes import save_tiny_chat_model

HANGING = textwrap.dedent('''
    import json, os, signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only a kill ends it
    pidfile, mode = sys.argv[1], sys.argv[2]
    with open(pidfile, "a") as f:
        f.write(f"{os.getpid()}\\n")

    def reply(i, result):
        sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": i, "result": result}) + "\\n")
        sys.stdout.flush()

    for line in sys.stdin:
        msg = json.loads(line)
        m, i = msg.get("method"), msg.get("id")
        if m == "initialize" and mode != "init":
            reply(i, {"protocolVersion": msg["params"]["protocolVersion"], "capabilities": {"tools": {}},
                      "serverInfo": {"name": "hang", "version": "1"}})
        elif m == "tools/list" and mode == "call":
            reply(i, {"tools": [{"name": "wait", "description": "Waits.",
                                 "inputSchema": {"type": "object", "properties": {"s": {"type": "string"}}}}]})
    while True:  # stdin closed: it stays anyway
        time.sleep(1)
''')

FAILING = "import sys\nsys.stderr.write('Traceback (most recent call last):\\n  boom\\nValueError: bad config\\n')\n" \
          "sys.exit(1)\n"


def _server(tmp_path: Path, mode: str) -> tuple[str, Path]:
    script = tmp_path / "hanging_server.py"
    script.write_text(HANGING)
    pidfile = tmp_path / f"pids-{mode}"
    return f"{sys.executable} {script} {pidfile} {mode}", pidfile


def _pids(pidfile: Path) -> list[int]:
    deadline = time.monotonic() + 60  # the agent CLI imports torch first: seconds on a loaded machine
    while time.monotonic() < deadline:
        if pidfile.exists() and pidfile.read_text().strip():
            break
        time.sleep(0.05)
    return [int(x) for x in pidfile.read_text().split()]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("SINKCHAT_HOME", str(tmp_path / "home"))


def test_hanging_servers_are_ended(tmp_path, monkeypatch):
    from sinkchat.apps.agent.tools.mcp_client import McpServers

    init_cmd, init_pids = _server(tmp_path, "init")
    list_cmd, list_pids = _server(tmp_path, "list")
    call_cmd, call_pids = _server(tmp_path, "call")
    warnings: list[str] = []
    servers = McpServers([init_cmd, list_cmd, call_cmd], warn=warnings.append, call_timeout=1, start_timeout=5)
    try:
        tools = servers.start()
        assert [t.name for t in tools] == ["wait"]
        assert len(warnings) == 2 and all("did not list its tools" in w for w in warnings)
        with pytest.raises(Exception, match="did not answer"):
            servers.call(call_cmd, "wait", {"s": "x"})
    finally:
        servers.close()
    pids = _pids(init_pids) + _pids(list_pids) + _pids(call_pids)
    assert len(pids) == 3
    assert all(_gone(p) for p in pids), [p for p in pids if not _gone(p)]


def test_servers_spawned_after_their_start_timed_out_are_ended(tmp_path):
    """A start timeout shorter than the spawn (a loaded machine): the SDK spawns the process after `start` gave up
    on it, and its cancelled task never ends it; `close` finds it by its command line (before: all 3 outlived it)."""
    import os

    from sinkchat.apps.agent.tools.mcp_client import McpServers

    cmds = [_server(tmp_path, m) for m in ("init", "list", "call")]
    servers = McpServers([c for c, _ in cmds], warn=lambda _: None, call_timeout=1, start_timeout=0.01)
    try:
        servers.start()
    finally:
        servers.close()
    pids = []
    for _, pidfile in cmds:  # a process the cancel stopped before it ran wrote no pid: nothing to end
        time.sleep(0.2)
        pids += [int(x) for x in pidfile.read_text().split()] if pidfile.exists() else []
    alive = [p for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])
             and p.pid != os.getpid()]
    assert not [p for p in alive if not _gone(p.pid)], alive
    assert all(_gone(p) for p in pids)


def test_failing_server_stderr_goes_to_a_file(tmp_path):
    from sinkchat.apps.agent.tools.mcp_client import McpServers

    script = tmp_path / "failing_server.py"
    script.write_text(FAILING)
    warnings: list[str] = []
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # not a server: left alone
    servers = McpServers([f"{sys.executable} {script}"], warn=warnings.append)
    try:
        assert servers.start() == []
    finally:
        servers.close()
        alive = other.poll() is None
        other.kill()
        other.wait()
    assert alive
    assert len(warnings) == 1 and "could not start" in warnings[0] and "\n" not in warnings[0]
    assert 'it said: "ValueError: bad config' in warnings[0]  # its last line: why, in the warning itself
    path = Path(warnings[0].split("its stderr: ")[1].rstrip(")"))
    assert path.parent == tmp_path / "home" / "mcp" and "ValueError: bad config" in path.read_text()


def _agent(tmp_path: Path, server_cmd: str, model: str) -> subprocess.CompletedProcess:
    ws = tmp_path / "ws"
    ws.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "sinkchat", "agent", "Wait for x.", "--mcp", server_cmd, "--no-builtin-tools",
           "--workspace", str(ws), "--max-steps", "1", "--mcp-timeout", "5", "--model", model, "--quant", "none",
           "--no-log",
           "--temperature", "0", "--max-tokens", "30"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)


def test_agent_run_ends_its_servers(tmp_path):
    server_cmd, pidfile = _server(tmp_path, "call")
    model = save_tiny_chat_model(tmp_path / "model")
    out = _agent(tmp_path, server_cmd, str(model))
    assert "tools: wait" in out.stderr, out.stderr[-2000:]
    pids = _pids(pidfile)
    assert pids and all(_gone(p) for p in pids), out.stderr[-2000:]


@pytest.mark.slow  # a CLI agent with a hanging server, ~17 s idle; the normal exit: test_agent_run_ends_its_servers
def test_agent_error_after_start_ends_its_servers(tmp_path):
    server_cmd, pidfile = _server(tmp_path, "call")
    out = _agent(tmp_path, server_cmd, str(tmp_path / "no-such-model"))
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    pids = _pids(pidfile)
    assert pids and all(_gone(p) for p in pids), out.stderr[-2000:]


def test_ctrl_c_while_a_server_hangs_ends_it(tmp_path):
    import os
    import signal

    server_cmd, pidfile = _server(tmp_path, "init")
    ws = tmp_path / "ws"
    ws.mkdir()
    env = {**os.environ, "SINKCHAT_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen([sys.executable, "-m", "sinkchat", "agent", "x", "--mcp", server_cmd, "--workspace",
                             str(ws), "--no-log"], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        pids = _pids(pidfile)  # the agent waits for the server's tools (up to 30 s): interrupt it then
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert pids and all(_gone(p) for p in pids), err[-2000:]
