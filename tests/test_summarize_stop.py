"""A stop keeps the README's promise and says what it did (issue: SIGTERM took ~10.5 s, with a second generation,
and the output could not tell a SIGTERM's skips from back-pressure drops); the session log's [system] entry is the
prompt actually fed, not the question template; the final status line is printed once."""

from __future__ import annotations

import io
import json
import queue
import time
from types import SimpleNamespace

from sinkchat.apps.summarize.reader import End, Line

from fakes import CharTokenizer
from test_summarize_trust import DPKG, _blocks, _summarizer

DISK = "2025-06-24 14:36:30 web-01 kernel: ERROR disk /dev/sdb1 full: No space left on device"
LINES = DPKG[:5] + [DISK] + DPKG[5:]


def _stopped_run(replies: list[str], at_offset: float, on_generate=None):
    """Run LINES through a scripted Summarizer stopped while it asks its first question (as SIGTERM does), then
    finish as the command does, the signal `at_offset` seconds ago. Returns (blocks, generations after the stop)."""
    from sinkchat.apps.summarize.summarizer import Interrupted

    holder: dict = {"calls": []}

    def hook(n: int) -> None:
        holder["calls"].append(n)
        if n == 0:
            holder["s"].halt.set()
        if on_generate is not None:
            on_generate(holder["s"], n)

    s, eng, out = _summarizer(replies, on_generate=hook)
    holder["s"] = s
    q: queue.Queue = queue.Queue()
    for i, line in enumerate(LINES, 1):
        q.put(Line(i, line))
    for i in range(len(LINES) + 1, len(LINES) + 41):  # a backlog the stop leaves unread
        q.put(Line(i, f"2025-06-24 14:37:{i % 60:02d} status installed pkg{i}:amd64 1.0"))
    try:
        s.run(q)
    except Interrupted:
        s.finish_stopped(q, lines_read=len(LINES) + 40, at=time.monotonic() - at_offset, by="SIGTERM")
    return [b for b in _blocks(out) if b["lines"]], [n for n in holder["calls"] if n > 0]


def test_with_no_time_left_the_final_summary_is_the_digest_and_the_model_is_not_asked():
    """Past the time a stop allows, the final question is not fed nor answered (on the issue's box, feeding the
    question alone took ~6 s); the digest names the disk-full line all the same."""
    (b,), after = _stopped_run(["Nothing happened."] * 4, at_offset=30.0)
    assert after == [] and b["final"] and b["prose"] == "digest" and not b["regenerated"]
    assert b["stopped_by"] == "SIGTERM" and b["skipped_by_stop"] == b["skipped"] == b["lines"] - b["summarized"] > 0
    assert "disk full" in b["summary"] and "line 6" in b["summary"]


def test_after_a_stop_the_answer_is_never_regenerated():
    """The issue's final record said `"regenerated": true`: a second generation after SIGTERM."""
    (b,), after = _stopped_run(["The disk crashed twice."] * 4, at_offset=0.0)
    assert after == [1] and not b["regenerated"], (after, b)
    assert "crash" not in b["summary"] and "disk full" in b["summary"]


def test_a_deadline_passing_while_the_model_answers_gives_the_digest():
    def late(s, n: int) -> None:
        if n == 1:
            s.clock.at -= 100  # the rates promised time the answer did not get (a load spike)

    (b,), after = _stopped_run(["Nothing happened."] * 4, at_offset=0.0, on_generate=late)
    assert after == [1] and b["prose"] == "digest" and any("ran out of time" in w for w in b["why"]), b
    assert "disk full" in b["summary"]


def test_the_text_output_says_the_run_was_stopped_and_how_many_lines_were_not_summarized():
    from sinkchat.apps.summarize.output import render_block

    (b,), _ = _stopped_run(["Nothing happened."] * 4, at_offset=30.0)
    head = render_block(b, "text").splitlines()[0]
    n = b["skipped_by_stop"]
    assert n > 0 and f"stopped by SIGTERM: {n} lines read but not summarized" in head, head
    dropped = dict(b, stopped_by=None, skipped_by_stop=None)  # skipped by back-pressure, no stop
    assert "stopped" not in render_block(dropped, "text").splitlines()[0]


