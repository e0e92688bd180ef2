"""How the agent talks to the model: tool-call parsing, the two protocols, and the events the loop yields.

Two protocols. `native`: the model's chat template has tool support (it mentions `tools`): the tool schemas go into
the template (`apply_chat_template(tools=...)`), results go back with role "tool", calls come as `<tool_call>{...}`.
`json`: everything else (the bundled SmolLM2 template has no tool support and renders role "tool" as a role the model
never saw), so prompts/agent.txt describes `{"tool": ..., "args": {...}}` / `{"final": ...}` and results come back as
user messages starting "Tool result".

Parsing is deliberately forgiving about shape (several key spellings, Python-literal dicts, trailing commas, code
fences) and strict about outcome: anything it cannot turn into exactly one call or a final answer becomes an error
text for the model, never an exception.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

NAME_KEYS = ("tool", "name", "tool_name", "function", "action")
ARG_KEYS = ("args", "arguments", "parameters", "input", "action_input", "params")
FINAL_KEYS = ("final", "final_answer", "answer")
FINAL_TOOL_NAMES = ("final", "final_answer", "finish", "done", "answer")
FINAL_MARKER = re.compile(r"(?im)^\s*(?:final(?: answer)?|answer)\s*:\s*(.+)", re.DOTALL)
SPECIAL = re.compile(r"<\|[a-z_]+\|>|</?s>")
JSON_REMINDER = 'Reply with one tool call as JSON, like {"tool": "clock", "args": {}}, or finish with {"final": "your answer"}.'


# ------------------------------------------------------------------------------------------------------ events
@dataclass(frozen=True)
class StepEvent:
    """A step begins (the model is about to reply)."""

    step: int
    task: str


@dataclass(frozen=True)
class ModelTextEvent:
    """What the model wrote in this step (whole reply; TokenEvents stream it live)."""

    step: int
    text: str
    reason: str  # DoneEvent reason, or 'call' when the loop stopped it after a complete tool call
    tokens: int


@dataclass(frozen=True)
class ToolCallEvent:
    step: int
    name: str
    args: dict[str, Any]


@dataclass(frozen=True)
class ToolResultEvent:
    """A tool result (or a protocol error) that was fed back to the model as the step's result."""

    step: int
    name: str
    ok: bool
    text: str  # exactly what was fed back (capped)
    chars: int  # length before capping
    truncated: bool
    seconds: float


@dataclass(frozen=True)
class AgentErrorEvent:
    """The reply could not be used (malformed JSON, unknown tool, wrong types, denied); fed back as the result."""

    step: int
    message: str


@dataclass(frozen=True)
class TaskDoneEvent:
    """reason: 'final' (the model answered), 'max_steps', or 'interrupted'."""

    task: str
    steps: int
    reason: str
    answer: str = ""


AgentEvent = StepEvent | ModelTextEvent | ToolCallEvent | ToolResultEvent | AgentErrorEvent | TaskDoneEvent


# ------------------------------------------------------------------------------------------------------ parsing
@dataclass(frozen=True)
class Parsed:
    """kind: 'call' (name, args), 'final' (answer), 'error' (error), 'none' (plain text)."""

    kind: str
    name: str = ""
    args: Any = field(default_factory=dict)
    answer: str = ""
    error: str = ""


def _objects(text: str) -> tuple[list[str], bool]:
    """Top-level {...} spans in order (string-aware brace matching) and whether one was left unclosed."""
    spans, depth, start, in_str, esc, quote = [], 0, -1, False, False, ""
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == quote:
                in_str = False
        elif ch in "\"'" and depth > 0:
            # an apostrophe inside prose ("it's") must not swallow the rest; only quote inside objects
            in_str, quote = True, ch
        elif ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}" and depth > 0:
            depth -= 1
            if depth == 0:
                spans.append(text[start : i + 1])
    return spans, depth > 0


def loads_lenient(s: str) -> Any:
    """json.loads, then the usual small-model slips: trailing commas, Python literals / single quotes."""
    try:
        return json.loads(s)
    except json.JSONDecodeError as first:
        fixed = re.sub(r",\s*([}\]])", r"\1", s)
        try:
            return json.loads(fixed)
        except json.JSONDecodeError:
            pass
        try:
            return ast.literal_eval(fixed)  # literals only: safe on untrusted text
        except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
            raise first from None


