"""Sessions through the real CLI: /save + --load gives the same next reply; kill -9 mid-reply, then --resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from sinkchat.store import transcript
BASE = [sys.executable, "-m", "sinkchat.cli", "chat", "--cache", "96", "--temperature", "0", "--max-tokens", "16",
        "--system", "You are terse."]


def run_chat(args, stdin, home, timeout=300):
    env = dict(os.environ, SINKCHAT_HOME=str(home))
    return subprocess.run(BASE + args, input=stdin, capture_output=True, text=True, timeout=timeout, env=env)


def _cache_line(stderr: str) -> str:
    """The /stats row that says how many tokens the cache holds ("cache  39/96 tokens, 2.1 MiB KV")."""
    return next(ln.split()[1] for ln in stderr.splitlines() if ln.startswith("cache "))


def test_save_then_load_gives_the_same_next_reply(tmp_path):
    """The loaded cache is the saved one (same fill, same next answer, whole and in JSONL so a multi-line reply
    counts), and it is not what an empty cache gives: a restore that lost the context fails the fill check."""
    a = run_chat(["--format", "jsonl"], "Name a color.\nName a city.\n/save snap1\n/stats\nName a fruit.\n", tmp_path)
    assert a.returncode == 0, a.stderr[-1500:]
    assert (tmp_path / "snapshots" / "snap1.safetensors").is_file()
    b = run_chat(["--format", "jsonl", "--load", "snap1"], "/stats\nName a fruit.\n", tmp_path)
    assert b.returncode == 0, b.stderr[-1500:]
    saved, loaded = _cache_line(a.stderr), _cache_line(b.stderr)
    assert saved == loaded and int(saved.split("/")[0]) > 20  # both turns are in the cache, not only the system
    answer = [json.loads(ln)["answer"] for ln in a.stdout.splitlines()][-1]
    assert json.loads(b.stdout.splitlines()[-1])["answer"] == answer and answer.strip()


def test_a_flag_typed_for_this_run_wins_over_the_loaded_snapshots_setting(tmp_path):
    """The snapshot was saved with --max-tokens 16 (its sampling settings come with it, so a bare --load gives the
    saved session's next reply); this run's --max-tokens 3 must still cut the reply at 3, and say so (the reply was
    cut at the snapshot's 16 while the hint said "--max-tokens N to change")."""
    a = run_chat([], "Name a color.\n/save snapm\n", tmp_path)
    assert a.returncode == 0, a.stderr[-1500:]
    b = run_chat(["--format", "jsonl", "--max-tokens", "3", "--load", "snapm"], "Write a long story.\n", tmp_path)
    assert b.returncode == 0, b.stderr[-1500:]
    (rec,) = [json.loads(ln) for ln in b.stdout.splitlines()]
    assert rec["tokens"] == 3, rec
    assert "kept this run's --max-tokens 3 (the snapshot's 16)" in b.stderr
    # /set is the user's latest word: a /load after it keeps it too
    c = run_chat(["--format", "jsonl", "--max-tokens", "3"], "/set max_tokens 5\n/load snapm\nWrite a long story.\n",
                 tmp_path)
    (rec,) = [json.loads(ln) for ln in c.stdout.splitlines()]
    assert rec["tokens"] == 5 and "kept this run's --max-tokens 5 (the snapshot's 16)" in c.stderr, c.stderr[-800:]


@pytest.mark.slow  # two CLI runs on the bundled model, ~11 s idle
def test_load_at_start_takes_a_json_transcript_too(tmp_path):
    t = tmp_path / "t.json"
    a = run_chat([], f"Name a color.\n/save {t}\n", tmp_path)
    assert a.returncode == 0 and t.is_file(), a.stderr[-1500:]
    b = run_chat(["--load", str(t)], "Name a fruit.\n", tmp_path)
    assert b.returncode == 0, b.stderr[-1500:]
    assert "replaying 2 messages" in b.stderr and "snapshot" not in b.stderr
    assert [r for r in b.stdout.split("\n") if r.strip()]
    r = run_chat(["--load", str(tmp_path / "missing.json")], "hi\n", tmp_path)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "cannot read" in r.stderr


@pytest.mark.parametrize("content", [None, "{not json", '{"messages": "x"}'], ids=["missing", "broken", "wrong"])
def test_a_bad_transcript_is_refused_before_the_model_loads(tmp_path, content):
    """`--load FILE.json` that cannot be read or is no transcript: one line, exit 1 (as a missing snapshot), before
    the model loads, and no empty session left in the log (it loaded the model, then exited 2 with the usage text)."""
    t = tmp_path / "t.json"
    if content is not None:
        t.write_text(content)
    env = dict(os.environ, SINKCHAT_HOME=str(tmp_path), SINKCHAT_MODEL=str(tmp_path / "no-model.gguf"))
    r = subprocess.run(BASE + ["--load", str(t)], input="hi\n", capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1, r.stderr[-1500:]
    assert "Traceback" not in r.stderr and "Usage:" not in r.stderr
    assert f"{t}" in r.stderr and ("cannot read" in r.stderr or "cannot load" in r.stderr), r.stderr
    assert not (tmp_path / "sinkchat.db").exists() or not transcript.list_sessions(None, 10, tmp_path / "sinkchat.db")


def test_corrupt_snapshot_refused_at_start(tmp_path):
    (tmp_path / "snapshots").mkdir(parents=True)
    (tmp_path / "snapshots" / "bad.safetensors").write_bytes(b"\x00" * 100)
    r = run_chat(["--load", "bad"], "hi\n", tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "Error" in r.stderr


def test_kill_9_mid_reply_then_resume(tmp_path):
    env = dict(os.environ, SINKCHAT_HOME=str(tmp_path))
    p = subprocess.Popen(BASE[:-4] + ["--max-tokens", "200", "--snapshot-every", "1", "--system", "You are terse."],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    p.stdin.write("Say hello.\n")
    p.stdin.flush()
    # wait until the first turn is logged, then ask for a long reply and kill -9 while it streams
    db = tmp_path / "sinkchat.db"
    deadline = time.time() + 240
    while time.time() < deadline:
        if db.exists():
            s = transcript.latest_session("chat", path=db)
            if s is not None and s.turns >= 2:
                break
        time.sleep(0.5)
    else:
        p.kill()
        pytest.fail("first turn never logged")
    p.stdin.write("Write a very long story about a dragon.\n")
    p.stdin.flush()
    time.sleep(4)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    sid = transcript.latest_session("chat", path=db).id
    before = transcript.turns(sid, path=db)
    assert [t.role for t in before][:2] == ["user", "assistant"]
    r = run_chat(["--resume", str(sid)], "Thanks, bye.\n", tmp_path)
    assert r.returncode == 0, r.stderr[-1500:]
    assert "resumed session" in r.stderr
    after = transcript.turns(sid, path=db)
    assert len(after) > len(before)
    assert after[-1].role == "assistant" and after[-2].role == "user" and after[-2].text == "Thanks, bye."
    assert after[-1].text.strip()


def test_library_records_read_as_the_apps_lines_and_a_bugs_traceback_is_kept(capsys):
    """Under the CLI a library warning is `warning: ...` (it was `WARNING sinkchat.store.snapshot: ...`), and
    `log.exception` still prints the traceback a bug needs."""
    import logging

    from sinkchat.bootstrap import setup_logging

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    root.handlers.clear()
    try:
        setup_logging(0)
        log = logging.getLogger("sinkchat.store.snapshot")
        log.warning("the snapshot's recall memory (%d blocks) is not loaded", 2)
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logging.getLogger("sinkchat.apps.serve").exception("generation failed")
        log.info("not shown")
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "warning: the snapshot's recall memory (2 blocks) is not loaded"
    assert err[1] == "error: generation failed" and err[2].startswith("Traceback") and err[-1] == "RuntimeError: boom"
    assert "not shown" not in "\n".join(err)
