"""What a summary may show as fact: the model's checked sentences, and sentences written by code from the digest.

Why: one regeneration with the unsupported words banned rarely fixes a 135M model's invented incident, and a model
that small also misses real ones. An operations tool must never print an invented incident as fact, and a real one
must not depend on the model noticing it. So, after `ask` (answer.py):

1. every sentence of the reply that still carries an unsupported claim (factcheck.py), a content word the lines
   and digest do not hold, facts stitched from lines of different times, or says "no error" where the lines show
   one, is dropped from the prose (its claims and words stay in the record's `unsupported`, the sentences in
   `dropped`); so is a sentence that echoes the question (the prompt and its digest text are never a summary), one
   that says nothing (no content word, no name: "- 15 more lines."), one already said in this reply, and one with
   unreadable characters; a last sentence cut by the token limit is dropped too, and one the model ended without a
   full stop is closed with one, so a summary always ends with a complete sentence;
2. every severity the digest counted (error, fail, oom, denied, disk full, HTTP 5xx as error, ...) that the kept
   prose does not name gets a sentence written by code: its count of lines, first line number and timestamp and
   the template of that first line (`added`);
3. when no model sentence is left, the summary is written by code from the digest alone: line count and time span,
   the most frequent kinds of lines with their counts and values, then the severity sentences (or "No line shows
   a severity word (no errors or warnings).").

The record says which: `prose` is "model", "model+digest" (code sentences appended) or "digest" (code only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from sinkchat.apps.summarize.digest import SEVERITY_RE, _GROUP_TO_KEY
from sinkchat.apps.summarize.factcheck import (SENTENCE_END_RE, Support, _negated, claims,
                                               content_words, stem, stitched, unbacked_words, unsupported)

TOP_TEMPLATES = 3  # templates named in a summary written from the digest
MAX_INCIDENT_SENTENCES = 6  # severity sentences appended; the rest are counted in one more sentence
TEMPLATE_CHARS = 100  # a quoted template is cut to this many characters
VALUE_CHARS = 40  # a value shown in a filled template is cut to this many
NO_INCIDENT = "No line shows a severity word (no errors or warnings)."  # negated: checked against the lines
ECHO_GRAM = 3  # word n-grams shared with the question that mark a sentence as copied from it ...
ECHO_SHARE = 0.5  # ... when they cover at least this share of its words
_WILDCARD_RE = re.compile(r"<\*>|(?:^|[\s\"'(])\*(?=[\s\"')]|$)")  # a template's slot, as the question shows it
_UNREADABLE_RE = re.compile(r"[\ufffd\x00-\x08\x0b-\x1f\x7f-\x9f]")


@dataclass
class Guarded:
    """The summary as shown, and what was dropped and added on the way."""

    text: str
    prose: str  # "model", "model+digest" or "digest"
    unsupported: list[str] = field(default_factory=list)  # claims and words of the dropped sentences, in order
    why: list[str] = field(default_factory=list)  # other reasons sentences were dropped ("echoed the question")
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


def _quote(template: str, limit: int = TEMPLATE_CHARS) -> str:
    """A template or value as quoted text: one line, no unreadable characters, at most `limit` characters, cut at a
    space where there is one."""
    t = " ".join(_UNREADABLE_RE.sub("", template).replace('"', "'").split())
    if len(t) <= limit:
        return t
    cut = t[: limit - 1]
    return (cut.rsplit(" ", 1)[0] if " " in cut[limit // 2:] else cut).rstrip() + "…"


def _filled(t: dict[str, Any]) -> str:
    """A template with each `<*>` slot shown as its values: one value as itself, more in braces, past two as the
    first two and how many ("status {half-installed, unpacked} libfoo:amd64 1.2", "install {a, b, … 8 in all}").
    Braces and commas, not "/": "unpacked/half-configured" would read back as one name no line holds."""
    params = iter(t.get("params") or [])

    def slot(_: re.Match[str]) -> str:
        p = next(params, None)
        if not p or not p.get("values"):
            return "…"
        vals, n = [_quote(v, VALUE_CHARS) for v in p["values"]], p.get("distinct", len(p["values"]))
        if n == 1:
            return vals[0]
        return "{" + ", ".join(vals[:2]) + (f", … {n} in all" if n > 2 else "") + "}"

    return _quote(re.sub(r"<\*>", slot, t["template"]), TEMPLATE_CHARS + 40)


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
    """A summary written by code from the digest alone: span, the most frequent kinds of lines with their counts
    and values, then the severities ("26 lines from 14:36:31 to 14:36:33, of 9 kinds; most frequent: 8 x "status
    {half-installed, unpacked, installed} python3.11:amd64 3.11.2-6"; ... No line shows a severity word.")."""
    n = digest.get("lines", 0)
    temps = digest.get("templates") or []
    head = f"{n} line{'s' if n != 1 else ''}"
    if digest.get("first_ts"):
        head += f" from {digest['first_ts']} to {digest['last_ts']}"
    if len(temps) > 1:
        head += f", of {len(temps)} kinds"
    top = sorted(temps, key=lambda t: (-t["count"], t["first_line"]))[:TOP_TEMPLATES]
    if len(top) == 1:
        head += f": {top[0]['count']} x \"{_filled(top[0])}\""
    elif top:
        head += "; most frequent: " + "; ".join(f"{t['count']} x \"{_filled(t)}\"" for t in top)
    out = [head + "."]
    incs = incidents(digest)
    out += incident_sentences(incs) if incs else [NO_INCIDENT]
    return out


_TOKEN_RE = re.compile(r"[\w'](?:[\w'.:/+-]*[\w'])?")


def _tokens(text: str) -> list[str]:
    """Words and whole identifiers ("libglvnd-core-dev", "1.6.0-1"), lower case: a sentence naming a package the
    digest lists shares one token with it, not three."""
    return [t.lower() for t in _TOKEN_RE.findall(text)]


def _grams(words: list[str]) -> set[tuple[str, ...]]:
    return {tuple(words[i: i + ECHO_GRAM]) for i in range(len(words) - ECHO_GRAM + 1)}


class Echo:
    """Whether a sentence is copied from the question: its word 3-grams found in the question cover half its words
    or more ("Kinds of lines in log lines 230 to 255:", "- 8 lines "install * <none> *"", the instructions)."""

    def __init__(self, question: str, lines: list[str] | None = None) -> None:
        """`lines`: the log lines; n-grams they hold are content, not the prompt's, and a sentence quoting a line
        is no echo ("connect() failed (111: Connection refused)" is in the digest and in the line)."""
        self.grams = _grams(_tokens(question))
        for line in lines or []:
            self.grams -= _grams(_tokens(line))

    def __call__(self, sentence: str) -> bool:
        words = _tokens(sentence)
        if len(words) < ECHO_GRAM or not self.grams:
            return False
        covered = [False] * len(words)
        for i in range(len(words) - ECHO_GRAM + 1):
            if tuple(words[i: i + ECHO_GRAM]) in self.grams:
                covered[i: i + ECHO_GRAM] = [True] * ECHO_GRAM
        return sum(covered) >= ECHO_SHARE * len(words)


def problems(sentence: str, support: Support, echo: Echo) -> tuple[list[str], str | None]:
    """Why a model sentence may not be shown: (unsupported claims and words, another reason or None)."""
    if _UNREADABLE_RE.search(sentence):
        return [], "unreadable characters"
    if echo(sentence) or _WILDCARD_RE.search(sentence):  # the digest's "status * libfoo *" copied back
        return [], "echoed the question"
    bad = unsupported(sentence, support) + contradicted(sentence, support)
    bad += [w for w in unbacked_words(sentence, support) if not any(w in b.lower() for b in bad)]  # not "nginx"
    bad += [c for c in stitched(sentence, support) if c.rsplit(" at ", 1)[0] not in bad]  # of "nginx.service"
    if bad:
        return bad, None
    if not content_words(sentence) and not SEVERITY_RE.search(sentence) \
            and not any(k == "name" for k, _ in claims(sentence)):
        return [], "said nothing"  # "- 15 more lines."; "No errors were found." says something checked
    return [], None


def guard(text: str, cut: bool, support: Support, digest: dict[str, Any] | None, question: str = "") -> Guarded:
    """Drop the sentences of a checked reply that may not be shown, then state what the digest shows that the
    prose does not (see the module doc). `cut`: the reply hit the token limit (its last piece is unfinished);
    `question`: what the model was asked (a sentence copied from it is dropped)."""
    kept: list[str] = []
    g = Guarded("", "model")
    echo = Echo(question, support.lines)
    pieces = sentences(text)
    for i, (sentence, ended) in enumerate(pieces):
        if not ended:
            last_cut = cut and i == len(pieces) - 1
            if last_cut or sentence.endswith("…") or not re.search(r"[A-Za-z]", sentence) \
                    or not re.search(r"[\w)\"']$", sentence):
                g.dropped.append(sentence)  # cut by the token limit, a lone list number, a "Packages:" header
                if "unfinished" not in g.why:
                    g.why.append("unfinished")
                continue
            sentence += "."  # a list item, or the model stopped (EOS) without a full stop: close the sentence
        claim = _LIST_MARK_RE.sub("", sentence)  # "2." of a numbered list is not a number claim
        bad, why = problems(claim, support, echo)
        if why is None and not bad and claim.lower() in (k.lower() for k in kept):
            why = "repeated"
        if bad or why:
            g.dropped.append(sentence)
            g.unsupported += [b for b in bad if b not in g.unsupported]
            if why and why not in g.why:
                g.why.append(why)
        else:
            kept.append(claim)
    return _complete(g, kept, digest)


def _refers(prose: str, stems: set[str], inc: Incident) -> bool:
    """The prose speaks of this incident, not just of its severity: it shares a content word or a name with the
    incident's template ("The backup job failed with an error." does not name an ext4 error's remount)."""
    words = content_words(inc.template.replace("<*>", " "))
    names = [c.lower() for k, c in claims(inc.template) if k == "name"]
    if not words and not names:
        return True
    return any(stem(w) in stems for w in words) or any(n in prose.lower() for n in names)


def _complete(g: Guarded, kept: list[str], digest: dict[str, Any] | None) -> Guarded:
    """The kept prose, with the digest's incidents it leaves out stated by code; the digest's own summary when no
    model sentence is left."""
    if digest is not None and not kept:
        g.added = digest_summary(digest)
        g.prose = "digest"
        kept = g.added
    elif digest is not None:
        prose = " ".join(kept)
        said, stems = mentioned(prose), {stem(w) for w in content_words(prose)}
        missing = [i for i in incidents(digest) if not (set(i.keys) <= said and _refers(prose, stems, i))]
        g.added = incident_sentences(missing)
        if g.added:
            g.prose = "model+digest"
            kept = kept + g.added
    g.text = " ".join(kept)
    return g
