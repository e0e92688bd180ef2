"""The stream scenario of `sinkchat soak`: a text (a file, looped; or stdin until EOF) fed block by block."""

from __future__ import annotations

import codecs
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
        self.encode = engine.encode
        # where the reader stands, all of it a checkpoint's (state()): the lap of the file, the next byte to read in
        # it, the decoded text not yet cut at whitespace and the decoder's pending bytes (a character split by a read)
        self.lap, self.offset, self.rest, self.ended = 0, 0, "", False
        self.dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _read(self) -> bytes | None:
        """The next bytes of the input: the file looped (b"\\n\\n" between laps), or stdin; None at the end (stdin's
        EOF, an empty file)."""
        if self.path == "-":
            return sys.stdin.buffer.read(READ_BYTES) or None
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(READ_BYTES)
        except OSError as e:
            raise click.ClickException(f"cannot read {self.path}: {e.strerror}") from None
        if data:
            self.offset += len(data)
            return data
        if self.offset == 0:
            return None  # an empty file (emptied since the check)
        log.info("stream: lap %d of %s done", self.lap + 1, self.path)
        self.lap, self.offset = self.lap + 1, 0
        return b"\n\n"

    def _next_piece(self) -> str | None:
        """Decoded text cut at whitespace (invalid UTF-8 becomes U+FFFD rather than an error); None at the end."""
        while not self.ended:
            data = self._read()
            if data is None:
                self.ended = True
                tail, self.rest = self.rest + self.dec.decode(b"", final=True), ""
                return tail if tail.strip() else None
            text = self.rest + self.dec.decode(data)
            cut = max(text.rfind(" "), text.rfind("\n"))
            if cut <= 0 and len(text) > 4 * READ_BYTES:  # one endless "word" (a 10 MB line): cut it anyway
                cut = len(text)
            if cut <= 0:
                self.rest = text
                continue
            self.rest = text[cut:]
            return text[:cut]
        return None

    @property
    def resumable(self) -> bool:
        """A file can be read again from where a checkpoint stood; stdin cannot (its runs take no checkpoints)."""
        return self.path != "-"

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (checkpoint.py): the tokens read but not fed and where the reader stands. A
        stream from stdin cannot be read again: CheckpointError."""
        from sinkchat.apps.soak.checkpoint import CheckpointError

        if self.path == "-":
            raise CheckpointError("a stream from stdin cannot be resumed (what was read is gone)")
        pending, flag = self.dec.getstate()
        return {"ids": list(self.ids), "lap": self.lap, "offset": self.offset, "rest": self.rest,
                "ended": self.ended, "pending": pending.hex(), "flag": flag}

    def load_state(self, d: dict[str, Any]) -> None:
        self.ids = deque(int(i) for i in d["ids"])
        self.lap, self.offset, self.rest, self.ended = int(d["lap"]), int(d["offset"]), str(d["rest"]), d["ended"]
        self.dec.setstate((bytes.fromhex(d["pending"]), int(d["flag"])))

    def step(self, engine: Any) -> Iterator[Any]:
        if self.bos and len(engine.ledger) == 0 and (not self.ids or self.ids[0] != self.bos[0]):
            self.ids.appendleft(self.bos[0])  # the start of the stream, or of a cache cleared by recovery
        while len(self.ids) < self.block:
            piece = self._next_piece()
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
