"""`write_file`: create or overwrite (or append to) a workspace file. The target is resolved like every other path;
an existing target must be a regular file, a final symlink is never followed (O_NOFOLLOW), and content is capped so
a runaway model cannot fill the disk."""

from __future__ import annotations

import os

from sinkchat.apps.agent.tools.schema import Arg, ToolError, tool
from sinkchat.apps.agent.tools.workspace import Workspace

MAX_WRITE_CHARS = 1_000_000


@tool(side_effects=True, args={"path": Arg(path="new")})
def write_file(path: str, content: str, append: bool = False, *, workspace: Workspace) -> str:
    """Write text to a file in the workspace (creates folders as needed).

    Args:
        path: file path relative to the workspace
        content: the text to write
        append: add to the end of the file instead of replacing it
    """
    if len(content) > MAX_WRITE_CHARS:
        raise ToolError(f"content longer than {MAX_WRITE_CHARS} characters")
    real = workspace.resolve(path, kind="file", must_exist=False)
    if real == workspace.root:
        raise ToolError("a file name is needed")
    parent = real.parent
    if not parent.exists():
        os.makedirs(parent, exist_ok=True)
    workspace.resolve(workspace.rel(parent), kind="dir")  # re-check after creating folders
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    fd = workspace.open_regular(real, flags)
    try:
        data = content.encode("utf-8")
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
    finally:
        os.close(fd)
    return f"{'appended' if append else 'wrote'} {len(data)} bytes to {workspace.rel(real)}"
