"""The input side of `sinkchat summarize`: reading lines as they arrive, in bounded memory, and cleaning them.

No model here, so all of it is unit-testable in milliseconds. A reader thread turns bytes into numbered `Line`s and
puts them on a bounded queue, so a slow model never blocks reading and `--interval` works without EOF. Under
`--backpressure drop` a full queue drops lines in the reader; the next line (or `End`) carries how many were dropped
just before it, so the consumer can account for every input line number: each one ends up exactly once as
summarized, filtered, deduped or skipped (`batching.Period`). Filters, dedupe and batching live in batching.py, the
output blocks in output.py.
"""

from __future__ import annotations

import os
import queue
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from sinkchat.apps.summarize.digest import CUT_MARK, severities
from sinkchat.apps.summarize.structured import flatten

READ_SIZE = 65536
POLL_SECONDS = 0.2
TAIL_CHARS = 120  # a cut line keeps this much of its end (at most a quarter of --max-line-chars)
MIDDLE_OVERLAP = 48  # bytes carried between dropped pieces, so a severity word split by a read is still found
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


class LineQueue(queue.Queue):  # type: ignore[type-arg]
    """The reader's bounded queue, which also knows how many of its items are input lines.

    `qsize()` counts the `End` marker and notices as well, so a "queue N" figure built on it reads one too high
    once the input has ended (and more after notices). `lines` is kept under the queue's own lock by the two
    hooks every put and get goes through; `Reader.notice` appends a Notice past the bound and never touches it."""

    def _init(self, maxsize: int) -> None:
        super()._init(maxsize)
        self.lines = 0

    def _put(self, item: Item) -> None:
        super()._put(item)
        if isinstance(item, Line):
            self.lines += 1

    def _get(self) -> Item:
        item = super()._get()
        if isinstance(item, Line):
            self.lines -= 1
        return item


# ------------------------------------------------------------------------------------------------- bytes -> lines
class LineSplitter:
    """Splits a byte stream into lines in bounded memory: a line keeps at most `limit` bytes from its start and
    `tail` from its end, the rest is only counted and searched for severity words (a 10 MB line costs `limit` +
    `tail` bytes, not 10 MB). Handles lines split across reads. Why the tail and the search: a line of a long
    payload and then "-> ERROR upstream failed" was cut before its error, and the summary said "no errors"."""

    def __init__(self, limit: int, tail: int = 0) -> None:
        self.limit = max(1, limit)
        self.tail_limit = max(0, tail)
        self.buf = bytearray()
        self.tail = bytearray()
        self.total = 0  # bytes of the current line seen so far, kept or not
        self.middle: set[str] = set()  # severity keys in the bytes dropped between the head and the tail
        self._carry = b""  # the end of the last dropped piece: a word split across two

    def feed(self, data: bytes) -> list[tuple[bytes, int, str]]:
        """Complete lines in `data` as (kept bytes: head then tail, total bytes, severity keys of the dropped
        middle joined by ", "), newline excluded."""
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

    def flush(self) -> tuple[bytes, int, str] | None:
        """The partial last line (input ended or the file changed under us), if any."""
        return self._take() if self.total else None

    def _append(self, piece: bytes) -> None:
        self.total += len(piece)
        room = self.limit - len(self.buf)
        if room > 0:
            self.buf += piece[:room]
            piece = piece[room:]
        if not piece:
            return
        self.tail += piece
        over = len(self.tail) - self.tail_limit
        if over > 0:
            self._search(bytes(self.tail[:over]))
            del self.tail[:over]

    def _search(self, dropped: bytes) -> None:
        text = (self._carry + dropped).decode("utf-8", errors="replace")
        self.middle.update(severities(text))
        self._carry = dropped[-MIDDLE_OVERLAP:]

    def _take(self) -> tuple[bytes, int, str]:
        line = (bytes(self.buf + self.tail), self.total, ", ".join(sorted(self.middle)))
        self.buf.clear()
        self.tail.clear()
        self.total = 0
        self.middle = set()
        self._carry = b""
        return line


def tail_chars(max_chars: int) -> int:
    """The characters a cut line keeps of its end: TAIL_CHARS, at most a quarter of the line's limit."""
    return min(TAIL_CHARS, max_chars // 4)


def clean_line(raw: bytes, total: int, max_chars: int, middle: str = "") -> tuple[str, bool]:
    """UTF-8 with replacement, CR stripped, ANSI colours removed, other control bytes shown as U+FFFD, cut to
    `max_chars` with a marker that says how long the line really was; a JSON-lines record as `TIME LEVEL message
    key=value ...` (structured.py). A cut line keeps its last TAIL_CHARS (where a
    line of a payload ends with its "ERROR ..."), and the marker names the severity words of the part cut out
    (`middle`: those of the bytes the splitter dropped). Returns (text, truncated)."""
    text = raw.decode("utf-8", errors="replace")
    if text.endswith("\r") and total == len(raw):
        text = text[:-1]
    if total == len(raw) and text[:1] == "{":  # a JSON-lines record, read whole (structured.py)
        text = flatten(text)
    text = CONTROL_RE.sub("\ufffd", ANSI_RE.sub("", text)).replace("\r", "").replace("\n", " ")
    cut = total > len(raw) or len(text) > max_chars
    if cut:
        size = f"{total} bytes" if total > len(raw) else f"{len(text)} chars"
        keep = tail_chars(max_chars)
        head, tail = text[: max_chars - keep], text[len(text) - keep:] if keep else ""
        found = {k for k in middle.split(", ") if k} | set(severities(text[len(head): len(text) - len(tail)]))
        holds = f"; the cut part holds {', '.join(sorted(found))}" if found else ""
        text = f"{head}{CUT_MARK}, {size}{holds}]…" + (f" {tail}" if tail else "")
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
        # UTF-8 needs at most 4 bytes a character
        splitter = LineSplitter(self.max_chars * 4 + 4, tail_chars(self.max_chars) * 4)
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
                for raw, total, middle in lines:
                    self._emit(raw, total, middle)
            tail = splitter.flush()
            if tail and not self.stop.is_set():
                self._emit(*tail)
        except OSError as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - reported to the consumer as a one-line error, never a traceback
            error = f"{type(e).__name__}: {e}"
        self._put(End(self.n, self.dropped, error), force=True)

    def _emit(self, raw: bytes, total: int, middle: str = "") -> None:
        self.n += 1
        if self.backpressure == "drop" and self.q.full():
            self.dropped += 1
            return
        text, cut = clean_line(raw, total, self.max_chars, middle)
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
