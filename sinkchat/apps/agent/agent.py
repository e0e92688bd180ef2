"""`sinkchat agent`: a tool-using loop that runs unbounded on the Engine's one persistent cache.

Thoughts, tool calls and tool results all go through `engine.add_message` / `engine.generate`: nothing is ever
re-encoded, memory stays flat, and when the cache is full the oldest steps leave it with visible EvictionEvents. The
library API is `Agent(engine, tools, ...).run(task, max_steps)`, an iterator of agent events (agent_protocol) with the
engine's own events passed through, so a soak test or a UI folds one stream. The model is untrusted: whatever it
writes ends as a tool result or an error text fed back to it, never as an exception out of the loop.
"""

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

from sinkchat.apps.agent.checkpoint import TaskCheckpoint
from sinkchat.apps.agent.constrain import ToolCallConstraint, build_constraint
from sinkchat.apps.agent.protocol import (
    FEW_SHOT, AgentErrorEvent, AgentEvent, ModelTextEvent, Parsed, StepEvent, TaskDoneEvent, ToolCallEvent, ToolResultEvent,
    ToolsTokenizer, complete_call, examples_for, is_example_call, parse_reply, render_system, result_message, task_message, template_has_tools,
)
from sinkchat.bootstrap import build_settings, common_options, open_engine, pop_common, read_prompt, setup_logging, user_errors
from sinkchat.config import ConfigError, data_dir
from sinkchat.apps.agent.display import Display, _abridge
from sinkchat.core.events import DoneEvent, Event, TokenEvent
from sinkchat.apps.agent.log import AgentLog
from sinkchat.apps.runlog import open_log
from sinkchat.apps.agent.tools.schema import ToolError
from sinkchat.apps.agent.tools.toolbox import ToolResult, Toolbox, build_default_tools, cap_text, load_tools_module
from sinkchat.apps.agent.tools.workspace import Workspace, WorkspaceError

__all__ = ["Agent", "AgentCounts", "AgentEvent", "build_default_tools", "Workspace", "Toolbox", "agent_command"]

log = logging.getLogger(__name__)

NATIVE_SYSTEM = ("You are an agent that completes tasks by calling the tools you are given, one call at a time. "
                 "Files live in a workspace folder; use relative paths. When the task is done, answer in plain text.")
Approve = Callable[[str, dict[str, Any]], bool]


@dataclass
class AgentCounts:
    """Running totals over every task this Agent ran (what a soak test reports)."""

    tasks: int = 0
    steps: int = 0
    calls_ok: int = 0
    calls_failed: int = 0  # unknown tool, bad arguments, denied, tool error or timeout
    unusable: int = 0  # replies with malformed JSON or no tool call at all
    finals: int = 0


