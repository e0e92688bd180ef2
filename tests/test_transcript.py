"""The SQLite session log: what it stores, migrations, failure fallbacks, concurrent writers and `sinkchat logs`."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from sinkchat.store.logdb import SCHEMA_VERSION, LogError, auto_snapshot_path, migrate
from sinkchat.store.sessionlog import NullLog, SessionLog
from sinkchat.store.transcript import export, get_session, latest_session, list_sessions, turns
from sinkchat.apps.logs import logs_command


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SINKCHAT_HOME", str(tmp_path))
    return tmp_path


def fill(slog, n: int = 2) -> None:
    for i in range(n):
        slog.turn("user", f"question {i}", 3)
        slog.eviction(SimpleNamespace(count=8, first=4, last=12, preview="old words", policy="sink", cache_len=56))
        slog.metrics({"tok_s": 12.5, "cache_len": 56})
        slog.tool_call("read_file", {"path": "a.txt"}, "contents", True)
        slog.turn("assistant", f"answer {i}", 10, 0.5, reason="eos", cache_len=60)


def test_session_roundtrip(home):
    slog = SessionLog.open("chat", "SmolLM2", {"cache": {"capacity": 64}, "temperature": 0.0}, system="Be brief.")
    assert isinstance(slog, SessionLog) and slog.enabled and slog.path == home / "sinkchat.db"
    fill(slog)
    assert slog.pointer() == {"session_id": slog.id, "turns_logged": 4}
    slog.close()
    info = get_session(slog.id)
    assert (info.mode, info.model, info.turns, info.tokens, info.system) == ("chat", "SmolLM2", 4, 26, "Be brief.")
    assert info.ended is not None and info.settings == {"cache": {"capacity": 64}, "temperature": 0.0}
    ts = turns(slog.id)
    assert [(t.seq, t.role, t.text) for t in ts] == [(1, "user", "question 0"), (2, "assistant", "answer 0"),
                                                    (3, "user", "question 1"), (4, "assistant", "answer 1")]
    assert ts[1].reason == "eos" and ts[1].cache_len == 60 and ts[1].seconds == 0.5
    data = export(slog.id)
    assert len(data["evictions"]) == 2 and data["evictions"][0]["preview"] == "old words"
    assert data["metrics"][0]["data"] == {"tok_s": 12.5, "cache_len": 56}
    assert [t["turn_seq"] for t in data["tool_calls"]] == [1, 3] and data["tool_calls"][0]["args"] == '{"path": "a.txt"}'
    with sqlite3.connect(home / "sinkchat.db") as c:
        assert c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert c.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_latest_and_resume_append(home):
    a = SessionLog.open("chat", "m")
    b = SessionLog.open("agent", "m")
    a.turn("user", "x")
    assert latest_session().id == b.id and latest_session("chat").id == a.id
    a2 = SessionLog.resume(a.id)  # a crashed: it was never closed; the resumed log continues its numbering
    assert a2.turn("assistant", "y") == 2
    assert [t.seq for t in turns(a.id)] == [1, 2]
    with pytest.raises(LogError):
        SessionLog.resume(999)


def test_secrets_are_never_stored(home, monkeypatch):
    monkeypatch.setenv("SINKCHAT_TEST_API_KEY", "sk-abcdef123456")
    slog = SessionLog.open("agent", "m", {"api_key": "sk-abcdef123456", "policy": "sink"})
    slog.turn("user", "my key is sk-abcdef123456 ok")
    slog.tool_call("env", {}, "SINKCHAT_TEST_API_KEY=sk-abcdef123456", True)
    slog.close()
    raw = b"".join(p.read_bytes() for p in home.glob("sinkchat.db*"))
    assert b"sk-abcdef123456" not in raw
    assert turns(slog.id)[0].text == "my key is [redacted] ok"
    assert get_session(slog.id).settings == {"policy": "sink"}


def test_migration_from_v1_keeps_data(home):
    db = home / "sinkchat.db"
    c = sqlite3.connect(db, isolation_level=None)
    migrate(c, target=1)  # the schema as version 1 shipped it
    c.execute("INSERT INTO sessions (started, mode, model, settings) VALUES (1.0, 'chat', 'old', '{}')")
    c.execute("INSERT INTO turns (session_id, seq, role, text, tokens, seconds, created) "
              "VALUES (1, 1, 'user', 'from v1', 2, 0, 1.0)")
    assert c.execute("PRAGMA user_version").fetchone()[0] == 1
    assert "tool_calls" not in {r[0] for r in c.execute("SELECT name FROM sqlite_master")}
    c.close()
    slog = SessionLog.open("chat", "new")
    assert slog.enabled
    fill(slog, 1)
    slog.close()
    assert [t.text for t in turns(1)] == ["from v1"] and turns(1)[0].reason is None
    assert len(export(slog.id)["tool_calls"]) == 1
    with sqlite3.connect(db) as c:
        assert c.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_newer_schema_is_refused_not_clobbered(home):
    db = home / "sinkchat.db"
    with sqlite3.connect(db) as c:
        c.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 5}")
    warnings: list[str] = []
    slog = SessionLog.open("chat", "m", warn=warnings.append)
    assert isinstance(slog, NullLog) and not slog.enabled and len(warnings) == 1 and "newer" in warnings[0]
    with pytest.raises(LogError, match="newer"):
        list_sessions()


def test_unwritable_dir_warns_once_and_continues(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    warnings: list[str] = []
    slog = SessionLog.open("chat", "m", path=blocker / "sinkchat.db", warn=warnings.append)
    assert not slog.enabled and slog.id is None
    assert slog.turn("user", "hi") == 1 and slog.turn("assistant", "yo") == 2  # keeps counting, no exception
    slog.tool_call("t", {}, None, False)
    slog.close()
    assert len(warnings) == 1 and "\n" not in warnings[0] and "cannot write" in warnings[0]


def test_disk_full_mid_session_degrades_once(tmp_path):
    warnings: list[str] = []
    slog = SessionLog.open("chat", "m", path=tmp_path / "s.db", warn=warnings.append)
    slog.turn("user", "saved")

    class Full:
        in_transaction = False

        def execute(self, *a, **k):
            raise sqlite3.OperationalError("database or disk is full")

        def close(self):
            pass

    slog._conn = Full()  # what a full disk looks like to the writer
    for i in range(3):
        slog.turn("assistant", f"lost {i}")
    slog.eviction(SimpleNamespace(count=1, first=0, last=1))
    slog.close()
    assert len(warnings) == 1 and "disk is full" in warnings[0] and slog.turn_count == 4
    assert [t.text for t in turns(slog.id, tmp_path / "s.db")] == ["saved"]


WRITER = """
import sys
from sinkchat.store.sessionlog import SessionLog
slog = SessionLog.open("soak", "w" + sys.argv[1], {}, path=sys.argv[2], warn=lambda m: sys.exit("WARN " + m))
print(slog.id, flush=True)
for i in range(int(sys.argv[3])):
    slog.turn("user", f"{sys.argv[1]}-{i}", 1)
    slog.eviction(type("E", (), {"count": 1, "first": i, "last": i + 1})())
