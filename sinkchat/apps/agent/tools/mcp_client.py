"""Tools from MCP servers (`sinkchat agent --mcp "COMMAND ARGS"`): stdio servers through the official `mcp` SDK.

Each server is started as a child process and kept open for the whole run on one background asyncio loop (the SDK
is async; the agent is not). Its tools become ordinary `Tool`s: name, description and the JSON schema's top-level
properties as `Param`s (so the agent's grammar offers them like any built-in tool, enums as enums), run in a thread
(`isolate=False`: the connection lives in this process) under the tool timeout. A result marked `isError` is a
tool error for the model, as a built-in tool's `ToolError` is. A server that cannot start, dies or hangs is one
warning line: its tools are left out (at start) or answer with an error (later), and the agent goes on.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shlex
import sys
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable

from sinkchat.apps.agent.tools.schema import Param, Tool, ToolError

log = logging.getLogger(__name__)

START_TIMEOUT = 30.0  # seconds for a server to start and list its tools
CALL_TIMEOUT = 30.0
GRACE = 2.0  # seconds between terminate and kill for a server left running at close
EXIT_WAIT = 0.5  # seconds a server gets to exit by itself once its stdin is closed, at close
JSON_TO_PY = {"string": str, "integer": int, "number": float, "boolean": bool, "array": list, "object": dict}


def params_from_schema(schema: dict[str, Any]) -> list[Param]:
    """The agent's `Param`s for a JSON schema's top-level properties (enums of strings stay enums)."""
    props = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    out = []
    for name, spec in props.items():
        spec = spec if isinstance(spec, dict) else {}
        enum = spec.get("enum")
        t: Any = tuple(enum) if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum) \
            else JSON_TO_PY.get(spec.get("type") if isinstance(spec.get("type"), str) else "string", str)
        out.append(Param(name, t, name in required, spec.get("default"), str(spec.get("description") or "")))
    return out


def result_text(res: Any) -> tuple[str, bool]:
    """(text, is_error) of a CallToolResult: its text parts joined (other parts named by their type)."""
    parts = []
    for c in getattr(res, "content", None) or []:
        parts.append(getattr(c, "text", None) or f"[{getattr(c, 'type', 'content')}]")
    err = bool(getattr(res, "is_error", None) or getattr(res, "isError", False))
    return "\n".join(parts), err


class McpServers:
    """The MCP servers of one agent run, connected on a background loop; `tools()` lists what they offer."""

    def __init__(self, commands: list[str], warn: Callable[[str], None] = log.warning,
                 call_timeout: float = CALL_TIMEOUT, start_timeout: float = START_TIMEOUT) -> None:
        self.commands, self.warn, self.call_timeout = list(commands), warn, call_timeout
        self.start_timeout = start_timeout
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="sinkchat-mcp", daemon=True)
        self.sessions: dict[str, Any] = {}  # command -> ClientSession
        self._stop = asyncio.Event()
        self._tasks: dict[str, Any] = {}  # command -> the task holding its session
        self._errfiles: dict[str, Any] = {}  # command -> its open stderr file
        self.procs: list[Any] = []  # psutil.Process of every server started, ended for sure in `close`
        self._before: set[int] = set()  # our child processes before `start`

    def start(self) -> list[Tool]:
        """Connect every server at once (two hung servers cost one `start_timeout`, not two); the tools of those
        that came up, in the order given (a name taken already is skipped, with a line). Interrupted or failing, it
        stops every server started so far before raising."""
        self.thread.start()
        tools: list[Tool] = []
        before = self._before = {p.pid for p in _children()}
        try:
            futs = [(cmd, asyncio.run_coroutine_threadsafe(self._open(cmd), self.loop)) for cmd in self.commands]
            deadline = time.monotonic() + self.start_timeout
            for cmd, fut in futs:
                tools.extend(self._started(cmd, fut, deadline))
        except BaseException:
            self._adopt(before)  # before `close`, which ends what it knows of
            self.close()
            raise
        self._adopt(before)
        return tools

    def _late(self) -> None:
        """Adopt the servers whose process appeared after `start` gave up on them (a start timed out before the
        SDK had spawned it, on a loaded machine: its cancelled task never ended it). Only processes running one of
        our server commands: a tool's own children are not ours to end."""
        import psutil

        argvs = [shlex.split(cmd) for cmd in self.commands]
        known = {p.pid for p in self.procs}
        for p in _children():
            if p.pid in self._before or p.pid in known:
                continue
            try:
                line = p.cmdline()
            except psutil.Error:
                continue
            if any(line[1:] == a[1:] and os.path.basename(line[0]) == os.path.basename(a[0]) for a in argvs if a):
                self.procs.append(p)

    def _adopt(self, before: set[int]) -> None:
        """Note the child processes started since `before` (the servers and whatever they run) for `close`."""
        known = {p.pid for p in self.procs}
        self.procs.extend(p for p in _children() if p.pid not in before and p.pid not in known)

    def _started(self, cmd: str, fut: Any, deadline: float) -> list[Tool]:
        """The tools of one server; [] (with one warning line) when it failed or hung, its task then cancelled."""
        try:
            listed = fut.result(max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            self.warn(f"MCP server '{cmd}' did not list its tools within {self.start_timeout:g} s; left out"
                      f"{self._where(cmd)}")
            task = self._tasks.get(cmd)
            if task is not None:  # its start hung: the SDK closes its stdin, `close` ends its process for sure
                self.loop.call_soon_threadsafe(task.cancel)
            return []
        except Exception as e:  # noqa: BLE001 - any start failure: one line, the run goes on
            self.warn(f"MCP server '{cmd}' could not start: {_one_line(e)}; left out{self._where(cmd)}")
            return []
        return [self._tool(cmd, t) for t in listed]

    async def _open(self, cmd: str) -> list[Any]:
        """Start `cmd`, keep its session open in a task until `close`; return its tools."""
        from mcp import ClientSession, StdioServerParameters
        from mcp.client.stdio import stdio_client

        argv = shlex.split(cmd)
        if not argv:
            raise ValueError("empty command")
        listed: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()

        async def hold() -> None:
            try:
                params = StdioServerParameters(command=argv[0], args=argv[1:])
                async with stdio_client(params, errlog=self._errlog(cmd)) as (read, write):
                    async with ClientSession(read, write) as session:
                        await session.initialize()
                        result = await session.list_tools()
                        self.sessions[cmd] = session
                        listed.set_result(list(result.tools))
                        await self._stop.wait()
            except BaseException as e:  # noqa: BLE001 - reported through `listed` at start, else logged
                if not listed.done():
                    listed.set_exception(e if isinstance(e, Exception) else RuntimeError(str(e)))
                else:
                    log.info("MCP server '%s' ended: %s", cmd, _one_line(e))
            finally:
                self.sessions.pop(cmd, None)

        self._tasks[cmd] = asyncio.ensure_future(hold())
        return await listed

    def _errlog(self, cmd: str) -> Any:
        """Where a server's stderr goes: ours with -v (its tracebacks help there), else a file under the data dir
        (an SDK server prints a framed traceback for every failing call, which would bury the agent's own lines)."""
        if log.isEnabledFor(logging.INFO):
            return sys.stderr
        if cmd not in self._errfiles:
            self._errfiles[cmd] = open(errlog_path(cmd), "w", encoding="utf-8")  # noqa: SIM115 - closed in close
        return self._errfiles[cmd]

    def _where(self, cmd: str) -> str:
        """'; it said: "LAST LINE" (its stderr: PATH)' for a server whose stderr went to a file and wrote something
        there. Why the last line: a server that dies at start says why there (`ModuleNotFoundError: No module named
        'mcp'` for a `python` without the SDK), and the warning alone said "Connection closed"."""
        f = self._errfiles.get(cmd)
        if f is None:
            return ""
        f.flush()
        size = os.path.getsize(f.name)
        if not size:
            return ""
        with open(f.name, "rb") as r:
            r.seek(max(0, size - 4096))
            lines = [ln.strip() for ln in r.read().decode("utf-8", "replace").splitlines() if ln.strip()]
        said = f"; it said: \"{' '.join(lines[-1].split())[:200]}\"" if lines else ""
        return f"{said} (its stderr: {f.name})"

    def _tool(self, cmd: str, t: Any) -> Tool:
        name = str(t.name)
        schema = getattr(t, "input_schema", None) or getattr(t, "inputSchema", None) or {}

        def call(**kwargs: Any) -> str:
            return self.call(cmd, name, kwargs)

        desc = str(getattr(t, "description", "") or "").strip().split("\n")[0]
        return Tool(name, call, desc or f"tool {name} of MCP server {argv0(cmd)}", params_from_schema(schema),
                    side_effects=True, timeout=self.call_timeout + 5, isolate=False, data=True)

    def call(self, cmd: str, name: str, args: dict[str, Any]) -> str:
        """Run one tool call; a tool error, a dead server or a timeout becomes a ToolError for the model."""
        session = self.sessions.get(cmd)
        if session is None:
            raise ToolError(f"MCP server {argv0(cmd)} is not running (it ended or never started)")
        fut = asyncio.run_coroutine_threadsafe(session.call_tool(name, args), self.loop)
        try:
            res = fut.result(self.call_timeout)
        except FutureTimeout:
            fut.cancel()
            self.warn(f"MCP tool {name} ({argv0(cmd)}) did not answer within {self.call_timeout:.0f} s")
            raise ToolError(f"{name} did not answer within {self.call_timeout:.0f} s") from None
        except Exception as e:  # noqa: BLE001 - a server that died mid-call, a protocol error
            self.warn(f"MCP tool {name} ({argv0(cmd)}) failed: {_one_line(e)}")
            raise ToolError(f"{name} failed: {_one_line(e)}") from None
        text, err = result_text(res)
        if err:
            raise ToolError(text or f"{name} reported an error")
        return text

    def close(self) -> None:
        """Stop every server: their sessions end (the SDK closes their stdin), a server that has not exited
        `EXIT_WAIT` seconds later is terminated, then killed after GRACE seconds, and only then are the session
        tasks waited for (the SDK's own wait and terminate, ~4 s a hung server, then find it gone). Measured with
        three servers that ignore SIGTERM and stdin's end: 13.0 s to close before, ~3 s now."""
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
            import psutil

            _, left = psutil.wait_procs(self.procs, timeout=EXIT_WAIT)
            end_processes(left)

            async def stop() -> None:
                pending = [t for t in self._tasks.values() if not t.done()]
                if pending:
                    _, pending = await asyncio.wait(pending, timeout=2)
                for t in pending:
                    t.cancel()
                if pending:
                    await asyncio.wait(pending, timeout=3)

            try:
                asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
            except BaseException:  # noqa: BLE001 - closing is best effort; the processes are ended below anyway
                log.debug("MCP shutdown", exc_info=True)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
            self._late()
        end_processes(self.procs)
        self.procs = []
        for f in self._errfiles.values():
            f.close()


def _quiet_reaped(record: logging.LogRecord) -> bool:
    """Drops asyncio's "Unknown child process pid N" warning: `end_processes` reaps a server it had to end, and the
    SDK's child watcher then finds it gone (nothing the user can act on)."""
    return not str(record.msg).startswith("Unknown child process pid")


logging.getLogger("asyncio").addFilter(_quiet_reaped)


def _one_line_parse_error(record: logging.LogRecord) -> bool:
    """The SDK logs a server's stdout line that is not JSON-RPC with its whole pydantic traceback (`Error: Failed to
    parse JSONRPC message ...` then ~40 lines): one warning line instead, the line ignored as the SDK ignores it."""
    if str(record.msg).startswith("Failed to parse JSONRPC message"):
        record.msg, record.args = "an MCP server wrote a line that is not JSON-RPC to its stdout (ignored)", ()
        record.exc_info = record.exc_text = None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
    return True


logging.getLogger("mcp.client.stdio").addFilter(_one_line_parse_error)


def _children() -> list[Any]:
    """This process's child processes now (psutil.Process objects: a reused pid is not mistaken for ours)."""
    import psutil

    try:
        return psutil.Process().children()
    except psutil.Error:
        return []


def end_processes(procs: list[Any], grace: float = GRACE) -> None:
    """Terminate each process still running (and its children), kill what is left after `grace` seconds."""
    import psutil

    alive = []
    for p in procs:
        try:
            alive.extend([p, *p.children(recursive=True)])
        except psutil.Error:
            continue
    for p in alive:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, left = psutil.wait_procs(alive, timeout=grace)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=grace)


def errlog_path(cmd: str) -> Any:
    """The file a server's stderr goes to: <data dir>/mcp/<command and first argument's names>.log."""
    from sinkchat.config import data_dir

    folder = data_dir() / "mcp"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        words = shlex.split(cmd)[:2]
    except ValueError:
        words = [cmd]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", "-".join(os.path.basename(w) for w in words))[:80] or "server"
    return folder / f"{name}.log"


def argv0(cmd: str) -> str:
    try:
        return shlex.split(cmd)[0]
    except (ValueError, IndexError):
        return cmd


def _one_line(e: BaseException) -> str:
    inner = getattr(e, "exceptions", None)  # an ExceptionGroup from the SDK's task group: its first cause
    if inner:
        return _one_line(inner[0])
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:200]
