"""The check for invented facts in a summary, and the sentence trim.

Why: a small model asked to "name errors first" names errors whether or not there are any ("the installation of
libglvnd-core-dev failed" for a clean install). The claims a reader acts on are checkable by code: severity words
(error, fail, fatal, warning, panic, denied, timeout, ...), names with a package/host/file shape (libfoo-dev,
nginx.service, /var/log/x, web-01), numbers and timestamps. Each must occur in the support text (the period's
lines, the question with its digest, the full digest record). Severity words are compared by canonical key (an
"error" claim needs an error-ish line), negated ones ("no errors") are not claims. An unsupported claim gets its
words banned through a logits processor for one regeneration; what is still unsupported is flagged in the record.

Beyond those claims (guard.py applies these per sentence): every content word of a sentence, after function words
and a small fixed vocabulary of summary words (vocab.py), must occur, by its Porter2 stem, in the lines or their
digest ("crashing", "sudo", "troubleshooting", "new machine" in a summary of a clean dpkg log do not); a sentence
that ties a timestamp to names or versions must find them on a line with that timestamp (`stitched`). The question
(the prompt with its line range and digest text) never backs anything: the line range and counts are given as
`numbers`, the digest as its record.
"""

from __future__ import annotations

import copy
import re
from functools import lru_cache
from typing import Any, Callable

import snowballstemmer

from sinkchat.apps.summarize.digest import SEVERITY_RE, _GROUP_TO_KEY, changes, marks, severities, split_timestamp
from sinkchat.apps.summarize.written import QUOTE_LIMITS, filled, quote
from sinkchat.apps.summarize.vocab import FAILURE_CHANGES, FUNCTION_WORDS, NEGATIONS, SUMMARY_WORDS, negated

NAME_RE = re.compile(r"(?<![\w/.-])(/?[A-Za-z0-9][\w+]*(?:[-_./:][\w+]+)+)")
NUMBER_RE = re.compile(r"(?<![\w.:/-])(\d+(?:[-.:/]\d+)*)(?![\w-])")
SENTENCE_END_RE = re.compile(r"[.!?][\"')\]]*(?=\s|$)")
_ALPHA_RE = re.compile(r"[a-z]+")
TIME_RE = re.compile(r"(?<![\d:])\d{1,2}:\d{2}:\d{2}(?![\d:])")
_STEMMER = snowballstemmer.stemmer("english")


@lru_cache(maxsize=65536)
def stem(word: str) -> str:
    """The Porter2 stem of a lower-case word ("installed", "installation" -> "instal")."""
    return _STEMMER.stemWord(word)


_negated = negated  # the rule lives in vocab.py: digest.changes applies it to log lines too


def claims(summary: str) -> list[tuple[str, str]]:
    """(kind, text) claims in a summary: severity (canonical key), name, number."""
    out: list[tuple[str, str]] = []
    for m in SEVERITY_RE.finditer(summary):
        if not _negated(summary, m.start()):
            out.append(("severity", _GROUP_TO_KEY[m.lastgroup or ""] + ":" + m.group(0)))
    for m in NAME_RE.finditer(summary):
        name = m.group(1).rstrip(".:")
        if re.search(r"[A-Za-z]", name) and len(name) > 4:
            out.append(("name", name))  # not "e.g" or "i.e"
    for m in NUMBER_RE.finditer(summary):
        out.append(("number", m.group(1)))
    return out


def _quotable(text: str) -> str:
    """Text as a quote of it compares: whitespace collapsed, a double quote as the code's quotes show it (')."""
    return " ".join(text.replace('"', "'").split())


_SOURCE_RE = re.compile(r"(?<![\w./-])([A-Za-z][\w.-]*?)(?:\[\d+\])?:(?=\s)")


def _sources(lines: list[str]) -> set[str]:
    """The words of the programs the lines come from (`kernel:`, `orders-api[4242]:` -> orders, api): the first
    `name:` or `name[pid]:` within a line's first 60 characters after its timestamp."""
    out: set[str] = set()
    for line in lines:
        m = _SOURCE_RE.search(split_timestamp(line)[1][:60])
        if m:
            out.update(w for w in _ALPHA_RE.findall(m.group(1).lower()) if len(w) > 2)
    return out


