"""Running one tool call so that its timeout really stops it.

A thread cannot be killed, so a tool call that only timed out in a thread keeps working (and writing files, and
holding processes) behind the model's back. Tools therefore run in a forked child process in a process group of its
own (POSIX), and the call's text comes back through a pipe:

- at the timeout (or a Ctrl-C while waiting) the group gets SIGTERM, which raises `ToolCancelled` inside the tool so
  its `finally` blocks run (the shell tool kills its command there); after `STOP_GRACE` seconds the group and every
  process the call started (found before the stop, in whatever group or session) get SIGKILL;
- after a call that finished, whatever it left running in its group is killed too: nothing a call started outlives it.

Limits, by design: a process that daemonizes itself out of the call's tree before the stop (double fork and a new
session) is out of reach; a forked tool's changes to Python memory stay in the child (files are shared, so every
built-in tool is unaffected); a tool that needs this process's memory says `@tool(isolate=False)` and runs in a
thread, which cannot be stopped: a timed-out call of it is reported as still running, and the tool is refused until
it ends, so at most one stuck thread per tool exists. Without `os.fork` (Windows) every tool runs that way.

Forking a process that has other threads (torch's pool, a UI refresh thread) is safe here because the child runs
only the tool's own code and leaves with `os._exit`; a tool that itself uses torch's thread pool in the child may
hang, and is then stopped by its timeout like any other.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import signal
import sys
import threading
import time
import warnings
from typing import Any, Callable, NoReturn

from sinkchat.apps.agent.tools.schema import ToolError

log = logging.getLogger(__name__)

STOP_GRACE = 1.0  # seconds between SIGTERM (clean-up runs) and SIGKILL


class ToolCancelled(BaseException):
    """Raised inside a forked tool when its call is stopped (SIGTERM): unwinds it through its `finally` blocks.
    A BaseException so that a tool's own `except Exception` cannot swallow it."""


class ToolCrashed(Exception):
    """The tool raised something other than ToolError; the text is 'ExceptionType: message'."""


def run_tool_call(fn: Callable[..., Any], kwargs: dict[str, Any], timeout: float, name: str,
                  isolate: bool = True) -> str:
    """The tool's result as text (None -> ""). Raises ToolError (the tool's own, a timeout, a dead child) or
    ToolCrashed (any other exception in the tool)."""
    if isolate and hasattr(os, "fork"):
        return run_in_child(fn, kwargs, timeout, name)
    return run_in_thread(fn, kwargs, timeout, name)


# ------------------------------------------------------------------------------------------------ child process
def run_in_child(fn: Callable[..., Any], kwargs: dict[str, Any], timeout: float, name: str) -> str:
    """Run the call in a forked child in its own process group; stop the whole group at the timeout."""
    for stream in (sys.stdout, sys.stderr):  # else the child would inherit, and print again, what is buffered
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    r, w = os.pipe()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12+: fork with threads; see the module doc
            pid = os.fork()
    except OSError as e:
        os.close(r)
        os.close(w)
        raise ToolError(f"{name} could not start: {e.strerror or e}") from None
    if pid == 0:  # pragma: no cover - the child; coverage cannot follow it
        os.close(r)
        _child_main(fn, kwargs, w)
    os.close(w)
    try:
        os.setpgid(pid, pid)  # the child does it too; whichever runs first wins, so a stop never misses the group
    except OSError:
        pass
    try:
        data, finished = _read_until(r, time.monotonic() + timeout)
    except BaseException:  # Ctrl-C while waiting: the call ends with the wait
        _stop(pid)
        raise
    finally:
        os.close(r)
    if not finished:
        _stop(pid)
        raise ToolError(f"{name} timed out after {timeout:g} s and was stopped")
    return _decode(data, _finish(pid), name)


def _child_main(fn: Callable[..., Any], kwargs: dict[str, Any], w: int) -> NoReturn:  # pragma: no cover - child
    """The child: own process group, no stdin, SIGTERM -> ToolCancelled; writes one JSON reply, then `os._exit`
    (no atexit handlers, no flushing of the parent's files or database connections)."""
    code = 0
    try:
        os.setpgid(0, 0)
        signal.signal(signal.SIGTERM, _cancel)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the parent, which then stops us
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        try:
            value = fn(**kwargs)
            reply = {"ok": True, "text": "" if value is None else str(value)}
        except ToolError as e:
            reply = {"ok": False, "kind": "tool", "text": str(e)}
        except ToolCancelled:
            raise
        except BaseException as e:  # noqa: BLE001 - SystemExit too: reported to the model, never re-raised
            reply = {"ok": False, "kind": "crash", "text": f"{type(e).__name__}: {e}"}
        data = json.dumps(reply).encode()
        while data:
            data = data[os.write(w, data):]
    except BaseException:  # noqa: BLE001 - cancelled, or the parent went away: just leave
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001
                pass
        os._exit(code)


