"""A killed process cannot remove its recall-memory store (up to the disk budget, 1 GiB by default, per crash): a
new memory removes the stores of processes that no longer run, and nothing else (a live process's, our own, a
folder that is not a store's or holds anything but segments)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sinkchat.bootstrap import build_settings, open_memory
from sinkchat.memory.sweep import sweep_dead_stores


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _store(parent: Path, name: str, files: tuple[str, ...] = ("seg-000001.mem",)) -> Path:
    root = parent / name
    root.mkdir(parents=True)
    for f in files:
        (root / f).write_bytes(b"x" * 100)
    return root


def test_a_new_memory_removes_the_stores_of_processes_that_are_gone(tmp_path, monkeypatch):
    from fakes import tiny_model
    from sinkchat.model.spec import ModelSpec

    home = tmp_path / "home"
    monkeypatch.setenv("SINKCHAT_HOME", str(home))
    parent = home / "memory"
    dead, me = _dead_pid(), os.getpid()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        killed = _store(parent, f"20261203-072834-{dead}", ("seg-000001.mem", "seg-000002.mem"))
        restored = _store(parent, f"20261203-072900-{dead}-a1b2c3-0f0f0f0f")
        running = _store(parent, f"20261203-073000-{live.pid}")
        mine = _store(parent, f"20261203-073100-{me}")
        foreign = _store(parent, f"20261203-073200-{dead}", ("seg-000001.mem", "notes.txt"))
        other = _store(parent, "my-backup")
        mem = open_memory(build_settings({"memory": "on"}), ModelSpec.from_model(tiny_model()))
        try:
            assert not killed.exists() and not restored.exists()
            assert running.exists() and mine.exists() and foreign.exists() and other.exists()
            assert Path(mem.store.root).is_dir()  # the new memory's own store
            assert sweep_dead_stores(parent, keep=Path(mem.store.root)) == []  # nothing more to remove
        finally:
            mem.close()
    finally:
        live.kill()
        live.wait()
    assert sweep_dead_stores(parent) == [running]  # once its process is gone
