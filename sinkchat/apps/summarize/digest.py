"""The exact digest of the lines since the last summary: log templates with counts, computed by code.

Why: a 135M model reading ~25 raw lines cannot count, and it invents failures. Every accepted line (deduped repeats
included) goes through Drain3 (a maintained log-template miner: a fixed-depth parse tree, no training, offline),
so the digest says exactly which kinds of lines came, how many of each, their first/last timestamps, the severity
words found and the values that vary per template. It goes into the JSONL record beside the prose (`digest`), into
the question (rendered within a token budget) and into the fact check as support.

Timestamps are cut off before mining (they would otherwise become a `<*>` in front of every template) and kept per
template as first/last. The lines of one summary period are bounded (the window or --every), so keeping their
tokens for exact parameter values costs bounded memory; past MAX_TOKENS_KEPT per template the values are marked
as a sample (`values_exact: false`).
"""

from __future__ import annotations

import logging
import re
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable

from sinkchat.apps.summarize.vocab import CHANGE_WORDS, ROUTINE_CHANGES, negated

log = logging.getLogger(__name__)

MAX_TOKENS_KEPT = 2000  # token lists kept per template per period, for exact parameter values
MAX_VALUES = 8  # values listed per parameter slot (the distinct count is always exact)
FIRST_TEXT_CHARS = 200  # a template's first line, kept as written (quoted by code instead of its `<*>` template)
NOTABLE_KEPT = 64  # run-wide: the last lines with a severity ...
CHANGES_KEPT = 32  # ... and, apart, the last lines with a state change and no severity ...
ROUTINE_KEPT = 8  # ... and the last with only a routine one (start, stop, reload), so neither pushes out the above

_TS_PATTERNS = [
    re.compile(r"^\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?"),  # ISO / dpkg
    re.compile(r"^[A-Z][a-z]{2} [ \d]\d \d{2}:\d{2}:\d{2}"),  # syslog
    re.compile(r"\[(\d{2}/[A-Z][a-z]{2}/\d{4}:\d{2}:\d{2}:\d{2} [+-]\d{4})\]"),  # common/combined log format
    re.compile(r"^\d{4}/\d{2}/\d{2} \d{2}:\d{2}:\d{2}"),  # nginx error log, Go's log package
    re.compile(r"^\[\s*\d+\.\d+\]"),  # kernel ring buffer (dmesg): seconds since boot
    re.compile(r"\d{4}-\d{2}-\d{2}\s+\d{2}:\d{2}:\d{2}"),  # anywhere (apt history "Start-Date: ...")
]

# canonical severity key -> word pattern; a match glued to an identifier (libgpg-error-dev, stderr) does not count
_SEVERITY_WORDS = {
    "fatal": r"fatal(?:ly)?", "panic": r"panic(?:s|ked)?", "critical": r"crit(?:ical)?", "emergency": r"emerg(?:ency)?",
    "error": r"err(?:or|ors|ored)?", "fail": r"fail(?:s|ed|ure|ures|ing)?", "warning": r"warn(?:ing|ings|ed)?",
    "denied": r"den(?:ied|y|ies)", "timeout": r"time(?:d)?[ -]?outs?", "oom": r"oom|out of memory",
    "killed": r"kill(?:ed|s)?", "segfault": r"segfault|segmentation fault", "refused": r"refused",
    "unreachable": r"unreachable", "abort": r"abort(?:ed|s)?", "corrupt": r"corrupt(?:ed|ion)?",
    "disk full": r"no space left|disk (?:is )?full", "crash": r"crash(?:ed|es)?", "unable": r"unable|cannot|can't", "invalid": r"invalid", "unauthorized": r"unauthori[sz]ed",
}
SEVERITY_RE = re.compile(
    r"(?<![\w./-])(?:" + "|".join(f"(?P<{re.sub(r'[^a-z]', '_', k)}>{p})" for k, p in _SEVERITY_WORDS.items())
    + r")(?![\w/-])(?!\.\w)", re.IGNORECASE)
