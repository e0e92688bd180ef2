"""SIGTERM in the chat REPL: the session ends as /bye ends it (kept apart from `repl`, which re-exports it as
`_sigterm_exits`)."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator


@contextmanager
def sigterm_exits() -> Iterator[Callable[[], None]]:
    """SIGTERM (`kill`, a service manager, `timeout`) ends chat as /bye does, with exit status 143: SystemExit at
    the next safe point (the Engine holds it through a cache-and-ledger update, as it holds Ctrl-C), so the session
    log is closed and `sinkchat logs` lists the session as ended, not crashed. Only the first one, and none once the
    caller says it is closing (the callable yielded): a SIGTERM while the log closes (a service manager repeating
    itself, or one after /bye) is ignored, not a SystemExit inside the close."""
    ending: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return

    def on_term(signum: int, frame: Any) -> None:
        if not ending:
            ending.append(signum)
            raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield lambda: ending.append(0)
    finally:
        signal.signal(signal.SIGTERM, old)
