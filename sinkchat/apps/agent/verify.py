"""Is a task done? A final answer must be grounded in what the task's tools returned, and every file the task asks
to be written must hold what it asks for (goals.py). Checked by code after each final answer; what is wrong is fed
back to the model, which goes on (within the step limit); a task that ends with something still wrong ends
unverified, and `sinkchat agent` exits with EXIT_UNVERIFIED.

Grounded (issue 28: a port lookup read `"port": 8443` from the tool and answered `18`; "Compute the total ... and
write that number to total.txt" answered `860` having written nothing):

- numbers: every number in the answer is one the task's text or its data results held. Data results are the ok
  results of calls that return data (`Tool.returns_data`: calls without side effects, and the shell): a write's
  "wrote 3 bytes" is not data. Under the grammar the answer cannot even spell another number (grammar.final_schema);
  this check is what covers `--no-constrain` and native templates' plain text.
- names: every name-like word of the answer (a word with inner `.`, `_`, `-`, `/`, `@` or `:` such as a file name,
  a host or a code; an all-caps word; a capitalized word not starting a sentence) occurs, ignoring case, in the
  task text or a data result.

An answer, where the answer is the task's result (it names no file to write): a task that asks for something (a
question, or count / find / list / show / tell ...) is not answered by an acknowledgment ("done", "ok", "task
complete": grounded, since it holds no number or name, so it passed until a user audit ran "Count the lines of
notes.txt", read `4` from the tool and ended `answer: done`, verified, exit 0); one that asks for a count or a total
("how many", "count", "total", "sum", "average", "number of") is not answered without a number.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from sinkchat.apps.agent.asks import asks_count, asks_something, is_acknowledgment, negative_count
from sinkchat.apps.agent.goals import WriteGoal, check_goal, write_goals
from sinkchat.apps.agent.grammar import STRING_CHARS, TargetFile, TaskContext
from sinkchat.apps.agent.patterns import grounded_pattern, numbers_in
from sinkchat.apps.agent.tools.schema import Tool, ToolError
from sinkchat.apps.agent.tools.workspace import Workspace

EXIT_UNVERIFIED = 3  # `sinkchat agent`: a task ended without a verified answer (like soak's FAIL: ran, not done)
MAX_REJECTED_FINALS = 3  # final answers sent back per task before it ends unverified (with no step limit too)
MAX_OFFERED = 32  # numbers or copied lines offered as a file's content
PIECE_CHARS = 200  # longest copied line offered (a long one would raise every reply's closing reserve)
WORD = re.compile(r"[A-Za-z_][\w.\-/@:]*[\w]|[A-Za-z]")
NAME_INNER = re.compile(r"\w[._\-/@:]\w")
PLAIN = {"i", "ok", "yes", "no", "none", "true", "false", "done", "n/a"}  # capitalized, yet no names


@dataclass
class Grounding:
    """What a task's data results said: their numbers (in order) and their text."""

    task: str
    results: list[str] = field(default_factory=list)
    values: list[str] = field(default_factory=list)
    paths: list[frozenset[str]] = field(default_factory=list)  # per result: the strings its call was given
    whole: list[bool] = field(default_factory=list)  # per result: its call used no numeric option (no offset)

    def __post_init__(self) -> None:
        # the task's own numbers are grounded too: "Write 42 to answer.txt" and "17 + 25 = 42" (for "What is
        # 17 + 25?") must be writable and sayable, though no tool returned 42's operands
        self.values += [v for v in dict.fromkeys(numbers_in(self.task)) if v not in self.values]

    def add(self, text: str, args: dict[str, Any] | None = None, whole: bool = True) -> None:
        self.results.append(text)
        self.paths.append(frozenset(os.path.normpath(v) for v in (args or {}).values() if isinstance(v, str) and v))
        self.whole.append(whole)
        self.values += [v for v in numbers_in(text) if v not in self.values]

    def returned(self) -> list[str]:
        """The numbers the data results held (the task's own numbers left out: "How many of the first 10 lines
        ..." is not answered by echoing 10)."""
        return list(dict.fromkeys(v for r in self.results for v in numbers_in(r)))

    def pieces(self, source: str = "", which: str = "", max_chars: int | None = None) -> list[str]:
        """What a copy may be: the data results of calls given `source` (any, if ""), each whole and each of its
        lines, or only its `which` ("first", "last") line; stripped, at most `max_chars` long (to offer: the
        newest MAX_OFFERED of them)."""
        out: list[str] = []
        for r, given, whole in zip(self.results, self.paths, self.whole):
            if source and (os.path.normpath(source) not in given or not whole):
                continue  # another file, or a part of it (measured: `read_file notes.txt offset 1`, "eeting at noon")
            lines = [ln.strip() for ln in r.splitlines() if ln.strip()]
            for piece in (lines[:1] if which == "first" else lines[-1:] if which == "last" else [r.strip(), *lines]):
                if piece and (max_chars is None or len(piece) <= max_chars) and piece not in out:
                    out.append(piece)
        return out if max_chars is None else out[-MAX_OFFERED:]

    def ungrounded(self, text: str) -> list[str]:
        """The numbers and names of `text` that neither a data result (numbers) nor the task (names) holds."""
        known = {_num(v) for v in self.values}
        bad = [n for n in numbers_in(text) if _num(n) not in known]
        hay = (self.task + "\n" + "\n".join(self.results)).lower()
        for m in WORD.finditer(text):
            w = m.group(0)
            start = not text[: m.start()].strip() or text[: m.start()].rstrip()[-1] in ".!?:;\n"
            name = (NAME_INNER.search(w) or (w.isupper() and len(w) > 1)
                    or (w[0].isupper() and not start))
            if name and w.lower() not in PLAIN and w.lower() not in hay and w not in bad:
                bad.append(w)
        return bad


