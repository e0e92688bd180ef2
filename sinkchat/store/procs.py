"""Which process holds a session open, and whether it still runs.

A session row that has no `ended` time is either still being written (a `summarize` of a `tail -f` may run for
weeks) or was left by a process that crashed or was killed. The pid alone cannot tell: pids are reused, so a
crashed session's pid may belong to some unrelated process by the time anyone looks. The pid together with the
process's start time names one process for good; the host name keeps a log on a shared disk from judging another
machine's pids by this machine's process table.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import psutil

START_TOLERANCE_S = 1.0  # create_time is boot time + clock ticks: the same process can read a little differently


@dataclass(frozen=True)
class ProcessId:
    """One process for good: pid, start time (seconds since the epoch), host."""

    pid: int
    started: float | None
    host: str


def current() -> ProcessId:
    """This process, as a session row records it."""
    return identify(os.getpid())


def identify(pid: int) -> ProcessId:
    """The identity of a running process (start time None if it cannot be read)."""
    try:
        started: float | None = psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        started = None
    return ProcessId(pid, started, socket.gethostname())


def liveness(pid: int | None, started: float | None, host: str | None) -> str:
    """'running' (that very process is alive on this host), 'crashed' (it is gone, a zombie, or its pid now names
    a process that started at another time), 'other host' (cannot be checked from here), or 'unknown' (no pid
    recorded: a session written by an older sinkchat)."""
    if pid is None:
        return "unknown"
    if host and host != socket.gethostname():
        return "other host"
    try:
        proc = psutil.Process(int(pid))
        if proc.status() == psutil.STATUS_ZOMBIE:
            return "crashed"
        if started is not None and abs(proc.create_time() - float(started)) > START_TOLERANCE_S:
            return "crashed"  # the pid was reused
    except psutil.NoSuchProcess:
        return "crashed"
    except (psutil.Error, OSError):  # e.g. access denied: it exists, and we cannot tell more
        return "running"
    return "running"
