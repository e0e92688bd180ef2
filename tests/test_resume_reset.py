"""`chat --resume` after a /clear or /load: the turns before it were dropped from the cache by the user, so a resume
must not bring them back (neither by re-feeding them nor through an automatic snapshot taken before)."""

from __future__ import annotations

from fakes import FakeTokenizer, tiny_model
from sinkchat.config import CacheConfig, SamplingConfig
from sinkchat.core.engine import Engine
from sinkchat.store.resume import resume_session
from sinkchat.store.sessionlog import SessionLog


def engine() -> Engine:
    return Engine(tiny_model(max_pos=512), FakeTokenizer("chars"), CacheConfig(capacity=256),
                  SamplingConfig(temperature=0, max_tokens=4), system="be brief")


def test_resume_replays_only_the_turns_after_the_last_clear(tmp_path):
    db = tmp_path / "sinkchat.db"
    slog = SessionLog.open("chat", "tiny", system="be brief", path=db)
    slog.turn("user", "forgotten question")
    slog.turn("assistant", "forgotten answer")
    slog.event("command", "/clear", "dropped 40 tokens")
    slog.turn("user", "kept question")
    slog.turn("assistant", "kept answer")
    slog.close()
    eng = engine()
    res = resume_session(eng, None, slog.id, path=db)
    texts = [m["content"] for m in eng.conv.messages]
    assert texts == ["kept question", "kept answer"], texts
    assert res.method == "rebuild" and res.turns_replayed == 2 and res.turns_total == 2


def test_an_automatic_snapshot_older_than_the_clear_is_not_used(tmp_path, monkeypatch):
    from sinkchat.store import resume

    db = tmp_path / "sinkchat.db"
    slog = SessionLog.open("chat", "tiny", system="be brief", path=db)
    slog.turn("user", "old")
    slog.turn("assistant", "old answer")
    old = engine()
    list(old.chat("old"))
    snap = resume.auto_snapshot_path(slog.id, tmp_path)
    resume.save_snapshot(old, snap, {"session_id": slog.id, "turns_logged": 2})
    slog.event("command", "/clear")
    slog.turn("user", "new")
    slog.close()
    eng = engine()
    res = resume_session(eng, None, slog.id, path=db)
    assert res.method == "rebuild" and "before the session's last /clear" in res.note
    assert [m["content"] for m in eng.conv.messages] == [] and res.pending == "new"
