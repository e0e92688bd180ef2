"""`read_file`: text of a workspace file. At most READ_BYTES are read per call (a 10 MB log or a huge file costs
nothing; the model pages with `offset`), binary files get a hex summary instead of garbage tokens, and anything that
is not a regular file (a device such as /dev/zero, a fifo) is refused before it is opened."""

from __future__ import annotations

import os

from sinkchat.apps.agent.tools.schema import Arg, ToolError, tool
from sinkchat.apps.agent.tools.workspace import Workspace, hex_summary, looks_binary

READ_BYTES = 64 * 1024


@tool(args={"path": Arg(path="file"), "offset": Arg(minimum=0)})
def read_file(path: str, offset: int = 0, *, workspace: Workspace) -> str:
    """Read a text file from the workspace (large files are truncated; use offset to read further).

    Args:
        path: file path relative to the workspace
        offset: byte offset to start reading at
    """
    if offset < 0:
        raise ToolError("offset must be >= 0")
    real = workspace.resolve(path, kind="file")
    fd = workspace.open_regular(real, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        os.lseek(fd, offset, os.SEEK_SET)
        data = os.read(fd, READ_BYTES)
    finally:
        os.close(fd)
    if looks_binary(data):
        return hex_summary(data, size)
    text = data.decode("utf-8", errors="replace")
    end = offset + len(data)
    if offset == 0 and end >= size:
        return text
    if not data:
        return f"[offset {offset} is at or past the end of the file ({size} bytes)]"
    marker = f"[showing bytes {offset}-{end} of {size}"
    return text + (f"\n...{marker}; read more with offset={end}]" if end < size else f"]\n{marker}]")
