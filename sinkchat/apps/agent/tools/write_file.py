"""`write_file`: create a workspace file, or (asked for explicitly) replace or append to one. The target is resolved
like every other path; an existing target must be a regular file, a final symlink is never followed (O_NOFOLLOW),
and content is capped so a runaway model cannot fill the disk.

It never destroys a file by default: an existing target is refused unless `overwrite` or `append` is true, and the
agent only lets those through (and the grammar only offers them) for an existing file the task names as the one to
write (issue 28: "Copy the first line of notes.txt into a new file first.txt" became `write_file notes.txt`, the
user's input overwritten). Every write is journaled first, with the previous content (`sinkchat agent --undo`). A
new file is opened with O_EXCL (a file that appeared since the check is refused, never truncated); an overwrite
writes a temporary file and renames it over the target (never a half-written file)."""

from __future__ import annotations

import os
import stat
import uuid
from pathlib import Path

from sinkchat.apps.agent.tools.schema import Arg, ToolError, tool
from sinkchat.apps.agent.tools.workspace import Workspace

MAX_WRITE_CHARS = 1_000_000


@tool(side_effects=True, args={"path": Arg(path="new"), "content": Arg(content_of="path"),
                               "append": Arg(overwrites="path", appends=True), "overwrite": Arg(overwrites="path")})
def write_file(path: str, content: str, append: bool = False, overwrite: bool = False, *,
               workspace: Workspace) -> str:
    """Write text to a new file in the workspace (creates folders as needed).

    Args:
        path: file path relative to the workspace
        content: the text to write
        append: add to the end of an existing file the task names
        overwrite: replace an existing file the task names
    """
    if len(content) > MAX_WRITE_CHARS:
        raise ToolError(f"content longer than {MAX_WRITE_CHARS} characters")
    if path != path.strip():
        raise ToolError(f"refused: {path!r} starts or ends with a space")  # resolve() would strip it: another file
    real = workspace.resolve(path, kind="file", must_exist=False)
    if real == workspace.root:
        raise ToolError("a file name is needed")
    rel = workspace.rel(real)
    exists = os.path.lexists(real)
    if exists and not (append or overwrite):
        raise ToolError(f"refused: {rel} exists, and write_file only replaces a file the task names (with "
                        "overwrite: true); write a new file instead")
    data = content.encode("utf-8")
    parent = real.parent
    if not parent.exists():
        os.makedirs(parent, exist_ok=True)
    workspace.resolve(workspace.rel(parent), kind="dir")  # re-check after creating folders
    before = _read(workspace, real) if exists and append else b""
    op = "write" if not exists else "append" if append else "overwrite"
    entry = workspace.record_change(real, op, before + data)
    if op == "overwrite":
        _replace(workspace, real, data)
    else:  # a new file must still be new (O_EXCL: one that appeared since the check is never truncated)
        flags = os.O_WRONLY | (os.O_APPEND if op == "append" else os.O_CREAT | os.O_EXCL)
        try:
            fd = workspace.open_regular(real, flags)
        except ToolError:
            entry.file.unlink(missing_ok=True)  # nothing changed: an entry left would make undo refuse this file
            raise
        try:
            _write_all(fd, data)
        finally:
            os.close(fd)
    if op == "overwrite":
        return f"replaced {rel} with {len(data)} bytes"
    return f"{'wrote' if op == 'write' else 'appended'} {len(data)} bytes to {rel}"


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _replace(workspace: Workspace, real: Path, data: bytes) -> None:
    """Overwrite `real` whole or not at all: a temporary file in its folder (same permissions), then renamed over
    it, so a crash or a full disk midway never leaves the user's file truncated or half-written."""
    fd = workspace.open_regular(real, os.O_RDONLY)  # a regular file, not a symlink swapped in since
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
    tmp = real.parent / f".{real.name}.sinkchat-{uuid.uuid4().hex[:8]}"
    try:
        fd = workspace.open_regular(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            _write_all(fd, data)
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, real)
    except OSError as e:
        raise ToolError(f"cannot write {workspace.rel(real)!r}: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)


def _read(workspace: Workspace, real: os.PathLike[str]) -> bytes:
    fd = workspace.open_regular(real, os.O_RDONLY)  # type: ignore[arg-type]
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
