"""`search_text`: grep over the workspace. The walk never follows symlinks (a link to / cannot widen the search),
skips anything that is not a regular file or looks binary, reads at most SCAN_BYTES of each file and stops after
MAX_MATCHES matches or MAX_FILES files, so one call is bounded whatever the workspace holds."""

from __future__ import annotations

import os
import re
import stat

from sinkchat.apps.agent.tools.schema import Arg, ToolError, tool
from sinkchat.apps.agent.tools.workspace import Workspace, looks_binary

MAX_MATCHES = 50
MAX_FILES = 5000
SCAN_BYTES = 1024 * 1024
LINE_CHARS = 200
PATTERN_CHARS = 64  # a search text longer than this is a model looping in a string, not a search


@tool(timeout=20, args={"pattern": Arg(max_chars=PATTERN_CHARS, min_chars=1), "path": Arg(path="any")})
def search_text(pattern: str, path: str = ".", regex: bool = False, *, workspace: Workspace) -> str:
    """Find lines containing a text (case-insensitive) in the workspace files; prints file:line: text.

    Args:
        pattern: the text to look for (a Python regular expression if regex is true)
        path: file or folder to search, relative to the workspace
        regex: treat pattern as a regular expression
    """
    if not pattern:
        raise ToolError("empty pattern")
    try:
        rx = re.compile(pattern if regex else re.escape(pattern), re.IGNORECASE)
    except re.error as e:
        raise ToolError(f"bad regular expression: {e}") from None
    real = workspace.resolve(path)
    files = [real] if real.is_file() else _walk(real)
    hits: list[str] = []
    scanned = 0
    for f in files:
        if scanned >= MAX_FILES or len(hits) >= MAX_MATCHES:
            break
        scanned += 1
        try:
            fd = workspace.open_regular(f, os.O_RDONLY)
        except ToolError:
            continue
        try:
            data = os.read(fd, SCAN_BYTES)
        finally:
            os.close(fd)
        if looks_binary(data):
            continue
        for no, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            if rx.search(line):
                hits.append(f"{workspace.rel(f)}:{no}: {line.strip()[:LINE_CHARS]}")
                if len(hits) >= MAX_MATCHES:
                    break
    if not hits:
        return f"no matches for {pattern!r} in {scanned} file(s)"
    more = " (stopped at the match limit)" if len(hits) >= MAX_MATCHES else ""
    return f"{len(hits)} match(es){more}:\n" + "\n".join(hits)


def _walk(root: os.PathLike[str] | str) -> list:
    """Regular files under root, sorted, without following symlinks."""
    from pathlib import Path

    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        for name in sorted(filenames):
            p = Path(dirpath) / name
            try:
                if stat.S_ISREG(os.lstat(p).st_mode):
                    out.append(p)
            except OSError:
                continue
            if len(out) >= MAX_FILES:
                return out
    return out
