"""`sinkchat` under a real pseudo-terminal (pexpect): the prompt appears, a reply streams, the toolbar shows memory,
cache fill, evictions and the sink gauge, and /bye exits. The screen is read as the terminal received it, with the
escape sequences stripped (prompt-toolkit repaints the whole toolbar on each new prompt). Like a real terminal, the pty answers cursor-position
requests; without them prompt-toolkit hides the bottom toolbar."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")

ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][0-9A-Za-z]|\x1b[=>78]|\r")


class Screen:
    """Accumulates what the pty printed; `wait` polls until a regex matches the text without escape codes."""

    def __init__(self, child: "pexpect.spawn") -> None:
        self.child, self.raw = child, ""

    def pump(self) -> None:
        try:
            while True:
                chunk = self.child.read_nonblocking(65536, timeout=0.2)
                # Answer cursor-position requests like a terminal would: prompt-toolkit shows the bottom toolbar
                # only once it knows the height below the cursor.
                for _ in range(chunk.count("\x1b[6n")):
                    self.child.send("\x1b[1;1R")
                self.raw += chunk
        except pexpect.TIMEOUT:
            pass

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw)

    def wait(self, pattern: str, timeout: float, start: int = 0) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.pump()
            m = re.search(pattern, self.text[start:])
            if m:
                return m
            if not self.child.isalive():
                break
        raise AssertionError(f"{pattern!r} not on screen; last output:\n{self.text[-3000:]}")


def test_chat_under_a_pty(tmp_path: Path):
    exe = shutil.which("sinkchat") or str(Path(sys.executable).parent / "sinkchat")
    cache_dir = "/tmp/sc-cache" if Path("/tmp/sc-cache").is_dir() else "/tmp/sc-cache-test"
    env = dict(os.environ, SINKCHAT_CACHE_DIR=cache_dir, SINKCHAT_HOME=str(tmp_path), TERM="xterm-256color",
               COLUMNS="140", LINES="40", OMP_WAIT_POLICY="PASSIVE")
    args = ["--cache", "128", "--max-tokens", "12", "--temperature", "0"]
    # the greedy reply, as the pipe mode gives it: the terminal must stream the same (its words are the tiny model's:
    # "Paris" came and went with a 1e-7 change in the SiLU)
    piped = subprocess.run([exe, *args], input="What is the capital of France?\n", env=env, capture_output=True,
                           text=True, timeout=300).stdout.strip()
    assert piped, "no reply in pipe mode"
    child = pexpect.spawn(exe, args, env=env, dimensions=(40, 140), encoding="utf-8", codec_errors="replace",
                          timeout=30)
    scr = Screen(child)
    try:
        scr.wait(r">>> ", timeout=240)  # model load (first run converts the GGUF)
        scr.wait(r"RSS \d", timeout=10)
        scr.wait(r"KV [\d.]+ \w+ \d+/128", timeout=10)
        child.send("What is the capital of France?\r")
        mark = len(scr.text)
        scr.wait(re.escape(piped.splitlines()[0][:16]), timeout=120, start=mark)  # the reply streams
        scr.wait(r">>> ", timeout=120, start=mark)
        # a long message forces evictions in a 128-token cache
        child.send("Please repeat these words: " + " ".join(["apple banana cherry"] * 30) + "\r")
        mark = len(scr.text)
        scr.wait(r"⟂ evicted \d+ tokens [\d,]+–[\d,]+ \(", timeout=120, start=mark)  # the chat's one range notation
        scr.wait(r">>> ", timeout=120, start=mark)
        tb = scr.wait(r"evicted (\d+) \((\d+)x\)", timeout=20, start=mark)
        assert int(tb.group(1)) > 0 and int(tb.group(2)) > 0
        scr.wait(r"sink [█░]{10} \d\.\d\d", timeout=20, start=mark)  # the gauge: bar and number
        assert re.search(r"seen \d+", scr.text[mark:]) and "tok/s" in scr.text[mark:]
        child.send("/bye\r")
        child.expect(pexpect.EOF, timeout=30)
    finally:
        if child.isalive():
            child.terminate(force=True)
    child.close()
    assert child.exitstatus == 0
    assert "Traceback" not in scr.text


def test_chat_with_the_recall_memory_under_a_pty(tmp_path: Path):
    """Issue 30: the toolbar's memory field, the recall line after a reply and /recall's text, on a terminal.
    A fact given first, then enough text to push it out of a 192-token cache into the memory (blocks of 16)."""
    exe = shutil.which("sinkchat") or str(Path(sys.executable).parent / "sinkchat")
    cache_dir = "/tmp/sc-cache" if Path("/tmp/sc-cache").is_dir() else "/tmp/sc-cache-test"
    env = dict(os.environ, SINKCHAT_CACHE_DIR=cache_dir, SINKCHAT_HOME=str(tmp_path), TERM="xterm-256color",
               COLUMNS="160", LINES="50", OMP_WAIT_POLICY="PASSIVE")
    args = ["--cache", "192", "--max-tokens", "8", "--temperature", "0", "--memory", "on", "--memory-block", "16"]
    child = pexpect.spawn(exe, args, env=env, dimensions=(50, 160), encoding="utf-8", codec_errors="replace",
                          timeout=30)
    scr = Screen(child)
    try:
        scr.wait(r">>> ", timeout=240)
        scr.wait(r"mem 0 blk · 0 tok · 0 B", timeout=10)  # on from the start, empty
        child.send("My locker code is 4417. " + "The grass is green and the sky is blue. " * 30 + "\r")
        mark = len(scr.text)
        scr.wait(r"⟂ evicted \d+ tokens [\d,]+–[\d,]+ to memory", timeout=120, start=mark)
        line = scr.wait(r"↺ recalled (\d+) blocks?: tokens [\d,]+–[\d,]+.*? ago", timeout=120, start=mark)
        at = mark + line.end()  # the toolbar drawn with the next prompt, after the recall line
        tb = scr.wait(r"mem (\d+) blk · ([\d,]+) tok · [\d.]+ \w+", timeout=20, start=at)
        blocks, tokens = int(tb.group(1)), int(tb.group(2).replace(",", ""))
        assert blocks >= 1 and 16 * blocks <= tokens < 16 * (blocks + 1)  # whole blocks plus a queue under one
        assert int(line.group(1)) <= blocks
        child.send("/recall\r")
        mark = len(scr.text)
        scr.wait(r"the last reply read \d+ blocks? from the memory:", timeout=20, start=mark)
        scr.wait(r"block 0 · tokens [\d,]+–[\d,]+ · \d+ s ago · in \d+/30 layers", timeout=20, start=mark)
        scr.wait(r"locker code is 4417", timeout=20, start=mark)  # the first block's text, read back from disk
        child.send("/bye\r")
        child.expect(pexpect.EOF, timeout=30)
    finally:
        if child.isalive():
            child.terminate(force=True)
    child.close()
    assert child.exitstatus == 0
    assert "Traceback" not in scr.text
    assert not list((tmp_path / "memory").glob("*/*"))  # the session's memory went with it
