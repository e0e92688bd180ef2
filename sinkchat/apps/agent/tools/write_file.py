"""`write_file`: create a workspace file, or (asked for explicitly) replace or append to one. The target is resolved
like every other path; an existing target must be a regular file, a final symlink is never followed (O_NOFOLLOW),
and content is capped so a runaway model cannot fill the disk.

It never destroys a file by default: an existing target is refused unless `overwrite` or `append` is true, and the
agent only lets those through (and the grammar only offers them) for an existing file the task names as the one to
write (issue 28: "Copy the first line of notes.txt into a new file first.txt" became `write_file notes.txt`, the
user's input overwritten). Every write is journaled first, with the previous content (`sinkchat agent --undo`).

A change is made whole or not at all: a new file is written to a temporary file, then linked under its name
(`os.link` fails if the name exists: a file that appeared since the check is refused, never truncated); an
overwrite writes the whole new content to a temporary file and renames it over the target; an append writes in
place (O_APPEND: the same file, owner, mode and links) and is cut back to its old size if it does not finish. A
call stopped midway (its timeout or the user's Ctrl-C: the tool's process gets SIGTERM) or a full disk leaves the
file as it was (a half-written file used to be left, which `--undo` refused as "changed after the agent's write")."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import uuid
from pathlib import Path

from sinkchat.apps.agent.tools.schema import Arg, ToolError, tool
from sinkchat.apps.agent.tools.workspace import Workspace
from sinkchat.store.atomic import write_all

MAX_WRITE_CHARS = 1_000_000


@tool(side_effects=True, args={"path": Arg(path="new"), "content": Arg(content_of="path"),
                               "append": Arg(overwrites="path", appends=True), "overwrite": Arg(overwrites="path")})
def write_file(path: str, content: str, append: bool = False, overwrite: bool = False, *,
               workspace: Workspace) -> str:
    """Write text to a new file in the workspace (creates folders as needed).

    Args:
        path: file path relative to the workspace
        content: the text to write
        append: add to the end of an existing file the task names (on a new line)
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
    newline = op == "append" and before and not before.endswith(b"\n") and not data[:1].isspace()
    if newline:  # an appended line goes on a line of its own ("alpha line onezeta six" was verified, exit 0);
        # content that starts with a space or a newline says where it goes itself
        data = b"\n" + data
    entry = workspace.record_change(real, op, before + data)
    try:
        if op == "write":
            _create(workspace, real, data)
        elif op == "append":
            _append(workspace, real, data)
        else:
            _replace(workspace, real, data)
    except ToolError:  # refused, or the disk full: nothing changed, and an entry left would only make undo say so
        entry.file.unlink(missing_ok=True)
        raise  # (a stopped call keeps its entry: undo finds its file as before, or as written, and acts on either)
    if op == "overwrite":
        return f"replaced {rel} with {len(data)} bytes"
    if op == "append":
        return f"appended {len(data)} bytes to {rel}" + (" (on a new line: it did not end with one)" if newline else "")
    return f"wrote {len(data)} bytes to {rel}"


def _create(workspace: Workspace, real: Path, data: bytes) -> None:
    """Write a new file whole or not at all: a temporary file in its folder, fsynced, then hard-linked under its
    name (an existing name is refused, never replaced). A file system without hard links gets the file opened with
    O_EXCL and written in place (a stop midway can then leave it partly written)."""
    tmp = _temp_name(real)
    try:
        fd = workspace.open_regular(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.link(tmp, real, follow_symlinks=False)
    except FileExistsError:
        raise ToolError(f"refused: {workspace.rel(real)} exists (it appeared while the file was written)") from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV):
            raise ToolError(f"cannot write {workspace.rel(real)!r}: {e.strerror or e}") from None
        _create_in_place(workspace, real, data)
    finally:
        _unlink_quietly(tmp)


def _temp_name(real: Path) -> Path:
    """A hidden temporary file beside `real`, short (a name near NAME_MAX plus a suffix would not fit)."""
    return real.parent / f".sinkchat-{uuid.uuid4().hex[:12]}.tmp"


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def _append(workspace: Workspace, real: Path, data: bytes) -> None:
    """Append in place (O_APPEND: the same file, its owner, mode and hard links; a read-only file refused), and on
    any failure or stop midway cut it back to its size before: whole or not at all short of a SIGKILL mid-write."""
    fd = workspace.open_regular(real, os.O_WRONLY | os.O_APPEND)
    try:
        size = os.fstat(fd).st_size
        try:
            write_all(fd, data)
        except BaseException as e:  # a full disk, the call stopped (ToolCancelled): nothing of it stays
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            if isinstance(e, OSError):
                raise ToolError(f"cannot write {workspace.rel(real)!r}: {e.strerror or e}") from None
            raise
    finally:
        os.close(fd)


def _create_in_place(workspace: Workspace, real: Path, data: bytes) -> None:
    fd = workspace.open_regular(real, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        write_all(fd, data)
    except OSError as e:  # the file is ours (O_EXCL): a partial one goes
        real.unlink(missing_ok=True)
        raise ToolError(f"cannot write {workspace.rel(real)!r}: {e.strerror or e}") from None
    finally:
        os.close(fd)


def _replace(workspace: Workspace, real: Path, data: bytes) -> None:
    """Overwrite `real` whole or not at all: a temporary file in its folder (same permissions), then renamed over
    it, so a crash or a full disk midway never leaves the user's file truncated or half-written."""
    fd = workspace.open_regular(real, os.O_RDONLY)  # a regular file, not a symlink swapped in since
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
    tmp = _temp_name(real)
    try:
        fd = workspace.open_regular(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            write_all(fd, data)
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, real)
    except OSError as e:
        raise ToolError(f"cannot write {workspace.rel(real)!r}: {e.strerror or e}") from None
    finally:
        _unlink_quietly(tmp)


def _read(workspace: Workspace, real: os.PathLike[str]) -> bytes:
    fd = workspace.open_regular(real, os.O_RDONLY)  # type: ignore[arg-type]
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