class Support:
    """What a summary may claim: the period's lines, their digest record and the period's own figures (line range,
    counts); the severity keys among them and the stems of their words."""

    def __init__(self, texts: list[str], digest: dict[str, Any] | None = None, numbers: str = "") -> None:
        """`texts`: the log text fed this period; `numbers`: the period's figures as text ("lines 120 to 146, 27
        lines"). The question itself is never support: the prompt says "error, warning or failure", and a reply
        that echoes it must not back its own words."""
        joined = "\n".join(texts)
        raw = joined.splitlines()
        self.quotable = [_quotable(ln) for ln in raw]  # as written, for quotes (quoted.py)
        self.lines = [ln.lower() for ln in raw]
        self.text = joined.lower() + "\n" + numbers.lower()
        self.sources = _sources(raw)
        # kinds with no variable part: each of their lines is the first one's text, so a quote of it is in all
        self.kinds = [(_quotable(t.get("first_text", "")), t["count"]) for t in (digest or {}).get("templates", [])
                      if "<*>" not in t["template"]]
        shown = [x for t in (digest or {}).get("templates", []) for x in [t["template"], t.get("first_text", ""),
                 filled(t)] + [m[3] for f in ("severity", "changes") for m in marks(t, f).values()]]
        self.quotable_digest = [_quotable(x) for x in shown]
        # as the code quotes them: a run of one letter cut short ("payload=aaa…") is a word no line holds as such
        self.text += "\n" + "\n".join(quote(x, n) for x in shown for n in QUOTE_LIMITS).lower()
        self.severity = set(severities(joined))
        self.failures = set(changes(joined)) & FAILURE_CHANGES  # a traceback: "no errors" is contradicted (guard)
        if digest:
            self.severity |= set(digest.get("severity") or {})
            self.failures |= set(digest.get("changes") or {}) & FAILURE_CHANGES
            self.text += "\n" + _digest_text(digest).lower()
        self.text += "\n" + " ".join(self.severity)  # "disk full" backs "the disk is full"
        self.words = set(_ALPHA_RE.findall(self.text))
        self.stems = {stem(w) for w in self.words}

    def extended(self, texts: list[str]) -> "Support":
        """This support with more log text (an earlier line of the log), without re-reading what it holds."""
        joined = "\n".join(texts)
        more = copy.copy(self)
        sev = set(severities(joined)) - self.severity
        more.quotable = self.quotable + [_quotable(ln) for ln in joined.splitlines()]
        more.sources = self.sources | _sources(joined.splitlines())
        more.lines = self.lines + [ln.lower() for ln in joined.splitlines()]
        more.severity = self.severity | sev
        more.failures = self.failures | (set(changes(joined)) & FAILURE_CHANGES)
        more.text = self.text + "\n" + joined.lower() + "\n" + " ".join(sev)
        words = set(_ALPHA_RE.findall(joined.lower() + " " + " ".join(sev)))
        more.words = self.words | words
        more.stems = self.stems | {stem(w) for w in words}
        return more

    def supports(self, kind: str, claim: str) -> bool:
        if kind == "severity":
            return claim.split(":", 1)[0] in self.severity
        if kind == "number":
            return re.search(r"(?<![\d])" + re.escape(claim) + r"(?![\d])", self.text) is not None
        return claim.lower() in self.text

    def kind_count(self, quote: str) -> int:
        """The lines of the digest's kinds with no variable part whose line holds `quote` (lines summarized by the
        digest alone are not among `quotable`)."""
        q = _quotable(quote)
        return sum(n for first, n in self.kinds if q and q in first)

    def backs_word(self, word: str) -> bool:
        """A content word occurs in the lines or digest, as written or by its stem."""
        return word in self.words or stem(word) in self.stems


def period_numbers(first: int, last: int, lines: int, *counts: int) -> str:
    """A period's own figures as support text: its line range both ways ("lines 120 to 146", "120-146"), its line
    count and any other counts (summarized, filtered, ...)."""
    return f"lines {first} to {last}, {first}-{last}: {lines} lines, " + " ".join(map(str, counts))


def content_words(sentence: str) -> list[str]:
    """The sentence's words that carry content: letters only (identifiers split at digits and punctuation, as the
    support is), three letters or more, neither a function word nor a summary word, nor a severity word or a
    negation (those are claims, checked by their canonical key: "timed out" for a `timeout` line, "no errors")."""
    text = SEVERITY_RE.sub(" ", sentence.lower())
    return [w for w in _ALPHA_RE.findall(text)
            if len(w) > 2 and w not in FUNCTION_WORDS and w not in SUMMARY_WORDS and w not in NEGATIONS]


def unbacked_words(sentence: str, support: Support) -> list[str]:
    """Content words of `sentence` that the lines and digest do not hold, in order, without repeats."""
    out: list[str] = []
    for w in content_words(sentence):
        if not support.backs_word(w) and w not in out:
            out.append(w)
    return out


