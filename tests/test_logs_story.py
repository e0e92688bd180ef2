"""`sinkchat logs` tells what happened: slash commands and the agent's error feedback in order with the turns, real
prefill and generation times, and a session still being written told from one whose process died."""

from __future__ import annotations

import io
import os
import signal
import sqlite3
import subprocess
import sys
import time
from types import SimpleNamespace

import torch
from click.testing import CliRunner

from sinkchat.apps.agent.agent import Agent, build_default_tools
from sinkchat.apps.agent.display import Display
from sinkchat.apps.agent.log import AgentLog
from sinkchat.apps.agent.protocol import AgentErrorEvent, ModelTextEvent, StepEvent, ToolResultEvent
from sinkchat.apps.agent.tools.workspace import Workspace
from sinkchat.apps.chat.repl import ChatLoop, lines_reader
from sinkchat.apps.logs import format_transcript, logs_command
from sinkchat.apps.render import Renderer
from sinkchat.config import CacheConfig, SamplingConfig
from sinkchat.core.engine import Engine
from sinkchat.core.events import DoneEvent, PrefillEvent
from sinkchat.core.metrics import Metrics
from sinkchat.store.sessionlog import SessionLog
from sinkchat.store.transcript import export, get_session, list_sessions, turns

from fakes import CharTokenizer, ScriptedEngine, tiny_model

torch.set_num_threads(1)


def chat_engine(capacity: int = 256, max_tokens: int = 6) -> Engine:
    model = tiny_model("llama", layers=2, max_pos=512)
    model.config.eos_token_id = 96
    return Engine(model, CharTokenizer(), CacheConfig(policy="sink", n_sink=4, capacity=capacity),
                  SamplingConfig(temperature=0, max_tokens=max_tokens, repetition_penalty=1.0), system="be brief")


def chat_loop(eng: Engine, slog) -> ChatLoop:
    return ChatLoop(eng, Renderer(io.StringIO(), io.StringIO(), tty=False, live=False), slog=slog)


# ----------------------------------------------------------------------------------------------- task 1: the story
def test_state_changing_slash_commands_are_logged_in_order_with_the_turns(tmp_path):
    """Before: `logs show` listed the turns alone, so a reply after /system, /clear or /policy read as if nothing had
    happened in between; failed commands must not be logged as if they had changed anything."""
    slog = SessionLog.open("chat", "tiny", {}, system="be brief")
    eng = chat_engine()
    loop = chat_loop(eng, slog)
    loop.run(lines_reader(["hello", "/policy window", "/policy nope", "/system Be terse now.", "/set temperature 0.5",
                           "/set temperature hot", "/save snapA", "/clear", "/stats", "/bogus", "again",
                           "/load snapA", "/load missing-snap", "after load"]))
    slog.close()
    data = export(slog.id)
    logged = [(e["turn_seq"], e["text"]) for e in data["events"]]
    assert logged == [(2, "/policy window"), (3, "/set temperature 0.5"), (3, "/save snapA"), (3, "/clear"),
                      (5, "/load snapA")]
    assert all(e["kind"] == "command" and e["detail"] for e in data["events"])
    assert [(t["seq"], t["role"]) for t in data["turns"]] == [(1, "user"), (2, "assistant"), (3, "system"),
                                                              (4, "user"), (5, "assistant"), (6, "user"),
                                                              (7, "assistant")]
    assert data["turns"][2]["text"] == "Be terse now." and data["turns"][2]["tokens"] > 0
    shown = format_transcript(data)
    order = ["hello", "[command] /policy window", "Be terse now.", "[command] /set temperature 0.5",
             "[command] /save snapA", "[command] /clear", "again", "[command] /load snapA", "after load"]
    at = [shown.index(s) for s in order]
    assert at == sorted(at), shown
    assert "/policy nope" not in shown and "temperature hot" not in shown and "missing-snap" not in shown
    assert "/stats" not in shown and "/bogus" not in shown
    md = format_transcript(data, markdown=True)
    assert "`/clear`" in md and md.index("`/clear`") < md.index("again")


def test_system_prompt_set_before_anything_is_fed_becomes_the_sessions(tmp_path):
    slog = SessionLog.open("chat", "tiny", {}, system="be brief")
    loop = chat_loop(chat_engine(), slog)
    loop.run(lines_reader(["/system You are a pirate.", "hi"]))
    slog.close()
    assert get_session(slog.id).system == "You are a pirate."  # what a resume rebuild feeds first
    ev = export(slog.id)["events"]
    assert [(e["turn_seq"], e["text"]) for e in ev] == [(0, "/system You are a pirate.")]
    shown = format_transcript(export(slog.id))
    assert shown.index("[command] /system You are a pirate.") < shown.index("[user]")


