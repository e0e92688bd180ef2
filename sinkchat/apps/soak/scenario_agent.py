"""The agent scenario of `sinkchat soak`: the agent loop with the built-in tools on generated tasks, each judged."""

from __future__ import annotations

import logging
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import click

from sinkchat.apps.soak.checkpoint import rng_state, set_rng_state
from sinkchat.apps.soak.steps import CHAT_MAX_TOKENS, Fault, Outcome, ToolCall, finite, recover
from sinkchat.core.events import TokenEvent
from sinkchat.store.sessionlog import NullLog
from sinkchat.textutil import plural

log = logging.getLogger(__name__)

WORDS = ("apple", "harbor", "violet", "copper", "meadow", "falcon", "pepper", "glacier")


@dataclass(frozen=True)
class AgentTask:
    """One generated task and how to tell it was done right: `kind` picks the check (see AgentScenario.judge)."""

    kind: str
    text: str
    file: str = ""  # the file the task writes or reads (workspace-relative)
    word: str = ""
    number: int | None = None  # the result a calculation must report


def _mentions_number(answer: str, n: int) -> bool:
    import re

    return str(n) in re.findall(r"-?\d+", answer.replace(",", ""))


def no_final_reason(done: Any) -> str:
    """Why a task ended without a final answer, from its TaskDoneEvent (None: the loop yielded none)."""
    if done is None:
        return "the agent loop ended without a TaskDoneEvent"
    if done.reason == "max_steps":
        return f"max steps: {done.steps}"
    return f"{done.reason.replace('_', ' ')} after {plural(done.steps, 'step')}"


