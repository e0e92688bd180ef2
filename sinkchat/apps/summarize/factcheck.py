"""The check for invented facts in a summary, and the sentence trim.

Why: a small model asked to "name errors first" names errors whether or not there are any ("the installation of
libglvnd-core-dev failed" for a clean install). The claims a reader acts on are checkable by code: severity words
(error, fail, fatal, warning, panic, denied, timeout, ...), names with a package/host/file shape (libfoo-dev,
nginx.service, /var/log/x, web-01), numbers and timestamps. Each must occur in the support text (the period's
lines, the question with its digest, the full digest record). Severity words are compared by canonical key (an
"error" claim needs an error-ish line), negated ones ("no errors") are not claims. An unsupported claim gets its
words banned through a logits processor for one regeneration; what is still unsupported is flagged in the record.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from sinkchat.apps.summarize.digest import SEVERITY_RE, _GROUP_TO_KEY, severities

NEGATIONS = {"no", "not", "without", "zero", "0", "none", "never", "nor", "free", "neither"}
NAME_RE = re.compile(r"(?<![\w/.-])(/?[A-Za-z0-9][\w+]*(?:[-_./:][\w+]+)+)")
NUMBER_RE = re.compile(r"(?<![\w.:/-])(\d+(?:[-.:/]\d+)*)(?![\w-])")
SENTENCE_END_RE = re.compile(r"[.!?][\"')\]]*(?=\s|$)")
_WORD_RE = re.compile(r"[A-Za-z0-9']+")


def _negated(text: str, start: int) -> bool:
    """A severity word preceded (within four words) by a negation is not a claim: "no errors", "without failure"."""
    before = _WORD_RE.findall(text[max(0, start - 40): start].lower())[-4:]
    return any(w in NEGATIONS or w.endswith("n't") for w in before)


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


class Support:
    """What a summary may claim: the period's text (lines, question, digest) and its severity keys."""

    def __init__(self, texts: list[str], digest: dict[str, Any] | None = None, context: str = "") -> None:
        """`texts`: the log lines; `context`: the question, which may back names and numbers (its line range) but
        never a severity word (the prompt itself says "error, warning or failure")."""
        joined = "\n".join(texts)
        self.text = joined.lower() + "\n" + context.lower()
        self.severity = set(severities(joined))
        if digest:
            self.severity |= set(digest.get("severity") or {})
            self.text += "\n" + _digest_text(digest).lower()

    def supports(self, kind: str, claim: str) -> bool:
        if kind == "severity":
            return claim.split(":", 1)[0] in self.severity
        if kind == "number":
            return re.search(r"(?<![\d])" + re.escape(claim) + r"(?![\d])", self.text) is not None
        return claim.lower() in self.text


def _digest_text(d: dict[str, Any]) -> str:
    """Every number and value of a digest record as text (counts, line numbers, timestamps, parameter values)."""
    parts = [str(d.get("lines", "")), str(d.get("first_ts") or ""), str(d.get("last_ts") or ""),
             str(d.get("binary", ""))] + [f"{k} {v}" for k, v in (d.get("severity") or {}).items()]
    for t in d.get("templates", []):
        parts += [t["template"], str(t["count"]), str(t["first_line"]), str(t["last_line"]),
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
