"""Path safety for the file tools: the one folder they are confined to, and what they may open in it.

Paths are resolved (symlinks included) and refused when they leave the workspace or name anything but a regular
file or directory (devices, fifos, sockets would block or stream forever). A workspace is never created by accident:
a mistyped `--workspace` must not become a new directory tree, so creating one is an explicit `create=True`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from sinkchat.apps.agent.tools.journal import Entry, Journal, JournalError
from sinkchat.apps.agent.tools.schema import ToolError


class WorkspaceError(ValueError):
    """The workspace folder is missing (and was not to be created) or is not a folder; one line for the user."""


class Workspace:
    """A directory the file tools are confined to. `resolve` is the one gate every path goes through.

    `create`: make the folder (and its parents) if it is missing; otherwise a missing folder is a WorkspaceError.
    `journal_dir`: where the undo journal of its file changes lives (default: under the user data dir, keyed by the
    folder's resolved path; see tools/journal.py)."""

    def __init__(self, root: str | os.PathLike[str], create: bool = False,
                 journal_dir: str | os.PathLike[str] | None = None) -> None:
        root_path = Path(root).expanduser()
        if root_path.exists() and not root_path.is_dir():
            raise WorkspaceError(f"workspace {root_path} is not a folder")
        if create:
            try:
                root_path.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise WorkspaceError(f"cannot create workspace {root_path}: {e.strerror or e}") from None
        elif not root_path.is_dir():
            raise WorkspaceError(f"workspace {root_path} does not exist")
        self.root = Path(os.path.realpath(root_path))
        self._journal_dir = None if journal_dir is None else Path(journal_dir)
        self._journal: Journal | None = None

    @property
    def journal(self) -> Journal:
        """The undo journal every file-changing tool records into before it changes a file."""
        if self._journal is None:
            self._journal = Journal(self.root, self._journal_dir)
        return self._journal

    def record_change(self, real: Path, op: str, after: bytes | None) -> Entry:
        """Journal a change about to be made to `real`; a journal that cannot be written is a ToolError (and the
        tool then changes nothing: no change without its undo). The entry, to drop if the change then fails."""
        try:
            return self.journal.record(real, op, after)
        except JournalError as e:
            raise ToolError(f"refused: {e}") from None

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
