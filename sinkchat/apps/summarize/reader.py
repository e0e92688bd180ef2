"""The plumbing of `sinkchat summarize` around the model: reading lines as they arrive, cleaning, filtering, dedupe,
batching, accounting, and the output blocks.

No model here, so all of it is unit-testable in milliseconds. A reader thread turns bytes into numbered `Line`s and
puts them on a bounded queue, so a slow model never blocks reading and `--interval` works without EOF. Under
`--backpressure drop` a full queue drops lines in the reader; the next line (or `End`) carries how many were dropped
just before it, so the consumer can account for every input line number: each one ends up exactly once as
summarized, filtered, deduped or skipped (`Period`).
"""

from __future__ import annotations

import json
import os
import queue
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, TextIO

READ_SIZE = 65536
POLL_SECONDS = 0.2
ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-Z\\-_]")
CONTROL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


@dataclass(frozen=True)
class Line:
    """Input line `no` (1-based, over the whole run); `skipped_before` lines just before it were dropped."""

    no: int
    text: str
    skipped_before: int = 0
    truncated: bool = False


@dataclass(frozen=True)
class Notice:
    """Something the reader wants the user to know (file truncated, rotated, waiting for it to appear)."""

    message: str


@dataclass(frozen=True)
class End:
    """No more input: `last_no` lines were read in all; `skipped_before` were dropped just before the end."""

    last_no: int
    skipped_before: int = 0
    error: str | None = None


Item = Line | Notice | End


