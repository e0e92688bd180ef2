"""How `summarize_eval.py` runs the real CLI (all at once, live, stopped by SIGTERM) and its journal mix: a log
the summarizer was not tuned on (sshd in journalctl's short-iso form, nginx's error log, the kernel ring buffer,
systemd units), with incidents of its own kinds."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

CMD = [sys.executable, "-m", "sinkchat.cli", "summarize", "--format", "jsonl", "--temperature", "0", "--interval",
       "0", "--no-log", "-q"]
LIVE_BATCH = 4  # lines written at a time in live mode ...
LIVE_PAUSE = 0.8  # ... with this many seconds between (longer than the summarizer's idle flush)


def _records(out: bytes) -> list[dict[str, Any]]:
    return [json.loads(l) for l in out.decode().splitlines() if l.strip()]


def run_cli(lines: list[str], extra: list[str]) -> list[dict[str, Any]]:
    """All lines at once through a pipe."""
    res = subprocess.run(CMD + extra, input="\n".join(lines).encode() + b"\n", capture_output=True, timeout=3600)
    if res.returncode:
        raise RuntimeError(res.stderr.decode(errors="replace")[-2000:])
    return _records(res.stdout)


def _writer(proc: subprocess.Popen, lines: list[str], batch: int, pause: float) -> threading.Thread:
    """Write `lines` `batch` at a time with `pause` seconds between; stdin stays open (communicate() closes it)."""

    def write() -> None:
        try:
            for i in range(0, len(lines), batch):
                proc.stdin.write(("\n".join(lines[i: i + batch]) + "\n").encode())
                proc.stdin.flush()
                time.sleep(pause)
        except (BrokenPipeError, ValueError, OSError):
            pass

    t = threading.Thread(target=write, daemon=True)
    t.start()
    return t


def run_live(lines: list[str], extra: list[str]) -> list[dict[str, Any]]:
    """A few lines at a time with pauses, as `tail -f app.log | sinkchat summarize` gets them; --every 25."""
    proc = subprocess.Popen(CMD + ["--every", "25"] + extra, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    _writer(proc, lines, LIVE_BATCH, LIVE_PAUSE).join()  # communicate() then closes stdin (EOF)
    out, err = proc.communicate(timeout=3600)
    if proc.returncode:
        raise RuntimeError(err.decode(errors="replace")[-2000:])
    return _records(out)


def run_sigterm(lines: list[str], extra: list[str]) -> list[dict[str, Any]]:
    """Lines written steadily (--every 25); SIGTERM one second after the first summary is out. Exit 143."""
    proc = subprocess.Popen(CMD + ["--every", "25"] + extra, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    _writer(proc, lines, LIVE_BATCH * 4, LIVE_PAUSE / 2)
    first = proc.stdout.readline()
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=600)
    if proc.returncode != 143:
        raise RuntimeError(f"exit {proc.returncode} after SIGTERM: {err.decode(errors='replace')[-2000:]}")
    return _records(first + out)


def journal_lines(n: int, seed: int = 3) -> list[str]:
    """A clean mix in four formats: journalctl -o short-iso (sshd, systemd, cron), nginx's error log, dmesg."""
    rnd = random.Random(seed)
    r = rnd.randrange
    kinds: list[Callable[[str, str, int], str]] = [
        lambda iso, hms, i: f"{iso} gw-3 sshd[{r(2000, 9000)}]: Connection closed by 198.51.100.{r(256)} port "
                            f"{r(30000, 60000)} [preauth]",
        lambda iso, hms, i: f"{iso} gw-3 systemd[1]: Finished {rnd.choice(['logrotate', 'man-db', 'apt-daily'])}"
                            f".service - Daily {rnd.choice(['rotation', 'maintenance', 'refresh'])}.",
        lambda iso, hms, i: f"2025/03/01 {hms} [notice] {r(10, 99)}#{r(10, 99)}: signal process started",
        lambda iso, hms, i: f"[{1000 + i * 1.5:12.6f}] usb 1-{r(1, 4)}: new high-speed USB device number {r(2, 9)} "
                            "using xhci_hcd",
        lambda iso, hms, i: f"{iso} gw-3 CRON[{r(2000, 9000)}]: pam_unix(cron:session): session opened for user "
                            "root(uid=0) by (uid=0)",
    ]
    out = []
    for i in range(n):
        hms = f"11:{(i // 60) % 60:02d}:{i % 60:02d}"
        out.append(kinds[r(len(kinds))](f"2025-03-01T{hms}+0000", hms, i))
    return out


MIX_INCIDENTS: dict[str, Callable[[str], list[str]]] = {
    "upstream refused": lambda ts: ["2025/03/01 11:00:00 [error] 31#31: *5 connect() failed (111: Connection "
                                    "refused) while connecting to upstream, client: 198.51.100.4"],
    "ext4 error": lambda ts: ["[ 2042.118812] EXT4-fs error (device sda1): ext4_find_entry:1455: inode #2: comm "
                              "ls: reading directory lblock 0"],
    "unit failed": lambda ts: [f"{ts} gw-3 systemd[1]: nginx.service: Main process exited, code=exited, "
                               "status=1/FAILURE", f"{ts} gw-3 systemd[1]: nginx.service: Failed with result "
                               "'exit-code'."],
    "segfault": lambda ts: [f"[ 2043.000001] worker[4242]: segfault at 0 ip 000055d1 sp 00007ffd error 4 in "
                            "worker[55d1+1000]"],
}
