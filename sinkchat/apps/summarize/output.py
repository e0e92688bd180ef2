"""The output blocks of `sinkchat summarize`: one per summary, as text, JSON lines or markdown."""

from __future__ import annotations

import json
from typing import Any, TextIO


FORMATS = ("text", "jsonl", "markdown")


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
    parts = [f"{b['summarized']} summarized"] + [f"{b[k]} {k}" for k in ("filtered", "deduped", "skipped") if b[k]]
    return f"{b['lines']} lines: " + ", ".join(parts)


def render_block(b: dict[str, Any], fmt: str) -> str:
    """One summary block in the chosen format (jsonl: exactly one line)."""
    if fmt == "jsonl":
        return json.dumps(b, ensure_ascii=False) + "\n"
    summary = b["summary"] or "(no lines to summarize)"
    final = " (final)" if b["final"] else ""
    if fmt == "markdown":
        return (f"### {b['time']} · lines {b['first_line']}–{b['last_line']}{final}\n\n"
                f"_{counts_text(b)} · {b['tokens_fed']} tokens fed, {b['tokens_evicted']} evicted_\n\n{summary}\n\n")
    return f"[{b['time']}] lines {b['first_line']}-{b['last_line']}{final} ({counts_text(b)})\n{summary}\n\n"


def fill(template: str, **values: Any) -> str:
    """Replace {name} placeholders; any other braces in a user's prompt file stay as they are."""
    for k, v in values.items():
        template = template.replace("{" + k + "}", str(v))
    return template
