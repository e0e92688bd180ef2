"""The stream scenario of `sinkchat soak`: a text (a file, looped; or stdin until EOF) fed block by block."""

from __future__ import annotations

import codecs
import itertools
import logging
import sys
from collections import deque
from pathlib import Path
from typing import Any, Iterator

import click

from sinkchat.apps.soak.steps import InputExhausted, Outcome, logged, recover
from sinkchat.core.events import PrefillEvent
from sinkchat.store.sessionlog import NullLog

log = logging.getLogger(__name__)

READ_BYTES = 1 << 18


class StreamScenario:
    """Feeds a text (a file, looped; or stdin until EOF) block by block, scoring every token through the cache."""

    name = "stream"
    unit = "blocks fed"
    recall_style = "text"  # --memory on: facts planted and asked as raw text in the stream (recall.py)
    recover = staticmethod(recover)
    slog: Any = NullLog()

    def __init__(self, engine: Any, path: str, block: int | None = None) -> None:
        self.path, self.block = path, block or engine.max_chunk
        self.ids: deque[int] = deque()
        # a stream starts with the BOS where the model was trained with one (Gemma): without it a Gemma 3 270M soak
        # read its sink gauge as 0.00 and scored the text worse (`Engine.encode_document`, as ppl / demo / bench)
        self.bos = engine.encode_document("")[:1]
        self.pieces = self._pieces()
        self.encode = engine.encode

    def _read_chunks(self) -> Iterator[bytes]:
        if self.path == "-":
            while data := sys.stdin.buffer.read(READ_BYTES):
                yield data
            return
        for lap in itertools.count():
            try:
                with open(self.path, "rb") as f:
                    got = False
                    while data := f.read(READ_BYTES):
                        got = True
                        yield data
            except OSError as e:
                raise click.ClickException(f"cannot read {self.path}: {e.strerror}") from None
            if not got:
                return
            log.info("stream: lap %d of %s done", lap + 1, self.path)
            yield b"\n\n"

    def _pieces(self) -> Iterator[str]:
        """Decoded text cut at whitespace (invalid UTF-8 becomes U+FFFD rather than an error)."""
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        rest = ""
        for data in self._read_chunks():
            text = rest + dec.decode(data)
            cut = max(text.rfind(" "), text.rfind("\n"))
            if cut <= 0 and len(text) > 4 * READ_BYTES:  # one endless "word" (a 10 MB line): cut it anyway
                cut = len(text)
            if cut <= 0:
                rest = text
                continue
            rest = text[cut:]
            yield text[:cut]
        tail = rest + dec.decode(b"", final=True)
        if tail.strip():
            yield tail

    def step(self, engine: Any) -> Iterator[Any]:
        if self.bos and len(engine.ledger) == 0 and (not self.ids or self.ids[0] != self.bos[0]):
            self.ids.appendleft(self.bos[0])  # the start of the stream, or of a cache cleared by recovery
        while len(self.ids) < self.block:
            piece = next(self.pieces, None)
            if piece is None:
                break
            self.ids.extend(self.encode(piece))
        if not self.ids:
            raise InputExhausted()
        block = [self.ids.popleft() for _ in range(min(self.block, len(self.ids)))]
        engine.gauge.armed = True  # keep the last fed token's queries: the gauge for this block
        fed = 0
        try:
            for ev in logged(engine.feed_ids(block), self.slog):
                fed += ev.tokens if isinstance(ev, PrefillEvent) else 0
                yield ev
        finally:
            engine.gauge.armed = False
        g = engine.measure_gauge()
        if g is not None:
            yield g
        yield Outcome(fed == len(block), f"{fed} of {len(block)} tokens fed")


def check_input(path: str | None) -> None:
    """Reject a missing or empty --input before the model is loaded (stdin can only be judged by reading it)."""
    if not path:
        raise click.UsageError("--scenario stream needs --input FILE or -")
    if path != "-" and not Path(path).is_file():
        raise click.UsageError(f"--input {path}: {'not a regular file' if Path(path).exists() else 'no such file'}")
    if path != "-" and Path(path).stat().st_size == 0:
        raise click.UsageError(f"--input {path} is empty")
