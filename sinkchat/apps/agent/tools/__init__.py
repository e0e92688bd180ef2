"""Agent tools: plain Python functions whose schema comes from their signature and docstring.

The model is untrusted, so everything it asks for goes through this package, one module per concern:

- `schema`: what a tool is (`@tool`, `Tool`, argument validation and coercion, `ToolError`);
- `workspace`: path safety (`Workspace`, the one folder the file tools are confined to);
- `journal`: the undo journal every file change is recorded in first (`sinkchat agent --undo`);
- `runner`: running one call so that its timeout really stops it (a child process, killed with what it started);
- `toolbox`: the registry offered to the model (`Toolbox`, result capping, `build_default_tools`, user modules);
- one module per built-in tool (clock, calculator, list_dir, read_file, write_file, search_text, notes, shell).

The names below are the public surface (what a `--tools-module` file imports, e.g. `tool` and `ToolError`).
"""

from __future__ import annotations

from sinkchat.apps.agent.tools.journal import Journal, JournalError
from sinkchat.apps.agent.tools.runner import ToolCancelled, ToolCrashed, run_tool_call
from sinkchat.apps.agent.tools.schema import (
    DEFAULT_TIMEOUT, Arg, Param, Tool, ToolError, coerce, parse_docstring, tool, tool_from_function,
)
from sinkchat.apps.agent.tools.toolbox import (
    DEFAULT_RESULT_CHARS, ToolResult, Toolbox, build_default_tools, cap_text, load_tools_module,
)
from sinkchat.apps.agent.tools.workspace import Workspace, WorkspaceError, file_kind, hex_summary, looks_binary

__all__ = ["Arg", "DEFAULT_RESULT_CHARS", "DEFAULT_TIMEOUT", "Journal", "JournalError", "Param", "Tool", "ToolCancelled",
           "ToolCrashed", "ToolError",
           "ToolResult", "Toolbox", "Workspace", "WorkspaceError", "build_default_tools", "cap_text", "coerce",
           "file_kind", "hex_summary", "load_tools_module", "looks_binary", "parse_docstring", "run_tool_call", "tool",
           "tool_from_function"]
