"""JSON-lines log records (structlog, zap, bunyan, pino, logstash, Docker's json-file) as plain log lines.

Why: Drain mines words split at spaces, so a record `{"ts": "...", "level": "info", "msg": "payment processed",
"amount": 171.33}` became the template `{'ts': {'2025-03-14T10:00:02Z',, ...` (the keys' quotes and commas glued
to every value), the time range was lost (the timestamp is not at the line's start) and the model read braces. A
record is shown as `TIME LEVEL message key=value ...`: the timestamp, level and message under their usual keys
first (pino's and bunyan's numeric levels as words, epoch times as ISO 8601), the other fields after in the
record's order; anything that is not a JSON object stays as it was. Flattened before control characters are
cleaned, so an escaped ESC, NUL or line break inside a value is cleaned like one in a plain line.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

TIME_KEYS = ("ts", "time", "timestamp", "@timestamp", "datetime", "date", "t")
LEVEL_KEYS = ("level", "severity", "lvl", "levelname", "log.level", "loglevel")
MESSAGE_KEYS = ("msg", "message", "event", "text", "log")
NUMERIC_LEVELS = {10: "TRACE", 20: "DEBUG", 30: "INFO", 40: "WARN", 50: "ERROR", 60: "FATAL"}  # pino, bunyan
MAX_DEPTH_TEXT = 200  # a nested value is shown as compact JSON, cut to this many characters


def _value(v: Any) -> str:
    """A field's value as one token where it can be: strings with spaces in double quotes, nested values as
    compact JSON."""
    if isinstance(v, str):
        v = v.strip()
        return json.dumps(v, ensure_ascii=False) if (not v or any(c.isspace() for c in v)) else v
    if isinstance(v, (dict, list)):
        return json.dumps(v, ensure_ascii=False, separators=(",", ":"))[:MAX_DEPTH_TEXT]
    return json.dumps(v)


def _take(rec: dict[str, Any], keys: tuple[str, ...]) -> Any:
    """The first of `keys` the record holds as a string or number (taken out of it), else None."""
    for k in keys:
        v = rec.get(k)
        if isinstance(v, (str, int, float)) and not isinstance(v, bool) and str(v).strip():
            del rec[k]
            return v
    return None


def _one_line(v: Any) -> str:
    """A value as one line of words (a message's own line breaks and tabs as spaces: one record, one line)."""
    return " ".join(str(v).split())


def _time(v: Any) -> str:
    """A timestamp as text; a number is seconds (zap, logstash) or milliseconds (pino, bunyan: past 1e11) since the
    epoch, shown as ISO 8601 UTC so the time range reads it."""
    if isinstance(v, (int, float)) and 0 < v < 1e14:
        secs = v / 1000 if v > 1e11 else v
        return datetime.fromtimestamp(secs, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    return _one_line(v)


def _level(v: Any) -> str:
    """A level as its word: pino's and bunyan's numbers (10 trace ... 60 fatal) named, so a `"level": 50` record
    counts as an error."""
    if isinstance(v, (int, float)):
        return NUMERIC_LEVELS.get(int(v), str(v))
    return _one_line(v).upper()


def flatten(text: str) -> str:
    """`text` as `TIME LEVEL message key=value ...` when it is a JSON object, else unchanged. A message's own
    line breaks become spaces (one record, one line)."""
    s = text.strip()
    if not (s.startswith("{") and s.endswith("}")):
        return text
    try:
        rec = json.loads(s)
    except (ValueError, RecursionError):  # RecursionError: `{"a": [[[[...` 1,200 deep stopped the reader
        return text
    if not isinstance(rec, dict) or not rec:
        return text
    ts, level, msg = _take(rec, TIME_KEYS), _take(rec, LEVEL_KEYS), _take(rec, MESSAGE_KEYS)
    parts = [p for p in (None if ts is None else _time(ts), None if level is None else _level(level),
                         None if msg is None else _one_line(msg)) if p]
    parts += [f"{k}={_value(v)}" for k, v in rec.items()]
    return " ".join(parts)
