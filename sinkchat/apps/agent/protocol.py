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
import warnings
from dataclasses import dataclass, field
from typing import Any, Collection

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
class FinalRejectedEvent:
    """A final answer was sent back (agent/verify.py): what is wrong with it was fed to the model, which goes on."""

    step: int
    answer: str
    problems: tuple[str, ...]


@dataclass(frozen=True)
class TaskDoneEvent:
    """reason: 'final' (the model answered), 'max_steps', or 'interrupted'. `verified`: the answer is grounded in
    the task's tool results and every file the task asked for holds what it asked (agent/verify.py); `problem`:
    what is not, when not."""

    task: str
    steps: int
    reason: str
    answer: str = ""
    verified: bool = True
    problem: str = ""


@dataclass(frozen=True)
class Denied:
    """An approver's refusal of a call, saying who refused and how to allow it (issue 28: "the user denied this
    shell call" was told to the model ten times though no user was asked). `always`: every call of this tool would
    be refused in this run (a policy, not a person), so the tool is taken out of the grammar. False in a test, like
    the plain False an approver may also return."""

    reason: str
    always: bool = False

    def __bool__(self) -> bool:
        return False


AgentEvent = (StepEvent | ModelTextEvent | ToolCallEvent | ToolResultEvent | AgentErrorEvent | FinalRejectedEvent
              | TaskDoneEvent)


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
            with warnings.catch_warnings():  # "invalid escape sequence" in model text is not our warning to show
                warnings.simplefilter("ignore")
                return ast.literal_eval(fixed)  # literals only: safe on untrusted text
        except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
            raise first from None


