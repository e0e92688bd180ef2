"""What the chat's session code and slash commands need from the REPL loop, as a Protocol.

`session` and `commands` act on the running loop, but must not import `repl` (which imports them): they type their
argument as `ChatHost`, the loop satisfies it structurally, and imports point one way, host <- session <- commands
<- repl.
"""

from __future__ import annotations

from typing import Any, Protocol

from sinkchat.apps.render import Renderer
from sinkchat.core.metrics import Metrics, Stats


class ChatHost(Protocol):
    """The REPL loop as seen by session handling and slash commands."""

    engine: Any
    r: Renderer
    metrics: Metrics
    slog: Any  # a SessionLog, or a NullLog with --no-log
    auto_snapshot: Any  # an AutoSnapshot with --snapshot-every, else None
    interactive: bool
    settings: Any  # the run's Settings (what /memory on opens a memory with), or None: the defaults
    sampling_flags: dict[str, Any]  # the sampling flags typed for this run (`session.sampling_flags`)
    last_recalled: list[Any]  # the blocks the last reply read from the recall memory (`report.Recalled`)
    recall_tally: list[int]  # [replies that read the memory, blocks they read] this session

    def stats(self) -> Stats: ...

    def memory_stats(self) -> Any: ...

    def turn(self, text: str, log_user: bool = True) -> Any: ...

    def feed_message(self, role: str, content: str, quiet: bool = False) -> int: ...

    def on_event(self, ev: Any) -> None: ...
