"""MCP tools for the agent (issue 31 item 6): a real stdio MCP server written here with the SDK's FastMCP (MCPServer
in mcp 2), its tools listed, called, failing as tool errors, a server that hangs or cannot start reported in one
line, and `sinkchat agent --mcp ... --no-builtin-tools` calling it end to end on a tiny model."""

from __future__ import annotations

import subprocess
import os
import sys
import textwrap
from pathlib import Path

import pytest

from fakes import save_tiny_chat_model

SERVER = textwrap.dedent('''
    import time
    from typing import Literal
    try:
        from mcp.server.mcpserver import MCPServer as Server
    except ImportError:  # mcp 1.x
        from mcp.server.fastmcp import FastMCP as Server

    app = Server("ports")

    @app.tool()
    def port_of(service: Literal["nginx", "redis"]) -> str:
        """The port a service listens on."""
        return {"nginx": "8443", "redis": "6379"}[service]

    @app.tool()
    def fail(reason: str) -> str:
        """Always fails."""
        raise ValueError(reason)

    @app.tool()
    def hang(seconds: int) -> str:
        """Sleeps."""
        time.sleep(seconds)
        return "woke"

    if __name__ == "__main__":
        app.run()
''')


@pytest.fixture
def server_cmd(tmp_path: Path) -> str:
    path = tmp_path / "ports_server.py"
    path.write_text(SERVER)
    return f"{sys.executable} {path}"


def test_tools_listed_called_and_failing(server_cmd):
    from sinkchat.apps.agent.tools.mcp_client import McpServers
    from sinkchat.apps.agent.tools.schema import ToolError
    from sinkchat.apps.agent.tools.toolbox import Toolbox

    warnings: list[str] = []
    servers = McpServers([server_cmd, "no-such-mcp-command-xyz"], warn=warnings.append, call_timeout=2)
    try:
        tools = servers.start()
        assert sorted(t.name for t in tools) == ["fail", "hang", "port_of"]
        assert len(warnings) == 1 and "no-such-mcp-command-xyz" in warnings[0] and "\n" not in warnings[0]
        port_of = next(t for t in tools if t.name == "port_of")
        assert port_of.params[0].type == ("nginx", "redis") and port_of.params[0].required  # the enum -> the grammar
        assert "port a service" in port_of.description
        box = Toolbox(tools)
        ok = box.call("port_of", {"service": "redis"})
        assert ok.ok and ok.text == "6379"
        bad = box.call("fail", {"reason": "boom"})
        assert not bad.ok and bad.text.startswith("error:")
        with pytest.raises(ToolError, match="did not answer within 2 s"):
            servers.call(server_cmd, "hang", {"seconds": 30})
        assert len(warnings) == 2 and "hang" in warnings[1]
        assert box.call("port_of", {"service": "nginx"}).text == "8443"  # the server goes on after a hung call
    finally:
        servers.close()
    with pytest.raises(ToolError, match="not running"):
        servers.call(server_cmd, "port_of", {"service": "nginx"})


@pytest.mark.slow  # a CLI agent run with an MCP server, ~10 s idle; also test_mcp_lifecycle's agent run
def test_agent_cli_with_mcp_only(server_cmd, tmp_path):
    model = save_tiny_chat_model(tmp_path / "model")
    ws = tmp_path / "ws"
    ws.mkdir()
    cmd = [sys.executable, "-m", "sinkchat", "agent", "Which port does nginx listen on?", "--mcp", server_cmd,
           "--no-builtin-tools", "--workspace", str(ws), "--max-steps", "1", "--model", str(model), "--quant", "none",
           "--no-log", "--temperature", "0", "--max-tokens", "40"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert "tools: port_of, fail, hang" in out.stderr or "tools: fail, hang, port_of" in out.stderr, out.stderr[-2000:]
    assert "list_dir" not in out.stderr.split("tools:")[1].splitlines()[0]
    # the first step must call a tool (the grammar requires it); whichever, the call reached the MCP server
    assert "tool calls ok 1 / failed 0" in out.stderr or "tool calls ok 0 / failed 1" in out.stderr
    assert out.returncode == 3  # the random model's task is not verified, and the run ends normally


def test_no_builtin_tools_without_others_is_one_line(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    out = subprocess.run([sys.executable, "-m", "sinkchat", "agent", "x", "--no-builtin-tools", "--workspace", str(ws),
                          "--no-log"], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 2 and "no tools to offer" in out.stderr and "Traceback" not in out.stderr


def test_a_server_that_writes_other_lines_to_stdout_is_one_warning_line(tmp_path, caplog):
    """A user audit: a server printing a line that is not JSON-RPC to its stdout dumped the SDK's whole pydantic
    traceback on the terminal (`Error: Failed to parse JSONRPC message ...`); the docs promise one line."""
    from sinkchat.apps.agent.tools.mcp_client import McpServers
    from sinkchat.apps.agent.tools.toolbox import Toolbox

    path = tmp_path / "chatty_server.py"
    path.write_text(SERVER.replace('if __name__ == "__main__":', 'if __name__ == "__main__":\n'
                                   '    print("starting the ports server...", flush=True)'))
    servers = McpServers([f"{sys.executable} {path}"], warn=lambda _: None, call_timeout=10)
    with caplog.at_level("WARNING"):
        try:
            tools = servers.start()
            assert Toolbox(tools).call("port_of", {"service": "redis"}).text == "6379"
        finally:
            servers.close()
    said = [r for r in caplog.records if r.name.startswith("mcp")]
    assert said and all(r.exc_info is None and r.exc_text is None and "\n" not in r.getMessage() for r in said)
    assert any("not JSON-RPC" in r.getMessage() for r in said)


def test_no_builtin_tools_with_failed_servers_says_they_offered_none(tmp_path):
    """--mcp given, its server dead at start, --no-builtin-tools: the error said "needs --tools-module or --mcp
    tools" as if no --mcp had been given (a new user's audit); it now says the servers offered none, after the
    warning that quotes why (the server's last stderr line)."""
    ws = tmp_path / "ws"
    ws.mkdir()
    said = "import sys; sys.stderr.write('ModuleNotFoundError: no mcp here' + chr(10)); sys.exit(1)"
    dead = f'{sys.executable} -c "{said}"'
    out = subprocess.run([sys.executable, "-m", "sinkchat", "agent", "x", "--no-builtin-tools", "--workspace", str(ws),
                          "--mcp", dead, "--mcp-timeout", "20", "--no-log"], capture_output=True, text=True,
                         timeout=120, stdin=subprocess.DEVNULL, env={**os.environ, "SINKCHAT_HOME": str(tmp_path)})
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "the --mcp servers offered none" in out.stderr
    assert 'it said: "ModuleNotFoundError: no mcp here"' in out.stderr
