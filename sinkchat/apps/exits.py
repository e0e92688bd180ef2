"""How a finished command ends its process: `exit_now` skips the interpreter's teardown (of torch, mostly) once a
command says its work is written and closed (`allow_fast_exit`). Here, not in `cli`, so an app can allow it without
importing the command line above it."""

from __future__ import annotations

import os
import sys

_FAST_EXIT = {"allowed": False}  # set by a command that ended with its work done (`allow_fast_exit`)


def allow_fast_exit() -> None:
    """Let `run` end this process with `exit_now` once the command returns with status 0: the command has closed
    what it wrote (its session log, snapshots) and the rest is only the interpreter tearing down torch."""
    _FAST_EXIT["allowed"] = True


def exit_now(code: int = 0) -> None:
    """End the process the way the interpreter would, less its teardown: a piped chat's answer is written and its
    log closed, then freeing torch's thousands of modules and objects took 2.7-3.0 s on the busy 2-core box (from
    the last atexit handler to the process's end; 0.1-0.15 s with this) for nothing anyone reads. Every atexit handler
    runs (logging's flush, the recall memory's removal, weakref finalizers such as temporary folders), then Python's
    and C's stdio buffers are flushed, then `os._exit`. Returns instead (a normal exit follows) while a non-daemon
    thread runs (the interpreter would wait for it) or when stdout cannot be flushed (a closed pipe: Python's own
    message and status 120)."""
    import atexit
    import threading

    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        return
    atexit._run_exitfuncs()  # (they are run once: the interpreter's exit finds none left)
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except (OSError, ValueError):
        return
    if "ctypes" in sys.modules:  # C code's own stdio buffers (`exit` flushes them, `_exit` does not)
        import ctypes

        try:
            ctypes.CDLL(None).fflush(None)
        except (OSError, AttributeError, TypeError):  # no C library by that name here: nothing of ours buffered
            pass
    os._exit(code)


def fast_exit_allowed() -> bool:
    return _FAST_EXIT["allowed"]


def reset() -> None:
    _FAST_EXIT["allowed"] = False
