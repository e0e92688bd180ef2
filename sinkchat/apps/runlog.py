"""Session logging for every client: open the SQLite log for a run, and count the tokens the model processed.

Chat logs its own turns (apps/chat/session.py), the agent through `apps/agent/log.py`, `summarize` per summary;
all open their log here, so `sinkchat logs` lists every kind of session. What is stored is what the user gave and
the model produced: an agent's tasks, each model reply, tool calls with their results and evictions; for `summarize`, each summary question
(with its line range) and the summary itself plus the per-summary figures, but not the raw log lines, which stay in
the user's own log file (a `tail -f` running for weeks would otherwise copy the whole log into the database).

The session's token total (the TOKENS column of `sinkchat logs`) is not the sum of its turns: an agent's tool
results, summarize's log lines and a compacted conversation's closing are fed between turns, in no turn. It comes
from a `ForwardTally` on the engine, the one counter the soak report reads too, so the two always agree.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Callable


class ForwardTally:
    """Every token the model processed (fed or generated, an end-of-turn token too) and the longest the cache got:
    a view of the engine's own counters, `Engine.processed` and `Engine.take_peak`, kept in `Engine._forward`,
    through which every prefill chunk and every generated token passes (an interrupted call raises and counts
    nothing, as its tokens were taken back).

    Why not count events: a generated EOS has no TokenEvent, tokens fed between turns are in no turn, and sampling
    `cache.length` now and then misses the peak of a task the agent then rewinds."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @classmethod
    def of(cls, engine: Any) -> ForwardTally | None:
        """The engine's tally; None for an engine double that keeps no such counters (no model call to count)."""
        if not isinstance(getattr(engine, "processed", None), int) or not callable(getattr(engine, "take_peak", None)):
            return None
        return cls(engine)

    @property
    def tokens(self) -> int:
        return int(self.engine.processed)

    def take_peak(self) -> int:
        """The longest the cache was since the last call (or since the engine was built); starts over from now."""
        return int(self.engine.take_peak())


def open_log(engine: Any, mode: str, no_log: bool, system: str | None, warn: Callable[[str], None],
             resume_id: int | None = None, extra: dict[str, Any] | None = None,
             tokens_before: int | None = None, drop_after: float | None = None) -> Any:
    """A SessionLog (or NullLog with --no-log / an unusable log dir). Only settings and text are stored; the log
    counts the tokens the engine processes from now on (resumed: on top of what the session had counted)."""
    from sinkchat.store.sessionlog import NullLog, SessionLog

    if no_log:
        return NullLog()
    counter = _counter(ForwardTally.of(engine))
    if resume_id is not None:
        return SessionLog.resume(resume_id, warn=warn, tokens=counter, tokens_before=tokens_before,
                                 drop_after=drop_after)
    loaded = getattr(engine, "loaded", None)
    settings = {"cache": asdict(engine.cache_cfg), "sampling": asdict(engine.sampling),
                "quant": getattr(loaded, "quant", None), **(extra or {})}
    return SessionLog.open(mode, getattr(loaded, "source", None), settings, system=system, warn=warn,
                           tokens=counter)


def _counter(tally: ForwardTally | None) -> Callable[[], int] | None:
    """The tokens processed from now on, as the session log reads them at each write (None: nothing to count)."""
    if tally is None:
        return None
    start = tally.tokens
    return lambda: tally.tokens - start


class SharedTally:
    """Token counts per session on one engine that several sessions take turns on (`serve`: one request at a time,
    each session installed in the engine for its request). `switch(key)` is called when a session is installed
    (key None: a session that is not logged); the tokens the engine processes until the next switch are that
    session's. `counter(key)` is what its SessionLog reads: that session's tokens since the counter was made."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.counted = ForwardTally.of(engine) is not None  # False: an engine double, nothing to count
        self.current: Any = None
        self.mark = self._now()
        self.done: dict[Any, int] = {}

    def _now(self) -> int:
        return int(self.engine.processed) if self.counted else 0

    def switch(self, key: Any) -> None:
        now = self._now()
        if self.current is not None:
            self.done[self.current] = self.done.get(self.current, 0) + now - self.mark
        self.current, self.mark = key, now

    def total(self, key: Any) -> int:
        live = self._now() - self.mark if key is not None and key == self.current else 0
        return self.done.get(key, 0) + live

    def counter(self, key: Any) -> Callable[[], int] | None:
        """None where the engine keeps no counter (the log then shows the tokens of the turns)."""
        if not self.counted:
            return None
        start = self.total(key)
        return lambda: self.total(key) - start
