"""`list_dir`: what is in a workspace directory. Symlinks are shown but not followed, so listing never leaves the
workspace; the listing is capped so a directory with a million files cannot flood the cache."""

from __future__ import annotations

import os
import stat

from sinkchat.apps.agent.tools.schema import Arg, tool
from sinkchat.apps.agent.tools.workspace import Workspace, file_kind

MAX_ENTRIES = 200


@tool(args={"path": Arg(path="dir")})
def list_dir(path: str = ".", *, workspace: Workspace) -> str:
    """List the files and folders in a workspace directory (name, kind, size).

    Args:
        path: directory relative to the workspace; "." is the workspace itself
    """
    real = workspace.resolve(path, kind="dir")
    with os.scandir(real) as it:
        entries = sorted(it, key=lambda e: e.name)
    if not entries:
        return f"{workspace.rel(real)}: empty directory"
    lines = []
    for e in entries[:MAX_ENTRIES]:
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISLNK(st.st_mode):
            lines.append(f"{e.name} -> {os.readlink(e.path)} (symlink)")
        elif stat.S_ISDIR(st.st_mode):
            lines.append(f"{e.name}/")
        elif stat.S_ISREG(st.st_mode):
            lines.append(f"{e.name} ({st.st_size} bytes)")
        else:
            lines.append(f"{e.name} ({file_kind(st.st_mode)})")
    more = len(entries) - MAX_ENTRIES
    if more > 0:
        lines.append(f"...[{more} more entries not shown]")
    return f"{workspace.rel(real)}: {len(entries)} entries\n" + "\n".join(lines)
