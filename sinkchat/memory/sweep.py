"""Removing the recall-memory stores of processes that are gone.

A store lives in `<data dir>/memory/<time>-<pid>[-<hex>...]/` (bootstrap.open_memory; a restored or emptied one adds
a hex tag) and is removed by its own process when it ends. A process killed (kill -9, a crash, the machine taken
back) cannot: its store stayed, up to the disk budget (1 GiB by default) per crash. What it held that matters is in
the snapshots (their memory folders hard-link its segments) and soak checkpoints (likewise), never only in the
store, so a new memory removes the stores of processes that are gone. Each store names its owner in `owner.json`
(pid, start time, host: `claim`); a store is removed only when that owner ran on this host and is gone (no such
process, or its pid now names a process started at another time), and the folder holds nothing but segments and
that file: never what sinkchat did not write, never a store without an owner file, never one of another machine or
container (another host name) sharing the data dir.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
from pathlib import Path

log = logging.getLogger(__name__)

OWNER = "owner.json"
STORE_NAME = re.compile(r"\d{8}-\d{6}-(\d+)(?:-[0-9a-f]{6,8})*")  # `<time>-<pid>`, restored: `-<hex>` added


def owner(root: Path) -> int | None:
    """The pid in a store folder's name (None: not a store's name)."""
    m = STORE_NAME.fullmatch(root.name)
    return int(m.group(1)) if m else None


def pid_runs(pid: int) -> bool:
    """A process `pid` exists here (our own pid counts: it names another store only across pid namespaces)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, another user's
        return True
    return True


def only_segments(root: Path) -> bool:
    """The folder holds nothing but segment files (and its owner file)."""
    try:
        return all(p.is_file() and (p.name == OWNER or p.name.startswith("seg-") and p.name.endswith(".mem"))
                   for p in root.iterdir())
    except OSError:
        return False


def claim(root: Path) -> None:
    """Name this process as the store's owner (`owner.json`); a store that cannot say is never swept."""
    import psutil

    try:
        started: float | None = psutil.Process().create_time()
    except (psutil.Error, OSError):
        started = None
    with contextlib.suppress(OSError):
        (root / OWNER).write_text(json.dumps({"pid": os.getpid(), "started": started, "host": socket.gethostname()}))


def owner_gone(root: Path) -> bool:
    """The store's owner ran on this host and is gone (see the module docstring); False whenever unsure."""
    import psutil

    try:
        who = json.loads((root / OWNER).read_text())
        pid, started = int(who["pid"]), who.get("started")
        if who.get("host") != socket.gethostname() or pid == os.getpid():
            return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return True
        return started is not None and abs(proc.create_time() - float(started)) > 1.0  # the pid reused
    except psutil.NoSuchProcess:
        return True
    except (psutil.Error, OSError):
        return False


def sweep_dead_stores(parent: Path, keep: Path | None = None) -> list[Path]:
    """Remove the store folders under `parent` whose process is gone (see the module docstring) but `keep`;
    the folders removed."""
    try:
        roots = sorted(p for p in parent.iterdir() if p.is_dir())
    except OSError:
        return []
    gone = []
    for root in roots:
        if root == keep or owner(root) is None or not owner_gone(root) or not only_segments(root):
            continue
        shutil.rmtree(root, ignore_errors=True)
        if not root.exists():
            gone.append(root)
            log.info("removed the memory store of a process that ended without removing it: %s", root)
    return gone