def test_the_answer_gets_only_the_tokens_the_measured_rates_allow():
    from sinkchat.apps.summarize.stop import STOP_SECONDS, StopClock

    def metrics(fed_per_s: float, decoded_per_s: float | None) -> SimpleNamespace:
        return SimpleNamespace(recent_prefill=[(100, 100 / fed_per_s)],
                               latencies=[1 / decoded_per_s] * 10 if decoded_per_s else [])

    clock = StopClock(time.monotonic(), "SIGTERM")
    assert clock.answer_tokens(metrics(50, 46), 350, 150) == 0  # the box: the question alone takes 7 s
    assert clock.answer_tokens(metrics(20000, 2000), 350, 150) == 150  # a fast machine: the full answer
    n = clock.answer_tokens(metrics(2000, 100), 350, 150)
    assert 24 <= n < 150 and n <= STOP_SECONDS * 100
    assert clock.answer_tokens(SimpleNamespace(recent_prefill=[], latencies=[]), 350, 150) == 0  # nothing measured


class DefaultSystemTokenizer(CharTokenizer):
    """A chat template that, like SmolLM2's, puts a default system message in when the conversation has none."""

    DEFAULT = "You are a helpful AI assistant named Tiny."

    def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=False, tools=None):
        if not msgs or msgs[0]["role"] != "system":
            msgs = [{"role": "system", "content": self.DEFAULT}] + list(msgs)
        return super().apply_chat_template(msgs, tokenize, add_generation_prompt, tools)


def test_the_session_log_shows_the_system_prompt_fed_not_the_question_template(monkeypatch):
    """`logs show` printed the summarize template with `{first_line} ... {digest} ... {note}` unfilled as the
    [system] entry, while its eviction line showed the prompt the chat template really fed."""
    from click.testing import CliRunner

    import sinkchat.apps.summarize.command as command
    from sinkchat.apps.logs import format_transcript
    from sinkchat.core.engine import Engine
    from sinkchat.store.transcript import export, latest_session

    from fakes import tiny_model

    def fake_open_engine(settings, system=None, progress=None):
        return Engine(tiny_model(max_pos=4096), DefaultSystemTokenizer(), settings.cache, settings.sampling,
                      system=system)

    monkeypatch.setattr("sinkchat.api.open_engine", fake_open_engine)
    res = CliRunner().invoke(command.summarize_command, ["--format", "jsonl", "--temperature", "0", "--max-tokens",
                                                         "4", "-q"], input="\n".join(DPKG) + "\n")
    assert res.exit_code == 0, res.output
    data = export(latest_session().id)
    assert data["session"]["system"] == DefaultSystemTokenizer.DEFAULT
    shown = format_transcript(data)
    assert f"[system] {DefaultSystemTokenizer.DEFAULT}" in shown and "{first_line}" not in shown
    assert "Kinds of lines in log lines 1 to 12" in shown  # the question as fed, filled


def test_the_bundled_template_s_default_system_prompt_is_found():
    from transformers import AutoTokenizer

    from sinkchat.apps.summarize.command import fed_system
    from sinkchat.core.turns import Conversation
    from sinkchat.model.loader import resolve_source

    tok = AutoTokenizer.from_pretrained(resolve_source(None, lambda m: None)[1])
    assert "SmolLM" in (fed_system(SimpleNamespace(conv=Conversation(tok, None))) or "")
    assert fed_system(SimpleNamespace(conv=Conversation(tok, "Be brief."))) == "Be brief."
    assert fed_system(SimpleNamespace(conv=Conversation(CharTokenizer(), None))) is None  # nothing fed


def test_the_final_status_line_is_printed_once():
    from sinkchat.apps.summarize.summarizer import Status

    err = io.StringIO()
    s, eng, out = _summarizer(["Nothing happened."] * 4, every=6)
    s.status = Status(err, quiet=False, line=s.status_text)
    q: queue.Queue = queue.Queue()
    for i, line in enumerate(DPKG, 1):
        q.put(Line(i, line))
    q.put(End(len(DPKG)))
    s.run(q)
    status = [ln for ln in err.getvalue().splitlines() if ln.startswith("lines ")]
    assert status and status[-1].startswith(f"lines {len(DPKG)}:")
    assert len(status) < 2 or status[-1] != status[-2], status[-2:]
    assert json.loads(out.getvalue().splitlines()[-1])["final"]
