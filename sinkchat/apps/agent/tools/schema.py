"""What a tool is: a plain Python function whose schema comes from its signature and docstring.

The model is untrusted, so its arguments are validated and coerced against the signature here (a wrong type becomes
a `ToolError` message for the model, never a crash). A function may take a keyword-only `workspace` parameter; it is
injected and hidden from the schema. `@tool(...)` marks side effects, the timeout and whether the call may run in a
child process (see `runner`); its `args={name: Arg(...)}` says what an argument names (an existing file, an existing
folder, a column of the CSV file another argument names), how long it may be and its range, so the tool-call grammar
(agent/grammar.py) can offer only values the tool accepts, without knowing any tool by name.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

DEFAULT_TIMEOUT = 10.0
INJECTED = ("workspace",)
JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


PATH_KINDS = ("file", "dir", "any", "new")


@dataclass(frozen=True)
class Arg:
    """What one argument names, declared on the tool (`@tool(args={"path": Arg(path="file")})`).

    Why: schema-valid calls the tools rejected were most of the agent soak's failures (1,000 tasks: 152 `list_dir`
    calls on a file, 237 CSV columns that are not in the file, `.` given to file tools, out of 1,155 calls). The
    grammar reads these declarations and offers only what the tool accepts.

    `path`: "file" (an existing regular file), "dir" (an existing folder, "." included), "any" (either), "new" (a
    file to write: free text, but no absolute path, `~`, `..` or `.` at its start). `column_of`: the name of the
    argument holding a CSV path; this argument is then one of that file's header names (`numeric`: only columns
    holding numbers). `max_chars`: cap on a string (short arguments keep a call short enough to close within one
    reply's token budget); `min_chars`: its least length (an empty search text or expression only fails). `minimum` /
    `maximum`: range of a number. `pattern`: a regular expression (anchored, ^...$) the whole string must match; it
    replaces the length bounds, so it bounds its own length, and every prefix of a match must extend to a match
    within a few characters (the grammar's closing reserve counts on it). `overwrites`: this boolean argument, when
    true, lets the named path argument (a `path="new"` one) name an existing file: the grammar offers it only for
    existing files the task names as the file to write (issue 28: "Copy the first line of notes.txt into a new file
    first.txt" ended as `write_file notes.txt`, the user's input overwritten), and the agent refuses it otherwise;
    `appends`: it adds to the file's end rather than replacing it. `content_of`: the name of the path argument whose
    file this text is written to (in a task that asks for given content, the grammar offers only that)."""

    path: str | None = None
    column_of: str | None = None
    numeric: bool = False
    max_chars: int | None = None
    min_chars: int = 0
    minimum: float | None = None
    maximum: float | None = None
    pattern: str | None = None
    overwrites: str | None = None
    appends: bool = False
    content_of: str | None = None

    def __post_init__(self) -> None:
        if self.path is not None and self.path not in PATH_KINDS:
            raise ValueError(f"Arg(path=) must be one of {PATH_KINDS}, got {self.path!r}")


NO_ARG = Arg()


class ToolError(Exception):
    """A failure the model should read (refused path, bad argument, timeout); its text becomes the tool result."""


def tool(*, name: str | None = None, side_effects: bool | Callable[[dict[str, Any]], bool] = False,
         timeout: float | None = None, isolate: bool = True, args: dict[str, Arg] | None = None,
         data: bool | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a function's tool properties (the function stays a plain function). `args`: what each argument
    names (see `Arg`). `data`: whether its result is data a final answer may quote (default: calls without side
    effects; a write's "wrote 3 bytes" is not, a shell's output is), see agent/grounding.py.

    `isolate=False` runs the tool in a thread of this process instead of a child process: for a tool that must
    change this process's memory. Such a call cannot be stopped at its timeout (see `runner.run_in_thread`)."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.__tool__ = {"name": name, "side_effects": side_effects, "timeout": timeout,  # type: ignore[attr-defined]
                       "isolate": isolate, "args": dict(args or {}), "data": data}
        return fn

    return deco


@dataclass(frozen=True)
class Param:
    name: str
    type: Any  # a Python type, or a tuple of allowed literal values
    required: bool
    default: Any
    description: str
    arg: Arg = NO_ARG  # what the argument names (declared with @tool(args=...))

    def json_schema(self) -> dict[str, Any]:
        if isinstance(self.type, tuple):
            out: dict[str, Any] = {"type": "string", "enum": list(self.type)}
        else:
            out = {"type": JSON_TYPES.get(self.type, "string")}
            if out["type"] in ("integer", "number"):
                out.update({k: v for k, v in (("minimum", self.arg.minimum), ("maximum", self.arg.maximum))
                            if v is not None})
        if self.description:
            out["description"] = self.description
        return out


@dataclass
class Tool:
    name: str
    fn: Callable[..., Any]
    description: str
    params: list[Param]
    side_effects: bool | Callable[[dict[str, Any]], bool] = False
    timeout: float = DEFAULT_TIMEOUT
    injected: dict[str, Any] = field(default_factory=dict)
    isolate: bool = True  # run in a child process that a timeout kills (False: a thread, which it cannot)
    data: bool | None = None  # its result is data an answer may quote (None: when the call has no side effects)

    def has_side_effects(self, args: dict[str, Any]) -> bool:
        return bool(self.side_effects(args) if callable(self.side_effects) else self.side_effects)

    def returns_data(self, args: dict[str, Any]) -> bool:
        return self.data if self.data is not None else not self.has_side_effects(args)

    def schema(self) -> dict[str, Any]:
        """OpenAI-style function schema (what chat templates with tool support take)."""
        props = {p.name: p.json_schema() for p in self.params}
        required = [p.name for p in self.params if p.required]
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                "parameters": {"type": "object", "properties": props, "required": required}}}

    def signature_text(self) -> str:
        """Compact one-line description for the JSON prompt: name(arg: type, opt: type = default) - what it does."""
        parts = []
        for p in self.params:
            t = "|".join(map(repr, p.type)) if isinstance(p.type, tuple) else JSON_TYPES.get(p.type, "string")
            parts.append(f"{p.name}: {t}" + ("" if p.required else f" = {p.default!r}"))
        return f"{self.name}({', '.join(parts)}) - {self.description}"


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(description, {arg: description}) from a Google-style docstring (first paragraph, 'Args:' section)."""
    if not doc:
        return "", {}
    text = inspect.cleandoc(doc)
    head, _, args_part = text.partition("\nArgs:")
    desc = " ".join(head.strip().split("\n\n")[0].split())
    args: dict[str, str] = {}
    current = None
    for line in args_part.splitlines():
        m = re.match(r"\s+(\w+)\s*(?:\([^)]*\))?:\s*(.*)", line)
        if m and (current is None or len(line) - len(line.lstrip()) <= 4):
            current = m.group(1)
            args[current] = m.group(2).strip()
        elif line.strip() and current:
            if not line.startswith(" "):
                break  # next section (Returns:, Raises:)
            args[current] += " " + line.strip()
    return desc, args


def tool_from_function(fn: Callable[..., Any], workspace: object | None = None) -> Tool:
    """Build a Tool from a plain function: schema from type hints + docstring, injected `workspace` (opaque here:
    typed `object` so this module never imports tools/workspace.py, which imports ToolError from here)."""
    meta = getattr(fn, "__tool__", {})
    name = meta.get("name") or fn.__name__
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - unresolvable annotations: treat as strings
        hints = {}
    desc, arg_docs = parse_docstring(fn.__doc__)
    params, injected = [], {}
    declared: dict[str, Arg] = meta.get("args") or {}
    for p in inspect.signature(fn).parameters.values():
        if p.name in INJECTED:
            if workspace is None:
                raise ValueError(f"tool {name} needs a workspace")
            injected[p.name] = workspace
            continue
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        params.append(Param(p.name, _py_type(hints.get(p.name, str)), p.default is p.empty,
                            None if p.default is p.empty else p.default, arg_docs.get(p.name, ""),
                            declared.get(p.name, NO_ARG)))
    unknown = set(declared) - {p.name for p in params}
    if unknown:
        raise ValueError(f"tool {name}: @tool(args=) names no argument(s) {sorted(unknown)}")
    for p in params:
        if p.arg.column_of and p.arg.column_of not in {q.name for q in params}:
            raise ValueError(f"tool {name}: {p.name} is a column of {p.arg.column_of!r}, which is no argument")
        if p.arg.content_of and p.arg.content_of not in {q.name for q in params}:
            raise ValueError(f"tool {name}: {p.name} is the content of {p.arg.content_of!r}, which is no argument")
        target = next((q for q in params if q.name == p.arg.overwrites), None)
        if p.arg.overwrites and (target is None or target.arg.path != "new" or p.type is not bool or p.required):
            raise ValueError(f"tool {name}: {p.name} overwrites {p.arg.overwrites!r}: it must be an optional bool "
                             "and name an Arg(path=\"new\") argument")
    return Tool(name, fn, desc or name, params, meta.get("side_effects", False),
                float(meta.get("timeout") or DEFAULT_TIMEOUT), injected, bool(meta.get("isolate", True)),
                meta.get("data"))


def _py_type(hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return tuple(typing.get_args(hint))
    if origin in (typing.Union, getattr(types, "UnionType", None)):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _py_type(args[0]) if args else str
    if origin in (list, dict):
        return origin
    return hint if hint in JSON_TYPES else str


def coerce(param: Param, value: Any) -> Any:
    """Accept the obvious conversions a small model gets wrong ("3" for 3); refuse the rest with a clear error."""
    t = param.type
    if isinstance(t, tuple):
        if value not in t:
            raise ToolError(f"argument {param.name!r} must be one of {list(t)}, got {value!r}")
        return value
    converted = _CONVERT.get(t, _as_container)(t, value)
    if converted is not _NO:
        lo, hi = param.arg.minimum, param.arg.maximum
        if t in (int, float) and ((lo is not None and converted < lo) or (hi is not None and converted > hi)):
            raise ToolError(f"argument {param.name!r} must be in [{lo}, {hi}], got {converted}")
        return converted
    raise ToolError(f"argument {param.name!r} must be {JSON_TYPES.get(t, 'string')}, "
                    f"got {type(value).__name__} {value!r:.60}")


_NO = object()  # "cannot convert" (None is a value)


def _as_bool(_t: Any, value: Any) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "yes", "no"):
        return value.strip().lower() in ("true", "yes")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    return _NO


def _as_int(_t: Any, value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d{1,18}\s*", value):
        return int(value)
    return _NO


def _as_float(_t: Any, value: Any) -> Any:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return _NO


def _as_str(_t: Any, value: Any) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return _NO


def _as_container(t: Any, value: Any) -> Any:
    return value if t in (list, dict) and isinstance(value, t) else _NO


_CONVERT: dict[Any, Callable[[Any, Any], Any]] = {bool: _as_bool, int: _as_int, float: _as_float, str: _as_str}