slog.close()
"""


def test_two_processes_write_at_once(tmp_path):
    db, n = tmp_path / "sinkchat.db", 150
    SessionLog.open("setup", "x", path=db).close()  # schema exists; now block writers for a while
    hold = sqlite3.connect(db, isolation_level=None)
    hold.execute("BEGIN IMMEDIATE")
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(k), str(db), str(n)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for k in (1, 2)]
    time.sleep(1.0)
    hold.execute("COMMIT")
    hold.close()
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert "locked" not in err
    ids = [int(out.split()[0]) for out, _ in outs]
    assert len(set(ids)) == 2
    for k, sid in zip((1, 2), ids):
        ts = turns(sid, db)
        assert [t.seq for t in ts] == list(range(1, n + 1))
        assert [t.text for t in ts] == [f"{k}-{i}" for i in range(n)]
        assert len(export(sid, db)["evictions"]) == n


def test_logs_cli(home):
    run = CliRunner().invoke
    r = run(logs_command, [])
    assert r.exit_code == 0 and "no sessions logged yet" in r.output  # no database at all yet
    r = run(logs_command, ["show"])
    assert r.exit_code == 1 and "no sessions logged yet" in r.output
    a = SessionLog.open("chat", "SmolLM2-135M", {}, system="sys")
    fill(a)
    a.close()
    b = SessionLog.open("agent", "other-model", {})
    b.turn("user", "only one")
    auto_snapshot_path(b.id).parent.mkdir(parents=True)
    auto_snapshot_path(b.id).write_bytes(b"snap")
    mem = auto_snapshot_path(b.id).with_name(f"session-{b.id}.memory-0123abcd")  # its recall memory's folder
    mem.mkdir()
    (mem / "seg-000001.mem").write_bytes(b"kv")
    other = auto_snapshot_path(a.id).with_name(f"session-{b.id}0.memory-0123abcd")  # another session's
    other.mkdir()
    r = run(logs_command, [])
    assert r.exit_code == 0, r.output
    rows = r.output.splitlines()
    assert rows[0].split()[:3] == ["ID", "STARTED", "MODE"]
    assert rows[1].split()[0] == str(b.id) and "agent" in rows[1] and rows[1].split()[-1] == "running"  # this process
    assert rows[2].split()[0] == str(a.id) and "SmolLM2-135M" in rows[2] and rows[2].split()[-3:] == ["4", "26+", "ended"]
    # ^ opened without a token counter (as before sinkchat counted them): the turns' 26 tokens, marked a lower bound
    r = run(logs_command, ["--json", "--mode", "chat"])
    assert [s["id"] for s in json.loads(r.output)] == [a.id]
    r = run(logs_command, ["show", str(a.id)])
    assert r.exit_code == 0 and "[user]" in r.output and "answer 1" in r.output and "read_file" in r.output
    r = run(logs_command, ["show", str(a.id), "--json"])
    assert [t["text"] for t in json.loads(r.output)["turns"]][-1] == "answer 1"
    r = run(logs_command, ["show", str(a.id), "--markdown"])
    assert r.output.startswith("# session") and "## assistant" in r.output
    r = run(logs_command, ["show"])
    assert "only one" in r.output  # default: newest session
    r = run(logs_command, ["rm", str(b.id)])
    assert r.exit_code == 0 and f"removed session {b.id}" in r.output
    assert not auto_snapshot_path(b.id).exists() and [s.id for s in list_sessions()] == [a.id]
    assert not mem.exists() and other.is_dir()  # `logs rm` left the memory folder (the conversation's KV) behind
    r = run(logs_command, ["show", "999"])
    assert r.exit_code == 1 and "no session 999" in r.output and "Traceback" not in r.output
    r = run(logs_command, ["rm", "999"])
    assert r.exit_code == 1 and "no session 999" in r.output


def test_undecodable_input_is_stored_not_a_crash(tmp_path):
    """Bytes that are not UTF-8 reach us as lone surrogates (surrogateescape); SQLite must still take the turn."""
    from sinkchat.store.sessionlog import SessionLog
    from sinkchat.store.transcript import turns

    log = SessionLog.open("agent", "m", {}, path=tmp_path / "t.db")
    log.turn("user", "bad \udcff\udcfe bytes")
    log.tool_call("read_file", {"path": "\udcc3"}, "ok \udc80", True)
    log.close()
    (t,) = turns(log.id, path=tmp_path / "t.db")
    assert t.text.startswith("bad ") and t.text.endswith(" bytes") and "\ufffd" in t.text


def test_a_long_model_name_is_cut_at_its_start_with_a_mark():
    """A 31-character file name in the 28-column MODEL column keeps its end (quantization, type) behind an ellipsis
    instead of losing it mid-word ("SmolLM2-135M-Instruct.Q4_1.g")."""
    from sinkchat.apps.logs import _cut

    got = _cut("SmolLM2-135M-Instruct.Q4_1.gguf", 28)
    assert len(got) == 28 and got.startswith("…") and got.endswith("Q4_1.gguf")
    assert _cut("SmolLM2-135M", 28) == "SmolLM2-135M"
