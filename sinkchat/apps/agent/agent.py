"""The agent: a tool-using loop that runs unbounded on the Engine's one persistent cache.

Thoughts, tool calls and tool results all go through `engine.add_message` / `engine.generate`: nothing is ever
re-encoded, memory stays flat, and when the cache is full the oldest steps leave it with visible EvictionEvents. The
library API is `Agent(engine, tools, ...).run(task, max_steps)`, an iterator of agent events (agent_protocol) with the
engine's own events passed through, so a soak test or a UI folds one stream. The model is untrusted: whatever it
writes ends as a tool result or an error text fed back to it, never as an exception out of the loop.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from sinkchat.apps.agent.checkpoint import TaskCheckpoint
from sinkchat.apps.agent.constrain import ToolCallConstraint, build_constraint
from sinkchat.apps.agent.protocol import (
    AgentErrorEvent, AgentEvent, Denied, FinalRejectedEvent, ModelTextEvent, Parsed, StepEvent, TaskDoneEvent,
    ToolCallEvent, ToolResultEvent, ToolsTokenizer, complete_call, examples_for, is_example_call, parse_reply,
    render_system, result_message, task_message, template_has_tools,
)
from sinkchat.apps.agent.verify import MAX_REJECTED_FINALS, TaskCheck
from sinkchat.bootstrap import read_prompt
from sinkchat.core.events import DoneEvent, Event, TokenEvent
from sinkchat.apps.agent.tools.schema import ToolError
from sinkchat.apps.agent.tools.toolbox import ToolResult, Toolbox, build_default_tools, cap_text
from sinkchat.apps.agent.tools.workspace import Workspace

__all__ = ["Agent", "AgentCounts", "AgentEvent", "Denied", "build_default_tools", "Workspace", "Toolbox"]

log = logging.getLogger(__name__)

NATIVE_SYSTEM = ("You are an agent that completes tasks by calling the tools you are given, one call at a time. "
                 "Files live in a workspace folder; use relative paths. When the task is done, answer in plain text.")
Approve = Callable[[str, dict[str, Any]], "bool | Denied"]


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
    """The loop. `tools`: a Toolbox (see build_default_tools); `workspace`: a Workspace or the path of an existing folder
    (shown to the model; a missing one is a WorkspaceError); `approve(name, args) -> bool | Denied` is asked before each
    side-effecting call (None = allow all; a Denied says who refused and why, fed to the model as is, and one that is
    `always` takes the tool out of the grammar); protocol: 'auto' | 'native' | 'json'; `max_tokens` per reply (None =
    the engine's sampling.max_tokens); `keep_messages`: past this many, engine.conv's bookkeeping is compacted (0 =
    never). Takes over the engine's system prompt if nothing was fed yet, and then (JSON protocol, few_shot) feeds one
    demonstrated exchange before the first task. `constrain`: mask every token that would leave the tool-call grammar
    (see constrain.py; off where the engine or tokenizer cannot take it). `fresh_tasks`: each task starts from the cache
    as it was after the system prompt (fed alone before the first task), so a task never sees, and copies, the
    previous one's reply; the checkpoint is taken again where the cache stands once its own slots were evicted.
    `require_call`: with the constraint, a task's first reply must be a tool call, not an answer."""

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
        self.denied: set[str] = set()  # tools an approver refuses every time (taken out of the grammar)
        self._examples_held = 0  # example turns at the head of engine.conv.messages

    def run(self, task: str, max_steps: int | None = 10) -> Iterator[AgentEvent | Event]:
        """Work on `task` until the model gives a final answer or `max_steps` steps (None/0 = no limit).
        Every step's tool result (or error) is fed back before the next step; the last one is fed without an
        assistant header, so the next task continues the same conversation cleanly. A final answer that is not
        grounded in the task's tool results, or leaves a file the task asks for missing or wrong, is sent back with
        what is wrong (up to MAX_REJECTED_FINALS times, not on the last step); the TaskDoneEvent says whether the
        task ended verified (agent/verify.py)."""
        self.counts.tasks += 1
        content = task_message(task, self.tools.names, self.native, reminder=self.constraint is None)
        if not self.own_system:
            content += "\nTool list:\n" + self.tools.describe()
        yield from self._compact()
        per_task = self.fresh_tasks and hasattr(self.engine, "cache")  # examples ordered for each task (rewound)
        if self.fresh_tasks:
            if self.own_system and hasattr(self.engine, "feed_system"):  # the checkpoint after the system prompt
                yield from self.engine.feed_system()
            self.checkpoint.restore(self.engine)
            yield from self.checkpoint.events  # the earlier task set aside into the recall memory
        if not self.primed:
            self.primed = not per_task
            scaffold = per_task and hasattr(self.engine, "not_kept")  # fed again each task: the memory keeps no copy
            with self.engine.not_kept() if scaffold else nullcontext():
                turns = examples_for(task if per_task else None, self.tools.names)
                for role, text in turns:
                    yield from self.engine.add_message(role, text, add_generation_prompt=False)
            self._examples_held = len(turns)  # not counted against keep_messages until compacted away
        check = TaskCheck(task, self.workspace, tuple(self.tools.tools))
        self._offer(check)
        yield from self.engine.add_message("user", content)
        step, reason, answer, problems = 0, "max_steps", "", ["no final answer"]
        while not max_steps or step < max_steps:
            step += 1
            self.counts.steps += 1
            last = bool(max_steps) and step >= max_steps  # type: ignore[operator]
            yield StepEvent(step, task)
            text, why, ntok = yield from self._generate(first=step == 1 or bool(check.unmet()))
            yield ModelTextEvent(step, text, why, ntok)
            parsed = parse_reply(text)
            if parsed.kind == "none" and self.native:
                parsed = Parsed("final", answer=text.strip())
            if parsed.kind == "final":
                self.counts.finals += 1
                problems = check.problems(parsed.answer)
                if not problems or last or check.rejected >= MAX_REJECTED_FINALS:
                    reason, answer = "final", parsed.answer
                    break
                check.rejected += 1
                yield FinalRejectedEvent(step, parsed.answer, tuple(problems))
                role, content = self._rejection(problems)
                problems = ["no final answer"]
            else:
                result = yield from self._act(step, parsed, check)
                check.observe(self.tools.tools.get(result.name), result.args, result.ok, result.text)
                role, content = result_message(result.name, result.text, result.ok, self.native,
                                               reminder=self.constraint is None)
                yield ToolResultEvent(step, result.name, result.ok, result.text, result.chars, result.truncated,
                                      result.seconds)
            self._offer(check)
            yield from self._compact()
            yield from self.engine.add_message(role, content, add_generation_prompt=not last)
        if reason != "final":
            problems += check.unmet()
        problems += check.blocked
        yield TaskDoneEvent(task, step, reason, answer, not problems, "; ".join(problems))

    def _offer(self, check: TaskCheck) -> None:
        """Tell the grammar what this task allows now: its target files, the numbers its results held."""
        if self.constraint is not None:
            self.constraint.set_task(check.context())

    def _rejection(self, problems: list[str]) -> tuple[str, str]:
        """(role, content) telling the model why its final answer was sent back."""
        msg = "not done yet: " + "; ".join(problems)
        if self.native:
            return "user", msg
        return "user", f"Tool error (final): {msg}"

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
        except Exception:  # noqa: BLE001 - a template that cannot render this: keep the history as it is
            log.debug("cannot compact the conversation", exc_info=True)
            return
        base = conv.system_prefix()  # what every rendering starts with, or ""
        if closing is None or not base:
            return
        if closing:
            yield from self.engine.feed(closing)
        conv.messages.clear()
        conv.fed = base
        self._examples_held = 0

    def _generate(self, first: bool = False) -> Iterator[Event]:
        """Stream one reply; stop as soon as it holds a complete call (a small model rambles on and invents the
        result). `first`: a call is required (a task's first reply, and every reply while a file the task asks for
        is missing or wrong: the bundled model otherwise answered `{"final": ...}` over and over, nothing written).
        Constrained, the reply's token limit goes to the constraint, which closes the call within it (and
        may raise it to fit the grammar's longest call: see ToolCallConstraint.begin). The reply is recorded in the conversation even when the caller closes us mid-way."""
        eng = self.engine
        if self.constraint is not None:
            limit = self.max_tokens or getattr(getattr(eng, "sampling", None), "max_tokens", None)
            self.constraint.begin(require_call=first and self.require_call, budget=limit)
            stop = self.stop if self.native else ()  # the grammar ends the reply; "\nTool result" in a string is text
            gen = eng.generate(self.constraint.budget or self.max_tokens, stop=stop, sampling=self._sampling(),
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

    def _act(self, step: int, parsed: Parsed, check: TaskCheck | None = None) -> Iterator[AgentEvent]:
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
        refusal = check.refuse_overwrite(tool, kwargs) if check is not None else None
        if refusal:
            self.counts.calls_failed += 1
            yield AgentErrorEvent(step, f"{tool.name}: {refusal}")
            return self._failed(tool.name, refusal)
        verdict = self.approve(tool.name, kwargs) if self.approve and tool.has_side_effects(kwargs) else True
        if not verdict:
            self.counts.calls_failed += 1
            denied = verdict if isinstance(verdict, Denied) else Denied(f"the user denied this {tool.name} call")
            yield AgentErrorEvent(step, f"{tool.name} denied: {denied.reason}")
            if denied.always:
                self._deny(tool.name)
                return self._failed(tool.name, f"{denied.reason}. {tool.name} is refused every time in this run: "
                                               "do not call it again")
            return self._failed(tool.name, f"{denied.reason}; try something else")
        result = self.tools.run(tool, kwargs)
        if result.ok:
            self.counts.calls_ok += 1
        else:
            self.counts.calls_failed += 1
        return result

    def _deny(self, name: str) -> None:
        """`name` is refused every time: the grammar stops offering it."""
        self.denied.add(name)
        if self.constraint is not None:
            self.constraint.set_tools([t for t in self.tools.tools.values() if t.name not in self.denied])

    def _failed(self, name: str, msg: str) -> ToolResult:
        text, truncated = cap_text(msg, self.tools.max_result_chars)
        return ToolResult(name, {}, False, text, len(msg), truncated, 0.0)


# ------------------------------------------------------------------------------------------------------ display
