"""`notes`: a scratchpad file (NOTES.md) in the workspace. The cache forgets the oldest steps; what the model writes
here survives eviction and can be read back at any time. Appending and clearing are journaled like every file
change (tools/journal.py), so `sinkchat agent --undo` can bring cleared notes back. A NOTES.md that was there
already (the user's own) is never appended to or cleared: only one the agent created, as its journal records."""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path
from typing import Literal

from sinkchat.apps.agent.tools.schema import ToolError, tool
from sinkchat.apps.agent.tools.workspace import Workspace

NOTES_FILE = "NOTES.md"
MAX_NOTE_CHARS = 4000


@tool(side_effects=lambda args: args.get("action", "read") != "read")
def notes(action: Literal["read", "append", "clear"] = "read", text: str = "", *, workspace: Workspace) -> str:
    """Your scratchpad that survives forgetting: read it, append a note, or clear it.

    Args:
        action: "read", "append" or "clear"
        text: the note to append (for action "append")
    """
    real = workspace.resolve(NOTES_FILE, kind="file", must_exist=False)
    if action in ("append", "clear"):
        _refuse_users_file(workspace, real)
    if action == "append":
        if not text.strip():
            raise ToolError('action "append" needs a non-empty "text"')
        if len(text) > MAX_NOTE_CHARS:
            raise ToolError(f"a note is limited to {MAX_NOTE_CHARS} characters")
        stamp = _dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        line = f"- [{stamp}] {text.strip()}\n".encode("utf-8")
        before = _read(workspace, real) if real.exists() else None
        workspace.record_change(real, "write" if before is None else "append", (before or b"") + line)
        fd = workspace.open_regular(real, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        return f"note saved to {NOTES_FILE}"
    if action == "clear":
        workspace.record_change(real, "overwrite" if real.exists() else "write", b"")
        fd = workspace.open_regular(real, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.close(fd)
        return "notes cleared"
    if not real.exists():
        return "(no notes yet)"
    return _read(workspace, real, 256 * 1024).decode("utf-8", errors="replace") or "(no notes yet)"


def _refuse_users_file(workspace: Workspace, real: Path) -> None:
    """A NOTES.md the agent did not create in this workspace (its journal has no entry creating it) is the user's:
    clearing or appending to it would change their file with no task asking for it, so it is refused."""
    if os.path.lexists(real) and not workspace.journal.created(workspace.rel(real)):
        raise ToolError(f"refused: {NOTES_FILE} in the workspace is the user's file (the agent did not create it); "
                        "the notes tool only changes its own notes")


def _read(workspace: Workspace, real: Path, limit: int = 64 * 1024 * 1024) -> bytes:
    fd = workspace.open_regular(real, os.O_RDONLY)
    try:
        return os.read(fd, limit)
    finally:
        os.close(fd)
