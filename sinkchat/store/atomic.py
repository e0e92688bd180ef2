"""Files written whole or not at all, and durably: the agent's undo journal, the soak's checkpoint pointer
and report (and its workspace copy), /save's transcripts (written 0600; folders for the user alone: private.py)."""

from __future__ import annotations

import os
import stat
import uuid
from pathlib import Path



def write_all(fd: int, data: bytes) -> None:
    """All of `data` to `fd` (os.write may write less than asked)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_synced(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write `path` (created with `mode`) and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), mode)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write `path` whole or not at all: a temporary file in its folder, fsynced, then renamed over it."""
    tmp = path.parent / f".{path.name}.sinkchat-{uuid.uuid4().hex[:8]}"
    try:
        write_synced(tmp, data, 0o644 if mode is None else mode)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def fsync_dir(d: Path) -> None:
    """Make a rename in `d` durable (a filesystem that cannot fsync a directory: the rename is still atomic)."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every regular file under `root` and every folder (a copy made with shutil, which does not: a power cut
    after the copy could leave its files empty)."""
    for folder, _dirs, files in os.walk(root):
        for name in files:
            try:
                fd = os.open(os.path.join(folder, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:  # a symlink (copied as one) or a special file: nothing to sync
                continue
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(folder))