class Agent:
    """The loop. `tools`: a Toolbox (see build_default_tools); `workspace`: a Workspace or the path of an existing
    folder (shown to the model; a missing one is a WorkspaceError); `approve(name, args) -> bool` is asked before each
    side-effecting call (None = allow all); protocol: 'auto' | 'native' | 'json'; `max_tokens` per reply (None =
    the engine's sampling.max_tokens); `keep_messages`: past this many, engine.conv's bookkeeping is compacted
    (0 = never). Takes over the engine's system prompt if nothing was fed yet, and then (JSON protocol, few_shot)
    feeds one demonstrated exchange before the first task. `constrain`: mask every token that would leave the
    tool-call grammar (see constrain.py; off where the engine or tokenizer cannot take it). `fresh_tasks`: each task
    starts from the cache as it was before the first task (system prompt + example), so a task never sees, and
    copies, the previous one's reply; skipped once the cache has evicted since then. `require_call`: with the
    constraint, a task's first reply must be a tool call, not an answer."""

    def __init__(self, engine: Any, tools: Toolbox, workspace: Workspace | str | Path | None = None,
                 approve: Approve | None = None, max_result_chars: int | None = None, *, max_tokens: int | None = None,
                 protocol: str = "auto", system_prompt: str | None = None, keep_messages: int = 32,
                 few_shot: bool = True, constrain: bool = True, fresh_tasks: bool = True,
                 require_call: bool = True) -> None:
        self.engine, self.tools, self.approve = engine, tools, approve
        self.workspace = workspace if isinstance(workspace, Workspace) or workspace is None else Workspace(workspace)
        if max_result_chars is not None:
            tools.max_result_chars = max_result_chars
        self.max_tokens = max_tokens
        self.counts = AgentCounts()
        self.keep_messages = keep_messages  # 0 = never compact engine.conv (keeps the full message list)
        self.native = protocol == "native" or (protocol == "auto" and template_has_tools(engine.tokenizer))
        conv = engine.conv
        self.own_system = not conv.fed and not conv.messages  # only a fresh conversation can take our system prompt
        if self.own_system:
            if self.native:
                conv.tokenizer = ToolsTokenizer(conv.tokenizer, tools.schemas())
                conv.system = system_prompt or NATIVE_SYSTEM
            else:
                where = str(self.workspace.root) if self.workspace else "."
                conv.system = render_system(system_prompt or read_prompt("agent"), tools.describe(), where)
        else:
            log.info("the engine already holds a conversation: tools are described in each task message")
        self.primed = not (few_shot and self.own_system and not self.native)
        self.stop = ("</tool_call>",) if self.native else ("\nTool result", "</tool_call>")
        self.constraint: ToolCallConstraint | None = (
            build_constraint(engine, list(tools.tools.values()), self.native,
                             self.workspace.root if self.workspace else None) if constrain else None)
        self.fresh_tasks = fresh_tasks
        self.require_call = require_call
        self.plain_sampling = True  # constrained replies: no repetition penalty (see _sampling)
        self.checkpoint = TaskCheckpoint()  # where every task starts (fresh_tasks)
        self._examples_held = 0  # example turns at the head of engine.conv.messages

    def run(self, task: str, max_steps: int | None = 10) -> Iterator[AgentEvent | Event]:
        """Work on `task` until the model gives a final answer or `max_steps` steps (None/0 = no limit).
        Every step's tool result (or error) is fed back before the next step; the last one is fed without an
        assistant header, so the next task continues the same conversation cleanly."""
        self.counts.tasks += 1
        content = task_message(task, self.tools.names, self.native, reminder=self.constraint is None)
        if not self.own_system:
            content += "\nTool list:\n" + self.tools.describe()
        yield from self._compact()
        per_task = self.fresh_tasks and hasattr(self.engine, "cache")  # examples ordered for each task (rewound)
        if self.fresh_tasks:
            self.checkpoint.restore(self.engine)
        if not self.primed:
            self.primed = not per_task
            for role, text in examples_for(task) if per_task else FEW_SHOT:
                yield from self.engine.add_message(role, text, add_generation_prompt=False)
            self._examples_held = len(FEW_SHOT)  # not counted against keep_messages until compacted away
        yield from self.engine.add_message("user", content)
        step, reason, answer = 0, "max_steps", ""
        while not max_steps or step < max_steps:
            step += 1
            self.counts.steps += 1
            yield StepEvent(step, task)
            text, why, ntok = yield from self._generate(first=step == 1)
            yield ModelTextEvent(step, text, why, ntok)
            parsed = parse_reply(text)
            if parsed.kind == "none" and self.native:
                parsed = Parsed("final", answer=text.strip())
            if parsed.kind == "final":
                self.counts.finals += 1
                reason, answer = "final", parsed.answer
                break
            result = yield from self._act(step, parsed)
            role, content = result_message(result.name, result.text, result.ok, self.native,
                                           reminder=self.constraint is None)
            yield ToolResultEvent(step, result.name, result.ok, result.text, result.chars, result.truncated,
                                  result.seconds)
            last = bool(max_steps) and step >= max_steps  # type: ignore[operator]
            yield from self._compact()
            yield from self.engine.add_message(role, content, add_generation_prompt=not last)
        yield TaskDoneEvent(task, step, reason, answer)

    def _compact(self) -> Iterator[Event]:
        """Keep `engine.conv` bounded in a run of hours: it re-renders every message for each new one (quadratic)
        and its `fed` text grows without end, though the cache forgot those turns long ago. Feed the closing of the
        last turn, then restart the bookkeeping from the system prompt alone; the next delta is unchanged. Called
        only between turns (after a reply, before the next message), where the rendered history extends `fed`."""
        conv = self.engine.conv
        limit = self.keep_messages + self._examples_held
        if not self.keep_messages or len(conv.messages) <= limit or conv.system is None:
            return  # without a system message an empty render may not be a prefix (templates add a default one)
        try:
            closing = conv.closing()
            base = conv._render([], False)
            probe = conv._render([{"role": "user", "content": "x"}], True)
        except Exception:  # noqa: BLE001 - a template that cannot render this: keep the history as it is
            log.debug("cannot compact the conversation", exc_info=True)
            return
        if closing is None or not probe.startswith(base):
            return
        if closing:
            yield from self.engine.feed(closing)
        conv.messages.clear()
        conv.fed = base
        self._examples_held = 0

    def _generate(self, first: bool = False) -> Iterator[Event]:
        """Stream one reply; stop as soon as it holds a complete call (a small model rambles on and invents the
        result). The reply is recorded in the conversation even when the caller closes us mid-way."""
        eng = self.engine
        if self.constraint is not None:
            self.constraint.begin(require_call=first and self.require_call)
            gen = eng.generate(self.max_tokens, stop=self.stop, sampling=self._sampling(),
                               logits_processors=[self.constraint])
        else:
            gen = eng.generate(self.max_tokens, stop=self.stop)
        text, why, n, t0 = "", "length", 0, time.perf_counter()
        try:
            for ev in gen:
                yield ev
                if isinstance(ev, DoneEvent):
                    return ev.text, ev.reason, ev.tokens
                if isinstance(ev, TokenEvent):
                    text += ev.text
                    n += 1
                    if "}" in ev.text and "<tool_call>" not in text and complete_call(text):
                        why = "call"
                        break
        finally:
            gen.close()
            eng.conv.add_reply(eng.reply_text())
        yield DoneEvent("stop", n, time.perf_counter() - t0, text, tuple(eng.last_reply_ids))
        return text, why, n

    def _sampling(self) -> Any:
        """The engine's settings without the repetition penalty: an agent's job is to copy names and numbers out of
        the task and the tool results, which the penalty (1.1 by default, over the last 64 ids) pushes it away from.
        Measured on the bundled model: "How many lines are in poem.txt?" -> file_stats "4 lines" -> answer "3"."""
        from dataclasses import replace

        cfg = getattr(self.engine, "sampling", None)
        return replace(cfg, repetition_penalty=1.0) if cfg is not None and self.plain_sampling else cfg

    def _act(self, step: int, parsed: Parsed) -> Iterator[AgentEvent]:
        """Validate, approve and run one parsed reply; anything unusable becomes a failed result."""
        if parsed.kind != "call":
            self.counts.unusable += 1
            msg = parsed.error or "your reply has no tool call"
            yield AgentErrorEvent(step, msg)
            return self._failed("", msg)
        yield ToolCallEvent(step, parsed.name, parsed.args if isinstance(parsed.args, dict) else {"value": parsed.args})
        try:
            tool, kwargs = self.tools.validate(parsed.name, parsed.args)
        except ToolError as e:
            self.counts.calls_failed += 1
            yield AgentErrorEvent(step, str(e))
            return self._failed(parsed.name if parsed.name in self.tools else "", str(e))
        if tool.has_side_effects(kwargs) and not self.native and is_example_call(tool.name, kwargs):
            self.counts.calls_failed += 1
            yield AgentErrorEvent(step, f"{tool.name} copied the example")
            return self._failed(tool.name, "that call is the example's, not your task; do the task you were given")
        if self.approve is not None and tool.has_side_effects(kwargs) and not self.approve(tool.name, kwargs):
            self.counts.calls_failed += 1
            yield AgentErrorEvent(step, f"{tool.name} denied")
            return self._failed(tool.name, f"the user denied this {tool.name} call; try something else")
        result = self.tools.run(tool, kwargs)
        if result.ok:
            self.counts.calls_ok += 1
        else:
            self.counts.calls_failed += 1
        return result

    def _failed(self, name: str, msg: str) -> ToolResult:
        text, truncated = cap_text(msg, self.tools.max_result_chars)
        return ToolResult(name, {}, False, text, len(msg), truncated, 0.0)


