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
        self.pending: int | None = None  # the signal held back
        self.old: dict[int, Any] = {}

    def handler(self, signum: int, frame: FrameType | None) -> None:
        if self.open:
            _deliver(self.old.get(signum), signum)
        elif self.pending is None or signum == signal.SIGTERM:
            self.pending = signum

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        """Within a deferred section: let Ctrl-C raise immediately (and deliver any signal already held)."""
        if self.pending is not None:
            signum, self.pending = self.pending, None
            _deliver(self.old.get(signum), signum)
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
    """Hold SIGINT (and SIGTERM, where a Python handler turns it into an exception, as `summarize` and `soak` do)
    for the body; re-deliver it to the previous handler when the body ends without an error."""
    if threading.current_thread() is not threading.main_thread():
        yield _NoGuard()
        return
    guard = _Guard()
    guard.old[signal.SIGINT] = signal.signal(signal.SIGINT, guard.handler)
    if callable(signal.getsignal(signal.SIGTERM)):
        guard.old[signal.SIGTERM] = signal.signal(signal.SIGTERM, guard.handler)
    try:
        yield guard
    finally:
        for signum, old in guard.old.items():
            signal.signal(signum, old)
    if guard.pending is not None:
        _deliver(guard.old.get(guard.pending), guard.pending)


def _deliver(old: Any, signum: int) -> None:
    if callable(old):
        old(signum, None)  # default_int_handler raises KeyboardInterrupt; an outer guard defers again
    elif old == signal.SIG_DFL and signum == signal.SIGINT:
        raise KeyboardInterrupt
    elif old == signal.SIG_DFL:
        signal.raise_signal(signum)
