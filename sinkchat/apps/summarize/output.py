"""The output blocks of `sinkchat summarize`: one per summary, as text, JSON lines or markdown."""

from __future__ import annotations

import json
from typing import Any, TextIO

from sinkchat.textutil import plural

FORMATS = ("text", "jsonl", "markdown")
SHOWN_WORDS = 8  # unsupported words named under a summary (the record keeps them all)


class OutputClosed(Exception):
    """stdout went away (SIGPIPE / EPIPE): stop quietly."""


class Output:
    """One block per summary on stdout, flushed at once so a reader of the pipe sees it before EOF."""

    def __init__(self, fmt: str, stream: TextIO) -> None:
        self.fmt, self.stream = fmt, stream

    def write(self, block: dict[str, Any]) -> None:
        try:
            self.stream.write(render_block(block, self.fmt))
            self.stream.flush()
        except (BrokenPipeError, ConnectionResetError) as e:
            raise OutputClosed() from e
        except OSError as e:
            if e.errno == 32:  # EPIPE seen through a wrapper
                raise OutputClosed() from e
            raise


def counts_text(b: dict[str, Any]) -> str:
    """The header's line accounting; says how many lines the model read in full when that is not all of them."""
    parts = [f"{b['summarized']} summarized"] + [f"{b[k]} {k}" for k in ("filtered", "deduped") if b[k]]
    if b["skipped"]:
        binary = b.get("binary") or 0
        parts.append(f"{b['skipped']} skipped" + (f" ({binary} binary)" if binary else ""))
    if b.get("truncated"):  # shown as their start and end, the marker naming the severity words cut out
        parts.append(f"{b['truncated']} cut (over --max-line-chars)")
    full = b.get("lines_in_full")
    if full is not None and b["summarized"] and full < b["summarized"]:
        parts.append(f"{full} read in full, {b.get('lines_digest_only', 0)} only through the digest")
    return f"{plural(b['lines'], 'line')}: " + ", ".join(parts)


def summary_text(b: dict[str, Any]) -> str:
    """The prose, or why there is none; under it how many of the model's sentences were dropped (and for which
    unsupported claims), and whether the summary was written by code from the digest."""
    summary = b["summary"]
    if not summary:
        binary = b.get("binary") or 0
        summary = f"(skipped {binary} binary lines; nothing to summarize)" if binary else "(no lines to summarize)"
    dropped = b.get("dropped") or []
    notes = []
    if dropped:
        n = len(dropped)
        words = list(b.get("unsupported") or [])
        shown = ", ".join(words[:SHOWN_WORDS]) + (f" and {len(words) - SHOWN_WORDS} more" if len(words) >
                                                  SHOWN_WORDS else "")
        why = ([f"unsupported by the log: {shown}"] if words else []) + list(b.get("why") or [])
        notes.append(f"dropped {plural(n, 'sentence')} of the model's summary: "
                     + ("; ".join(why) if why else "unfinished"))  # records from before `why` held "unfinished"
    elif b.get("unsupported"):
        notes.append("unsupported by the log: " + ", ".join(b["unsupported"]))
    if b.get("prose") == "digest":
        notes.append("summary written from the digest")
    elif b.get("prose") == "model+digest":
        notes.append(f"{len(b.get('added') or [])} sentence(s) added from the digest")
    if notes:
        summary += "\n[" + "; ".join(notes) + "]"
    return summary


def render_block(b: dict[str, Any], fmt: str) -> str:
    """One summary block in the chosen format (jsonl: exactly one line). The zero-line end-of-run marker is shown
    only in JSONL (a text reader needs no empty block)."""
    if fmt == "jsonl":
        return json.dumps(b, ensure_ascii=False) + "\n"
    if not b["lines"] and b["final"]:
        return ""
    summary = summary_text(b)
    final = " (final)" if b["final"] else ""
    if b["final"] and b.get("stopped_by"):  # a stop's skips, told apart from back-pressure drops
        n = b.get("skipped_by_stop", 0)
        final = f" (final; stopped by {b['stopped_by']}: {plural(n, 'line')} read but not summarized)"
    if fmt == "markdown":
        return (f"### {b['time']} · lines {b['first_line']}–{b['last_line']}{final}\n\n"
                f"_{counts_text(b)} · {b['tokens_fed']} tokens fed, {b['tokens_evicted']} evicted_\n\n{summary}\n\n")
    return f"[{b['time']}] lines {b['first_line']}-{b['last_line']}{final} ({counts_text(b)})\n{summary}\n\n"


def fill(template: str, **values: Any) -> str:
    """Replace {name} placeholders; any other braces in a user's prompt file stay as they are."""
    for k, v in values.items():
        template = template.replace("{" + k + "}", str(v))
    return template