def to_json_value(v: Any, depth: int = 0) -> Any:
    """What `ast.literal_eval` can return, made JSON-safe: sets and tuples become lists, bytes text, complex numbers
    and anything else their repr, non-string keys strings. A soak recorded `TypeError: Object of type set is not
    JSON serializable` from a tool name written as a Python set; every value a Parsed carries goes through here."""
    if depth > 50:
        return repr(v)[:200]
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if v == v and v not in (float("inf"), float("-inf")) else repr(v)
    if isinstance(v, dict):
        return {k if isinstance(k, str) else repr(k): to_json_value(x, depth + 1) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [to_json_value(x, depth + 1) for x in v]
    if isinstance(v, (set, frozenset)):
        return sorted((to_json_value(x, depth + 1) for x in v), key=repr)
    if isinstance(v, bytes):
        return v.decode("utf-8", errors="replace")
    return repr(v)


def _interpret(obj: Any) -> Parsed | None:
    """A parsed JSON value as a call / final answer, an error, or None when it is not an object at all."""
    if not isinstance(obj, dict):
        return None
    obj = to_json_value(obj)
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
    """The first tool call or final answer in a reply; malformed JSON and stray shapes become 'error'. Never raises
    (fuzzed in tests/test_agent_fuzz.py): an unforeseen failure is an error text for the model too."""
    try:
        return _parse(text)
    except Exception as e:  # noqa: BLE001 - the model is untrusted; a parser bug must not end the loop
        return Parsed("error", error=f"unreadable reply ({type(e).__name__})")


def _parse(text: str) -> Parsed:
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


# Demonstrated exchanges, fed as real turns before the first task: a 135M model copies the shape of earlier assistant
# turns far more reliably than it follows a written instruction. Measured: the old single example (calculator, then
# `notes append "2 + 5 = 7"`) was copied into unrelated tasks (a stray NOTES.md in the user's workspace, answers "I
# saved 2 + 5 = 7"). These use files that the user's workspace does not have, so a copied call fails harmlessly
# (and the agent refuses a side-effecting call identical to an example's, see Agent._act), and they show the
# pattern the everyday tasks need: one tool that computes, then a final answer that quotes its result.
EXAMPLES: list[list[tuple[str, str]]] = [
    [("user", "Task: Find the total of the cost column in bills.csv and write it to cost.txt."),
     ("assistant", '{"tool": "column_sum", "args": {"path": "bills.csv", "column": "cost"}}'),
     ("user", "Tool result (column_sum): 57"),
     ("assistant", '{"tool": "write_file", "args": {"path": "cost.txt", "content": "57"}}'),
     ("user", "Tool result (write_file): wrote 2 bytes to cost.txt"),
     ("assistant", '{"final": "57"}')],
    [("user", "Task: Copy the first line of memo.txt into a new file top.txt."),
     ("assistant", '{"tool": "read_file", "args": {"path": "memo.txt"}}'),
     ("user", "Tool result (read_file): buy bread\ncall mum"),
     ("assistant", '{"tool": "write_file", "args": {"path": "top.txt", "content": "buy bread"}}'),
     ("user", "Tool result (write_file): wrote 9 bytes to top.txt"),
     ("assistant", '{"final": "buy bread"}')],
    [("user", "Task: Replace the contents of plan.txt with the text go home."),
     ("assistant", '{"tool": "write_file", "args": {"path": "plan.txt", "content": "go home", "overwrite": true}}'),
     ("user", "Tool result (write_file): replaced plan.txt with 7 bytes"),
     ("assistant", '{"final": "done"}')],
    [("user", "Task: Put the text good morning in greet.txt."),
     ("assistant", '{"tool": "write_file", "args": {"path": "greet.txt", "content": "good morning"}}'),
     ("user", "Tool result (write_file): wrote 12 bytes to greet.txt"),
     ("assistant", '{"final": "done"}')],
    [("user", "Task: What is the password in keys.txt?"),
     ("assistant", '{"tool": "read_file", "args": {"path": "keys.txt"}}'),
     ("user", "Tool result (read_file): user: ann\npassword: tiger7"),
     ("assistant", '{"final": "tiger7"}')],
    [("user", "Task: What is 12 times 9?"),
     ("assistant", '{"tool": "calculator", "args": {"expression": "12 * 9"}}'),
     ("user", "Tool result (calculator): 108"),
     ("assistant", '{"final": "108"}')],
    [("user", "Task: How many lines of events.log contain WARN?"),
     ("assistant", '{"tool": "count_matches", "args": {"pattern": "WARN", "path": "events.log"}}'),
     ("user", "Tool result (count_matches): 6"),
     ("assistant", '{"final": "6"}')],
    [("user", "Task: What is the smallest price in shop.csv?"),
     ("assistant", '{"tool": "column_min", "args": {"path": "shop.csv", "column": "price"}}'),
     ("user", "Tool result (column_min): 4"),
     ("assistant", '{"final": "4"}')],
    [("user", "Task: What is the largest price in shop.csv?"),
     ("assistant", '{"tool": "column_max", "args": {"path": "shop.csv", "column": "price"}}'),
     ("user", "Tool result (column_max): 38"),
     ("assistant", '{"final": "38"}')],
    [("user", "Task: How many words are in story.txt?"),
     ("assistant", '{"tool": "count_words", "args": {"path": "story.txt"}}'),
     ("user", "Tool result (count_words): 41"),
     ("assistant", '{"final": "41"}')],
]
FEW_SHOT = [turn for ex in EXAMPLES for turn in ex]


def _calls(ex: list[tuple[str, str]]) -> set[str]:
    """The tools an example calls."""
    return {json.loads(t)["tool"] for r, t in ex if r == "assistant" and '"tool"' in t}


def examples_for(task: str | None, offered: Collection[str] | None = None) -> list[tuple[str, str]]:
    """The EXAMPLES that call only `offered` tools (None: all), the one sharing most words with `task` last (None:
    their own order): the model copies the nearest example most, so the nearest should be the most similar task
    (measured: with a fixed order the bundled model answered "What is 37 times 43?" with the last example's
    count_words, and "lines ... contain ERROR" with count_lines). Why only offered tools: with
    `--no-builtin-tools --mcp ...` every example called a tool the run does not have (a new user's audit)."""
    kept = [ex for ex in EXAMPLES if offered is None or _calls(ex) <= set(offered)]
    if task is None:
        return [turn for ex in kept for turn in ex]
    words = set(re.findall(r"[a-z]+", task.lower()))

    def score(ex: list[tuple[str, str]]) -> int:
        return len(words & set(re.findall(r"[a-z]+", ex[0][1].lower())))

    return [turn for ex in sorted(kept, key=score) for turn in ex]


def is_example_call(name: str, args: dict[str, Any]) -> bool:
    """Whether a call repeats one of FEW_SHOT's calls exactly (the agent refuses such a side-effecting call)."""
    examples = [json.loads(t) for r, t in FEW_SHOT if r == "assistant" and '"tool"' in t]
    return any(e["tool"] == name and e["args"] == args for e in examples)


def render_system(template: str, tools_text: str, workspace: str) -> str:
    return template.replace("{tools}", tools_text).replace("{workspace}", workspace)


def task_message(task: str, tool_names: list[str], native: bool, reminder: bool = True) -> str:
    """The task as fed to the model, with a short reminder of the protocol: in a run of hours the system prompt has
    long been evicted, so each task restates what the model may call. Without `reminder` (constrained decoding:
    the grammar is the reminder) the task looks exactly like the demonstrated ones; measured, the bundled model
    copied the reminder's placeholder as its answer ({"final": "ANSWER"})."""
    if native or not reminder:
        return f"Task: {task}"
    return (f"Task: {task}\n(Tools: {', '.join(tool_names)}. Call one tool per reply as "
            '{"tool": "NAME", "args": {...}}; when done, reply {"final": "the answer"}.)')


def result_message(name: str, text: str, ok: bool, native: bool, reminder: bool = True) -> tuple[str, str]:
    """(role, content) for feeding a result back. `reminder`: after an error, restate the protocol (not needed
    under constrained decoding, where the bundled model copied its placeholder: {"final": "your answer"})."""
    if native:
        return "tool", text
    head = f"Tool result ({name})" if ok else (f"Tool error ({name})" if name else "Tool error")
    tail = "" if ok or not reminder else "\n" + JSON_REMINDER
    return "user", f"{head}: {text}{tail}"