def test_agent_error_feedback_is_logged_after_its_reply(tmp_path):
    """Before: a reply with no valid tool call left no trace but the reply; what the model was told was lost."""
    slog = SessionLog.open("agent", "scripted", {})
    ws = Workspace(tmp_path / "ws", create=True)
    eng = ScriptedEngine(["I will just chat instead.", '{"tool": "no_such_tool", "args": {}}',
                          '{"final": "there is no such tool"}'])  # not "done": no call ran ok (verify.py)
    agent = Agent(eng, build_default_tools(ws), ws, few_shot=False)
    fake = SimpleNamespace(cache=SimpleNamespace(length=0), ledger=SimpleNamespace(seen=0, evicted=0))
    display = Display(fake, Metrics(), False, 0, AgentLog(slog, fake))
    display.status = lambda: None  # the scripted engine has no cache to report
    for ev in agent.run("do the thing", 5):
        display(ev)
    slog.close()
    data = export(slog.id)
    assert [(e["turn_seq"], e["kind"]) for e in data["events"]] == [(2, "feedback"), (3, "feedback")]
    assert "no tool call" in data["events"][0]["text"] and "no_such_tool" in data["events"][1]["text"]
    shown = format_transcript(data)
    order = ["I will just chat instead.", "[feedback]", "no_such_tool", "[feedback]", '{"final": "there is no such tool"}']
    pos, at = 0, []
    for s in order:
        pos = shown.index(s, pos)
        at.append(pos)
    assert at == sorted(at), shown


# ----------------------------------------------------------------------------------------------- task 2: timings
def test_agent_turns_carry_prefill_and_generation_seconds(tmp_path):
    """Before: every agent turn was logged with 0.0 s."""
    slog = SessionLog.open("agent", "m", {})
    fake = SimpleNamespace(cache=SimpleNamespace(length=7), ledger=SimpleNamespace(seen=0, evicted=0))
    alog = AgentLog(slog, fake)
    for ev in [PrefillEvent(30, 0.25, 30), PrefillEvent(12, 0.5, 42), StepEvent(1, "task"),
               DoneEvent("stop", 5, 1.5, "reply"), ModelTextEvent(1, "reply", "stop", 5),
               AgentErrorEvent(1, "your reply has no tool call"),
               ToolResultEvent(1, "", False, "your reply has no tool call", 27, False, 0.0),
               PrefillEvent(20, 0.75, 62), StepEvent(2, "task"),
               DoneEvent("eos", 3, 0.125, "r2"), ModelTextEvent(2, "r2", "eos", 3)]:
        alog(ev)
    slog.close()
    ts = turns(slog.id)
    assert [(t.role, t.tokens, t.seconds) for t in ts] == [("user", 42, 0.75), ("assistant", 5, 1.5),
                                                           ("assistant", 3, 0.125)]


def test_chat_turns_carry_prefill_and_generation_seconds(monkeypatch):
    """Before: the user turn was logged with 0.0 s, however long its prefill took."""
    slog = SessionLog.open("chat", "tiny", {})
    eng = chat_engine()
    real_add = eng.add_message

    def slow_add(*a, **k):  # a prefill that takes measurable time
        time.sleep(0.2)
        yield from real_add(*a, **k)

    monkeypatch.setattr(eng, "add_message", slow_add)
    chat_loop(eng, slog).run(lines_reader(["hello"]))
    slog.close()
    user, reply = turns(slog.id)
    assert user.role == "user" and user.seconds >= 0.2 and user.tokens > 0
    assert reply.role == "assistant" and 0 < reply.seconds < user.seconds
    r = CliRunner().invoke(logs_command, ["show", str(slog.id)])
    assert "0.0 s" not in r.output and "fed in" in r.output and "generated in" in r.output


# ----------------------------------------------------------------------------------------------- task 3: liveness
HOLDER = """
import sys
from sinkchat.store.sessionlog import SessionLog
slog = SessionLog.open("summarize", "m", {}, path=sys.argv[1])
slog.turn("user", "q")
print(slog.id, flush=True)
if sys.argv[2] == "exit":
    import os
    os._exit(0)  # gone without closing the session: what a crash leaves
sys.stdin.read()
"""


def _status(db, sid) -> str:
    return get_session(sid, db).status