def stitched(sentence: str, support: Support) -> list[str]:
    """A sentence that names one time of day ties what it says to the lines of that time: each of its names and
    versions must stand on one line with that time, else the facts are stitched from different lines ("14:42:12
    status half-installed gcc:amd64 1.31-1.2" where gcc's line says 14:42:11 and 4:12.2.0-3). Returns the claims
    no such line holds (empty for sentences with no time, or with a span of two times)."""
    times = [m.group(0) for m in TIME_RE.finditer(sentence)]
    if len(times) != 1:  # none, or a span ("from 14:36:25 to 14:36:25")
        return []
    t = times[0]
    span_from = r"\bfrom\s+\S*" + re.escape(t) + r"\S*\s+to\s"
    span_to = r"\bfrom\s+\S.{0,40}?\sto\s+\S*" + re.escape(t)
    if re.search(span_from, sentence) or re.search(span_to, sentence):  # a span with another clock's stamp
        return []
    ids = [c for k, c in claims(sentence) if (k == "name" or (k == "number" and re.search(r"\d[-.:/+]\d", c)))
           and t not in c and not re.fullmatch(r"[\d:-]+", c)]
    if not ids:
        return []
    at_t = [ln for ln in support.lines if t in ln]
    if any(all(c.lower() in ln for c in ids) for ln in at_t):
        return []
    return [f"{c} at {t}" for c in ids if not any(c.lower() in ln for ln in at_t)] or [f"{' '.join(ids)} at {t}"]


def _digest_text(d: dict[str, Any]) -> str:
    """Every number and value of a digest record as text (counts, line numbers, timestamps, parameter values)."""
    parts = [str(d.get("lines", "")), str(d.get("first_ts") or ""), str(d.get("last_ts") or ""),
             str(d.get("binary", "")), str(len(d.get("templates") or []))]  # "of 7 kinds"
    parts += [f"{k} {v}" for k, v in (d.get("severity") or {}).items()]
    parts += [f"{k} {v}" for k, v in (d.get("changes") or {}).items()]  # "1 line shows restart"
    for field in ("changes", "severity"):  # "2 lines show error": the lines holding the key, over its templates
        for key in d.get(field) or {}:
            at = [marks(t, field).get(key) for t in d.get("templates", [])]
            parts.append(str(sum(m[0] for m in at if m)))
            parts += [f"{m[1]} {m[2] or ''} {m[3]}" for m in at if m]  # the first line holding it, as quoted
    for t in d.get("templates", []):
        parts += [t["template"], t.get("first_text", ""), str(t["count"]), str(t["first_line"]), str(t["last_line"]),
                  str(t.get("first_ts") or ""), str(t.get("last_ts") or "")]
        for p in t.get("params", []):
            parts += list(p["values"]) + [str(p["distinct"])]
    return " ".join(parts)


def unsupported(summary: str, support: Support) -> list[str]:
    """The claims of `summary` that its support does not back, in order, without repeats (shown as written)."""
    seen: list[str] = []
    for kind, claim in claims(summary):
        shown = claim.split(":", 1)[1] if kind == "severity" else claim
        if not support.supports(kind, claim) and shown not in seen:
            seen.append(shown)
    return seen


def ban_processor(words: list[str], encode: Callable[[str], list[int]]) -> Callable[[list[int], Any], Any]:
    """A logits processor that forbids the tokens that start the banned words (as written, capitalised, with and
    without a leading space). A multi-token word is banned by its first token only when that piece is a word of
    its own (>= 4 characters), so banning "libfoo-dev" does not forbid every "lib"."""
    ids: set[int] = set()
    for w in words:
        for v in {w, w.lower(), w.capitalize()}:
            for form in (v, " " + v):
                toks = encode(form)
                if len(toks) == 1 or (toks and len(form.strip()) >= 4 and len(toks) <= 2):
                    ids.add(toks[0])
    banned = sorted(ids)

    def process(recent_ids: list[int], logits: Any) -> Any:
        if banned:
            logits = logits.clone()
            logits[banned] = float("-inf")
        return logits

    process.banned = banned  # type: ignore[attr-defined]
    return process


def trim_sentence(text: str) -> tuple[str, bool]:
    """Cut a reply that stopped mid-sentence back to its last full sentence. Returns (text, was_cut); a reply with
    no full sentence at all keeps its words and ends with an ellipsis, so it never reads as complete."""
    text = text.strip()
    ends = list(SENTENCE_END_RE.finditer(text))
    if not text or (ends and ends[-1].end() == len(text)):
        return text, False
    if ends:
        return text[: ends[-1].end()].strip(), True
    return text + " …", True
