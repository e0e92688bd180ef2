"""`clock`: the current date and time. A model has no idea what time it is; this is the cheapest grounding tool."""

from __future__ import annotations

import datetime as _dt


def clock() -> str:
    """Current local date and time (ISO 8601, with weekday and time zone)."""
    now = _dt.datetime.now().astimezone()
    return f"{now.isoformat(timespec='seconds')} ({now.strftime('%A')}, {now.tzname()})"
