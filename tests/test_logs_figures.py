"""`sinkchat logs` figures that add up: TOKENS means the tokens the model processed for every kind of session (not
the tokens of the turns, which leave out what is fed between them), and `logs show` lists evictions in order among
the turns rather than as a total at the end."""

from __future__ import annotations

import io
import queue
import sqlite3
import time
from types import SimpleNamespace

from click.testing import CliRunner

from sinkchat.apps.logs import format_transcript, logs_command
from sinkchat.apps.runlog import open_log
from sinkchat.config import CacheConfig, SamplingConfig
from sinkchat.memory.events import ForgottenEvent
from sinkchat.core.engine import Engine
from sinkchat.store.logdb import migrate
from sinkchat.store.sessionlog import SessionLog
from sinkchat.store.transcript import export, get_session

from fakes import CharTokenizer, tiny_model

LOG_LINES = ("2025-06-24 14:36:{s:02d} status installed libfoo:amd64 1.{n}.0-1",
             "2025-06-24 14:36:{s:02d} worker {n} finished job in {n}ms",
             "2025-06-24 14:36:{s:02d} GET /users/{n} 200")


def _engine(capacity: int = 1024, max_tokens: int = 8) -> Engine:
    return Engine(tiny_model(max_pos=8192), CharTokenizer(), CacheConfig(capacity=capacity, n_sink=4),
                  SamplingConfig(temperature=0, max_tokens=max_tokens, repetition_penalty=1.0))


def _row(sid: int) -> list[str]:
    """The session's row of `sinkchat logs`, split into columns."""
    out = CliRunner().invoke(logs_command, []).output
    return next(r.split() for r in out.splitlines()[1:] if r.split()[0] == str(sid))


# ------------------------------------------------------------------------------------------------ TOKENS
def test_a_summarize_session_counts_the_log_lines_it_fed():
    """Before: TOKENS summed the turns, and summarize logs only its questions and answers, so a run that fed 27,244
    tokens showed 8,421. Now it is what the model processed, as for chat: here the ledger's `seen` (no rewinds)."""
    from sinkchat.apps.summarize.batching import Batcher
    from sinkchat.apps.summarize.reader import End, Line
    from sinkchat.apps.summarize.summarizer import Output, Status, Summarizer

    eng = _engine()
    slog = open_log(eng, "summarize", False, "prompt", warn=print)
    prompt = "Digest:\n{digest}\nSummarize lines {first_line} to {last_line}.{note}"
    summ = Summarizer(eng, Batcher(lambda t: len(eng.encode(t)), chunk_lines=4, chunk_tokens=10**6),
                      Output("jsonl", io.StringIO()), Status(io.StringIO(), quiet=True), prompt=prompt, every=20,
                      interval=0, max_tokens=8, slog=slog)
    q: queue.Queue = queue.Queue()
    n = 60
    for i in range(1, n + 1):
        q.put(Line(i, LOG_LINES[i % 3].format(s=i % 60, n=i)))
    q.put(End(n))
    summ.run(q)
    slog.close()
    info = get_session(slog.id)
    assert info.tokens == eng.ledger.seen, (info.tokens, eng.ledger.seen)
    assert info.tokens_counted and info.turns >= 6
    assert info.turn_tokens < eng.ledger.seen / 2  # most of what it read is log lines, in no turn
    assert _row(slog.id)[-2] == str(eng.ledger.seen)
    shown = format_transcript(export(slog.id))
    between = eng.ledger.seen - info.turn_tokens
    assert f"{eng.ledger.seen} tokens processed: {info.turn_tokens} in the turns, {between} between them" in shown


def _chat(capacity: int, lines: list[str]) -> tuple[Engine, int]:
    """A real chat loop on a tiny model, logged as `sinkchat chat` logs it; (engine, session id)."""
    from sinkchat.apps.chat.repl import ChatLoop, lines_reader
    from sinkchat.apps.render import Renderer

    eng = _engine(capacity=capacity, max_tokens=6)
    slog = open_log(eng, "chat", False, None, warn=print)
    ChatLoop(eng, Renderer(io.StringIO(), io.StringIO(), tty=False, live=False), slog=slog).run(lines_reader(lines))
    slog.close()
    return eng, slog.id


def test_a_chat_session_counts_what_its_turns_fed_and_generated():
    eng, sid = _chat(256, ["hello there", "and again", "one more"])
    info = get_session(sid)
    assert info.tokens_counted and info.turns == 6
    assert info.tokens == eng.ledger.seen == info.turn_tokens  # a chat feeds nothing between its turns


def test_a_resumed_session_adds_to_its_total(tmp_path):
    db = tmp_path / "s.db"
    count = {"n": 0}
    a = SessionLog.open("chat", "m", {}, path=db, tokens=lambda: count["n"])
    a.turn("user", "q", 5)
    count["n"] = 40
    a.flush()
    assert get_session(a.id, db).tokens == 40  # a running session shows what it processed by its last write
    a._conn.close()  # a crash: never closed
    again = SessionLog.resume(a.id, path=db, tokens=lambda: 7)
    again.close()
    assert get_session(a.id, db).tokens == 47


# ------------------------------------------------------------------------------------------------ evictions
def _ev(first: int, last: int) -> SimpleNamespace:
    return SimpleNamespace(count=last - first, first=first, last=last, preview=f"gone{first}", policy="sink",
                           cache_len=64)


