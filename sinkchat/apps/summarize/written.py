"""The sentences written by code from the digest: incidents (severities), state changes, the digest's own summary.

Why state changes and rare kinds: in the issue's log (50 INFO lines, two OutOfMemoryError lines, `FATAL worker:
exiting with code 137`, `INFO systemd: worker.service restarted`, 50 INFO lines) the summary written from the digest
named the three most frequent of its four kinds, and the restart, a line with no severity word, was in none of the
summaries. So besides every severity, each state change (restart, start, stop, exit, shutdown, failover, deploy,
rollback, connection lost, ...; vocab.py) gets a sentence of its own, and the digest's summary lists the kinds of
lines seen once or twice that no other sentence names ("Also seen: ..."), so a rare line outside any vocabulary is
not lost either.

Why a line, not its template, is quoted: a template shows its variable fields as `<*>` ("... (attempt <*>"), and a
slot's values glued to punctuation read as residue ("(attempt {1), 2), … 8 in all}"). An incident quotes its first
line as written (`first_text`), a kind seen once is its line, and a slot whose values share leading or trailing
punctuation shows it once, around them ("(attempt 1 to 8)").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from sinkchat.apps.summarize.digest import CUT_MARK, marks
from sinkchat.apps.summarize.vocab import FAILURE_CHANGES, ROUTINE_CHANGES, ROUTINE_TRIGGERS
from sinkchat.textutil import plural

TOP_TEMPLATES = 3  # templates named in a summary written from the digest
MAX_INCIDENT_SENTENCES = 6  # severity / state-change sentences appended; the rest are counted in one more sentence
RARE_COUNT = 2  # a kind of line with at most this many lines in the period is rare ...
RARE_SHOWN = 4  # ... and up to this many rare kinds are quoted in a summary written from the digest
TEMPLATE_CHARS = 100  # a quoted template is cut to this many characters
VALUE_CHARS = 40  # a value shown in a filled template is cut to this many
QUOTE_LIMITS = (TEMPLATE_CHARS, TEMPLATE_CHARS + 40)  # the lengths lines are quoted at: an incident's, a kind's
NO_INCIDENT = "No line shows a severity word (no errors or warnings)."  # negated: checked against the lines
UNREADABLE_RE = re.compile(r"[\ufffd\x00-\x08\x0b-\x1f\x7f-\x9f]")
_EDGE_RE = re.compile(r"^([^\w]*)(.*?)([^\w]*)$", re.DOTALL)
_CLOSE = {")": "(", "]": "[", "}": "{", ">": "<"}


@dataclass
class Incident:
    """One severity (or state change) of the digest, or several that occur in exactly the same templates."""

    keys: list[str]
    lines: int
    first_line: int
    first_ts: str | None
    template: str
    first_text: str = ""  # the first line of the first template, as written (timestamp cut off)
    change: bool = False  # a state change on lines with no severity word


def _grouped(digest: dict[str, Any], field: str) -> list[Incident]:
    """The digest's keys of `field` ("severity" or "changes") as incidents: the lines holding the key (over its
    templates), the first of them, as written; keys held by the same lines (the same counts and first lines in
    the same templates) are one incident ("oom and killed"). A state change on a line that holds a severity is
    that severity's incident already."""
    by_lines: dict[tuple[tuple[int, int, int], ...], list[str]] = {}
    temps = digest.get("templates") or []
    at = [marks(t, field) if field == "severity" or not t.get("severity") else {} for t in temps]
    for key in digest.get(field) or {}:
        sig = tuple((i, m[key][0], m[key][1]) for i, m in enumerate(at) if key in m)
        if sig:
            by_lines.setdefault(sig, []).append(key)
    out = []
    for sig, keys in by_lines.items():
        i, n, first_no = min(sig, key=lambda s: s[2])
        _, _, ts, text = at[i][keys[0]]
        out.append(Incident(keys, sum(s[1] for s in sig), first_no, ts, temps[i]["template"], text or "",
                            field == "changes"))
    out.sort(key=lambda x: x.first_line)
    return out


def incidents(digest: dict[str, Any]) -> list[Incident]:
    """The digest's severities as incidents (see `_grouped`)."""
    return _grouped(digest, "severity")


