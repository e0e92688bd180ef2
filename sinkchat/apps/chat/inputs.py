"""Where the chat REPL's lines come from: a byte stream (piped stdin), a list (tests), or a prompt-toolkit
PromptSession on a terminal (history, emacs keys, slash completion, Esc-Enter newline, the live toolbar).

Kept apart from the loop in `repl` so it stays about turning lines into turns; each source is a `Reader`:
read(continuation) -> one line, EOFError at the end, KeyboardInterrupt to cancel the line.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

from sinkchat.private import private_dir, private_file

log = logging.getLogger(__name__)

Reader = Callable[[bool], str]  # read(continuation) -> one line; EOFError ends, KeyboardInterrupt cancels the line


def stream_reader(stream: BinaryIO) -> Reader:
    """Lines from a byte stream; invalid UTF-8 becomes U+FFFD rather than a traceback."""

    def read(_continuation: bool) -> str:
        raw = stream.readline()
        if not raw:
            raise EOFError
        return raw.decode("utf-8", errors="replace").rstrip("\r\n")

    return read


def lines_reader(lines: list[str]) -> Reader:
    it: Iterator[str] = iter(lines)

    def read(_continuation: bool) -> str:
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    return read


def make_prompt_session(loop: Any, history_file: Path | None = None) -> Any:
    """A PromptSession: file history, emacs keys, slash completion, Esc-Enter newline, `loop.toolbar` live."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory, History, InMemoryHistory
    from prompt_toolkit.key_binding import KeyBindings
    from prompt_toolkit.styles import Style

    from sinkchat.apps.chat.completion import SlashCompleter

    kb = KeyBindings()

    @kb.add("escape", "enter")  # Alt-Enter arrives as Esc-Enter
    def _newline(event: Any) -> None:
        event.current_buffer.insert_text("\n")

    history: History = InMemoryHistory()
    if history_file is not None:
        try:
            private_file(private_dir(history_file.parent) / history_file.name)  # what the user typed: 0600
            history = FileHistory(str(history_file))
        except OSError as e:
            log.warning("history disabled: cannot write %s (%s)", history_file, e.strerror)
    style = Style.from_dict({
        "bottom-toolbar": "noreverse bg:#202020 #d0d0d0", "toolbar.policy": "bg:#005f87 #ffffff bold",
        "toolbar.kv": "bg:#303030 #87d7ff", "toolbar.evicted": "bg:#303030 #ffaf5f", "toolbar.gauge": "#5fd75f",
        "toolbar.memory": "bg:#303030 #d7afff",
        "prompt": "bold #5fafff",
    })
    return PromptSession(history=history, key_bindings=kb, completer=SlashCompleter(), complete_while_typing=True,
                         bottom_toolbar=loop.toolbar, refresh_interval=0.5, style=style, enable_open_in_editor=True,
                         prompt_continuation=lambda width, n, soft: "... ".rjust(width))


def prompt_reader(session: Any) -> Reader:
    def read(continuation: bool) -> str:
        return session.prompt([("class:prompt", "... " if continuation else ">>> ")])

    return read
