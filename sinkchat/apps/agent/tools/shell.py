"""`shell`: run a command in the workspace. Off unless `--allow-shell`: a shell is NOT confined (it can read or
write anything the user can); the workspace is only its working directory. It gets no stdin and runs in its own process
group, which is killed on timeout, once its output passes the cap, and when the call ends: a `yes` or `sleep 1e9`
cannot block the loop, and a background job (`cmd &`) does not outlive the call. When the call itself is stopped (its
tool timeout, see `runner`), the `finally` below still kills the group."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from sinkchat.apps.agent.tools.schema import ToolError, tool
from sinkchat.apps.agent.tools.workspace import Workspace

DEFAULT_TIMEOUT = 20
MAX_TIMEOUT = 120
MAX_OUTPUT_BYTES = 64 * 1024
BACKGROUND_GRACE = 0.5  # seconds to wait for output after bash exited while a background job holds the pipe


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
    status, ended = None, 0.0
    try:
        while True:
            chunk = _read_some(proc.stdout.fileno())
            if chunk:
                out += chunk
                if len(out) > MAX_OUTPUT_BYTES:
                    status = f"killed: output passed {MAX_OUTPUT_BYTES} bytes"
                    break
                continue
            now = time.monotonic()
            if _exited(proc):
                if chunk is None:  # EOF and exited
                    break
                ended = ended or now
                if now - ended > BACKGROUND_GRACE:  # bash is done; a background job still holds the output
                    status = "background processes killed when the command ended"
                    break
            if now > deadline:
                status = f"killed: timed out after {timeout} s"
                break
            time.sleep(0.02)
    finally:
        _kill_group(proc)  # also when bash has exited: its background jobs are still in the group
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


def _exited(proc: subprocess.Popen) -> bool:
    """Whether bash has exited, without reaping it: an unreaped bash keeps its pid, and so the group id that
    `_kill_group` uses, from being reused by an unrelated process."""
    waitid = getattr(os, "waitid", None)
    if waitid is None:  # macOS: reaping is the only way to ask
        return proc.poll() is not None
    try:
        return waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the command's process group (bash not yet reaped, see `_exited`)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