def _cancel(_signum: int, _frame: Any) -> None:  # pragma: no cover - runs in the child
    raise ToolCancelled()


def _read_until(fd: int, deadline: float) -> tuple[bytes, bool]:
    """Everything written to `fd` until EOF (True) or until the deadline (False)."""
    chunks: list[bytes] = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return b"".join(chunks), False
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b"".join(chunks), True
            chunks.append(chunk)


def _decode(data: bytes, status: int, name: str) -> str:
    try:
        reply = json.loads(data)
    except ValueError:
        how = (f"killed by signal {-os.waitstatus_to_exitcode(status)}" if os.WIFSIGNALED(status)
               else f"exit status {os.waitstatus_to_exitcode(status)}")
        raise ToolError(f"{name} ended without a result ({how})") from None
    if reply.get("ok"):
        return str(reply.get("text", ""))
    if reply.get("kind") == "tool":
        raise ToolError(str(reply.get("text", "")))
    raise ToolCrashed(str(reply.get("text", "")))


def _finish(pid: int) -> int:
    """Wait for a child that has replied, kill what it left running in its group; its wait status. A child that
    replied but does not leave (stuck flushing into a full pipe) is stopped like a timed-out one."""
    if not _wait_exit(pid, STOP_GRACE):
        _stop(pid)
        return 0
    _kill_group(pid)  # before reaping, so the group id cannot have been reused meanwhile
    return _reap(pid)


def _stop(pid: int) -> None:
    """Stop a call: SIGTERM to its group (clean-up runs), SIGKILL to the group and to every process it started."""
    family = _descendants(pid)
    _kill_group(pid, signal.SIGTERM)
    if not _wait_exit(pid, STOP_GRACE):
        family |= _descendants(pid)
    _kill_group(pid)
    for child in family:
        _kill_descendant(child, family | {pid})
    _reap(pid)
    log.debug("stopped tool process %d (%d descendants)", pid, len(family))


_reaped: dict[int, int] = {}  # wait statuses collected early where os.waitid is missing (macOS)


def _wait_exit(pid: int, timeout: float | None) -> bool:
    """Wait until `pid` has exited, without reaping it where the OS allows (its pid and group id stay reserved
    until `_reap`); False if it still runs after `timeout` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    waitid = getattr(os, "waitid", None)
    pause = 0.0005
    while True:
        try:
            if waitid is not None:
                flags = os.WEXITED | os.WNOWAIT | (0 if deadline is None else os.WNOHANG)
                if waitid(os.P_PID, pid, flags) is not None:
                    return True
            else:
                done, status = os.waitpid(pid, 0 if deadline is None else os.WNOHANG)
                if done:
                    _reaped[pid] = status
                    return True
        except ChildProcessError:
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


def _reap(pid: int) -> int:
    if pid in _reaped:
        return _reaped.pop(pid)
    try:
        return os.waitpid(pid, 0)[1]
    except ChildProcessError:
        return 0


def _descendants(pid: int) -> set[int]:
    """Every process below `pid` (children of children too, in any group or session)."""
    try:
        import psutil

        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except Exception:  # noqa: BLE001 - psutil missing, or the process is gone already
        return set()


def _kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_descendant(pid: int, family: set[int]) -> None:
    """SIGKILL a process the call started and, if one of them leads it, its process group (a command the tool ran
    in a new session). Groups led by anything else are left alone."""
    try:
        pgid = os.getpgid(pid)
        if pgid in family:
            _kill_group(pgid)
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ------------------------------------------------------------------------------------------------ thread
_stuck: dict[Callable[..., Any], threading.Thread] = {}
_stuck_lock = threading.Lock()


def run_in_thread(fn: Callable[..., Any], kwargs: dict[str, Any], timeout: float, name: str) -> str:
    """Run the call in a daemon thread. A thread cannot be stopped: past the timeout the call is reported as still
    running, and the same tool is refused until that thread ends (one stuck thread per tool at most)."""
    with _stuck_lock:
        previous = _stuck.get(fn)
        if previous is not None and previous.is_alive():
            raise ToolError(f"{name} is still running from an earlier call that timed out (it runs in-process and "
                            "cannot be stopped); try again later or use another tool")
        _stuck.pop(fn, None)
    box: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=1)

    def target() -> None:
        try:
            box.put((True, fn(**kwargs)))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box.put((False, e))

    th = threading.Thread(target=target, name=f"tool-{name}", daemon=True)
    th.start()
    try:
        ok, value = box.get(timeout=timeout)
    except queue.Empty:
        with _stuck_lock:
            _stuck[fn] = th
        raise ToolError(f"{name} timed out after {timeout:g} s; it runs in-process and cannot be stopped, so it is "
                        f"still running and {name} is refused until it ends") from None
    if not ok:
        if isinstance(value, ToolError) or not isinstance(value, Exception):
            raise value
        raise ToolCrashed(f"{type(value).__name__}: {value}") from value
    return "" if value is None else str(value)