def _interpret(obj: Any) -> Parsed | None:
    """A parsed JSON value as a call / final answer, an error, or None when it is not an object at all."""
    if not isinstance(obj, dict):
        return None
    if "function" in obj and isinstance(obj["function"], dict):  # OpenAI shape {"function": {"name", "arguments"}}
        obj = obj["function"]
    name = next((obj[k] for k in NAME_KEYS if k in obj), None)
    if name is None:
        final = next((obj[k] for k in FINAL_KEYS if k in obj), None)
        if final is not None:
            return Parsed("final", answer=final if isinstance(final, str) else json.dumps(final))
        return Parsed("error", error=f'the JSON object has no "tool" key (got keys {list(obj)[:6]})')
    args = next((obj[k] for k in ARG_KEYS if k in obj), {})
    if isinstance(args, str) and args.strip().startswith("{"):
        try:
            args = loads_lenient(args)
        except (json.JSONDecodeError, ValueError):
            return Parsed("error", error=f"the arguments of {name!r:.40} are not valid JSON")
    if isinstance(name, str) and name.strip().lower() in FINAL_TOOL_NAMES:
        ans = args.get("answer", args.get("text", args)) if isinstance(args, dict) else args
        return Parsed("final", answer=ans if isinstance(ans, str) else json.dumps(ans))
    if not isinstance(name, str):
        return Parsed("error", error=f"the tool name must be a string, got {json.dumps(name)[:60]}")
    return Parsed("call", name=name.strip(), args=args)


def parse_reply(text: str) -> Parsed:
    """The first tool call or final answer in a reply; malformed JSON and stray shapes become 'error'."""
    clean = SPECIAL.sub("", text)
    m = re.search(r"<tool_call>(.*?)(?:</tool_call>|$)", clean, re.DOTALL)
    body = m.group(1) if m else clean
    spans, unclosed = _objects(body)
    first_error = ""
    for span in spans:
        if ":" not in span:
            continue  # prose braces ("{name}", a set), not an attempt at a call
        try:
            obj = loads_lenient(span)
        except (json.JSONDecodeError, ValueError) as e:
            first_error = first_error or f"malformed JSON ({e.msg if hasattr(e, 'msg') else e}): {span[:80]}"
            continue
        got = _interpret(obj)
        if got is not None and got.kind != "error":
            return got
        if got is not None:
            first_error = first_error or got.error
    fm = FINAL_MARKER.search(clean)
    if fm and not spans:
        return Parsed("final", answer=fm.group(1).strip())
    if first_error:
        return Parsed("error", error=first_error)
    if unclosed:
        return Parsed("error", error="incomplete JSON: the object was never closed (reply too long?)")
    if m:
        return Parsed("error", error="empty or unreadable <tool_call>")
    return Parsed("none")


def complete_call(text: str) -> bool:
    """True once the reply holds a usable call or final answer, so generation can stop there."""
    if "}" not in text:
        return False
    return parse_reply(text).kind in ("call", "final")


# ------------------------------------------------------------------------------------------------------ templates
def template_has_tools(tokenizer: Any) -> bool:
    """Whether the chat template renders a `tools` list (Qwen2.5, Llama 3.1, Hermes style)."""
    tmpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tmpl, dict):
        return "tool_use" in tmpl or any("tools" in str(v) for v in tmpl.values())
    return isinstance(tmpl, str) and re.search(r"\btools\b", tmpl) is not None


class ToolsTokenizer:
    """Wraps a tokenizer so every apply_chat_template call renders the tool schemas (Conversation stays unaware)."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]) -> None:
        self._tok = tokenizer
        self._tools = tools

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def apply_chat_template(self, messages: Any, **kw: Any) -> Any:
        kw.setdefault("tools", self._tools)
        return self._tok.apply_chat_template(messages, **kw)


# One demonstrated exchange, fed as real turns before the first task: a 135M model copies the shape of earlier
# assistant turns far more reliably than it follows a written instruction.
FEW_SHOT = [
    ("user", "Task: Save the sum of 2 and 5 in the notes."),
    ("assistant", '{"tool": "calculator", "args": {"expression": "2 + 5"}}'),
    ("user", "Tool result (calculator): 7"),
    ("assistant", '{"tool": "notes", "args": {"action": "append", "text": "2 + 5 = 7"}}'),
    ("user", "Tool result (notes): note saved to NOTES.md"),
    ("assistant", '{"final": "I saved 2 + 5 = 7 in the notes."}'),
]


def render_system(template: str, tools_text: str, workspace: str) -> str:
    return template.replace("{tools}", tools_text).replace("{workspace}", workspace)


def task_message(task: str, tool_names: list[str], native: bool) -> str:
    """The task as fed to the model, with a short reminder of the protocol: in a run of hours the system prompt has
    long been evicted, so each task restates what the model may call."""
    if native:
        return f"Task: {task}"
    return (f"Task: {task}\n(Tools: {', '.join(tool_names)}. Call one tool per reply as "
            '{"tool": "NAME", "args": {...}}; when done, reply {"final": "ANSWER"}.)')


def result_message(name: str, text: str, ok: bool, native: bool) -> tuple[str, str]:
    """(role, content) for feeding a result back."""
    if native:
        return "tool", text
    head = f"Tool result ({name})" if ok else (f"Tool error ({name})" if name else "Tool error")
    tail = "" if ok else "\n" + JSON_REMINDER
    return "user", f"{head}: {text}{tail}"