def test_a_live_process_is_running_and_a_dead_one_crashed(tmp_path):
    """Before: a summarize still going was listed `open/crashed` like one killed hours ago."""
    db = tmp_path / "sinkchat.db"
    live = subprocess.Popen([sys.executable, "-c", HOLDER, str(db), "hold"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        live_id = int(live.stdout.readline())
        dead = subprocess.run([sys.executable, "-c", HOLDER, str(db), "exit"], capture_output=True, text=True,
                              timeout=120)
        dead_id = int(dead.stdout.split()[0])
        assert _status(db, live_id) == "running"
        assert _status(db, dead_id) == "crashed"
        assert get_session(live_id, db).pid == live.pid
        listed = {s.id: s.status for s in list_sessions(path=db)}
        assert listed == {live_id: "running", dead_id: "crashed"}
        os.kill(live.pid, signal.SIGKILL)
        live.wait(timeout=30)
        assert _status(db, live_id) == "crashed"
    finally:
        if live.poll() is None:
            live.kill()
            live.wait()


def test_a_reused_pid_an_old_row_and_another_host(tmp_path):
    db = tmp_path / "sinkchat.db"
    slog = SessionLog.open("chat", "m", {}, path=db)
    assert _status(db, slog.id) == "running"
    with sqlite3.connect(db) as c:  # our pid, but recorded for a process that started an hour earlier
        c.execute("UPDATE sessions SET pid_started = pid_started - 3600 WHERE id = ?", (slog.id,))
    assert _status(db, slog.id) == "crashed"
    with sqlite3.connect(db) as c:
        c.execute("UPDATE sessions SET host = 'elsewhere.example' WHERE id = ?", (slog.id,))
    assert _status(db, slog.id) == "other host"
    with sqlite3.connect(db) as c:  # written by a sinkchat that recorded no pid
        c.execute("UPDATE sessions SET pid = NULL, pid_started = NULL, host = NULL WHERE id = ?", (slog.id,))
    assert _status(db, slog.id) == "open/crashed"
    slog.close()
    assert _status(db, slog.id) == "ended"


def test_logs_cli_lists_running_and_crashed(monkeypatch, tmp_path):
    monkeypatch.setenv("SINKCHAT_HOME", str(tmp_path))
    a = SessionLog.open("summarize", "m", {})
    with sqlite3.connect(tmp_path / "sinkchat.db") as c:  # a pid that cannot exist: the process is gone
        c.execute("INSERT INTO sessions (started, mode, model, pid, pid_started, host) "
                  "SELECT started, 'chat', 'm', 2147483646, 1.0, host FROM sessions WHERE id = ?", (a.id,))
    r = CliRunner().invoke(logs_command, [])
    rows = r.output.splitlines()[1:]
    assert [row.split()[-1] for row in rows] == ["crashed", "running"], r.output
    a.close()
    assert "running" in CliRunner().invoke(logs_command, ["--help"]).output


def test_resume_marks_the_session_as_held_by_the_new_process(tmp_path):
    db = tmp_path / "sinkchat.db"
    dead = subprocess.run([sys.executable, "-c", HOLDER, str(db), "exit"], capture_output=True, text=True,
                          timeout=120)
    sid = int(dead.stdout.split()[0])
    assert _status(db, sid) == "crashed"
    again = SessionLog.resume(sid, path=db)
    assert _status(db, sid) == "running" and get_session(sid, db).pid == os.getpid()
    again.close()


def test_forgotten_tokens_are_logged_and_shown_apart_from_evictions(tmp_path):
    """A recall memory's ForgottenEvent goes to the session log beside the evictions and `logs show` says
    'forgotten' for it (with why), never counting it as an eviction."""
    from sinkchat.core.events import EvictionEvent, ForgottenEvent

    slog = SessionLog.open("chat", "tiny", {})
    slog.turn("user", "hi", tokens=3)
    slog.eviction(EvictionEvent(64, 4, 68, "old words", "sink", 960, 0.0, True))
    slog.eviction(ForgottenEvent(64, 4, 68, "budget"))
    slog.turn("assistant", "ok", tokens=2)
    slog.close()
    shown = format_transcript(export(slog.id))
    assert "<evicted 64 tokens [4,68): old words>" in shown
    assert "<forgotten 64 tokens [4,68) (budget)>" in shown
    assert "1 eviction, 64 tokens evicted" in shown and "64 tokens forgotten by the recall memory" in shown


def test_every_eviction_the_chat_makes_is_in_the_log(tmp_path):
    """`logs show`'s totals left out the tokens a /window evicted (logged only in the command's own line) and every
    eviction of a transcript replay (/load FILE.json feeds it without showing them): its totals said 8 evictions of
    383 tokens where the chat had made 9 of 503 and 368 more (a user audit). Each is now in the log."""
    slog = SessionLog.open("chat", "tiny", {}, system="be brief")
    eng = chat_engine(capacity=96)
    loop = chat_loop(eng, slog)
    path = tmp_path / "talk.json"
    loop.run(lines_reader(["hello there " * 5, f"/save {path}", "more words here " * 5, "/window 40"]))
    before = loop.metrics.evicted  # the stream's: the replay below starts the live figures over
    window = export(slog.id)["evictions"]  # before the replay
    loop.run(lines_reader([f"/load {path}"]))
    replayed = loop.metrics.evicted
    slog.close()
    evs = export(slog.id)["evictions"]
    assert before > 0 and replayed > 0 and len(evs) > len(window) > 0
    assert sum(e["count"] for e in evs) == before + replayed