def _num(v: str) -> float | str:
    try:
        return float(v)
    except ValueError:
        return v


# what a task asks that no built-in tool does ("Delete notes.txt" ended verified, exit 0, with notes.txt still there)
UNSUPPORTED = re.compile(r"^\s*(?:please\s+|now\s+|then\s+)?(delete|remove|erase|move|rename|download|upload|email|"
                         r"send|run|execute|install)\b", re.I)
NAMED_PATH = re.compile(r"(?<![\w.~/])(?:/|~/|\.\./)[\w.\-]+(?:/[\w.\-]+)*")  # "/etc/passwd", "~/a", "../b"


def unsupported_action(task: str) -> list[str]:
    """The verb of a task that asks what no built-in tool does (its first word, past "please")."""
    m = UNSUPPORTED.match(task)
    return [m.group(1).lower()] if m else []


def named_paths(task: str) -> list[str]:
    """Absolute, home or parent paths a task names: "Read /etc/passwd and tell me the first line"."""
    return [m.group(0).rstrip(".") for m in NAMED_PATH.finditer(task)]


class TaskCheck:
    """One task's goals and grounding, fed each call's result (`observe`) and asked after a final answer."""

    def __init__(self, task: str, workspace: Workspace | None, tools: Collection[str] = ()) -> None:
        self.workspace = workspace
        self.grounding = Grounding(task)
        self.goals: list[WriteGoal] = []
        self.blocked: list[str] = []  # goals that can never be met (outside the workspace, "new" but there)
        self.rejected = 0
        self.calls_ok = self.calls_failed = 0  # this task's tool calls that ran ok / failed or were refused
        if tools and "shell" not in tools:  # `tools`: the toolbox's names (empty: not known, nothing judged)
            self.blocked += [f"no tool can {verb} files (--allow-shell gives the model a shell)"
                             for verb in unsupported_action(task)]
        if workspace is None:
            return
        self.blocked += [f"{p} is outside the workspace: no tool can read or write it" for p in named_paths(task)
                         if self._real(p) is None and not any(b.startswith(f"{p} ") for b in self.blocked)]
        for g in write_goals(task, lambda p: bool(self._real(p) and self._real(p).exists())):
            real = self._real(g.path)
            if real is None:
                self.blocked.append(f"{g.path} is outside the workspace: it cannot be written")
            elif g.new and real.exists():
                self.blocked.append(f"{g.path} already exists, and the task asks for a new file")
            else:
                self.goals.append(g)

    def _real(self, path: str) -> Any:
        try:
            return self.workspace.resolve(path, kind="any", must_exist=False) if self.workspace else None
        except ToolError:
            return None

    def observe(self, tool: Tool | None, kwargs: dict[str, Any], ok: bool, text: str) -> None:
        ran = tool is not None and ok
        self.calls_ok += ran
        self.calls_failed += not ran
        if tool is not None and ok and tool.returns_data(kwargs):
            whole = all(kwargs.get(p.name, p.default) == p.default for p in tool.params
                        if p.type in (int, float) and not p.required)
            self.grounding.add(text, kwargs, whole)

    def context(self) -> TaskContext:
        """The grammar's view of this task: its target files with what may be written to them, and the numbers a
        final answer may hold."""
        # a "new" target that was missing when the task began is this task's own file: it may be rewritten
        targets = tuple(TargetFile(g.path, self._content(g), g.append) for g in self.goals)
        count = not (self.goals or self.blocked) and asks_count(self.grounding.task)
        return TaskContext(targets, tuple(self.grounding.values),
                           answer_numbers=tuple(self.grounding.returned()) if count else None)

    def _content(self, g: WriteGoal) -> str | None:
        """The JSON schema (as JSON) of what the task asks to be written to `g`, or None while nothing the task
        returned can be offered (a number before any tool gave one, a copy before anything was read)."""
        if g.kind == "exact":
            s: dict[str, Any] = {"const": g.content}
        elif g.kind == "number":
            if not self.grounding.values:
                return None
            s = {"enum": self.grounding.values[-MAX_OFFERED:]}
        elif g.kind == "copy":
            lines = self.grounding.pieces(g.source, g.which, PIECE_CHARS)
            if not lines:
                return None
            s = {"enum": lines}
        else:
            s = {"type": "string", "minLength": 1, "maxLength": STRING_CHARS,
                 "pattern": f"^(?:{grounded_pattern(self.grounding.values)})$"}
        return json.dumps(s, sort_keys=True)

    def refuse_overwrite(self, tool: Tool, kwargs: dict[str, Any]) -> str | None:
        """Why this call may not overwrite or append (an `overwrites` argument true for an existing file the task
        does not name as the one to write), or None."""
        for p in tool.params:
            if p.arg.overwrites and kwargs.get(p.name):
                target = self._real(str(kwargs.get(p.arg.overwrites, "")))
                allowed = {self._real(g.path) for g in self.goals}
                if target is not None and os.path.lexists(target) and target not in allowed:
                    return (f"refused: {p.name} is only for a file this task names as the one to write; "
                            "write a new file instead")
        return None

    def problems(self, answer: str) -> list[str]:
        """What is still wrong after the final answer `answer` (fixable by the model); see also `blocked`."""
        bad = self.grounding.ungrounded(answer)
        said = [f"your answer says {', '.join(bad[:3])}, which no tool result of this task holds; answer with what "
                "the tools returned"] if bad else []
        return said + self.unanswered(answer) + self.unmet()

    def unanswered(self, answer: str) -> list[str]:
        """Where the answer is the task's result (no file to write): an acknowledgment given for a task that asks
        for something, or a count that no tool returned for one that asks for a count or a total (asks.py)."""
        task, g = self.grounding.task, self.grounding
        if self.goals or self.blocked:
            return []  # the file is the result: "done" after writing it is an answer
        if not self.calls_ok and is_acknowledgment(answer, "\n".join(g.results)):
            # an MCP tool's only call failed ("Error executing tool explode") and the task ended `answer: done`,
            # verified, exit 0
            failed = f" ({self.calls_failed} failed)" if self.calls_failed else ""
            return [f'your answer says "{answer.strip()[:40]}", but no tool call of this task ran ok{failed}: say '
                    "what went wrong, or call a tool that does the task"]
        if asks_something(task) and is_acknowledgment(answer, "\n".join(g.results)):
            return [f'your answer only says "{answer.strip()[:40]}"; the task asks for something: answer with what '
                    "the tools returned"]
        if asks_count(task) and not negative_count(answer) and not set(map(_num, numbers_in(answer))) & set(
                map(_num, g.returned())):
            return ["the task asks for a count or a total and your answer holds no number a tool returned; answer "
                    "with the number the tools returned"]
        return []

    def unmet(self) -> list[str]:
        """The asked-for files that are missing or do not hold what the task asks."""
        if self.workspace is None:
            return []
        found = (check_goal(g, self.workspace.root, self.grounding.ungrounded, self._copies) for g in self.goals)
        return [f for f in found if f]

    def _copies(self, g: WriteGoal) -> list[str]:
        """What a copy must be: the source file's text (its first or last line) read by code when the task names
        a source in the workspace, else what the tools returned."""
        real = self._real(g.source) if g.source else None
        if real is None or not real.is_file():
            return self.grounding.pieces(g.source, g.which)
        try:
            text = real.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return []
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        return lines[:1] if g.which == "first" else lines[-1:] if g.which == "last" else [text.strip()]
