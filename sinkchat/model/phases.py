"""Seconds per phase of a model load, for benchmarks/startup.py."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("sinkchat.model.loader")  # the loader's logger: the benchmark listens there


class Phases:
    """Seconds per phase of a load (check, convert, config, tokenizer, weights), logged at debug level as each ends,
    so benchmarks/startup.py can say where a slow start spends its time (and which imports fell in which phase)."""

    def __init__(self) -> None:
        self.done: list[tuple[str, float]] = []
        self.t = time.perf_counter()

    def end(self, name: str) -> None:
        now = time.perf_counter()
        self.done.append((name, now - self.t))
        log.debug("phase %s: %.3f s", name, now - self.t)
        self.t = now
