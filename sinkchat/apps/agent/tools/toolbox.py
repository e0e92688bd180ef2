"""The tool registry: which tools the model is offered, validating its calls, running them, capping their results.

Every call runs through `runner.run_tool_call` (a child process a timeout kills), and every result is capped in size
with a visible marker, so neither a stuck tool nor a huge result can stall or flood the loop.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from sinkchat.apps.agent.tools.runner import ToolCrashed, run_tool_call
from sinkchat.apps.agent.tools.schema import Tool, ToolError, coerce, tool_from_function
from sinkchat.apps.agent.tools.workspace import Workspace

log = logging.getLogger(__name__)

DEFAULT_RESULT_CHARS = 1500


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
        """Run a validated call under its timeout (stopped when it passes it); any failure becomes a not-ok result."""
        t0 = time.perf_counter()
        try:
            text, ok = run_tool_call(t.fn, {**kwargs, **t.injected}, t.timeout, t.name, t.isolate), True
        except (ToolError, ToolCrashed) as e:
            log.debug("tool %s failed: %s", t.name, e)
            text, ok = f"error: {e}", False
        except Exception as e:  # noqa: BLE001 - a runner failure must not end the loop either
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
    """The built-in tools confined to `workspace` (shell only when allowed), plus `extra` functions. A path must
    name an existing folder (WorkspaceError otherwise); pass `Workspace(path, create=True)` to make one."""
    from sinkchat.apps.agent.tools import (
        calculator, clock, file_stats, list_dir, notes, read_file, search_text, shell, write_file,
    )

    ws = workspace if isinstance(workspace, Workspace) else Workspace(workspace)
    box = Toolbox(max_result_chars=max_result_chars)
    fns = [clock.clock, calculator.calculator, list_dir.list_dir, read_file.read_file, write_file.write_file,
           search_text.search_text, *file_stats.TOOLS, notes.notes]
    if allow_shell:
        fns.append(shell.shell)
    for fn in fns + list(extra or []):
        box.add(fn, ws)
    return box
