"""Removing the recall-memory stores of processes that are gone.

A store lives in `<data dir>/memory/<time>-<pid>[-<hex>...]/` (bootstrap.open_memory; a restored one adds a hex
tag) and is removed by its own process when it ends. A process killed (kill -9, a crash, the machine taken back)
cannot: its store stayed, up to the disk budget (1 GiB by default) per crash. What it held that matters is in the
snapshots (their memory folders hard-link its segments) and soak checkpoints (likewise), never only in the store,
so a new memory removes the stores of processes that no longer run. Only folders named as stores are named, whose
pid is not running on this machine and that hold nothing but segment files: never what sinkchat did not write.
(A data dir shared by machines over a network could name a process of another machine, which looks dead here:
the rule is the soak's own, `apps/soak/checkpoint.remove_dead_stores`.)
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

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
    try:
        return all(p.is_file() and p.name.startswith("seg-") and p.name.endswith(".mem") for p in root.iterdir())
    except OSError:
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
        pid = owner(root)
        if root == keep or pid is None or pid_runs(pid) or not only_segments(root):
            continue
        shutil.rmtree(root, ignore_errors=True)
        if not root.exists():
            gone.append(root)
            log.info("removed the memory store of process %d, which ended without removing it: %s", pid, root)
    return gone
