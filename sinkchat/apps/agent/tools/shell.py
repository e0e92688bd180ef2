"""`shell`: run a command in the workspace. Off unless `--allow-shell`: a shell is NOT confined (it can read or
write anything the user can); the workspace is only its working directory. It gets no stdin, runs in its own process
group that is killed on timeout or once its output passes the cap, so a `yes` or `sleep 1e9` cannot block the loop."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from sinkchat.apps.agent.tools import ToolError, Workspace, tool

DEFAULT_TIMEOUT = 20
MAX_TIMEOUT = 120
MAX_OUTPUT_BYTES = 64 * 1024


@tool(side_effects=True, timeout=MAX_TIMEOUT + 10)
def shell(command: str, timeout: int = DEFAULT_TIMEOUT, *, workspace: Workspace) -> str:
    """Run a shell command in the workspace folder and return its exit code and output.

    Args:
        command: the command line (bash)
        timeout: seconds before the command is killed
    """
    if not command.strip():
        raise ToolError("empty command")
    timeout = max(1, min(int(timeout), MAX_TIMEOUT))
    proc = subprocess.Popen(
        ["/bin/bash", "-c", command], cwd=workspace.root, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True,
    )
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    out = bytearray()
    deadline = time.monotonic() + timeout
    status = None
    try:
        while True:
            chunk = _read_some(proc.stdout.fileno())
            if chunk:
                out += chunk
                if len(out) > MAX_OUTPUT_BYTES:
                    status = f"killed: output passed {MAX_OUTPUT_BYTES} bytes"
                    break
                continue
            if chunk is None and proc.poll() is not None:  # EOF and exited
                break
            if time.monotonic() > deadline:
                status = f"killed: timed out after {timeout} s"
                break
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            _kill_group(proc)
        proc.stdout.close()
    code = proc.wait()
    text = out[:MAX_OUTPUT_BYTES].decode("utf-8", errors="replace")
    return f"exit code {code}" + (f" ({status})" if status else "") + (f"\n{text}" if text else " (no output)")


def _read_some(fd: int) -> bytes | None:
    """b'' when nothing is ready yet, None at EOF."""
    try:
        data = os.read(fd, 65536)
    except BlockingIOError:
        return b""
    return data if data else None


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
