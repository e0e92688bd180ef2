"""Line accounting, filters, dedupe and batching for `sinkchat summarize` (no model, no threads).

Every input line number ends up exactly once as summarized, filtered, deduped or skipped (`Period`), also when a
run is stopped before the lines it read reached the model (`Batcher.skip`, `Batcher.drop_chunk`): the blocks then
still add up to the lines that came in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from sinkchat.apps.summarize.digest import Digest
from sinkchat.apps.summarize.reader import End, Line

BINARY_SHARE = 0.25  # a line with undecodable characters making up more than this share of it is binary
_WORDISH_RE = re.compile(r"[^\W\d_]{3}")  # three letters of any script in a row


def is_binary(text: str, after_binary: bool = False) -> bool:
    """Binary or mostly undecodable: the reader turned invalid UTF-8 and control bytes into U+FFFD, so a line that
    is largely U+FFFD is not text. Such lines are skipped (counted as binary) and never reach the model, which would
    otherwise summarize noise into fiction, nor the output; a text line with a few bad bytes (a Latin-1 name in a
    long UTF-8 log) is still text. `after_binary`: the line before was binary. Random bytes break into lines at
    their 0x0A bytes, and a few come out short enough to look clean ("4j"); in such a run a line with any
    undecodable character, or without three letters in a row, is binary too (measured: 200 kB of /dev/urandom
    gives ~800 lines, none taken as text by this rule; by the share alone ~20 short ones were)."""
    bad = text.count("\ufffd")
    if bad and bad > BINARY_SHARE * len(text):
        return True
    return after_binary and (bad > 0 or not _WORDISH_RE.search(text))


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
    binary: int = 0  # of the skipped lines, those skipped as binary (never fed)

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
    chunk_summarized: int = 0  # input lines in `chunk` (its repeat markers stand for lines counted as deduped)
    chunk_truncated: int = 0
    last_no: int = 0  # the highest input line number accounted so far, over the whole run
    digest: Digest = field(default_factory=Digest)  # every line fed (deduped repeats included), nothing else
    run_last_no: int = 0  # the line number of the last repeat in the open run
    # (line no, text, count, a closed run's repeats?) of `chunk`; of the taken chunk until it is fed
    chunk_digest: list[tuple[int, str, int, bool]] = field(default_factory=list)
    in_flight: list[tuple[int, str, int, bool]] = field(default_factory=list)
    after_binary: bool = False  # the last line read was binary

    def add(self, item: Line | End) -> None:
        """Account one item; the lines dropped before it count as skipped."""
        first_skipped = item.no if isinstance(item, Line) else item.last_no + 1
        self.period.add("skipped", first_skipped - 1, item.skipped_before)
        self.last_no = max(self.last_no, first_skipped - 1)
        if isinstance(item, End):
            return
        self.last_no = item.no
        binary = is_binary(item.text, self.after_binary)
        self.after_binary = binary
        if binary:
            self.period.add("skipped", item.no)
            self.period.binary += 1
            self.digest.binary += 1
            return
        if self.grep is not None and not self.grep.search(item.text):
            self.period.add("filtered", item.no)
            return
        if self.exclude is not None and self.exclude.search(item.text):
            self.period.add("filtered", item.no)
            return
        if self.dedupe and item.text == self.last_text:
            self.repeats += 1
            self.run_last_no = item.no
            self.period.add("deduped", item.no)
            return
        self.end_run()
        self.last_text = item.text
        self.period.add("summarized", item.no)
        self.period.truncated += item.truncated
        self._append(item.text)
        self.chunk_digest.append((item.no, item.text, 1, False))
        self.chunk_summarized += 1
        self.chunk_truncated += item.truncated

    def skip(self, item: Line | End) -> None:
        """Account an item that will never be fed (the run was stopped) as skipped, with the lines dropped before
        it: the line numbers stay contiguous, so the final record still accounts for every line read."""
        last = item.no if isinstance(item, Line) else item.last_no
        self.skip_to(last)

    def skip_to(self, no: int) -> None:
        """Account every line after the last accounted one, up to line `no`, as skipped."""
        if no > self.last_no:
            self.period.add("skipped", no, no - self.last_no)
            self.last_no = no

    def unfeed(self, summarized: int, truncated: int) -> None:
        """Lines counted as summarized whose chunk never reached the model (a stop undid its feed): skipped, and
        left out of the digest, which covers exactly the lines fed."""
        self.period.summarized -= summarized
        self.period.skipped += summarized
        self.period.truncated -= truncated
        self._discard(self.in_flight)
        self.in_flight = []

    def _discard(self, entries: list[tuple[int, str, int, bool]]) -> None:
        """The digest entries of a chunk that never reached the model: a closed run's repeats whose first line was
        in the same chunk are skipped too; those of a line fed in an earlier chunk stay deduped, in the digest."""
        for i, (no, text, count, repeats) in enumerate(entries):
            if repeats and i == 0:
                self.digest.add(no, text, count=count)
            elif repeats:
                self.period.deduped -= count
                self.period.skipped += count

    def commit_chunk(self) -> None:
        """The taken chunk is in the model's cache: its lines join the digest."""
        for no, text, count, _ in self.in_flight:
            self.digest.add(no, text, count=count)
        self.in_flight = []

    def drop_chunk(self) -> int:
        """The run was stopped: the pending chunk will never be fed, so its lines count as skipped instead of
        summarized, and an open run of repeats of a line in it as well. Returns how many summarized lines moved."""
        n = self.chunk_summarized
        if self.repeats and self.last_text is not None:
            if self.chunk:  # the run's first line is in the dropped chunk (the chunk's last line)
                self.period.deduped -= self.repeats
                self.period.skipped += self.repeats
            else:  # it was fed: the repeats stay counted and go into the digest (exact counts)
                self.digest.add(self.run_last_no, self.last_text, count=self.repeats)
        self.in_flight = self.chunk_digest
        self.unfeed(n, self.chunk_truncated)
        self.chunk, self.chunk_tok, self.chunk_summarized, self.chunk_truncated = [], 0, 0, 0
        self.chunk_digest = []
        self.repeats, self.last_text = 0, None
        return n

    def end_run(self) -> None:
        """Close the current run of repeats (a marker line, like `uniq -c`); called at a summary boundary too."""
        if self.repeats:
            self._append(f"(the line above repeated {self.repeats} more times)")
            if self.last_text is not None:
                self.chunk_digest.append((self.run_last_no, self.last_text, self.repeats, True))
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
        self.chunk, self.chunk_tok, self.chunk_summarized, self.chunk_truncated = [], 0, 0, 0
        self.in_flight, self.chunk_digest = self.chunk_digest, []
        return text

    def take_period(self) -> Period:
        p, self.period = self.period, Period()
        return p
