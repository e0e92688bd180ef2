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
2. every severity the digest counted (error, fail, oom, denied, disk full, HTTP 5xx as error, ...) and every
   state change (restart, start, exit, failover, deploy, connection lost, ...; vocab.py), whatever the line's
   level word, that the kept prose does not name gets a sentence written by code: its count of lines, first line
   number and timestamp and that first line as written (`added`; written.py);
3. when no model sentence is left, the summary is written by code from the digest alone: line count and time span,
   the most frequent kinds of lines with their counts and values, the rare kinds no other sentence names, then
   the severity and state-change sentences (or "No line shows a severity word (no errors or warnings).", only
   when no line shows a severity nor a failure-type change such as an exception: written.py).

A sentence about an incident (a severity or state change) that the period's lines do not back but an earlier
notable line of the log does (Digest.notable) is kept, citing that line: "(earlier, at line 54)" (`earlier`).

The record says which: `prose` is "model", "model+digest" (code sentences appended) or "digest" (code only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from sinkchat.apps.summarize.digest import (CHANGE_GROUP_TO_KEY, CHANGE_RE, SEVERITY_RE, _GROUP_TO_KEY, changes,
                                            severities)
from sinkchat.apps.summarize.factcheck import (SENTENCE_END_RE, Support, _negated, claims,
                                               content_words, stem, stitched, unbacked_words, unsupported)
from sinkchat.apps.summarize import quoted
from sinkchat.apps.summarize.written import (MAX_INCIDENT_SENTENCES, NO_INCIDENT, UNREADABLE_RE,  # noqa: F401
                                             Incident, digest_summary, incident_sentence, incident_sentences,
                                             incidents, state_changes)

EARLIER_TRIES = 8  # earlier notable lines tried as the backing of a sentence the period's lines do not back
ECHO_GRAM = 3  # word n-grams shared with the question that mark a sentence as copied from it ...
ECHO_SHARE = 0.5  # ... when they cover at least this share of its words
_WILDCARD_RE = re.compile(r"<\*>|(?:^|[\s\"'(])\*(?=[\s\"')]|$)")  # a template's slot, as the question shows it
_UNREADABLE_RE = UNREADABLE_RE


@dataclass
class Guarded:
    """The summary as shown, and what was dropped and added on the way."""

    text: str
    prose: str  # "model", "model+digest" or "digest"
    unsupported: list[str] = field(default_factory=list)  # claims and words of the dropped sentences, in order
    why: list[str] = field(default_factory=list)  # other reasons sentences were dropped ("echoed the question")
    dropped: list[str] = field(default_factory=list)  # the model's sentences taken out
    added: list[str] = field(default_factory=list)  # the sentences written by code
    earlier: list[str] = field(default_factory=list)  # model sentences kept because an earlier line backs them
    cited: list[int] = field(default_factory=list)  # the numbers of those earlier lines


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


def mentioned_changes(prose: str) -> set[str]:
    """The state-change keys `prose` states (not negated: "was not restarted")."""
    return {CHANGE_GROUP_TO_KEY[m.lastgroup or ""] for m in CHANGE_RE.finditer(prose)
            if not _negated(prose, m.start())}


FAILURE_KEYS = frozenset({"error", "fail"})  # what a failure-type change (exception, core dump, down) contradicts


def contradicted(sentence: str, support: Support) -> list[str]:
    """Negated severity words whose key the lines do show ("no errors" while a line has an error), and "no errors"
    or "no failures" beside a failure-type change with no severity word (a Python traceback, a Java exception:
    the code's own sentences name it as "exception", written.py)."""
    out = []
    for m in SEVERITY_RE.finditer(sentence):
        key = _GROUP_TO_KEY[m.lastgroup or ""]
        if _negated(sentence, m.start()) and (key in support.severity or (key in FAILURE_KEYS and support.failures)):
            out.append("no " + m.group(0))
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
    bad = unsupported(sentence, support) + contradicted(sentence, support) + quoted.problems(sentence, support)
    bad += [w for w in unbacked_words(sentence, support) if not any(w in b.lower() for b in bad)]  # not "nginx"
    bad += [c for c in stitched(sentence, support) if c.rsplit(" at ", 1)[0] not in bad]  # of "nginx.service"
    if bad:
        return bad, None
    if not content_words(sentence) and not SEVERITY_RE.search(sentence) \
            and not any(k == "name" for k, _ in claims(sentence)):
        return [], "said nothing"  # "- 15 more lines."; "No errors were found." says something checked
    return [], None


def copied_line(sentence: str, support: Support) -> bool:
    """The sentence is a piece of one log line and nothing more: no summary of the period (`WARN disk: /var usage
    at 91%".` was a whole summary: no count, no time), so the digest's sentences say it instead. A sentence that
    quotes a line inside words of its own is a summary."""
    bare = re.sub(r"\s+", " ", sentence.strip().strip("\"'`.,;: -")).lower()
    return len(bare) >= 12 and any(bare in re.sub(r"\s+", " ", line) for line in support.lines)


def _kind(line: str) -> frozenset[str]:
    """The severity and state-change keys of a line: two lines of one kind report the same sort of incident."""
    return frozenset(severities(line)) | frozenset(changes(line))


def earlier_lines(claim: str, support: Support, echo: Echo, earlier: list[tuple[int, str]]) -> list[int]:
    """The numbers of earlier lines of the log that, beside the period's lines, back every word, name and number of
    `claim`: one line, or a pair of one kind (the same severity and change keys: "db-1 restarted" and "db-2
    restarted" back "db-1 and db-2 were restarted"), or []. Why: in the issue the model's sentence about
    `worker.service restarted` came one summary after that line and was dropped as `unsupported by the log: ...
    restarted`, though the log says it; a reader must not lose that, nor read it as news of these lines (the caller
    cites the lines). Why not any lines together: pooled, "database restarted" and "worker exited" backed "the
    database exited" (a code review). Only for a sentence about an incident (a severity or state change: the model
    copying its last summary of plain lines, "The archives were unpacked.", is still dropped), and only lines
    sharing a word or name with it are tried, the most recent EARLIER_TRIES of them."""
    stems = {stem(w) for w in content_words(claim)}
    names = [c.lower() for k, c in claims(claim) if k == "name"]
    found: list[tuple[int, str]] = []
    for no, line in reversed(earlier):
        low = line.lower()
        if any(n in low for n in names) or stems & {stem(w) for w in content_words(low)}:
            found.append((no, line))
            if len(found) >= EARLIER_TRIES:
                break
    for no, line in found:
        if problems(claim, support.extended([line]), echo) == ([], None):
            return [no]
    for i, (no, line) in enumerate(found):
        for no2, line2 in found[i + 1:]:
            if _kind(line) == _kind(line2) and problems(claim, support.extended([line, line2]), echo) == ([], None):
                return sorted([no, no2])
    return []


def _cite(sentence: str, nos: list[int]) -> str:
    """The sentence with the earlier lines that back it: "The worker was restarted (earlier, at line 54)."."""
    m = re.search(r"[.!?][\"')\]]*$", sentence)
    cut = m.start() if m else len(sentence)
    where = f"line {nos[0]}" if len(nos) == 1 else "lines " + ", ".join(map(str, nos[:-1])) + f" and {nos[-1]}"
    return sentence[:cut] + f" (earlier, at {where})" + (sentence[cut:] or ".")


def guard(text: str, cut: bool, support: Support, digest: dict[str, Any] | None, question: str = "",
          earlier: list[tuple[int, str]] | None = None) -> Guarded:
    """Drop the sentences of a checked reply that may not be shown, then state what the digest shows that the
    prose does not (see the module doc). `cut`: the reply hit the token limit (its last piece is unfinished);
    `question`: what the model was asked (a sentence copied from it is dropped); `earlier`: (number, text) of
    notable lines before this period (Digest.notable): a sentence one of them backs is kept, citing it."""
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
        if bad and why is None and earlier and (mentioned(claim) or mentioned_changes(claim)):
            nos = earlier_lines(claim, support, echo, earlier)
            if nos:
                bad, claim = [], _cite(claim, nos)
                g.earlier.append(claim)
                g.cited += nos
        if why is None and not bad and claim.lower() in (k.lower() for k in kept):
            why = "repeated"
        if bad or why:
            g.dropped.append(sentence)
            g.unsupported += [b for b in bad if b not in g.unsupported]
            if why and why not in g.why:
                g.why.append(why)
        else:
            kept.append(claim)
    return _complete(g, kept, digest, support)


def _refers(prose: str, stems: set[str], inc: Incident, common: set[str]) -> bool:
    """The prose speaks of this incident, not just of its severity: it shares a content word or a name with the
    incident's template ("The backup job failed with an error." does not name an ext4 error's remount). Words most
    of the period's kinds of lines share (`common`: the host "web01" on every syslog line) tell no incident apart:
    a sentence on nginx's lines named "web01", and the oom-kill line with it went unsaid."""
    words = content_words(inc.template.replace("<*>", " "))
    words = [w for w in words if stem(w) not in common] or words  # all common: they are all it has
    names = [c.lower() for k, c in claims(inc.template) if k == "name"]
    if not words and not names:
        return True
    return any(stem(w) in stems for w in words) or any(n in prose.lower() for n in names)


def _common(digest: dict[str, Any]) -> set[str]:
    """Stems of the content words in more than half of the period's kinds of lines (two kinds or more)."""
    temps = digest.get("templates") or []
    seen: dict[str, int] = {}
    for t in temps:
        for s in {stem(w) for w in content_words(t["template"].replace("<*>", " "))}:
            seen[s] = seen.get(s, 0) + 1
    return {s for s, n in seen.items() if n >= 2 and n * 2 > len(temps)}


def _complete(g: Guarded, kept: list[str], digest: dict[str, Any] | None, support: Support) -> Guarded:
    """The kept prose, with the digest's incidents it leaves out stated by code; the digest's own summary when no
    model sentence is left that summarizes this period (one citing earlier lines, or a copied line, does not)."""
    own = [k for k in kept if k not in g.earlier and not copied_line(k, support)]  # this period's, in its own words
    if digest is not None and not own:  # nothing said of this period (a kept sentence may cite earlier lines)
        copies = [k for k in kept if k not in g.earlier]  # pieces of a line: the digest says them with counts
        kept = [k for k in kept if k not in copies]
        g.dropped += copies
        if copies and "copied a log line" not in g.why:
            g.why.append("copied a log line")
        g.added = digest_summary(digest)
        g.prose = "model+digest" if kept else "digest"
        kept = g.added + kept
    elif digest is not None:
        prose = " ".join(kept)
        said = mentioned(prose) | mentioned_changes(prose)
        stems = {stem(w) for w in content_words(prose)}
        common = _common(digest)
        missing = [i for i in incidents(digest) + state_changes(digest)
                   if not (set(i.keys) <= said and _refers(prose, stems, i, common))]
        g.added = incident_sentences(missing)
        if g.added:
            g.prose = "model+digest"
            kept = kept + g.added
    g.text = " ".join(kept)
    return g
