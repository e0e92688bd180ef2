"""Checks on a model sentence that quotes the log: the quote as written, its count, and what is said around it.

Why: the word checks (factcheck.py) compare lower-case words and stems against everything the period holds, so a
sentence could pass while each of its parts came from a different place. Seen in new-user runs on the bundled model:
`"c.e.OrderController - request failed"` for a line that says `Request failed` (and repeated as fact in every
later summary); `24 lines "web01 nginx[811]: upstream connect error ..."` for 7 such lines (24 was the period's line
count); `an error message from the kernel: "app: ERROR disk full"` where the kernel's lines said `eth0 link up`.
So a quote of QUOTE_MIN characters or more must be a piece of a line (or of the digest) as written; a count put in
front of it ("7 lines", "7 x") must be the number of lines holding it; and in a sentence with one quote, a program
it names (a line's source: `kernel:`, `nginx[811]:`) and its severity words must be those of the lines holding the
quote (`Error: "usb 1-2: new high-speed USB device ..."` was kept, an error on another line backing the word). Other
words around a quote are left to the word checks: "orders-api restarted after 'Out of memory: ...'" relates two
lines, and dropping every such sentence lost true ones.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from sinkchat.apps.summarize.digest import _GROUP_TO_KEY, CHANGE_RE, SEVERITY_RE, severities
from sinkchat.apps.summarize.factcheck import _quotable as _norm
from sinkchat.apps.summarize.factcheck import content_words, stem
from sinkchat.apps.summarize.vocab import negated

if TYPE_CHECKING:
    from sinkchat.apps.summarize.factcheck import Support

QUOTE_MIN = 12  # shorter quoted text ("ok", a status word) is a word, checked as words are
QUOTE_RE = re.compile(r"[\"“`]([^\"”`\n]{%d,}?)[\"”`]|(?<!\w)['‘]([^'’\n]{%d,}?)['’](?!\w)"
                      % (QUOTE_MIN, QUOTE_MIN))
# the count right in front of a quote: no other number between ("Of 24 lines, 7 lines "..."" counts 7)
COUNT_RE = re.compile(r"(\d[\d,]*)\s+(?:x|×|times|lines?|entries|messages|occurrences)\b"
                      r"[^\"“`'‘\d]{0,24}$", re.I)
_ELLIPSIS_RE = re.compile(r"(?:…|\.\.\.)\s*$")


def quotes(sentence: str) -> list[tuple[str, int]]:
    """(quoted text, its start in the sentence) for each quote of QUOTE_MIN characters or more; a trailing "…" (a
    quote cut short) is taken off."""
    return [(_ELLIPSIS_RE.sub("", m.group(1) or m.group(2)).strip(), m.start()) for m in QUOTE_RE.finditer(sentence)]


def _pieces_in(pieces: list[str], text: str) -> bool:
    """Each piece found in `text`, in order."""
    at = 0
    for p in pieces:
        at = text.find(p, at)
        if at < 0:
            return False
        at += len(p)
    return True


def holding(quote: str, lines: list[str]) -> list[str]:
    """The lines (compared as `Support.quotable` holds them) that hold `quote` as written; a "…" inside it stands
    for what was left out (a line cut for length is quoted by its start and end), so its pieces are found in order."""
    pieces = [p for p in (x.strip() for x in _norm(quote).split("…")) if p]
    return [ln for ln in lines if _pieces_in(pieces, ln)]


def problems(sentence: str, support: "Support") -> list[str]:
    """What is wrong with the sentence's quotes (empty when each is right): a quote that no line nor the digest
    holds as written, a count in front of it that is not the number of lines holding it, content words outside
    the quotes that the lines holding them do not have."""
    found = quotes(sentence)
    if not found:
        return []
    out: list[str] = []
    on: list[str] = []
    for q, start in found:
        lines = holding(q, support.quotable)
        if not lines and not holding(q, support.quotable_digest):
            out.append(f'quote not in the log as written: "{q[:40]}"')
            continue
        on += lines
        m = COUNT_RE.search(sentence[:start])
        n = int(m.group(1).replace(",", "")) if m else None
        if n is not None and lines and n not in (len(lines), support.kind_count(q)):
            out.append(f"{n} lines (the log has {len(lines)} holding \"{q[:40]}\")")
    if on and not out and len(found) == 1:  # a sentence listing kinds ("22 x "..."; 1 x "..."") speaks of them all
        rest = re.sub(r"\S*\d\S*", " ", QUOTE_RE.sub(" ", sentence))  # times and counts: "from 01/Mar/2025"
        rest = CHANGE_RE.sub(" ", rest)
        stems = {stem(w) for w in content_words(" ".join(on))}  # a program named that the quoted lines are not from
        out += [w for w in dict.fromkeys(content_words(rest)) if stem(w) not in stems and w in support.sources]
        held = set(severities(" ".join(on)))  # `Error: "usb 1-2: new high-speed USB device ..."` was kept
        out += [m.group(0).lower() for m in SEVERITY_RE.finditer(rest)
                if not negated(rest, m.start()) and _GROUP_TO_KEY[m.lastgroup or ""] not in held]
    return out