# ------------------------------------------------------------------------------------------------------ display
def make_approver(mode: str, interactive: bool) -> Approve | None:
    if mode == "auto":
        return None
    if mode == "never-shell":
        return lambda name, args: name != "shell"

    def ask(name: str, args: dict[str, Any]) -> bool:
        if not interactive:
            log.warning("--approve ask without a terminal: denied %s (use --approve auto)", name)
            return False
        return click.confirm(f"allow {name} {_abridge(repr(args), 300)}?", default=False, err=True)

    return ask


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
@click.option("--tools-module", multiple=True, type=click.Path(dir_okay=False), help="extra tools: a .py file (repeatable)")
@click.option("--max-result-chars", type=click.IntRange(100, None), default=1500, show_default=True,
              help="cap on each tool result fed to the model")
@click.option("--no-log", is_flag=True, help="do not write the SQLite session log")
@click.option("--no-constrain", is_flag=True,
              help="let the model write anything (default: every reply is forced to be a valid tool call or answer)")
@click.option("--keep-context", is_flag=True,
              help="each task sees the earlier tasks' turns (default: each starts from the system prompt and examples)")
@common_options
def agent_command(task: str | None, workspace: str | None, create_workspace: bool, max_steps: int, forever: bool,
                  tasks_file: str | None, approve: str | None, allow_shell: bool, tools_module: tuple[str, ...],
                  max_result_chars: int, no_log: bool, no_constrain: bool, keep_context: bool, **kw: Any) -> None:
    """Run a tool-using agent on TASK (no TASK: type tasks at a prompt, or pipe one task per line)."""
    from sinkchat.core.metrics import Metrics, human_bytes, model_bytes, rss_bytes

    opts = pop_common(kw)
    setup_logging(opts["verbose"] or 0)
    interactive = sys.stdin.isatty()
    with user_errors():
        settings = build_settings(opts)
        if task is None and tasks_file is None and not interactive:
            tasks_file = "-"
        extra = load_extra_tools(tools_module)
        ws = open_workspace(workspace, create_workspace)
        try:
            tools = build_default_tools(ws, allow_shell, max_result_chars, extra)
        except ValueError as e:
            raise ConfigError(f"bad tool: {e}") from None
        engine = open_engine(settings, system=None, progress=lambda m: click.echo(m, err=True))
        agent = Agent(engine, tools, ws, make_approver(approve or ("ask" if interactive else "never-shell"), interactive),
                      constrain=not no_constrain, fresh_tasks=not keep_context)
        metrics = Metrics()
        mbytes = model_bytes(engine.model)
        slog = open_log(engine, "agent", no_log, None, lambda m: click.echo(f"warning: {m}", err=True),
                        extra={"workspace": str(ws.root), "tools": tools.names})
        display = Display(engine, metrics, sys.stdout.isatty(), mbytes, AgentLog(slog, engine))
        click.echo(f"workspace: {ws.root}  tools: {', '.join(tools.names)}", err=True)
        rss0 = rss_bytes()
        try:
            if task is None and tasks_file is None:
                _interactive(agent, display, max_steps)
            else:
                for t in task_source(task, tasks_file, forever):
                    for ev in agent.run(t, max_steps or None):
                        display(ev)
        except KeyboardInterrupt:
            display.line("interrupted", "red")
        finally:
            slog.close()
        c = agent.counts
        click.echo(f"agent: {c.tasks} task(s), {c.steps} step(s), tool calls ok {c.calls_ok} / failed {c.calls_failed}, "
                   f"unusable replies {c.unusable}, final answers {c.finals}; evictions {metrics.eviction_count} "
                   f"({metrics.evicted} tokens); rss {human_bytes(rss0)} → {human_bytes(rss_bytes())}"
                   + _constraint_note(agent.constraint), err=True)


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
