"""While the chat's model loads on a terminal under a rich status spinner: the log lines written meanwhile (e.g.
"no chat template: plain completion, ...") are held and shown after it, not inside its line."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Iterator


class _Held(logging.Handler):
    """Keeps the records it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def logs_after_spinner(console: Any) -> Iterator[None]:
    """sinkchat's log lines while the load spinner runs, printed (the message alone) once it has gone: written to
    stderr meanwhile they landed inside the spinner's line, e.g. "⠧ loading model.gguf (q4, cpu)WARNING
    sinkchat.core.plain: no chat template: ..." (measured on Gemma 3 270M in a terminal)."""
    from rich.text import Text

    logger, held = logging.getLogger("sinkchat"), _Held()
    propagate, logger.propagate = logger.propagate, False
    logger.addHandler(held)
    try:
        yield
    finally:
        logger.removeHandler(held)
        logger.propagate = propagate
        for rec in held.records:
            style = "yellow" if rec.levelno >= logging.WARNING else "dim"
            console.print(Text(rec.getMessage(), style=style), soft_wrap=True)  # one line: the terminal wraps it
