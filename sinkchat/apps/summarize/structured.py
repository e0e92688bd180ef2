"""JSON-lines log records (structlog, zap, bunyan, pino, logstash, Docker's json-file) as plain log lines.

Why: Drain mines words split at spaces, so a record `{"ts": "...", "level": "info", "msg": "payment processed",
"amount": 171.33}` became the template `{'ts': {'2025-03-14T10:00:02Z',, ...` (the keys' quotes and commas glued
to every value), the time range was lost (the timestamp is not at the line's start) and the model read braces. A
record is shown as `TIME LEVEL message key=value ...`: the timestamp, level and message under their usual keys
first, the other fields after in the record's order; anything that is not a JSON object stays as it was.
"""

from __future__ import annotations

import json
from typing import Any

TIME_KEYS = ("ts", "time", "timestamp", "@timestamp", "datetime", "date", "t")
LEVEL_KEYS = ("level", "severity", "lvl", "levelname", "log.level", "loglevel")
MESSAGE_KEYS = ("msg", "message", "event", "text", "log")
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


def _take(rec: dict[str, Any], keys: tuple[str, ...]) -> str | None:
    for k in keys:
        v = rec.get(k)
        if isinstance(v, (str, int, float)) and not isinstance(v, bool) and str(v).strip():
            del rec[k]
            return str(v).strip()
    return None


def flatten(text: str) -> str:
    """`text` as `TIME LEVEL message key=value ...` when it is a JSON object, else unchanged. A message's own
    line breaks become spaces (one record, one line)."""
    s = text.strip()
    if not (s.startswith("{") and s.endswith("}")):
        return text
    try:
        rec = json.loads(s)
    except ValueError:
        return text
    if not isinstance(rec, dict) or not rec:
        return text
    ts, level, msg = _take(rec, TIME_KEYS), _take(rec, LEVEL_KEYS), _take(rec, MESSAGE_KEYS)
    parts = [p for p in (ts, level.upper() if level else None, " ".join(msg.split()) if msg else None) if p]
    parts += [f"{k}={_value(v)}" for k, v in rec.items()]
    return " ".join(parts)
