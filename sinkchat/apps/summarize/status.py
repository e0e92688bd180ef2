"""`sinkchat summarize`'s progress line on stderr (split from summarizer.py, which holds the loop)."""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, TextIO

LIVE_EVERY = 0.25  # status refresh on a terminal
PLAIN_EVERY = 10.0  # plain status lines when stderr is not a terminal


class Status:
    """Progress on stderr: one live line on a terminal, a plain line every PLAIN_EVERY seconds otherwise.

    `line(width)` builds the status for `width` columns (None: no limit); on a terminal it is given the terminal's
    width, so the line drops lower-priority fields whole instead of being cut mid-field by the edge."""

    def __init__(self, stream: TextIO, quiet: bool, line: Callable[[int | None], str] | None = None) -> None:
        self.stream, self.quiet = stream, quiet
        self.line = line
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.every = LIVE_EVERY if self.tty else PLAIN_EVERY
        self.last = time.monotonic()
        self.live = False
        self.fresh = False  # the last thing written is a plain status line: `done` need not repeat it

    def _write(self, text: str) -> None:
        self.fresh = False
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            self.quiet = True  # stderr is gone; keep working without it

    def clear(self) -> None:
        if self.live:
            self._write("\r\x1b[K")
            self.live = False

    def notice(self, message: str) -> None:
        if not self.quiet:
            self.clear()
            self._write(f"sinkchat: {message}\n")

    def done(self) -> None:
        """The last status, left on screen as a plain line; not again when the final block's status line was the
        last thing written (it was printed twice after every run to a non-terminal)."""
        if not self.quiet and self.line is not None and not self.fresh:
            self.clear()
            self._write(self.line(None) + "\n")

    def tick(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.quiet or self.line is None or (not force and now - self.last < self.every):
            return
        self.last = now
        if self.tty:
            width = max(20, _term_width() - 1)
            self._write("\r\x1b[K" + self.line(width)[:width])  # fitted: the cut is a last resort, never reached
            self.live = True
        else:
            self._write(self.line(None) + "\n")
            self.fresh = True


def _term_width() -> int:
    """stderr's columns (where the live line goes); 120 when it is no terminal."""
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns or 120
    except (OSError, ValueError):
        return 120
