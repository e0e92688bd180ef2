"""SIGTERM and SIGHUP in the chat REPL: the session ends as /bye ends it (kept apart from `repl`, which re-exports
it as `_sigterm_exits`)."""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator


@contextmanager
def sigterm_exits() -> Iterator[Callable[[], None]]:
    """SIGTERM (`kill`, a service manager, `timeout`) ends chat as /bye does, with exit status 143 (SIGHUP, the
    terminal gone: 129, its output dropped, `_detach_output`): SystemExit at the next safe point (the Engine holds
    it through a cache-and-ledger update, as it holds Ctrl-C), so the session log is closed and `sinkchat logs` lists the session as ended, not crashed. Only the first one, and none once the
    caller says it is closing (the callable yielded): a SIGTERM while the log closes (a service manager repeating
    itself, or one after /bye) is ignored, not a SystemExit inside the close."""
    ending: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return

    def on_term(signum: int, frame: Any) -> None:
        if not ending:
            ending.append(signum)
            if signum == getattr(signal, "SIGHUP", None):
                _detach_output()
            raise SystemExit(128 + signum)

    sigs = [signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    old = {sig: signal.signal(sig, on_term) for sig in sigs}
    try:
        yield lambda: ending.append(0)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _detach_output() -> None:
    """SIGHUP: the terminal is gone (its window closed, an ssh connection dropped). Before, the default action
    killed the chat: `sinkchat logs` listed the session as crashed and its recall memory's files stayed on disk
    until the next start (a user audit). Now it ends as /bye does, and what it still writes while closing goes
    to /dev/null: a write to a hung-up terminal fails (EIO) and would cut the close short."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    for fd in (1, 2):
        try:
            os.dup2(null, fd)
        except OSError:
            pass
    os.close(null)
