"""Ctrl-C that never tears the cache: a SIGINT landing inside a bookkeeping step is held until the step is done.

Python raises KeyboardInterrupt between any two bytecodes, so an interrupt can land after the cache has shifted its
keys but before the ledger has dropped the same tokens, or after a forward pass has written K/V but before the
ledger recorded the ids. `deferred_sigint()` holds SIGINT for such a critical section and delivers it right after;
inside it, `guard.interruptible()` reopens a span (the model call itself) where Ctrl-C acts at once, so a long
prefill still stops promptly and is rolled back by its caller.

Signals are only delivered to the main thread, so off the main thread this is a no-op.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from types import FrameType
from typing import Any, Iterator


class _Guard:
    def __init__(self) -> None:
        self.open = False  # True while an interrupt may be raised at once
        self.pending = False

    def handler(self, signum: int, frame: FrameType | None) -> None:
        if self.open:
            raise KeyboardInterrupt
        self.pending = True

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        """Within a deferred section: let Ctrl-C raise immediately (and drop any interrupt already held)."""
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt
        self.open = True
        try:
            yield
        finally:
            self.open = False


class _NoGuard(_Guard):
    @contextmanager
    def interruptible(self) -> Iterator[None]:
        yield


@contextmanager
def deferred_sigint() -> Iterator[_Guard]:
    """Hold SIGINT for the body; re-deliver it to the previous handler when the body ends without an error."""
    if threading.current_thread() is not threading.main_thread():
        yield _NoGuard()
        return
    guard = _Guard()
    old: Any = signal.signal(signal.SIGINT, guard.handler)
    try:
        yield guard
    finally:
        signal.signal(signal.SIGINT, old)
    if guard.pending:
        _deliver(old)


def _deliver(old: Any) -> None:
    if callable(old):
        old(signal.SIGINT, None)  # default_int_handler raises KeyboardInterrupt; an outer guard defers again
    elif old == signal.SIG_DFL:
        raise KeyboardInterrupt