# ------------------------------------------------------------------------------------------------- bytes -> lines
class LineSplitter:
    """Splits a byte stream into lines in bounded memory: a line keeps at most `limit` bytes, the rest is only
    counted (a 10 MB line costs `limit` bytes, not 10 MB). Handles lines split across reads."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self.buf = bytearray()
        self.total = 0  # bytes of the current line seen so far, kept or not

    def feed(self, data: bytes) -> list[tuple[bytes, int]]:
        """Complete lines in `data` as (kept bytes, total bytes), newline excluded."""
        out = []
        start = 0
        while True:
            i = data.find(b"\n", start)
            if i < 0:
                break
            self._append(data[start:i])
            out.append(self._take())
            start = i + 1
        self._append(data[start:])
        return out

    def flush(self) -> tuple[bytes, int] | None:
        """The partial last line (input ended or the file changed under us), if any."""
        return self._take() if self.total else None

    def _append(self, piece: bytes) -> None:
        room = self.limit - len(self.buf)
        if room > 0:
            self.buf += piece[:room]
        self.total += len(piece)

    def _take(self) -> tuple[bytes, int]:
        line = (bytes(self.buf), self.total)
        self.buf.clear()
        self.total = 0
        return line


def clean_line(raw: bytes, total: int, max_chars: int) -> tuple[str, bool]:
    """UTF-8 with replacement, CR stripped, ANSI colours removed, other control bytes shown as U+FFFD, cut to
    `max_chars` with a marker that says how long the line really was. Returns (text, truncated)."""
    text = raw.decode("utf-8", errors="replace")
    if text.endswith("\r") and total == len(raw):
        text = text[:-1]
    text = CONTROL_RE.sub("\ufffd", ANSI_RE.sub("", text)).replace("\r", "")
    cut = total > len(raw) or len(text) > max_chars
    if cut:
        size = f"{total} bytes" if total > len(raw) else f"{len(text)} chars"
        text = text[:max_chars] + f" …[line truncated, {size}]"
    return text, cut


# ------------------------------------------------------------------------------------------------- byte sources
def stream_chunks(stream: Any, stop: threading.Event) -> Iterator[bytes]:
    """Bytes from a binary stream as they arrive, without waiting to fill a buffer. A real file descriptor is read
    with os.read: a daemon thread blocked inside a buffered read holds the buffer's lock, and the interpreter aborts
    at exit ("could not acquire lock ... at interpreter shutdown") when it then flushes or closes that stream."""
    try:
        fd = stream.fileno()
        read: Callable[[int], bytes] = lambda n: os.read(fd, n)  # noqa: E731
    except (AttributeError, OSError, ValueError):
        read = getattr(stream, "read1", None) or stream.read
    while not stop.is_set():
        data = read(READ_SIZE)
        if not data:
            return
        yield data


def follow_chunks(path: str, stop: threading.Event, notice: Callable[[str], None], from_end: bool = False,
                  poll: float = POLL_SECONDS) -> Iterator[bytes | None]:
    """`tail -F`: bytes appended to `path`, forever (until `stop`). Survives truncation (reads again from the start)
    and rotation (finishes the old file, then opens the new one from its start). Yields None at such a break, so
    the partial line before it is ended rather than glued to the new data."""
    f = None
    ident: tuple[int, int] | None = None
    waiting = False
    try:
        while not stop.is_set():
            if f is None:
                try:
                    f = open(path, "rb")  # noqa: SIM115 - kept open across iterations
                except FileNotFoundError:
                    if not waiting:
                        notice(f"{path}: not there (yet); waiting for it to appear")
                        waiting = True
                    stop.wait(poll)
                    continue
                except OSError as e:
                    raise OSError(f"cannot read {path}: {e.strerror}") from None
                waiting = False
                st = os.fstat(f.fileno())
                ident = (st.st_dev, st.st_ino)
                if from_end:
                    f.seek(0, os.SEEK_END)
                    from_end = False
            data = f.read1(READ_SIZE)
            if data:
                yield data
                continue
            try:
                st = os.stat(path)
            except FileNotFoundError:
                st = None
            if st is not None and (st.st_dev, st.st_ino) != ident:
                notice(f"{path}: file was replaced (rotated); following the new file from its start")
                f.close()
                f = None
                yield None
                continue
            if st is not None and st.st_size < f.tell():
                notice(f"{path}: file truncated; reading it again from the start")
                f.seek(0)
                yield None
                continue
            stop.wait(poll)
    finally:
        if f is not None:
            f.close()


# ------------------------------------------------------------------------------------------------- reader thread
class Reader(threading.Thread):
    """Turns byte chunks into numbered Lines on `q`. `drop`: a full queue drops the line (counted, reported with
    the next item); `block`: waits, which pushes back on the writer through the pipe."""

    def __init__(self, chunks: Iterable[bytes | None], q: "queue.Queue[Item]", *, max_line_chars: int,
                 backpressure: str = "block", stop: threading.Event | None = None) -> None:
        super().__init__(name="sinkchat-reader", daemon=True)
        self.chunks, self.q = chunks, q
        self.max_chars = max_line_chars
        self.backpressure = backpressure
        self.stop = stop or threading.Event()
        self.n = 0
        self.dropped = 0  # dropped since the last item that got through

    def run(self) -> None:
        splitter = LineSplitter(self.max_chars * 4 + 4)  # UTF-8 needs at most 4 bytes a character
        error = None
        try:
            for data in self.chunks:
                if self.stop.is_set():
                    break
                if data is None:
                    tail = splitter.flush()
                    lines = [tail] if tail else []
                else:
                    lines = splitter.feed(data)
                for raw, total in lines:
                    self._emit(raw, total)
            tail = splitter.flush()
            if tail and not self.stop.is_set():
                self._emit(*tail)
        except OSError as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - reported to the consumer as a one-line error, never a traceback
            error = f"{type(e).__name__}: {e}"
        self._put(End(self.n, self.dropped, error), force=True)

    def _emit(self, raw: bytes, total: int) -> None:
        self.n += 1
        if self.backpressure == "drop" and self.q.full():
            self.dropped += 1
            return
        text, cut = clean_line(raw, total, self.max_chars)
        if self._put(Line(self.n, text, self.dropped, cut), force=self.backpressure == "block"):
            self.dropped = 0
        else:
            self.dropped += 1

    def _put(self, item: Item, force: bool) -> bool:
        """Put without ever blocking forever: a stopped reader gives up."""
        if not force:
            try:
                self.q.put_nowait(item)
                return True
            except queue.Full:
                return False
        while not self.stop.is_set():
            try:
                self.q.put(item, timeout=POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def notice(self, message: str) -> None:
        """Notices bypass the bound (they are rare) so they are never lost to back-pressure."""
        with self.q.mutex:
            self.q.queue.append(Notice(message))
            self.q.unfinished_tasks += 1
            self.q.not_empty.notify()


# ------------------------------------------------------------------------------------------------- accounting
@dataclass
class Period:
    """Line accounting since the last summary: lines == summarized + filtered + deduped + skipped, and the lines are
    exactly first_line..last_line."""

    first_line: int = 0
    last_line: int = 0
    summarized: int = 0
    filtered: int = 0
    deduped: int = 0
    skipped: int = 0
    truncated: int = 0

    @property
    def lines(self) -> int:
        return self.summarized + self.filtered + self.deduped + self.skipped

    def add(self, kind: str, no: int, count: int = 1) -> None:
        """Account `count` lines ending at line `no` as `kind`."""
        if count <= 0:
            return
        if not self.first_line:
            self.first_line = no - count + 1
        self.last_line = no
        setattr(self, kind, getattr(self, kind) + count)

    def consistent(self) -> bool:
        return self.lines == (self.last_line - self.first_line + 1 if self.first_line else 0)


# ------------------------------------------------------------------------------------------------- filter + batch
@dataclass
class Batcher:
    """Filters (grep/exclude), dedupes runs of identical lines (the first is fed, the repeats are counted and fed
    as one short marker when the run ends) and groups fed lines into chunks of `chunk_lines` / `chunk_tokens`."""

    count_tokens: Callable[[str], int]
    chunk_lines: int = 32
    chunk_tokens: int = 256
    grep: re.Pattern[str] | None = None
    exclude: re.Pattern[str] | None = None
    dedupe: bool = True
    period: Period = field(default_factory=Period)
    chunk: list[str] = field(default_factory=list)
    chunk_tok: int = 0
    last_text: str | None = None
    repeats: int = 0

    def add(self, item: Line | End) -> None:
        """Account one item; the lines dropped before it count as skipped."""
        first_skipped = item.no if isinstance(item, Line) else item.last_no + 1
        self.period.add("skipped", first_skipped - 1, item.skipped_before)
        if isinstance(item, End):
            return
        if self.grep is not None and not self.grep.search(item.text):
            self.period.add("filtered", item.no)
            return
        if self.exclude is not None and self.exclude.search(item.text):
            self.period.add("filtered", item.no)
            return
        if self.dedupe and item.text == self.last_text:
            self.repeats += 1
            self.period.add("deduped", item.no)
            return
        self.end_run()
        self.last_text = item.text
        self.period.add("summarized", item.no)
        self.period.truncated += item.truncated
        self._append(item.text)

    def end_run(self) -> None:
        """Close the current run of repeats (a marker line, like `uniq -c`); called at a summary boundary too."""
        if self.repeats:
            self._append(f"(the line above repeated {self.repeats} more times)")
        self.repeats = 0
        self.last_text = None

    def _append(self, text: str) -> None:
        self.chunk.append(text)
        self.chunk_tok += self.count_tokens(text) + 1

    @property
    def full(self) -> bool:
        return len(self.chunk) >= self.chunk_lines or self.chunk_tok >= self.chunk_tokens

    def take_chunk(self) -> str | None:
        """The pending chunk as one text (lines joined by newlines), or None."""
        if not self.chunk:
            return None
        text = "\n".join(self.chunk)
        self.chunk, self.chunk_tok = [], 0
        return text

    def take_period(self) -> Period:
        p, self.period = self.period, Period()
        return p


# ------------------------------------------------------------------------------------------------- output
FORMATS = ("text", "jsonl", "markdown")


class OutputClosed(Exception):
    """stdout went away (SIGPIPE / EPIPE): stop quietly."""


class Output:
    """One block per summary on stdout, flushed at once so a reader of the pipe sees it before EOF."""

    def __init__(self, fmt: str, stream: TextIO) -> None:
        self.fmt, self.stream = fmt, stream

    def write(self, block: dict[str, Any]) -> None:
        try:
            self.stream.write(render_block(block, self.fmt))
            self.stream.flush()
        except (BrokenPipeError, ConnectionResetError) as e:
            raise OutputClosed() from e
        except OSError as e:
            if e.errno == 32:  # EPIPE seen through a wrapper
                raise OutputClosed() from e
            raise


def counts_text(b: dict[str, Any]) -> str:
    parts = [f"{b['summarized']} summarized"] + [f"{b[k]} {k}" for k in ("filtered", "deduped", "skipped") if b[k]]
    return f"{b['lines']} lines: " + ", ".join(parts)


def render_block(b: dict[str, Any], fmt: str) -> str:
    """One summary block in the chosen format (jsonl: exactly one line)."""
    if fmt == "jsonl":
        return json.dumps(b, ensure_ascii=False) + "\n"
    summary = b["summary"] or "(no lines to summarize)"
    final = " (final)" if b["final"] else ""
    if fmt == "markdown":
        return (f"### {b['time']} · lines {b['first_line']}–{b['last_line']}{final}\n\n"
                f"_{counts_text(b)} · {b['tokens_fed']} tokens fed, {b['tokens_evicted']} evicted_\n\n{summary}\n\n")
    return f"[{b['time']}] lines {b['first_line']}-{b['last_line']}{final} ({counts_text(b)})\n{summary}\n\n"


def fill(template: str, **values: Any) -> str:
    """Replace {name} placeholders; any other braces in a user's prompt file stay as they are."""
    for k, v in values.items():
        template = template.replace("{" + k + "}", str(v))
    return template
