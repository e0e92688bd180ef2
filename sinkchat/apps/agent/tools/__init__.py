"""Agent tools: plain Python functions whose schema comes from their signature and docstring.

The model is untrusted, so everything it asks for goes through here: arguments are validated and coerced against the
signature (a wrong type becomes a `ToolError` message for the model, never a crash), every call runs under a timeout
in a daemon thread (a stuck tool cannot block the loop), and every result is capped in size with a visible marker.
`Workspace` confines file tools: paths are resolved (symlinks included) and refused when they leave the workspace or
name anything but a regular file or directory (devices, fifos, sockets would block or stream forever).

A tool function may take a keyword-only `workspace: Workspace` parameter; it is injected and hidden from the schema.
Mark side effects and timeouts with `@tool(side_effects=..., timeout=...)`; the agent asks for approval before
side-effecting calls.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
import queue
import re
import stat
import threading
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 10.0
DEFAULT_RESULT_CHARS = 1500
INJECTED = ("workspace",)
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


class ToolError(Exception):
    """A failure the model should read (refused path, bad argument, timeout); its text becomes the tool result."""


# ------------------------------------------------------------------------------------------------------ workspace
class Workspace:
    """A directory the file tools are confined to. `resolve` is the one gate every path goes through."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        root_path = Path(root).expanduser()
        root_path.mkdir(parents=True, exist_ok=True)
        self.root = Path(os.path.realpath(root_path))

    def __repr__(self) -> str:
        return f"Workspace({str(self.root)!r})"

    def resolve(self, path: str, kind: str = "any", must_exist: bool = True) -> Path:
        """The real path of `path` (relative to the root) if it stays inside; kind: 'file', 'dir' or 'any'."""
        if not isinstance(path, str):
            raise ToolError(f"path must be a string, got {type(path).__name__}")
        if "\x00" in path:
            raise ToolError("path contains a NUL byte")
        raw = path.strip() or "."
        p = Path(raw).expanduser() if raw.startswith("~") else Path(raw)
        joined = p if p.is_absolute() else self.root / p
        real = Path(os.path.realpath(joined))  # follows every symlink, collapses '..'
        if not self.contains(real):
            why = "an absolute path outside" if p.is_absolute() else "a path leading outside"
            raise ToolError(f"refused: {path!r} is {why} the workspace (use paths relative to the workspace)")
        try:
            st = os.stat(real)
        except FileNotFoundError:
            if must_exist:
                raise ToolError(f"not found: {path!r}") from None
            return real
        except OSError as e:
            raise ToolError(f"cannot access {path!r}: {e.strerror}") from None
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            raise ToolError(f"refused: {path!r} is a {file_kind(st.st_mode)}, not a regular file or directory")
        if kind == "file" and not stat.S_ISREG(st.st_mode):
            raise ToolError(f"{path!r} is a directory, not a file")
        if kind == "dir" and not stat.S_ISDIR(st.st_mode):
            raise ToolError(f"{path!r} is a file, not a directory")
        return real

    def contains(self, real: Path) -> bool:
        return real == self.root or self.root in real.parents

    def rel(self, real: Path) -> str:
        """Path as the model should see it (relative to the root)."""
        return "." if real == self.root else str(real.relative_to(self.root))

    def open_regular(self, real: Path, flags: int, mode: int = 0o644) -> int:
        """Open without following a final symlink and without blocking; refuse anything but a regular file.
        Closes the race between `resolve` and the open (a file swapped for a symlink or a fifo in between)."""
        try:
            fd = os.open(real, flags | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), mode)
        except OSError as e:
            raise ToolError(f"cannot open {self.rel(real)!r}: {e.strerror}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise ToolError(f"refused: {self.rel(real)!r} is a {file_kind(st.st_mode)}")
        return fd


def file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"), (stat.S_ISFIFO, "fifo"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISDIR, "directory"), (stat.S_ISREG, "file")):
        if test(mode):
            return name
    return "special file"


def looks_binary(data: bytes) -> bool:
    """NUL bytes or mostly undecodable bytes in the sample: not text the model can use."""
    if b"\x00" in data[:8192]:
        return True
    sample = data[:8192]
    bad = sample.decode("utf-8", errors="replace").count("\ufffd")
    return len(sample) > 0 and bad > len(sample) * 0.1


def hex_summary(data: bytes, size: int, n: int = 32) -> str:
    return f"binary file, {size} bytes; first {min(n, len(data))} bytes (hex): {data[:n].hex(' ')}"


# ------------------------------------------------------------------------------------------------------ schema
def tool(*, name: str | None = None, side_effects: bool | Callable[[dict[str, Any]], bool] = False,
         timeout: float | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a function's tool properties (the function stays a plain function)."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.__tool__ = {"name": name, "side_effects": side_effects, "timeout": timeout}  # type: ignore[attr-defined]
        return fn

    return deco


@dataclass(frozen=True)
class Param:
    name: str
    type: Any  # a Python type, or a tuple of allowed literal values
    required: bool
    default: Any
    description: str

    def json_schema(self) -> dict[str, Any]:
        if isinstance(self.type, tuple):
            out: dict[str, Any] = {"type": "string", "enum": list(self.type)}
        else:
            out = {"type": _JSON_TYPES.get(self.type, "string")}
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

    def has_side_effects(self, args: dict[str, Any]) -> bool:
        return bool(self.side_effects(args) if callable(self.side_effects) else self.side_effects)

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
            t = "|".join(map(repr, p.type)) if isinstance(p.type, tuple) else _JSON_TYPES.get(p.type, "string")
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


def tool_from_function(fn: Callable[..., Any], workspace: Workspace | None = None) -> Tool:
    """Build a Tool from a plain function: schema from type hints + docstring, injected `workspace`."""
    meta = getattr(fn, "__tool__", {})
    name = meta.get("name") or fn.__name__
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - unresolvable annotations: treat as strings
        hints = {}
    desc, arg_docs = parse_docstring(fn.__doc__)
    params, injected = [], {}
    for p in inspect.signature(fn).parameters.values():
        if p.name in INJECTED:
            if workspace is None:
                raise ValueError(f"tool {name} needs a workspace")
            injected[p.name] = workspace
            continue
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        params.append(Param(p.name, _py_type(hints.get(p.name, str)), p.default is p.empty,
                            None if p.default is p.empty else p.default, arg_docs.get(p.name, "")))
    return Tool(name, fn, desc or name, params, meta.get("side_effects", False),
                float(meta.get("timeout") or DEFAULT_TIMEOUT), injected)


def _py_type(hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return tuple(typing.get_args(hint))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _py_type(args[0]) if args else str
    if origin in (list, dict):
        return origin
    return hint if hint in _JSON_TYPES else str


def coerce(param: Param, value: Any) -> Any:
    """Accept the obvious conversions a small model gets wrong ("3" for 3); refuse the rest with a clear error."""
    t = param.type
    where = f"argument {param.name!r}"
    if isinstance(t, tuple):
        if value not in t:
            raise ToolError(f"{where} must be one of {list(t)}, got {value!r}")
        return value
    if t is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false", "yes", "no"):
            return value.strip().lower() in ("true", "yes")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
    elif t is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and re.fullmatch(r"\s*-?\d{1,18}\s*", value):
            return int(value)
    elif t is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif t is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    elif t in (list, dict):
        if isinstance(value, t):
            return value
    raise ToolError(f"{where} must be {_JSON_TYPES.get(t, 'string')}, got {type(value).__name__} {value!r:.60}")


# ------------------------------------------------------------------------------------------------------ calling
@dataclass(frozen=True)
class ToolResult:
    name: str
    args: dict[str, Any]
    ok: bool
    text: str  # capped text, exactly what the model gets
    chars: int  # length before capping
    truncated: bool
    seconds: float


def cap_text(text: str, limit: int) -> tuple[str, bool]:
    """At most `limit` characters (plus a marker that says how much was cut)."""
    if limit <= 0 or len(text) <= limit:
        return text, False
    return text[:limit] + f"\n...[truncated: showing {limit} of {len(text)} chars]", True


class Toolbox:
    """The tools offered to the model, by name."""

    def __init__(self, tools: list[Tool] | None = None, max_result_chars: int = DEFAULT_RESULT_CHARS) -> None:
        self.tools: dict[str, Tool] = {}
        self.max_result_chars = max_result_chars
        for t in tools or []:
            self.add(t)

    def add(self, t: Tool | Callable[..., Any], workspace: Workspace | None = None) -> Tool:
        t = t if isinstance(t, Tool) else tool_from_function(t, workspace)
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", t.name):
            raise ValueError(f"invalid tool name {t.name!r}")
        self.tools[t.name] = t
        return t

    def __contains__(self, name: str) -> bool:
        return name in self.tools

    @property
    def names(self) -> list[str]:
        return list(self.tools)

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools.values()]

    def describe(self) -> str:
        return "\n".join(f"- {t.signature_text()}" for t in self.tools.values())

    def validate(self, name: Any, args: Any) -> tuple[Tool, dict[str, Any]]:
        """The tool and coerced keyword arguments, or ToolError saying exactly what is wrong."""
        if not isinstance(name, str) or name not in self.tools:
            raise ToolError(f"unknown tool {name!r:.60}; available tools: {', '.join(self.tools)}")
        t = self.tools[name]
        if args is None:
            args = {}
        if not isinstance(args, dict):
            if len(t.params) == 1 and isinstance(args, (str, int, float)):
                args = {t.params[0].name: args}  # a bare value for a one-argument tool
            else:
                raise ToolError(f"arguments for {name} must be a JSON object, got {type(args).__name__}")
        known = {p.name: p for p in t.params}
        extra = [k for k in args if k not in known]
        if extra:
            raise ToolError(f"{name} has no argument(s) {extra}; it takes: {', '.join(known) or 'no arguments'}")
        out = {}
        for p in t.params:
            if p.name in args:
                out[p.name] = coerce(p, args[p.name])
            elif p.required:
                raise ToolError(f"{name} needs argument {p.name!r}")
        return t, out

    def run(self, t: Tool, kwargs: dict[str, Any]) -> ToolResult:
        """Run a validated call under its timeout; any failure becomes a not-ok result."""
        t0 = time.perf_counter()
        try:
            value = run_with_timeout(t.fn, {**kwargs, **t.injected}, t.timeout, t.name)
            text, ok = ("" if value is None else str(value)), True
        except ToolError as e:
            text, ok = f"error: {e}", False
        except Exception as e:  # noqa: BLE001 - a tool bug must not end the loop
            log.debug("tool %s failed", t.name, exc_info=True)
            text, ok = f"error: {type(e).__name__}: {e}", False
        capped, truncated = cap_text(text, self.max_result_chars)
        return ToolResult(t.name, kwargs, ok, capped, len(text), truncated, time.perf_counter() - t0)

    def call(self, name: Any, args: Any) -> ToolResult:
        """Validate and run in one go (errors included in the result)."""
        try:
            t, kwargs = self.validate(name, args)
        except ToolError as e:
            text, truncated = cap_text(f"error: {e}", self.max_result_chars)
            return ToolResult(str(name), args if isinstance(args, dict) else {}, False, text, len(text), truncated, 0.0)
        return self.run(t, kwargs)


def run_with_timeout(fn: Callable[..., Any], kwargs: dict[str, Any], timeout: float, name: str) -> Any:
    """Call fn in a daemon thread; past `timeout` seconds give up on it (it may finish in the background)."""
    box: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=1)

    def target() -> None:
        try:
            box.put((True, fn(**kwargs)))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box.put((False, e))

    threading.Thread(target=target, name=f"tool-{name}", daemon=True).start()
    try:
        ok, value = box.get(timeout=timeout)
    except queue.Empty:
        raise ToolError(f"{name} timed out after {timeout:g} s") from None
    if not ok:
        raise value
    return value


# ------------------------------------------------------------------------------------------------------ loading
def load_tools_module(path: str | os.PathLike[str]) -> list[Callable[..., Any]]:
    """Functions from a user's .py file: its TOOLS list if it has one, else its public functions."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"tools module not found: {p}")
    spec = importlib.util.spec_from_file_location(f"sinkchat_user_tools_{p.stem}", p)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load {p} as a Python module")
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except Exception as e:  # noqa: BLE001 - a broken user file is a user error
        raise ValueError(f"error while importing {p}: {type(e).__name__}: {e}") from None
    fns = getattr(mod, "TOOLS", None)
    if fns is None:
        fns = [f for n, f in vars(mod).items()
               if inspect.isfunction(f) and not n.startswith("_") and f.__module__ == mod.__name__]
    if not fns:
        raise ValueError(f"{p} defines no tool functions (public functions or a TOOLS list)")
    return list(fns)


def build_default_tools(workspace: Workspace | str | os.PathLike[str], allow_shell: bool = False,
                        max_result_chars: int = DEFAULT_RESULT_CHARS,
                        extra: list[Callable[..., Any]] | None = None) -> Toolbox:
    """The built-in tools confined to `workspace` (shell only when allowed), plus `extra` functions."""
    from sinkchat.apps.agent.tools import calculator, clock, list_dir, notes, read_file, search_text, shell, write_file

    ws = workspace if isinstance(workspace, Workspace) else Workspace(workspace)
    box = Toolbox(max_result_chars=max_result_chars)
    fns = [clock.clock, calculator.calculator, list_dir.list_dir, read_file.read_file, write_file.write_file,
           search_text.search_text, notes.notes]
    if allow_shell:
        fns.append(shell.shell)
    for fn in fns + list(extra or []):
        box.add(fn, ws)
    return box
