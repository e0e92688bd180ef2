"""A killed process cannot remove its recall-memory store (up to the disk budget, 1 GiB by default, per crash): a
new memory removes the stores whose owner (`owner.json`: pid, start time, host) ran on this host and is gone, and
nothing else: a live process's, our own, one of another host (a container, a machine sharing the data dir), one
without an owner file, a folder that is not a store's or holds anything but segments."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import psutil

from sinkchat.bootstrap import build_settings, open_memory
from sinkchat.memory.sweep import OWNER, sweep_dead_stores


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _store(parent: Path, name: str, owner: dict | None, files: tuple[str, ...] = ("seg-000001.mem",)) -> Path:
    root = parent / name
    root.mkdir(parents=True)
    for f in files:
        (root / f).write_bytes(b"x" * 100)
    if owner is not None:
        (root / OWNER).write_text(json.dumps(owner))
    return root


def test_a_new_memory_removes_the_stores_of_processes_that_are_gone(tmp_path, monkeypatch):
    from fakes import tiny_model
    from sinkchat.model.spec import ModelSpec

    home = tmp_path / "home"
    monkeypatch.setenv("SINKCHAT_HOME", str(home))
    parent, host = home / "memory", socket.gethostname()
    dead = _dead_pid()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        born = psutil.Process(live.pid).create_time()
        gone = {"pid": dead, "started": 1.0, "host": host}
        killed = _store(parent, f"20261203-072834-{dead}", gone, ("seg-000001.mem", "seg-000002.mem"))
        restored = _store(parent, f"20261203-072900-{dead}-a1b2c3-0f0f0f0f", gone)
        reused = _store(parent, f"20261203-072950-{live.pid}", {"pid": live.pid, "started": born - 100, "host": host})
        running = _store(parent, f"20261203-073000-{live.pid}", {"pid": live.pid, "started": born, "host": host})
        elsewhere = _store(parent, f"20261203-073050-{dead}", {**gone, "host": host + "-container"})
        unowned = _store(parent, f"20261203-073100-{dead}", None)
        foreign = _store(parent, f"20261203-073200-{dead}", gone, ("seg-000001.mem", "notes.txt"))
        other = _store(parent, "my-backup", gone)
        mem = open_memory(build_settings({"memory": "on"}), ModelSpec.from_model(tiny_model()))
        try:
            assert not killed.exists() and not restored.exists() and not reused.exists()
            assert running.exists() and elsewhere.exists() and unowned.exists() and foreign.exists()
            assert other.exists()
            mine = Path(mem.store.root)
            assert json.loads((mine / OWNER).read_text())["pid"] == psutil.Process().pid  # its own is claimed
            assert sweep_dead_stores(parent, keep=None) == []  # ours is never swept, nor the others
        finally:
            mem.close()
    finally:
        live.kill()
        live.wait()
    assert sweep_dead_stores(parent) == [running]  # once its process is gone