class AgentScenario:
    """The agent loop with the built-in tools on generated tasks, each checked after it ran: a file the task asked
    for must exist with the asked-for word in it, a note must have been appended, a calculation's answer must hold
    the right number, a file read back must be quoted, the clock must be read, a listing must name a file that is
    there. File names come from a small fixed set, and whatever else the model wrote is removed before each task, so
    the workspace stays bounded however long the soak runs (a file a task is to write is removed first too, so an
    old copy cannot pass for new work). Kept, the model's strays grew without end: 48 files after 30 minutes of a
    2h15 soak ("plan.txt.txt.txt.txt}}"), each listing of them some 200 tokens, and every name one more path the
    grammar offers. The model's malformed calls and failed tools are faults the agent feeds back (counted, expected
    from a small model); only an exception out of the loop is an error. Every step that did not end the task yields
    a `ToolCall` (the valid-call share)."""

    name = "agent"
    unit = "tasks done right"
    calls_tools = True  # the runner records tool_calls_ok / tool_calls_failed in every sample
    recall_window_after = False  # --memory on: each task sets the last one aside, a plant with it (recall.py)
    recover = staticmethod(recover)
    slog: Any = NullLog()

    def __init__(self, engine: Any, workspace: Path, allow_shell: bool = False, max_tokens: int | None = None,
                 seed: int = 0, max_steps: int = 4) -> None:
        from sinkchat.apps.agent.agent import Agent
        from sinkchat.apps.agent.tools import build_default_tools

        try:
            workspace.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise click.ClickException(f"cannot create the agent workspace {workspace}: {e.strerror}") from None
        tools = build_default_tools(workspace, allow_shell)
        self.workspace = workspace
        self.agent = Agent(engine, tools, workspace, approve=None, max_tokens=max_tokens or CHAT_MAX_TOKENS)
        self.rng, self.max_steps = random.Random(seed), max_steps
        self._log: Any = None

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (checkpoint.py; the workspace is copied beside it): the task sequence and where
        the agent's tasks start. The logits at the task checkpoint are not kept: every task feeds its messages right
        after rewinding, which replaces them."""
        a, cp = self.agent, self.agent.checkpoint
        point = None if cp.state is None else {"length": cp.state[0], "anchor": cp.state[1],
                                               "messages": cp.state[2], "fed": cp.state[3]}
        return {"rng": rng_state(self.rng), "primed": a.primed, "examples_held": a._examples_held,
                "counts": asdict(a.counts), "checkpoint": point, "taken": cp.taken}

    def load_state(self, d: dict[str, Any]) -> None:
        from sinkchat.apps.agent.agent import AgentCounts

        a, cp, point = self.agent, self.agent.checkpoint, d["checkpoint"]
        set_rng_state(self.rng, d["rng"])
        a.primed, a._examples_held, a.counts = bool(d["primed"]), int(d["examples_held"]), AgentCounts(**d["counts"])
        cp.state = None if point is None else (int(point["length"]), point["anchor"],
                                               [dict(m) for m in point["messages"]], str(point["fed"]), None)
        cp.taken = int(d["taken"])

    def next_task(self) -> AgentTask:
        r = self.rng
        a, b, w, f = r.randint(2, 99), r.randint(2, 99), r.choice(WORDS), f"file{r.randint(1, 4)}.txt"
        kind = r.choice(("mul", "write", "list", "clock", "search", "note", "read", "calc"))
        text = {
            "mul": f"What is {a} times {b}? Use the calculator tool.",
            "write": f"Write the word '{w}' into the file {f}, then read the file back.",
            "list": "List the files in the workspace.",
            "clock": "What time is it? Use the clock tool.",
            "search": f"Search the workspace files for the text '{w}'.",
            "note": f"Save a note that says '{w}', then tell me what you saved.",
            "read": f"Read the file {f} and tell me what it says.",
            "calc": f"Compute ({a} + {b}) * 2 with the calculator.",
        }[kind]
        number = a * b if kind == "mul" else (a + b) * 2 if kind == "calc" else None
        return AgentTask(kind, text, f, w, number)

    def _read(self, name: str) -> str | None:
        try:
            return (self.workspace / name).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None

    def prepare(self, task: AgentTask) -> dict[str, Any]:
        """Before the task: remove what the model wrote outside the soak's own files, and the file a write task must
        create; remember what a check compares against."""
        self._tidy()
        if task.kind == "write":
            try:
                (self.workspace / task.file).unlink()
            except OSError:
                pass
        from sinkchat.apps.agent.tools.notes import NOTES_FILE

        return {"notes": self._read(NOTES_FILE) or "", "file": self._read(task.file),
                "files": sorted(p.name for p in self.workspace.iterdir() if p.is_file())}

    def _tidy(self) -> None:
        """Remove every workspace entry that is not one of the soak's files (file1.txt .. file4.txt, the notes)."""
        import shutil

        from sinkchat.apps.agent.tools.notes import NOTES_FILE

        keep = {NOTES_FILE, *(f"file{i}.txt" for i in range(1, 5))}
        for p in self.workspace.iterdir():
            if p.name in keep and p.is_file() and not p.is_symlink():
                continue
            try:
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
            except OSError as e:
                log.warning("cannot remove %s from the agent workspace: %s", p, e)

    def judge(self, task: AgentTask, done: Any, before: dict[str, Any]) -> Outcome:
        """Was `task` done right? `done`: its TaskDoneEvent (None when the loop ended without one). A task that
        wants an answer and got none says why ("no final answer (max steps: 4)"), not `answer ''`."""
        from sinkchat.apps.agent.tools.notes import NOTES_FILE

        answer = (done.answer if done is not None else "") or ""
        final = done is not None and done.reason == "final"
        said = f"answer {answer[:60]!r}" if final else f"no final answer ({no_final_reason(done)})"
        if task.kind == "write":
            body = self._read(task.file)
            if body is None:
                return Outcome(False, f"{task.file} was not written")
            ok = task.word in body.lower()
            return Outcome(ok, f"{task.file} holds {body[:40]!r}" + ("" if ok else f", not {task.word!r}"))
        if task.kind == "note":
            notes = self._read(NOTES_FILE) or ""
            added = notes[len(before["notes"]):] if notes.startswith(before["notes"]) else notes
            return Outcome(task.word in added.lower(), f"note {'saved' if task.word in added.lower() else 'missing'}")
        if task.kind in ("mul", "calc"):
            ok = final and task.number is not None and _mentions_number(answer, task.number)
            return Outcome(ok, f"{said}, expected {task.number}")
        if task.kind == "read":
            body = before["file"]
            want = " ".join(body.split())[:40].lower() if body and body.strip() else ""
            ok = final and (want in " ".join(answer.split()).lower() if want else bool(answer.strip()))
            return Outcome(ok, said + (f", file holds {want!r}" if want else ", no such file"))
        if task.kind == "list":
            names = before["files"]
            ok = final and (any(n in answer for n in names) if names else bool(answer.strip()))
            return Outcome(ok, said)
        if task.kind == "clock":
            return Outcome(final and any(ch.isdigit() for ch in answer), said)
        return Outcome(final and bool(answer.strip()), said)  # search: any final answer

    def step(self, engine: Any) -> Iterator[Any]:
        from sinkchat.apps.agent.log import AgentLog
        from sinkchat.apps.agent.protocol import AgentErrorEvent, TaskDoneEvent, ToolResultEvent

        if self._log is None or self._log.slog is not self.slog:
            self._log = AgentLog(self.slog, engine)
        task = self.next_task()
        before = self.prepare(task)
        reported = -1  # the step whose failure an AgentErrorEvent already reported
        done = None
        for ev in self.agent.run(task.text, self.max_steps):
            self._log(ev)
            if isinstance(ev, TaskDoneEvent):
                done = ev
            if isinstance(ev, AgentErrorEvent):
                reported = ev.step
                yield Fault("agent_error", ev.message[:300])
            elif isinstance(ev, ToolResultEvent):
                yield ToolCall(ev.name, ev.ok, valid=ev.step != reported)
                if not ev.ok and ev.step != reported:
                    yield Fault("tool_failed", f"{ev.name}: {ev.text[:300]}")
            elif isinstance(ev, TokenEvent) and engine.last_logits is not None and not finite(engine.last_logits):
                yield ev
                yield Fault("nonfinite_logits", "a generated token had NaN/inf logits", error=True)
            else:
                yield ev
        out = self.judge(task, done, before)
        yield Outcome(out.ok, f"{task.kind}: {out.detail}")
