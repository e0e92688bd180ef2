"""What sinkchat keeps holds the user's conversations: the folders it creates are 0700 and the log database (with
its -wal / -shm files), the input history, snapshots and the recall memory's files 0600 (a user audit found the
data dir 0755 and sinkchat.db, its -wal and the history 0644, with a planted PIN readable by every user)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from sinkchat.private import private_dir, private_file
from sinkchat.store.logdb import connect


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_the_log_database_and_the_folders_made_for_it_are_private(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        home = tmp_path / "a" / "home"
        conn = connect(home / "sinkchat.db")
        conn.execute("CREATE TABLE IF NOT EXISTS t (x TEXT)")
        conn.execute("INSERT INTO t VALUES ('my pin is 8812')")
        files = sorted(p.name for p in home.iterdir())
        assert "sinkchat.db-wal" in files, files
        assert all(mode(home / f) == 0o600 for f in files), {f: oct(mode(home / f)) for f in files}
        conn.close()
        assert mode(home) == mode(tmp_path / "a") == 0o700
    finally:
        os.umask(old)


def test_an_existing_file_is_made_private_and_an_existing_folder_left_alone(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    f = shared / "history"
    f.write_text("locker code XK-4471\n")
    os.chmod(f, 0o644)
    private_file(private_dir(shared) / "history")
    assert mode(f) == 0o600 and f.read_text() == "locker code XK-4471\n"
    assert mode(shared) == 0o755


def test_the_chat_input_history_is_private(tmp_path: Path) -> None:
    from sinkchat.apps.chat.inputs import make_prompt_session

    old = os.umask(0o022)
    try:
        hist = tmp_path / "home" / "history"
        try:
            make_prompt_session(None, hist)
        except Exception:  # noqa: BLE001 - no terminal here: the history file is made before the session
            pass
        assert hist.is_file() and mode(hist) == 0o600 and mode(hist.parent) == 0o700
    finally:
        os.umask(old)


def test_a_snapshot_file_is_private(tmp_path: Path) -> None:
    """A reviewer: safetensors wrote the snapshot with the umask's 0644, and its header holds the conversation."""
    from fakes import CharTokenizer, tiny_model
    from sinkchat.config import CacheConfig, SamplingConfig
    from sinkchat.core.engine import Engine
    from sinkchat.store.snapshot import save_snapshot

    old = os.umask(0o022)
    try:
        eng = Engine(tiny_model("llama", layers=1), CharTokenizer(), CacheConfig(capacity=64),
                     SamplingConfig(temperature=0, max_tokens=2), system="be brief")
        list(eng.add_message("user", "my pin is 8812"))
        p = save_snapshot(eng, tmp_path / "snaps" / "s.safetensors")
        assert mode(p) == 0o600 and mode(p.parent) == 0o700
    finally:
        os.umask(old)
