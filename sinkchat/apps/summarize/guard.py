"""What a summary may show as fact: the model's checked sentences, and sentences written by code from the digest.

Why: one regeneration with the unsupported words banned rarely fixes a 135M model's invented incident, and a model
that small also misses real ones. An operations tool must never print an invented incident as fact, and a real one
must not depend on the model noticing it. So, after `ask` (answer.py):

1. every sentence of the reply that still carries an unsupported claim (factcheck.py), or says "no error" where the
   lines show one, is dropped from the prose (its claims stay in the record's `unsupported`, the sentences in
   `dropped`); a last sentence cut by the token limit is dropped too, and one the model ended without a full stop
   is closed with one, so a summary always ends with a complete sentence;
2. every severity the digest counted (error, fail, oom, denied, disk full, HTTP 5xx as error, ...) that the kept
   prose does not name gets a sentence written by code: its count of lines, first line number and timestamp and
   the template of that first line (`added`);
3. when no model sentence is left, the summary is written by code from the digest alone: line count and time span,
   the most frequent templates with counts, then the severity sentences (or "No line has a severity word.").

The record says which: `prose` is "model", "model+digest" (code sentences appended) or "digest" (code only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from sinkchat.apps.summarize.digest import SEVERITY_RE, _GROUP_TO_KEY
from sinkchat.apps.summarize.factcheck import SENTENCE_END_RE, Support, _negated, unsupported

TOP_TEMPLATES = 3  # templates named in a summary written from the digest
MAX_INCIDENT_SENTENCES = 6  # severity sentences appended; the rest are counted in one more sentence
TEMPLATE_CHARS = 100  # a quoted template is cut to this many characters


@dataclass
class Guarded:
    """The summary as shown, and what was dropped and added on the way."""

    text: str
    prose: str  # "model", "model+digest" or "digest"
    unsupported: list[str] = field(default_factory=list)  # claims of the dropped sentences, in order
    dropped: list[str] = field(default_factory=list)  # the model's sentences taken out
    added: list[str] = field(default_factory=list)  # the sentences written by code


_BOUNDARY_RE = re.compile(SENTENCE_END_RE.pattern + r"|\n")
_LIST_MARK_RE = re.compile(r"^\s*(?:\d{1,2}[.)]|[-*\u2022])\s+")
_ENDED_RE = re.compile(r"[.!?][\"')\]]*$")


def sentences(text: str) -> list[tuple[str, bool]]:
    """(sentence, ended) pieces of `text`, in order: split after [.!?] and at line breaks (a list item is a piece).
    `ended`: the piece ends with a full stop. A piece without a letter ("1." of a numbered list) is kept with the
    piece after it."""
    out: list[tuple[str, bool]] = []
    start, carry = 0, ""
    for m in _BOUNDARY_RE.finditer(text):
        piece = carry + text[start: m.end()]
        start = m.end()
        if re.search(r"[A-Za-z]", piece):
            out.append((piece.strip(), bool(_ENDED_RE.search(piece.strip()))))
            carry = ""
        else:
            carry = piece
    rest = (carry + text[start:]).strip()
    if rest:
        out.append((rest, bool(_ENDED_RE.search(rest)) and bool(re.search(r"[A-Za-z]", rest))))
    return out


def mentioned(prose: str) -> set[str]:
    """The severity keys `prose` states (not negated)."""
    return {_GROUP_TO_KEY[m.lastgroup or ""] for m in SEVERITY_RE.finditer(prose) if not _negated(prose, m.start())}


def contradicted(sentence: str, support: Support) -> list[str]:
    """Negated severity words whose key the lines do show ("no errors" while a line has an error)."""
    return ["no " + m.group(0) for m in SEVERITY_RE.finditer(sentence)
            if _negated(sentence, m.start()) and _GROUP_TO_KEY[m.lastgroup or ""] in support.severity]


@dataclass
class Incident:
    """One severity of the digest (or several that occur in exactly the same templates)."""

    keys: list[str]
    lines: int
    first_line: int
    first_ts: str | None
    template: str


def incidents(digest: dict[str, Any]) -> list[Incident]:
    """The digest's severities as incidents: lines with the key (sum over its templates), the first such line and
    its template; keys found in exactly the same templates are one incident ("oom and killed")."""
    by_templates: dict[tuple[int, ...], list[str]] = {}
    temps = digest.get("templates") or []
    for key in digest.get("severity") or {}:
        idx = tuple(i for i, t in enumerate(temps) if key in (t.get("severity") or {}))
        if idx:
            by_templates.setdefault(idx, []).append(key)
    out = []
    for idx, keys in by_templates.items():
        first = min((temps[i] for i in idx), key=lambda t: t["first_line"])
        out.append(Incident(keys, sum(temps[i]["count"] for i in idx), first["first_line"], first.get("first_ts"),
                            first["template"]))
    out.sort(key=lambda x: x.first_line)
    return out


def _quote(template: str) -> str:
    t = " ".join(template.replace('"', "'").split())
    return t if len(t) <= TEMPLATE_CHARS else t[: TEMPLATE_CHARS - 1].rstrip() + "…"


def incident_sentence(inc: Incident) -> str:
    """"2 lines show error and disk full, first at line 56 (Mar  1 00:27:56): "web-01 rsyslogd: ..."."."""
    where = f"line {inc.first_line}" + (f" ({inc.first_ts})" if inc.first_ts else "")
    words = " and ".join(inc.keys)
    plural = "lines show" if inc.lines != 1 else "line shows"
    return f"{inc.lines} {plural} {words}, first at {where}: \"{_quote(inc.template)}\"."


def incident_sentences(incs: list[Incident]) -> list[str]:
    out = [incident_sentence(i) for i in incs[:MAX_INCIDENT_SENTENCES]]
    rest = incs[MAX_INCIDENT_SENTENCES:]
    if rest:
        keys = sorted({k for i in rest for k in i.keys})
        out.append(f"{sum(i.lines for i in rest)} more lines show {', '.join(keys)} (see the digest).")
    return out


def digest_summary(digest: dict[str, Any]) -> list[str]:
    """A summary written by code from the digest alone: span, top templates with counts, severities."""
    n = digest.get("lines", 0)
    head = f"{n} line{'s' if n != 1 else ''}"
    if digest.get("first_ts"):
        head += f" from {digest['first_ts']} to {digest['last_ts']}"
    out = [head + "."]
    temps = sorted(digest.get("templates") or [], key=lambda t: (-t["count"], t["first_line"]))[:TOP_TEMPLATES]
    if temps:
        out.append("Most frequent: " + "; ".join(f"{t['count']} x \"{_quote(t['template'])}\"" for t in temps) + ".")
    incs = incidents(digest)
    out += incident_sentences(incs) if incs else ["No line has a severity word."]
    return out


def guard(text: str, cut: bool, support: Support, digest: dict[str, Any] | None) -> Guarded:
    """Drop the unsupported and unfinished sentences of a checked reply, then state what the digest shows that the
    prose does not (see the module doc). `cut`: the reply hit the token limit (its last piece is unfinished)."""
    kept: list[str] = []
    g = Guarded("", "model")
    pieces = sentences(text)
    for i, (sentence, ended) in enumerate(pieces):
        if not ended:
            last_cut = cut and i == len(pieces) - 1
            if last_cut or sentence.endswith("…") or not re.search(r"[A-Za-z]", sentence) \
                    or not re.search(r"[\w)\"']$", sentence):
                g.dropped.append(sentence)  # cut by the token limit, a lone list number, a "Packages:" header
                continue
            sentence += "."  # a list item, or the model stopped (EOS) without a full stop: close the sentence
        claim = _LIST_MARK_RE.sub("", sentence)  # "2." of a numbered list is not a number claim
        bad = unsupported(claim, support) + contradicted(claim, support)
        if bad:
            g.dropped.append(sentence)
            g.unsupported += [b for b in bad if b not in g.unsupported]
        else:
            kept.append(sentence)
    if digest is not None and not kept:
        g.added = digest_summary(digest)
        g.prose = "digest"
        kept = g.added
    elif digest is not None:
        said = mentioned(" ".join(kept))
        missing = [i for i in incidents(digest) if not set(i.keys) <= said]
        g.added = incident_sentences(missing)
        if g.added:
            g.prose = "model+digest"
            kept = kept + g.added
    g.text = " ".join(kept)
    return g
