"""`sinkchat agent`: the command line around `Agent` (approval, task sources, the workspace, extra tools, the
interactive loop, `--undo`, the exit status)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import click

from sinkchat.apps.agent.agent import Agent, Approve
from sinkchat.apps.agent.constrain import ToolCallConstraint
from sinkchat.apps.agent.display import Display, _abridge
from sinkchat.apps.agent.log import AgentLog
from sinkchat.apps.agent.protocol import Denied, TaskDoneEvent
from sinkchat.apps.agent.tools.journal import JournalError
from sinkchat.apps.agent.verify import EXIT_UNVERIFIED
from sinkchat.apps.agent.tools.toolbox import build_default_tools, load_tools_module
from sinkchat.apps.agent.tools.workspace import Workspace, WorkspaceError
from sinkchat.apps.runlog import open_log
from sinkchat.api import start
from sinkchat.bootstrap import build_settings, common_options, pop_common, setup_logging, user_errors
from sinkchat.config import ConfigError, data_dir

log = logging.getLogger(__name__)


def shell_off(explicit: bool, interactive: bool) -> str:
    """Why `never-shell` refuses the shell, naming who decided it (issue 28: the model was told "the user denied
    this shell call" ten times, though no user was asked)."""
    if not explicit and not interactive:
        return "shell calls are off without a terminal: --approve auto allows them"
    return "shell calls are off (--approve never-shell): --approve auto allows them"


def make_approver(mode: str, interactive: bool, explicit: bool = True) -> Approve | None:
    """The approval policy: None (auto: allow all), or `approve(name, args) -> True | Denied`. `explicit`: the
    mode was given with --approve (else it is the default for this terminal), which the refusals say."""
    if mode == "auto":
        return None
    if mode == "never-shell":
        why = shell_off(explicit, interactive)
        return lambda name, args: Denied(why, always=True) if name == "shell" else True

    def ask(name: str, args: dict[str, Any]) -> bool | Denied:
        if not interactive:
            log.warning("--approve ask without a terminal: denied %s (use --approve auto)", name)
            return Denied("--approve ask has no terminal to ask on, so side-effecting calls are off: --approve auto "
                          "allows them", always=True)
        if click.confirm(f"allow {name} {_abridge(repr(args), 300)}?", default=False, err=True):
            return True
        return Denied(f"the user denied this {name} call")

    return ask


def _shell_refused(mode: str, explicit: bool, interactive: bool) -> bool:
    """Whether every shell call would be refused; then the tool is not offered at all, and the user is told why."""
    if mode != "never-shell":
        return False
    click.echo(f"note: {shell_off(explicit, interactive)}; the shell tool is not offered", err=True)
    return True


def _toolbox(ws: Workspace, allow_shell: bool, max_result_chars: int, extra: list[Callable[..., Any]],
             builtin: bool = True, mcp_tools: list[Any] = (), mcp_asked: bool = False) -> Any:
    """The built-in tools (unless --no-builtin-tools), --tools-module functions, then MCP tools (a name already
    taken is skipped with one line: the first one offered keeps it)."""
    from sinkchat.apps.agent.tools.toolbox import Toolbox

    try:
        box = build_default_tools(ws, allow_shell, max_result_chars, extra) if builtin else Toolbox(
            max_result_chars=max_result_chars)
        if not builtin:
            for fn in extra:
                box.add(fn, ws)
        for t in mcp_tools:
            if t.name in box:
                click.echo(f"warning: MCP tool {t.name} left out: a tool of that name is offered already", err=True)
            else:
                box.add(t)
    except ValueError as e:
        raise ConfigError(f"bad tool: {e}") from None
    if not box.names and mcp_asked:  # the servers were given, and none offered a tool (their warnings say why)
        raise ConfigError("no tools to offer: the --mcp servers offered none (see the warnings above), and "
                          "--no-builtin-tools leaves out the built-in ones")
    if not box.names:
        raise ConfigError("no tools to offer: --no-builtin-tools needs --tools-module or --mcp tools")
    return box


def start_mcp(commands: tuple[str, ...], timeout: float = 30.0) -> tuple[Any, list[Any]]:
    """The MCP servers of --mcp (None when there are none) and their tools; a server that cannot start (or list
    its tools within `timeout` s) is one warning line and the run goes on without it."""
    if not commands:
        return None, []
    from sinkchat.apps.agent.tools.mcp_client import McpServers

    servers = McpServers(list(commands), warn=lambda m: click.echo(f"warning: {m}", err=True), call_timeout=timeout,
                         start_timeout=timeout)
    return servers, servers.start()


def task_source(task: str | None, tasks_file: str | None, forever: bool) -> Iterable[str]:
    """TASK, then the lines of --tasks FILE (or stdin lines); with --forever cycle through them without end."""

    def lines() -> Iterator[str]:
        if task:
            yield task
        if tasks_file:
            try:
                fh = sys.stdin if tasks_file == "-" else open(tasks_file, encoding="utf-8", errors="replace")
            except OSError as e:
                raise click.ClickException(f"cannot read {tasks_file}: {e.strerror}") from None
            with fh if fh is not sys.stdin else contextlib.nullcontext():
                yield from (ln.strip() for ln in fh if ln.strip() and not ln.lstrip().startswith("#"))

    if not forever:
        return lines()
    return _cycle(lines)


def _cycle(make: Callable[[], Iterator[str]]) -> Iterator[str]:
    seen = []
    for t in make():
        seen.append(t)
        yield t
    if not seen:
        raise click.UsageError("--forever needs a TASK, --tasks FILE or task lines on stdin")
    yield from itertools.cycle(seen)


class WorkspaceUsageError(click.ClickException):
    """A workspace that cannot be used: one line and exit 2 (a usage mistake; click's UsageError would add the usage
    text around it)."""

    exit_code = 2


def open_workspace(path: str | None, create: bool) -> Workspace:
    """--workspace DIR must exist unless --create-workspace; without --workspace, a fresh folder under the data dir.
    Checked before the log or the model is opened, so a mistyped path creates nothing (no folder, no log)."""
    if path is None:
        return Workspace(data_dir() / "workspaces" / time.strftime(f"%Y%m%d-%H%M%S-{uuid.uuid4().hex[:6]}"),
                         create=True)
    try:
        return Workspace(path, create=create)
    except WorkspaceError as e:
        hint = "" if create or Path(path).expanduser().exists() else " (pass --create-workspace to create it)"
        raise WorkspaceUsageError(f"{e}{hint}") from None


def load_extra_tools(paths: tuple[str, ...]) -> list[Callable[..., Any]]:
    """The functions of every --tools-module file; a broken file is a ConfigError (exit 2)."""
    extra: list[Callable[..., Any]] = []
    for path in paths:
        try:
            extra += load_tools_module(path)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return extra


@click.command("agent")
@click.argument("task", required=False)
@click.option("--workspace", type=click.Path(file_okay=False), default=None,
              help="existing folder the file tools are confined to (default: a fresh folder under the data dir)")
@click.option("--create-workspace", is_flag=True,
              help="create the --workspace folder (and its parents) if it is missing, instead of refusing")
@click.option("--max-steps", type=click.IntRange(0, None), default=10, show_default=True, help="steps per task (0 = no limit)")
@click.option("--forever", is_flag=True, help="keep cycling through the tasks (TASK, --tasks FILE or stdin lines)")
@click.option("--tasks", "tasks_file", type=click.Path(dir_okay=False, allow_dash=True), default=None,
              help="file with one task per line ('-' = stdin)")
@click.option("--approve", type=click.Choice(["ask", "auto", "never-shell"]), default=None,
              help="before side-effecting calls: ask (default on a terminal), auto, never-shell (default otherwise)")
@click.option("--allow-shell", is_flag=True, help="offer the shell tool (NOT confined to the workspace)")
@click.option("--mcp", "mcp_commands", multiple=True, metavar='"COMMAND ARGS"',
              help="an MCP stdio server whose tools the agent gets (repeatable), e.g. --mcp \"npx -y @modelcontextprotocol/server-filesystem .\"")
@click.option("--mcp-timeout", type=click.FloatRange(0.1, None), default=30.0, show_default=True, metavar="SECONDS",
              help="how long an MCP server may take to list its tools, and a tool call to answer")
@click.option("--no-builtin-tools", is_flag=True, help="offer only --tools-module and --mcp tools")
@click.option("--tools-module", multiple=True, type=click.Path(dir_okay=False), help="extra tools: a .py file (repeatable)")
@click.option("--max-result-chars", type=click.IntRange(100, None), default=1500, show_default=True,
              help="cap on each tool result fed to the model")
@click.option("--no-log", is_flag=True, help="do not write the SQLite session log")
@click.option("--no-constrain", is_flag=True,
              help="let the model write anything (default: every reply is forced to be a valid tool call or answer)")
@click.option("--keep-context", is_flag=True,
              help="each task sees the earlier tasks' turns (default: each starts from the system prompt and examples)")
@click.option("--undo", type=click.IntRange(1, None), is_flag=False, flag_value=1, default=None, metavar="[N]",
              help="put back the last N file changes (default 1) the agent made in --workspace, newest first, and "
                   "exit (1 when there is nothing to undo or a file changed since)")
@common_options
def agent_command(task: str | None, workspace: str | None, create_workspace: bool, max_steps: int, forever: bool,
                  tasks_file: str | None, approve: str | None, allow_shell: bool, mcp_commands: tuple[str, ...],
                  mcp_timeout: float, no_builtin_tools: bool, tools_module: tuple[str, ...], max_result_chars: int, no_log: bool,
                  no_constrain: bool, keep_context: bool, undo: int | None,
                  **kw: Any) -> None:
    """Run a tool-using agent on TASK (no TASK: type tasks at a prompt, or pipe one task per line).

    A task is verified when its final answer's numbers and names come from its tool results and every file it asks
    to be written holds what it asks. Exit status: 0 every task verified; 3 a task ended unverified (one line says
    why); 1 an error; 2 bad usage; 130 interrupted (Ctrl-C). write_file never replaces a file the task does not
    name; every change is journaled, and --undo puts it back."""
    from sinkchat.core.metrics import Metrics, model_bytes, rss_bytes

    opts = pop_common(kw)
    setup_logging(opts["verbose"] or 0)
    interactive = sys.stdin.isatty()
    if undo is not None:
        return undo_changes(workspace, undo)
    with user_errors(), contextlib.ExitStack() as stack:
        settings = build_settings(opts)
        if task is None and tasks_file is None and not interactive:
            tasks_file = "-"
        extra = load_extra_tools(tools_module)
        ws = open_workspace(workspace, create_workspace)
        mode = approve or ("ask" if interactive else "never-shell")
        shell = allow_shell and not _shell_refused(mode, approve is not None, interactive)
        mcp_servers, tools = _tools_with_mcp(ws, shell, max_result_chars, extra, not no_builtin_tools, mcp_commands,
                                            mcp_timeout)
        stack.callback(lambda: mcp_servers is not None and mcp_servers.close())  # every exit: servers ended
        engine = start(settings, None, lambda m: click.echo(m, err=True)).engine
        agent = Agent(engine, tools, ws, make_approver(mode, interactive, explicit=approve is not None),
                      constrain=not no_constrain, fresh_tasks=not keep_context)
        metrics = Metrics()
        mbytes = model_bytes(engine.model)
        slog = open_log(engine, "agent", no_log, None, lambda m: click.echo(f"warning: {m}", err=True),
                        extra={"workspace": str(ws.root), "tools": tools.names})
        display = Display(engine, metrics, sys.stdout.isatty(), mbytes, AgentLog(slog, engine))
        click.echo(f"workspace: {ws.root}  tools: {', '.join(tools.names)}", err=True)
        rss0 = rss_bytes()
        tally = _Tally()
        interrupted = False
        try:
            if task is None and tasks_file is None:
                _interactive(agent, display, max_steps)
            else:
                _run_tasks(agent, display, task_source(task, tasks_file, forever), max_steps, tally)
        except KeyboardInterrupt:
            interrupted = True
            display.line(f"interrupted; {tally.unverified} task(s) ended unverified before it", "red")
        finally:
            slog.close()
            stack.close()
        click.echo(_summary(agent, tally, metrics, rss0), err=True)
    if interrupted:
        sys.exit(130)  # Ctrl-C: 128 + SIGINT, as a shell reports it (the project's convention), never 0
    if tally.unverified:
        sys.exit(EXIT_UNVERIFIED)


def _tools_with_mcp(ws: Any, shell: bool, max_result_chars: int, extra: Any, builtin: bool,
                    mcp_commands: tuple[str, ...], mcp_timeout: float = 30.0) -> tuple[Any, Any]:
    """The MCP servers started (None: none asked for) and the toolbox with their tools; the servers stopped again
    when the toolbox cannot be built."""
    mcp_servers, mcp_tools = start_mcp(mcp_commands, mcp_timeout)
    try:
        return mcp_servers, _toolbox(ws, shell, max_result_chars, extra, builtin, mcp_tools, bool(mcp_commands))
    except BaseException:
        if mcp_servers is not None:
            mcp_servers.close()
        raise


def _summary(agent: Any, tally: Any, metrics: Any, rss0: int) -> str:
    """The closing line: tasks, steps, calls, replies, evictions, RSS before and after."""
    from sinkchat.core.metrics import human_bytes, rss_bytes

    c = agent.counts
    return (f"agent: {c.tasks} task(s), {tally.unverified} unverified, {c.steps} step(s), "
            f"tool calls ok {c.calls_ok} / failed {c.calls_failed}, "
            f"unusable replies {c.unusable}, final answers {c.finals}; evictions {metrics.eviction_count} "
            f"({metrics.evicted} tokens); rss {human_bytes(rss0)} → {human_bytes(rss_bytes())}"
            + _constraint_note(agent.constraint))


@dataclass
class _Tally:
    """Tasks that ended unverified so far: kept outside `_run_tasks` so a Ctrl-C midway does not lose the count."""

    unverified: int = 0


def _run_tasks(agent: Agent, display: Display, tasks: Iterable[str], max_steps: int, tally: _Tally) -> None:
    """Run each task, showing its events; counts the tasks that ended unverified into `tally` as they end."""
    for t in tasks:
        for ev in agent.run(t, max_steps or None):
            display(ev)
            tally.unverified += isinstance(ev, TaskDoneEvent) and not ev.verified


def undo_changes(workspace: str | None, n: int) -> None:
    """`--undo N`: restore the last N journaled changes in the workspace, one line each (tools/journal.py)."""
    if workspace is None:
        raise WorkspaceUsageError("--undo needs --workspace DIR: the folder whose changes to undo")
    ws = open_workspace(workspace, create=False)
    done = 0
    try:
        for line in ws.journal.undo(n):
            click.echo(f"undo: {line}")
            done += 1
    except JournalError as e:
        raise click.ClickException(f"undo stopped after {done} change(s): {e}") from None
    if not done:
        raise click.ClickException(f"nothing to undo in {ws.root}")
    if done < n:
        click.echo(f"undo: only {done} change(s) were journaled; all undone", err=True)


def _constraint_note(con: ToolCallConstraint | None) -> str:
    if con is None or not con.tokens:
        return "; unconstrained"
    return f"; grammar mask {con.seconds / con.tokens * 1e6:.0f} us/token over {con.tokens} tokens"


def _interactive(agent: Agent, display: Display, max_steps: int) -> None:
    """Each line typed is a task; Ctrl-C stops the running task, Ctrl-D leaves."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory

    from sinkchat.apps.render import live_stats, toolbar_fragments

    def toolbar() -> Any:  # the same live status bar as `sinkchat chat`
        return toolbar_fragments(live_stats(agent.engine, display.metrics, display.model_nbytes))

    try:
        data_dir().mkdir(parents=True, exist_ok=True)
        history: Any = FileHistory(str(data_dir() / "agent-history"))
    except OSError:
        history = None
    session: PromptSession[str] = PromptSession(history=history, bottom_toolbar=toolbar, refresh_interval=0.5)
    while True:
        try:
            line = session.prompt("task> ").strip()
        except KeyboardInterrupt:
            continue
        except EOFError:
            return
        if not line:
            continue
        if line in ("/quit", "/exit"):
            return
        try:
            for ev in agent.run(line, max_steps or None):
                display(ev)
        except KeyboardInterrupt:
            display.line("task interrupted", "red")
