"""Slash-command completion for the chat prompt, apart from `commands` so that only a terminal session imports
prompt-toolkit (its completion and document modules: 0.1-0.26 s of a piped chat's start, which reads no prompt)."""

from __future__ import annotations

from typing import Iterable

from prompt_toolkit.completion import CompleteEvent, Completer, Completion, PathCompleter
from prompt_toolkit.document import Document

from sinkchat.apps.chat.commands import COMMANDS


class SlashCompleter(Completer):
    """Completes command names, then their fixed choices (/policy, /set) or paths (/save, /load)."""

    def __init__(self) -> None:
        self.paths = PathCompleter(expanduser=True)

    def get_completions(self, document: Document, event: CompleteEvent) -> Iterable[Completion]:
        text = document.text_before_cursor
        if not text.startswith("/"):
            return
        if " " not in text:
            for name, cmd in COMMANDS.items():
                if name.startswith(text):
                    yield Completion(name, -len(text), display_meta=cmd.help)
            return
        name, _, arg = text.partition(" ")
        cmd = COMMANDS.get(name)
        if cmd is None or " " in arg:
            return
        if cmd.paths:
            yield from self.paths.get_completions(Document(arg, len(arg)), event)
        for choice in cmd.choices:
            if choice.startswith(arg):
                yield Completion(choice, -len(arg))
