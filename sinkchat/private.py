"""Folders and files readable by the user alone: what sinkchat keeps holds the user's conversations (the log
database, the input history, snapshots, the recall memory's keys and values). A leaf: the store and the memory
both make their folders with it."""

from __future__ import annotations

import os
from pathlib import Path


def private_dir(path: Path) -> Path:
    """`path` and every missing folder above it created readable by the user alone (0700; `mkdir(parents=True)`
    gives the parents the umask's 0755); folders that exist are left as they are (SINKCHAT_HOME may be shared)."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir(mode=0o700, exist_ok=True)
    return path


def private_file(path: Path) -> Path:
    """`path` created if missing, and readable by the user alone (0600) either way."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600))
    os.chmod(path, 0o600)
    return path
