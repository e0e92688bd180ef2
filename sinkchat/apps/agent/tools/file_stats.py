"""Counting and column tools: numbers computed by a tool, not by the model.

Why: on the task suite (benchmarks/agent_tasks.py) the bundled 135M model read the right file but could not count its
lines or add a CSV column from the text (0 of 3 everyday tasks right). With one combined `file_stats` tool
("poem.txt: 4 lines, 26 words, 126 characters") it called the tool right but copied the wrong number (the last one:
126 for "how many lines"). So each tool answers one question with one number, and is named after the question
(`count_lines`, `column_sum`, ...): the model picks a tool by its name's overlap with the task, and copies a lone
number reliably. Files are read up to SCAN_BYTES, like search_text.
"""

from __future__ import annotations

import csv
import io
import os
import re
from decimal import Decimal, InvalidOperation
from typing import Callable

from sinkchat.apps.agent.tools.schema import Arg, ToolError, tool
from sinkchat.apps.agent.tools.search_text import PATTERN_CHARS
from sinkchat.apps.agent.tools.workspace import Workspace, looks_binary

SCAN_BYTES = 1024 * 1024
FILE = Arg(path="file")
# the column tools add up numbers: the grammar offers only the numeric columns of the file chosen as `path`
CSV_COLUMN = {"path": FILE, "column": Arg(column_of="path", numeric=True)}


def _text(path: str, workspace: Workspace) -> str:
    real = workspace.resolve(path, kind="file")
    fd = workspace.open_regular(real, os.O_RDONLY)
    try:
        data = os.read(fd, SCAN_BYTES)
    finally:
        os.close(fd)
    if looks_binary(data):
        raise ToolError(f"{path} is not a text file")
    return data.decode("utf-8", errors="replace")


def _num(x: float | Decimal) -> str:
    """The number exactly, never rounded nor in exponent form: "12345.75", not "1.235e+04" (which a 135M model
    copied as "1.235", and whose "1.235" the grounding then accepted as a number the tool returned)."""
    d = x if isinstance(x, Decimal) else Decimal(repr(float(x)))
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def _cell(text: str) -> Decimal | None:
    """A CSV cell as an exact decimal ("1,030.10" with thousands separators too), or None when it is no number."""
    t = text.strip()
    if _THOUSANDS.fullmatch(t):
        t = t.replace(",", "")
    try:
        d = Decimal(t)
    except InvalidOperation:
        return None
    return d if d.is_finite() else None


def _column(path: str, column: str, workspace: Workspace) -> tuple[list[Decimal], list[int]]:
    """The column's numbers, exact, and the (1-based data) rows whose cell holds something that is not a number."""
    text = _text(path, workspace)
    rows = list(csv.DictReader(io.StringIO(text)))
    key = next((k for k in (rows[0] if rows else {}) if k and k.strip().lower() == column.strip().lower()), None)
    if key is None:
        header = text.splitlines()[0] if text else ""
        raise ToolError(f"{path} has no column {column!r}; its columns are: {header[:200]}")
    values, skipped = [], []
    for i, r in enumerate(rows, 1):
        cell = str(r.get(key) or "")
        if not cell.strip():
            continue  # an empty cell is a missing value, as in a spreadsheet's SUM
        v = _cell(cell)
        if v is None:
            skipped.append(i)
        else:
            values.append(v)
    if not values:
        raise ToolError(f"column {key!r} of {path} holds no numbers")
    return values, skipped


@tool(args={"path": FILE})
def count_lines(path: str, *, workspace: Workspace) -> str:
    """How many lines a file has.

    Args:
        path: file path relative to the workspace
    """
    return _num(len(_text(path, workspace).splitlines()))


@tool(args={"path": FILE})
def count_words(path: str, *, workspace: Workspace) -> str:
    """How many words a file has.

    Args:
        path: file path relative to the workspace
    """
    return _num(len(_text(path, workspace).split()))


@tool(args={"path": FILE, "pattern": Arg(max_chars=PATTERN_CHARS, min_chars=1)})
def count_matches(pattern: str, path: str, *, workspace: Workspace) -> str:
    """How many lines of a file contain a text (case-insensitive).

    Args:
        pattern: the text to look for
        path: file path relative to the workspace
    """
    rx = re.compile(re.escape(pattern), re.IGNORECASE)
    return _num(sum(1 for line in _text(path, workspace).splitlines() if rx.search(line)))


def _column_tool(name: str, fold: Callable[[list[Decimal]], Decimal], what: str) -> Callable[..., str]:
    """One column tool: `fold` over the column's numbers. One body for the three (sum, max, min), each still its
    own tool named after its question (see the module doc for why one number per tool)."""

    def column_tool(path: str, column: str, *, workspace: Workspace) -> str:
        values, skipped = _column(path, column, workspace)
        out = _num(fold(values))
        if skipped:  # never silently: the answer covers fewer rows than the file has
            rows = ", ".join(map(str, skipped[:5])) + (" ..." if len(skipped) > 5 else "")
            out += f" (over {len(values)} of {len(values) + len(skipped)} rows; skipped, not a number: row {rows})"
        return out

    column_tool.__name__ = column_tool.__qualname__ = name
    column_tool.__doc__ = f"""{what} of a column of a CSV file.

    Args:
        path: CSV file path relative to the workspace
        column: the column name
    """
    return tool(args=CSV_COLUMN)(column_tool)


column_sum = _column_tool("column_sum", sum, "The sum (total)")
column_max = _column_tool("column_max", max, "The largest (maximum) value")
column_min = _column_tool("column_min", min, "The smallest (minimum) value")


TOOLS = [count_lines, count_words, count_matches, column_sum, column_max, column_min]