_GROUP_TO_KEY = {re.sub(r"[^a-z]", "_", k): k for k in _SEVERITY_WORDS}
CHANGE_RE = re.compile(
    r"(?<![\w./-])(?:" + "|".join(f"(?P<{re.sub(r'[^a-z]', '_', k)}>{p})" for k, p in CHANGE_WORDS.items())
    + r")(?![\w/-])(?!\.\w)", re.IGNORECASE)
CHANGE_GROUP_TO_KEY = {re.sub(r"[^a-z]", "_", k): k for k in CHANGE_WORDS}
HTTP_5XX_RE = re.compile(r"\"\s+(5\d\d)\s+(?:\d+|-)")  # access log: status after the quoted request
# an out-of-memory class name glued into a qualified name ("java.lang.OutOfMemoryError", Python's "MemoryError"),
# which the word pattern cannot see: the two OutOfMemoryError lines counted as "error" only
OOM_CLASS_RE = re.compile(r"OutOfMemory|(?<![A-Za-z])MemoryError")


CUT_MARK = " …[line truncated"  # the start of the marker reader.clean_line puts where it cut a line


def kept_text(content: str) -> str:
    """A line as the digest keeps it for quoting: its first FIRST_TEXT_CHARS characters; of a line cut for length,
    its start and then the marker with the line's kept end (where `-> ERROR upstream failed` is)."""
    i = content.find(CUT_MARK)
    if i < 0 or len(content) <= FIRST_TEXT_CHARS:
        return content[:FIRST_TEXT_CHARS]
    end = content[i:][-(FIRST_TEXT_CHARS * 3 // 4):]
    return content[: FIRST_TEXT_CHARS - len(end)] + end


def split_timestamp(line: str) -> tuple[str | None, str]:
    """(timestamp text or None, the line without it) for the common log timestamp shapes."""
    for pat in _TS_PATTERNS:
        m = pat.search(line)
        if m:
            ts = m.group(1) if pat.groups else m.group(0)
            return ts, (line[: m.start()] + line[m.end():]).strip()
    return None, line.strip()


_MONTHS = {m: i for i, m in enumerate("Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec".split(), 1)}  # CLF


def ts_order(ts: str) -> tuple[Any, ...] | None:
    """A sortable key for a timestamp `split_timestamp` found, its shape first, or None where it cannot be ordered:
    ISO, apt's and nginx / Go times by their digits, the common log format by date and time, dmesg by its seconds.
    Syslog's (no year on the line: `Dec 31 23:59:58` then `Jan  1 00:00:02` is the new year) goes by line order.
    Zones are not converted: one log is in one zone."""
    m = re.match(r"(\d{4})[-/](\d{2})[-/](\d{2})(?:T|\s+)(\d{2}):(\d{2}):(\d{2})(?:[.,](\d+))?", ts)
    if m:
        return ("iso",) + tuple(int(g) for g in m.groups()[:6]) + (float("0." + (m.group(7) or "0")),)
    m = re.match(r"(\d{2})/([A-Z][a-z]{2})/(\d{4}):(\d{2}):(\d{2}):(\d{2})", ts)
    if m and m.group(2) in _MONTHS:
        return ("clf", int(m.group(3)), _MONTHS[m.group(2)], int(m.group(1)), int(m.group(4)), int(m.group(5)),
                int(m.group(6)))
    m = re.match(r"\[\s*(\d+\.\d+)\]", ts)
    return ("dmesg", float(m.group(1))) if m else None


def severities(text: str) -> Counter[str]:
    """Canonical severity keys found in `text` (an HTTP 5xx status counts as an error)."""
    found: Counter[str] = Counter()
    for m in SEVERITY_RE.finditer(text):
        found[_GROUP_TO_KEY[m.lastgroup or ""]] += 1
    if HTTP_5XX_RE.search(text):
        found["error"] += 1
    if "oom" not in found and OOM_CLASS_RE.search(text):
        found["oom"] += 1
    return found


_ZERO_AFTER = re.compile(r"\s*[:=]?\s*0(?![\d.])")  # "pods evicted: 0", "evicted 0 pods", "exit 0"
_CODE_AFTER = re.compile(r"\b(?:code|status|rc)\b\s*[:=]?\s*(\d+)(?![\d.])")  # "exited with code 0", systemd


def _zero(text: str, end: int) -> bool:
    """The change word at `end` comes with a count or exit code of 0: nothing changed ("exit code 0", "pods
    evicted: 0", systemd's "Main process exited, code=exited, status=0/SUCCESS")."""
    tail = re.split(r"[;(]", text[end: end + 40], maxsplit=1)[0]
    if _ZERO_AFTER.match(tail):
        return True
    m = _CODE_AFTER.search(tail)
    return m is not None and int(m.group(1)) == 0


def changes(text: str) -> Counter[str]:
    """Canonical state-change keys found in `text` ("restarted" -> restart, "SIGKILL" -> signal; vocab.py); a
    negated ("no exception occurred", "0 pods evicted") or zero ("exit code 0") one is no change."""
    return Counter(CHANGE_GROUP_TO_KEY[m.lastgroup or ""] for m in CHANGE_RE.finditer(text)
                   if not negated(text, m.start()) and not _zero(text, m.end()))


@dataclass
class _Template:
    """Per-period aggregate of one Drain cluster."""

    count: int = 0
    first_line: int = 0
    last_line: int = 0
    first_ts: str | None = None
    last_ts: str | None = None
    severity: Counter[str] = field(default_factory=Counter)
    changes: Counter[str] = field(default_factory=Counter)
    first_text: str = ""  # the first line of the kind this period, timestamp cut off
    token_lists: list[tuple[str, ...]] = field(default_factory=list)
    # per severity / change key: [lines holding it, the first such line's number, its timestamp, its text]. Why
    # apart from the kind's count and first line: Drain put an access log's 200 and 502 lines in one template, and
    # "15 lines show error" quoted a 200 line where 5 lines were 502s
    severity_at: dict[str, list[Any]] = field(default_factory=dict)
    changes_at: dict[str, list[Any]] = field(default_factory=dict)

    def mark(self, at: dict[str, list[Any]], keys: Counter[str], no: int, ts: str | None, text: str,
             count: int) -> None:
        """Count `count` lines ending at `no` under each of `keys`, keeping the first such line."""
        for k in keys:
            entry = at.setdefault(k, [0, no - count + 1, ts, kept_text(text)])
            entry[0] += count


def _new_miner() -> Any:
    """A Drain3 miner with an explicit config (without one it looks for drain3.ini in the working directory)."""
    from drain3 import TemplateMiner
    from drain3.template_miner_config import TemplateMinerConfig

    cfg = TemplateMinerConfig()
    cfg.profiling_enabled = False
    cfg.drain_sim_th = 0.5
    cfg.drain_depth = 4
    cfg.drain_max_clusters = 5000  # LRU-bounded over a run that never ends
    return TemplateMiner(config=cfg)


class Digest:
    """Templates, counts, timestamps, severities and parameter values of the lines since the last summary.

    One Drain3 miner lives for the whole run (templates learned early keep matching later), while the counts are
    per period: `take()` returns the period's record and starts a new one. `notable` is run-wide too: the last
    lines (number, text) with a severity or a state change (bounded apart, see `notable`), so a summary sentence
    about an earlier incident can be backed by its line (guard.py), in bounded memory."""

    def __init__(self) -> None:
        self.miner = _new_miner()
        self.templates: dict[int, _Template] = {}
        self.lines = 0
        self.binary = 0
        self.first_ts: str | None = None
        self.last_ts: str | None = None
        self._first_key: tuple[Any, ...] | None = None
        self._last_key: tuple[Any, ...] | None = None
        self._seen_first: str | None = None  # the first line's timestamp, for a period of mixed shapes
        self._mixed = False
        self.severity: Counter[str] = Counter()
        self.changes: Counter[str] = Counter()
        self._severe: deque[tuple[int, str]] = deque(maxlen=NOTABLE_KEPT)
        self._changed: deque[tuple[int, str]] = deque(maxlen=CHANGES_KEPT)
        self._routine: deque[tuple[int, str]] = deque(maxlen=ROUTINE_KEPT)

    @property
    def notable(self) -> list[tuple[int, str]]:
        """The run's last notable lines (number, text), in line order: NOTABLE_KEPT with a severity, CHANGES_KEPT
        with only a state change, ROUTINE_KEPT with only a routine one. Why apart: in one deque of 64 a journal's
        "Started Session 42 of User root." lines pushed out the OutOfMemoryError a model sentence cited."""
        return sorted([*self._severe, *self._changed, *self._routine])

    def add(self, no: int, text: str, count: int = 1) -> None:
        """Account input line `no` (`count` identical lines ending there, for a closed run of repeats)."""
        ts, content = split_timestamp(text)
        result = self.miner.add_log_message(content or "(empty line)")
        t = self.templates.get(result["cluster_id"])
        if t is None:
            t = self.templates[result["cluster_id"]] = _Template(first_line=no - count + 1,
                                                                 first_text=kept_text(content))
        t.count += count
        t.last_line = no
        if ts:
            t.first_ts = t.first_ts or ts
            t.last_ts = ts
            self._span(ts)
        sev = severities(text)
        for k, v in sev.items():
            t.severity[k] += v * count
            self.severity[k] += v * count
        chg = changes(content)
        for k, v in chg.items():
            t.changes[k] += v * count
            self.changes[k] += v * count
        t.mark(t.severity_at, sev, no, ts, content, count)
        t.mark(t.changes_at, chg, no, ts, content, count)
        if sev:
            self._severe.append((no, text))
        elif chg:
            (self._routine if set(chg) <= ROUTINE_CHANGES else self._changed).append((no, text))
        if len(t.token_lists) < MAX_TOKENS_KEPT:
            t.token_lists.extend([tuple((content or "(empty line)").split())] * min(count, MAX_TOKENS_KEPT))
        self.lines += count

    def _span(self, ts: str) -> None:
        """The period's time range: its earliest and latest timestamps, not its first and last line's (a line
        logged late, out of order, made "from 13:00:00 to 12:59:58"). Where the lines' timestamps are of more than
        one shape (a journal mixing dmesg seconds and dates) or of one not known, the first and last line's."""
        key = ts_order(ts)
        if self.first_ts is None:
            self.first_ts = self.last_ts = self._seen_first = ts
            self._first_key = self._last_key = key
            self._mixed = key is None
        elif self._mixed or key is None or self._first_key is None or key[0] != self._first_key[0]:
            self._mixed = True
            self.first_ts, self.last_ts = self._seen_first, ts
        elif key < self._first_key:
            self.first_ts, self._first_key = ts, key
        elif key > self._last_key:  # type: ignore[operator]
            self.last_ts, self._last_key = ts, key

    def record(self) -> dict[str, Any]:
        """The period's digest as plain JSON data: templates ordered by severity, then count."""
        clusters = {c.cluster_id: c for c in self.miner.drain.clusters}
        out = []
        for cid, t in self.templates.items():
            cluster = clusters.get(cid)
            template = cluster.get_template() if cluster is not None else "(template evicted)"
            item: dict[str, Any] = {"template": template, "count": t.count, "first_line": t.first_line,
                                    "last_line": t.last_line}
            if t.first_ts:
                item["first_ts"], item["last_ts"] = t.first_ts, t.last_ts
            if t.severity:
                item["severity"] = dict(t.severity)
                item["severity_at"] = {k: list(v) for k, v in t.severity_at.items()}
            if t.changes:
                item["changes"] = dict(t.changes)
                item["changes_at"] = {k: list(v) for k, v in t.changes_at.items()}
            if t.first_text:
                item["first_text"] = t.first_text
            params, exact = _params(template, t.token_lists, t.count)
            if params:
                item["params"] = params
                if not exact:
                    item["values_exact"] = False
            out.append(item)
        out.sort(key=lambda x: (-sum(x.get("severity", {}).values()), -sum(x.get("changes", {}).values()),
                                -x["count"], x["first_line"]))
        return {"lines": self.lines, "templates": out, "first_ts": self.first_ts, "last_ts": self.last_ts,
                "severity": dict(self.severity), "changes": dict(self.changes), "binary": self.binary}

    def take(self) -> dict[str, Any]:
        """The record of this period, and a fresh period (the miner and its templates carry on)."""
        rec = self.record()
        self.reset()
        return rec

    def reset(self) -> None:
        """A fresh period, its record already taken with `record()` (the miner and its templates carry on)."""
        self.templates, self.lines, self.binary = {}, 0, 0
        self.first_ts = self.last_ts = None
        self.severity = Counter()
        self.changes = Counter()


def _params(template: str, token_lists: list[tuple[str, ...]], count: int) -> tuple[list[dict[str, Any]], bool]:
    """Per `<*>` slot: the most common values and the exact number of distinct ones."""
    slots = [i for i, tok in enumerate(template.split()) if tok == "<*>"]
    if not slots:
        return [], True
    n = len(template.split())
    counters = [Counter[str]() for _ in slots]
    for toks in token_lists:
        if len(toks) == n:
            for c, i in zip(counters, slots):
                c[toks[i]] += 1
    params = [{"values": [v for v, _ in c.most_common(MAX_VALUES)], "distinct": len(c)} for c in counters if c]
    return params, len(token_lists) >= count


def marks(t: dict[str, Any], field: str) -> dict[str, list[Any]]:
    """Per key of a template's `field`: [lines holding it, the first such line's number, timestamp, text]. A record
    from before these were kept falls back on the whole template (its count, first line and text)."""
    at = t.get(field + "_at")
    if at is not None:
        return at
    return {k: [t["count"], t["first_line"], t.get("first_ts"), t.get("first_text", "")] for k in t.get(field) or {}}


def render(rec: dict[str, Any], count_tokens: Callable[[str], int], budget: int) -> str:
    """The digest as short text for the question, cut to `budget` tokens (templates in the record's order, so the
    severe and frequent ones survive a cut). Says how many templates did not fit."""
    head = f"{rec['lines']} lines"
    if rec.get("first_ts"):
        head += f", {rec['first_ts']} to {rec['last_ts']}"
    sev = rec.get("severity") or {}
    head += "; severity words: " + (", ".join(f"{k} x{v}" for k, v in sev.items()) if sev else "none")
    chg = rec.get("changes") or {}
    head += ("; events: " + ", ".join(f"{k} x{v}" for k, v in chg.items()) if chg else "") + "."
    parts, used = [head], count_tokens(head)
    temps = rec.get("templates", [])
    for i, t in enumerate(temps):
        vals = "; ".join(", ".join(p["values"][:3]) + (f" and {p['distinct'] - 3} more" if p["distinct"] > 3 else "")
                         for p in t.get("params", []))
        line = f"- {t['count']} lines \"{t['template'].replace('<*>', '*')}\"" + (f" (* = {vals})" if vals else "")
        cost = count_tokens(line) + 1
        if used + cost > budget:
            parts.append(f"(+{len(temps) - i} more kinds of lines)")
            break
        parts.append(line)
        used += cost
    return "\n".join(parts)