def quiet_routine(digest: dict[str, Any]) -> bool:
    """Whether the period's routine changes (start, stop, reload) go unnamed: they do unless the period also shows
    a severity, a failure-type change (exception, core dump, down, ...) or a process that ended or restarted
    (restart, a non-zero exit, terminated). Why: a journal logs "Started Session 42 of User root." and "Stopping
    User Manager..." all day, and one code-written sentence per window about them buried the incidents; the start
    worth a sentence is the one beside a crash or an exit ("app.service: crashed" then "service started on port
    8080"), which this rule keeps. The digest still counts them (`changes`), for the model and the fact check."""
    keys = set(digest.get("changes") or {})
    return not digest.get("severity") and not keys & ROUTINE_TRIGGERS


def state_changes(digest: dict[str, Any]) -> list[Incident]:
    """The digest's state changes on lines with no severity word, as incidents (see `_grouped`); routine ones only
    beside a failure or an ended process (`quiet_routine`)."""
    out = _grouped(digest, "changes")
    if quiet_routine(digest):
        out = [i for i in out if not set(i.keys) <= ROUTINE_CHANGES]
    return out


def failures(digest: dict[str, Any]) -> set[str]:
    """The period's severities and failure-type changes: with none, the summary may say no line shows one."""
    return set(digest.get("severity") or {}) | (set(digest.get("changes") or {}) & FAILURE_CHANGES)