def _positions(shown: str, needles: list[str]) -> list[int]:
    pos, at = 0, []
    for s in needles:
        pos = shown.index(s, pos)
        at.append(pos)
    return at


def test_evictions_are_listed_in_order_among_the_turns(tmp_path):
    """Before: `logs show` said only "(3 evictions, 24 tokens evicted)" at the end."""
    db = tmp_path / "s.db"
    slog = SessionLog.open("chat", "m", {}, path=db)
    slog.eviction(_ev(4, 12))  # while feeding the first message: before it is logged
    slog.turn("user", "first question", 30)
    slog.turn("assistant", "first answer", 9)
    slog.eviction(_ev(12, 20))
    slog.turn("user", "second question", 20)
    slog.eviction(_ev(20, 28))  # while generating the second answer
    slog.turn("assistant", "second answer", 9)
    slog.close()
    data = export(slog.id, db)
    for markdown in (False, True):
        shown = format_transcript(data, markdown=markdown)
        _positions(shown, ["gone4", "first question", "first answer", "gone12", "second question", "gone20",
                           "second answer", "3 evictions, 24 tokens evicted"])
    assert "<evicted 8 tokens [12,20): gone12>" in format_transcript(data)
    assert [(e["first"], e["turn_seq"]) for e in data["evictions"]] == [(4, 0), (12, 2), (20, 3)]


def test_an_old_sessions_evictions_are_placed_by_their_time(tmp_path):
    """Rows from before the log recorded an eviction's turn (schema 3) are placed by when they happened."""
    db = tmp_path / "s.db"
    c = sqlite3.connect(db, isolation_level=None)
    migrate(c, target=3)
    c.execute("INSERT INTO sessions (started, mode, model, settings) VALUES (1.0, 'chat', 'old', '{}')")
    for seq, (role, created) in enumerate([("user", 10.0), ("assistant", 20.0), ("user", 30.0)], 1):
        c.execute("INSERT INTO turns (session_id, seq, role, text, tokens, seconds, created) "
                  "VALUES (1, ?, ?, ?, 3, 0, ?)", (seq, role, f"turn{seq}", created))
    c.execute("INSERT INTO evictions (session_id, created, count, first, last, preview) VALUES (1, 25.0, 4, 0, 4, 'x')")
    c.close()
    data = export(1, db)
    shown = format_transcript(data)
    _positions(shown, ["turn2", "<evicted 4 tokens [0,4)", "turn3"])
    assert data["evictions"][0]["turn_seq"] == 2 and not data["session"]["tokens_counted"]


def test_a_long_run_of_evictions_is_summed_after_a_few_lines(tmp_path):
    db = tmp_path / "s.db"
    slog = SessionLog.open("soak", "m", {}, path=db)
    slog.turn("user", "block", 100)
    for i in range(10):
        slog.eviction(_ev(4 + 8 * i, 12 + 8 * i))
    slog.turn("assistant", "reply", 5)
    slog.close()
    shown = format_transcript(export(slog.id, db))
    assert shown.count("<evicted ") == 4
    _positions(shown, ["block", "gone4", "gone12", "gone20", "... and 7 more evictions: 56 tokens [28,84)", "reply"])


def test_a_chat_that_evicts_shows_each_eviction_after_the_turn_before_it():
    """A real chat on a 64-token cache: every eviction is shown after the turn logged before it happened and
    before the next one."""
    _, sid = _chat(64, ["a first message of some length", "then a second one", "and a third"])
    data = export(sid)
    evs = data["evictions"]
    assert evs and {e["turn_seq"] for e in evs} != {len(data["turns"])}  # not all after the last turn
    created = {t["seq"]: t["created"] for t in data["turns"]}
    for e in evs:
        assert created.get(e["turn_seq"], 0.0) <= e["created"] <= created.get(e["turn_seq"] + 1, time.time())


def test_forgotten_ranges_after_evictions_show_their_own_first_lines_and_why(tmp_path):
    """Up to three lines of each kind in a row, then one line per kind for the rest, the forgotten one saying why by
    reason (it printed "... and 1 more forgotten blocks" after a single forgotten line, with no reason: two damaged
    blocks hid there); the totals keep copies of blocks read again apart from tokens lost."""
    db = tmp_path / "s.db"
    slog = SessionLog.open("soak", "m", {}, path=db)
    slog.turn("user", "block", 100)
    for i in range(3):
        slog.eviction(_ev(4 + 8 * i, 12 + 8 * i))
    for i, why in enumerate(["re-read", "re-read", "re-read", "damaged", "damaged", "re-read"]):
        slog.eviction(ForgottenEvent(8, 100 + 8 * i, 108 + 8 * i, why))
    slog.turn("assistant", "reply", 5)
    slog.close()
    shown = format_transcript(export(slog.id, db))
    assert shown.count("<evicted ") == 3 and shown.count("<forgotten 8 tokens") == 3
    assert "<forgotten ... and 3 more forgotten ranges: 24 tokens [124,148) (damaged: 16 tokens, re-read: 8 tokens)>" \
        in shown
    assert "16 tokens forgotten by the recall memory" in shown
    assert "32 tokens of blocks read again let go (their blocks held)" in shown