def quote(template: str, limit: int = TEMPLATE_CHARS) -> str:
    """A template or value as quoted text: one line, no unreadable characters, at most `limit` characters, cut at a
    space where there is one."""
    t = " ".join(UNREADABLE_RE.sub("", template).replace('"', "'").split())
    if len(t) <= limit:
        return t
    if CUT_MARK.strip() in t:  # a line cut for length: its start, then its kept end (quoted.py reads the "…")
        head = t[: limit // 3].rstrip()
        return head + " … " + t[len(t) - (limit - len(head) - 3):].lstrip()
    cut = t[: limit - 1]
    return (cut.rsplit(" ", 1)[0] if " " in cut[limit // 2:] else cut).rstrip() + "…"


def _balanced(text: str) -> bool:
    """Whether every bracket in `text` closes one it opened: "api[2231" is not, so the "]" the values share stays
    with them ("{api[2231], api[2290]}", not "{api[2231, api[2290}]")."""
    depth = {o: 0 for o in "([{<"}
    for ch in text:
        if ch in depth:
            depth[ch] += 1
        elif ch in _CLOSE and depth[_CLOSE[ch]] > 0:
            depth[_CLOSE[ch]] -= 1
        elif ch in _CLOSE:
            return False
    return not any(depth.values())


def _slot(values: list[str], n: int) -> str:
    """One `<*>` slot as its values: one as itself, more in braces, past two as the first two and how many
    ("{half-installed, unpacked}", "{a, b, … 8 in all}"), integers that fill a range as "1 to 8". Punctuation all
    the values share at their edges is shown once outside ("1)", "2)" -> "1 to 8)"), when every value is listed."""
    head = tail = ""
    if n == len(values) and n > 1:
        parts = [_EDGE_RE.match(v).groups() for v in values]  # type: ignore[union-attr]
        if (len({p[0] for p in parts}) == 1 and len({p[2] for p in parts}) == 1 and all(p[1] for p in parts)
                and all(_balanced(p[1]) for p in parts)):
            head, tail, values = parts[0][0], parts[0][2], [p[1] for p in parts]
    vals = [quote(v, VALUE_CHARS) for v in values]
    if n == 1:
        return head + vals[0] + tail
    if n == len(values) and n > 2 and all(re.fullmatch(r"\d{1,9}", v) for v in values):
        nums = sorted(int(v) for v in values)
        if nums[-1] - nums[0] + 1 == n:
            return f"{head}{nums[0]} to {nums[-1]}{tail}"
    return head + "{" + ", ".join(vals[:2]) + (f", … {n} in all" if n > 2 else "") + "}" + tail


def filled(t: dict[str, Any]) -> str:
    """A template with each `<*>` slot shown as its values (`_slot`); a kind seen once is its line as written.
    Braces and commas, not "/": "unpacked/half-configured" would read back as one name no line holds."""
    if t.get("count") == 1 and t.get("first_text"):
        return quote(t["first_text"], QUOTE_LIMITS[1])
    params = iter(t.get("params") or [])

    def slot(_: re.Match[str]) -> str:
        p = next(params, None)
        if not p or not p.get("values"):
            return "…"
        return _slot(list(p["values"]), p.get("distinct", len(p["values"])))

    return quote(re.sub(r"<\*>", slot, t["template"]), QUOTE_LIMITS[1])


def incident_sentence(inc: Incident) -> str:
    """"2 lines show error and disk full, first at line 56 (Mar  1 00:27:56): "web-01 rsyslogd: ..."." (its first
    line as written; the template, its slots as "…", only for a record without it)."""
    where = f"line {inc.first_line}" + (f" ({inc.first_ts})" if inc.first_ts else "")
    words = " and ".join(inc.keys)
    plural = "lines show" if inc.lines != 1 else "line shows"
    text = inc.first_text or inc.template.replace("<*>", "…")
    return f"{inc.lines} {plural} {words}, first at {where}: \"{quote(text)}\"."


def incident_sentences(incs: list[Incident]) -> list[str]:
    """A sentence per incident, in line order; past MAX_INCIDENT_SENTENCES (severities first, then state changes)
    the rest in one more sentence, with their keys and first line."""
    ranked = sorted(incs, key=lambda i: (i.change, i.first_line))
    shown = sorted(ranked[:MAX_INCIDENT_SENTENCES], key=lambda i: i.first_line)
    out = [incident_sentence(i) for i in shown]
    rest = ranked[MAX_INCIDENT_SENTENCES:]
    if rest:
        keys = sorted({k for i in rest for k in i.keys})
        out.append(f"{sum(i.lines for i in rest)} more lines show {', '.join(keys)}, first at line "
                   f"{min(i.first_line for i in rest)}.")
    return out


def _rare(temps: list[dict[str, Any]], named: list[dict[str, Any]], quiet: frozenset[str]) -> str | None:
    """"Also seen: 1 x "..."; 2 x "..."." for the kinds of at most RARE_COUNT lines no other sentence names (a kind
    whose only changes are `quiet`, routine ones left unnamed, is rare like any)."""
    rare = sorted((t for t in temps if t["count"] <= RARE_COUNT and not t.get("severity")
                   and not set(t.get("changes") or {}) - quiet and not any(t is n for n in named)),
                  key=lambda t: t["first_line"])
    if not rare:
        return None
    text = "Also seen: " + "; ".join(f"{t['count']} x \"{filled(t)}\"" for t in rare[:RARE_SHOWN])
    more = len(rare) - RARE_SHOWN
    return text + (f"; and {more} more {'kind' if more == 1 else 'kinds'}." if more > 0 else ".")


def digest_summary(digest: dict[str, Any]) -> list[str]:
    """A summary written by code from the digest alone: span, the most frequent kinds of lines with their counts
    and values, the rare kinds, then the severities and state changes ("26 lines from 14:36:31 to 14:36:33, of 9
    kinds; most frequent: 8 x "status {half-installed, unpacked, installed} python3.11:amd64 3.11.2-6"; ... No
    line shows a severity word.")."""
    n = digest.get("lines", 0)
    temps = digest.get("templates") or []
    head = plural(n, 'line')
    if digest.get("first_ts"):
        head += f" from {digest['first_ts']} to {digest['last_ts']}"
    if len(temps) > 1:
        head += f", of {len(temps)} kinds"
    top = sorted(temps, key=lambda t: (-t["count"], t["first_line"]))[:TOP_TEMPLATES]
    if len(top) == 1:
        head += f": {top[0]['count']} x \"{filled(top[0])}\""
    elif top:
        head += "; most frequent: " + "; ".join(f"{t['count']} x \"{filled(t)}\"" for t in top)
    out = [head + "."]
    rare = _rare(temps, top, ROUTINE_CHANGES if quiet_routine(digest) else frozenset())
    if rare:
        out.append(rare)
    out += incident_sentences(incidents(digest) + state_changes(digest))
    # not beside an exception with no severity word: "2 lines show exception, first at line 21: "Traceback (most
    # recent call last):"." then "No line shows a severity word (no errors or warnings)." read as a contradiction
    return out if failures(digest) else out + [NO_INCIDENT]
