"""Summaries a user can rely on (issue: "Words a user can rely on"): each case a new user met with the bundled
model, replayed through the real Summarizer on a tiny random model whose replies are scripted with what the model
actually wrote. No sentence the lines do not support is shown, no incident the digest counted is left unnamed in
the record that covers its line (batch, live small batches, a stop while the question is asked), and binary input
is counted, never printed."""

from __future__ import annotations

import io
import json
import queue
import random
import threading
import time
from dataclasses import replace

from sinkchat.apps.summarize.batching import Batcher
from sinkchat.apps.summarize.digest import severities
from sinkchat.apps.summarize.guard import mentioned
from sinkchat.apps.summarize.reader import End, Line, clean_line

from fakes import CharTokenizer as CharTok, tiny_model

DPKG = [f"2025-06-24 14:36:{i // 3:02d} " + t for i, t in enumerate([
    "startup archives unpack", "install libexpat1:amd64 <none> 2.5.0-1", "status half-installed libexpat1:amd64 2.5.0-1",
    "status unpacked libexpat1:amd64 2.5.0-1", "configure libexpat1:amd64 2.5.0-1 <none>",
    "status installed libexpat1:amd64 2.5.0-1", "install gcc:amd64 <none> 4:12.2.0-3",
    "status half-installed gcc:amd64 4:12.2.0-3", "status unpacked gcc:amd64 4:12.2.0-3",
    "configure gcc:amd64 4:12.2.0-3 <none>", "status installed gcc:amd64 4:12.2.0-3", "trigproc libc-bin:amd64 2.36-9"])]


def _summarizer(replies: list[str], capacity: int = 2048, every: int = 0, prompt: str | None = None,
                on_generate=None):
    """A Summarizer on a tiny model whose generated text is replaced by `replies` in turn (the cache gets the real
    tokens); `on_generate(n)` runs before the n-th generation (0-based)."""
    from sinkchat.config import CacheConfig, SamplingConfig
    from sinkchat.core.engine import Engine
    from sinkchat.core.events import DoneEvent
    from sinkchat.apps.summarize.output import Output
    from sinkchat.apps.summarize.summarizer import Status, Summarizer
    import importlib.resources

    eng = Engine(tiny_model(max_pos=8192), CharTok(), CacheConfig(capacity=capacity, n_sink=4),
                 SamplingConfig(temperature=0, max_tokens=8))
    real, script, calls = eng.generate, list(replies), [0]

    def scripted(max_tokens=None, stop=(), sampling=None, logits_processors=()):
        if on_generate is not None:
            on_generate(calls[0])
        calls[0] += 1
        for ev in real(max_tokens, stop, sampling, logits_processors):
            yield replace(ev, text=script.pop(0) if script else "", reason="eos") if isinstance(ev, DoneEvent) else ev

    eng.generate = scripted
    out = io.StringIO()
    if prompt is None:
        prompt = importlib.resources.files("sinkchat.prompts").joinpath("summarize.txt").read_text()
    s = Summarizer(eng, Batcher(lambda t: len(eng.encode(t)), chunk_lines=4, chunk_tokens=10**6),
                   Output("jsonl", out), Status(io.StringIO(), quiet=True), prompt=prompt, every=every, interval=0,
                   max_tokens=8)
    return s, eng, out


def _run(s, lines: list[str]) -> None:
    q: queue.Queue = queue.Queue()
    for i, line in enumerate(lines, 1):
        q.put(Line(i, line))
    q.put(End(len(lines)))
    s.run(q)


def _blocks(out: io.StringIO) -> list[dict]:
    return [json.loads(l) for l in out.getvalue().splitlines()]


def _covering_names_every_severity(blocks: list[dict], lines: list[str]) -> None:
    """Every severity key the digest counts is stated in the summary of the record whose lines hold it."""
    for b in blocks:
        for key in (b.get("digest") or {}).get("severity") or {}:
            assert key in mentioned(b["summary"]), (key, b["summary"])
    for no, line in enumerate(lines, 1):
        for key in severities(line):
            (b,) = [b for b in blocks if b["first_line"] <= no <= b["last_line"] and b["lines"]]
            if b["skipped"] < b["lines"]:
                assert key in mentioned(b["summary"]), (no, key, b["summary"])


def test_fiction_on_a_clean_log_is_never_shown_and_the_digest_reads_as_sentences():
    """What the bundled model wrote over a clean dpkg.log (600 lines, no severity word): names and severity words
    were all the old check looked at, and "crashing", "sudo", "troubleshooting", "new machine" passed it."""
    fiction = ['The system was crashing with the exception of the command "sudo" being used to remove a file named '
               '"troubleshooting".',
               "The system has changed to a new machine that supports this package. Please check your current "
               "environment before making any changes.",
               "- 15 more lines."]
    s, eng, out = _summarizer(fiction * 4, every=6)
    _run(s, DPKG)
    blocks = [b for b in _blocks(out) if b["lines"]]
    assert len(blocks) == 2
    for b in blocks:
        assert b["prose"] == "digest" and b["dropped"], b
        for word in ("crash", "sudo", "troubleshooting", "machine", "environment", "more lines"):
            assert word not in b["summary"].lower()
        assert b["summary"].startswith("6 lines from 2025-06-24 14:36:"), b["summary"]
        assert "most frequent:" in b["summary"] and "No line shows a severity word (no errors or warnings)." in b["summary"]
    assert "gcc:amd64" in blocks[1]["summary"] and "libexpat1" in blocks[0]["summary"]


def test_a_sentence_repeated_over_new_lines_that_do_not_support_it_is_dropped():
    """The model copies its previous summary from the cache: true of the first lines, not of the next."""
    first = "The archives were unpacked and configured."
    s, eng, out = _summarizer([first] * 3, every=6)
    _run(s, DPKG)
    a, b = [b for b in _blocks(out) if b["lines"]]
    assert (a["summary"], a["prose"]) == (first, "model")
    assert b["prose"] == "digest" and b["dropped"] == [first] and b["unsupported"] == ["archives"]


def test_the_prompt_echoed_back_is_no_summary_and_does_not_name_the_incident():
    """Live (`tail -f`): the digest counted an sshd authentication failure, the reply was the prompt's own words,
    and the echoed "error" and "fail" counted as naming it. The incident must be stated by code."""
    lines = ["Mar  1 10:00:01 web-01 sshd[311]: Accepted publickey for deploy from 10.0.0.7 port 52311 ssh2",
             "Mar  1 10:00:02 web-01 sshd[312]: error: PAM: Authentication failure for admin from 203.0.113.9",
             "Mar  1 10:00:03 web-01 CRON[313]: (root) CMD (run-parts /etc/cron.hourly)"]
    echo = ("(+1 more kinds of lines). In two or three plain sentences, tell a system administrator what happened "
            "in these log lines. Mention an error, fail and succeed only if there is one.")
    s, eng, out = _summarizer([echo, echo])
    _run(s, lines)
    (b,) = [b for b in _blocks(out) if b["lines"]]
    assert "tell a system administrator" not in b["summary"] and "echoed the question" in b["why"]
    assert b["added"] and "line 2" in b["summary"]
    _covering_names_every_severity([b], lines)


def test_facts_stitched_from_lines_of_different_times_are_dropped():
    lines = DPKG + ["2025-06-24 14:42:11 status half-installed gcc:amd64 4:12.2.0-3",
                    "2025-06-24 14:42:12 status installed libexpat1:amd64 2.5.0-1"]
    good = "At 14:42:11 gcc:amd64 4:12.2.0-3 was half-installed."
    bad = "At 14:42:12 gcc:amd64 4:12.2.0-3 was half-installed."  # every piece is in the log, not on one line
    s, eng, out = _summarizer([f"{good} {bad}", f"{good} {bad}"])
    _run(s, lines)
    (b,) = [b for b in _blocks(out) if b["lines"]]
    assert b["summary"] == good and b["dropped"] == [bad]


def test_a_stop_while_the_question_is_asked_keeps_the_digest_of_the_lines_summarized():
    """SIGTERM arrived while the model answered: the final record said "summarized 25" while the model was given
    "0 lines; severity words: none", and the disk-full line was never named."""
    lines = DPKG[:5] + ["2025-06-24 14:36:30 web-01 kernel: ERROR disk /dev/sdb1 full: No space left on device"] \
        + DPKG[5:]
    holder: dict = {}

    def stop_in_first_answer(n: int) -> None:
        if n == 0:
            holder["s"].halt.set()

    s, eng, out = _summarizer(["Nothing.", "Nothing."] * 3, on_generate=stop_in_first_answer)
    holder["s"] = s
    q: queue.Queue = queue.Queue()
    for i, line in enumerate(lines, 1):
        q.put(Line(i, line))
    q.put(End(len(lines)))
    from sinkchat.apps.summarize.summarizer import Interrupted
    try:
        s.run(q)
    except Interrupted:
        s.finish_stopped(q, lines_read=len(lines))
    (b,) = [b for b in _blocks(out) if b["lines"]]
    assert b["final"] and b["summarized"] == len(lines) and b["skipped"] == 0
    assert b["digest"]["lines"] == b["summarized"] + b["deduped"]
    assert b["digest"]["severity"].keys() >= {"error", "disk full"}
    assert "line 6" in b["summary"] and "0 lines" not in b["summary"]
    _covering_names_every_severity([b], lines)


def test_lines_whose_feed_a_stop_took_back_are_not_in_the_digest():
    b = Batcher(lambda t: len(t), chunk_lines=100, chunk_tokens=10**6)
    for i, line in enumerate(DPKG[:3], 1):
        b.add(Line(i, line))
    n = b.chunk_summarized
    b.take_chunk()
    b.unfeed(n, 0)  # the engine took the message back
    b.commit_chunk()
    assert b.digest.record()["lines"] == 0 and b.period.skipped == 3
    for i, line in enumerate(DPKG[3:6], 4):
        b.add(Line(i, line))
    b.take_chunk()
    b.commit_chunk()
    assert b.digest.record()["lines"] == 3


def test_live_small_batches_name_every_incident_in_the_covering_record():
    """Lines arriving a few at a time (`tail -f`): partial chunks are fed on idle, summaries come on the line
    count; the model echoes the prompt with the digest's own severity words, and the code must state each
    incident anyway."""
    rnd = random.Random(5)
    lines = []
    for i in range(40):
        lines.append(f"Mar  1 10:{i // 60:02d}:{i % 60:02d} web-0{rnd.randrange(1, 3)} CRON[{900 + i}]: (root) CMD "
                     f"(run-parts /etc/cron.hourly)")
        if i % 10 == 4:
            lines.append(f"Mar  1 10:00:{i:02d} web-01 sshd[{77 + i}]: error: PAM: Authentication failure for admin "
                         "from 203.0.113.9")
    echo = ("In two or three plain sentences, tell a system administrator what happened in these log lines. "
            "Mention an error and fail only if there is one.")
    s, eng, out = _summarizer([echo] * 20, every=11)
    q: queue.Queue = queue.Queue()

    def feed() -> None:
        for i, line in enumerate(lines, 1):
            q.put(Line(i, line))
            if i % 3 == 0:
                time.sleep(0.6)  # longer than IDLE_FLUSH: a partial chunk is fed
        q.put(End(len(lines)))

    t = threading.Thread(target=feed)
    t.start()
    s.run(q)
    t.join()
    blocks = [b for b in _blocks(out) if b["lines"]]
    assert sum(b["lines"] for b in blocks) == len(lines) and len(blocks) == 4
    _covering_names_every_severity(blocks, lines)
    for b in blocks:
        assert b["why"] == ["echoed the question"] and b["prose"] == "digest", b
        assert "first at line" in b["summary"] and "tell a system administrator" not in b["summary"]


def test_random_bytes_are_skipped_counted_and_never_printed():
    """`head -c 200000 /dev/urandom | sinkchat summarize` printed 8 "summaries" with raw bytes."""
    data = random.Random(7).randbytes(200_000)
    b = Batcher(lambda t: len(t), chunk_lines=100, chunk_tokens=10**6)
    raw = data.split(b"\n")
    for i, chunk in enumerate(raw, 1):
        b.add(Line(i, clean_line(chunk, len(chunk), 500)[0]))
    p = b.period
    assert p.binary == p.skipped == len(raw) and p.summarized == 0 and not b.chunk
    s, eng, out = _summarizer(["\ufffd4j\ufffd"] * 4)
    text_lines = ["2025-06-24 14:36:00 status installed libexpat1:amd64 2.5.0-1"] * 2 + \
        [clean_line(c, len(c), 500)[0] for c in raw[:50]]
    _run(s, text_lines)
    printed = out.getvalue()
    assert "\ufffd" not in json.loads(printed.splitlines()[0])["summary"]
    assert json.loads(printed.splitlines()[0])["binary"] == 50


def test_more_incident_groups_than_sentences_are_all_named():
    """Past MAX_INCIDENT_SENTENCES the rest are named in one more sentence; an off-by-one there drops one unseen."""
    from sinkchat.apps.summarize.digest import Digest
    from sinkchat.apps.summarize.factcheck import Support
    from sinkchat.apps.summarize.guard import MAX_INCIDENT_SENTENCES, guard, incidents

    words = ["fatal", "panic", "error", "denied", "timeout", "segfault", "refused", "unreachable", "corrupt"]
    d = Digest()
    lines = [f"2025-06-24 14:36:{i:02d} unit{i} {w} in module{i}" for i, w in enumerate(words)]
    for i, line in enumerate(lines, 1):
        d.add(i, line)
    rec = d.take()
    assert len(incidents(rec)) == len(words) > MAX_INCIDENT_SENTENCES + 1
    g = guard("", False, Support(lines), rec)
    assert mentioned(g.text) == {"fatal", "panic", "error", "denied", "timeout", "segfault", "refused",
                                 "unreachable", "corrupt"}
    assert len(g.added) == MAX_INCIDENT_SENTENCES + 2  # the digest head, the six, then the rest in one


def test_an_incident_over_several_templates_quotes_its_first_line():
    from sinkchat.apps.summarize.digest import Digest
    from sinkchat.apps.summarize.guard import incident_sentence, incidents

    d = Digest()
    d.add(1, "2025-06-24 14:36:01 backup started for volume vol1 at node a1")
    d.add(2, "2025-06-24 14:36:02 disk write error on sdb sector 12")  # the first error line
    for i in range(3, 9):  # a more frequent error template, later
        d.add(i, f"2025-06-24 14:36:{i:02d} upstream error talking to api host h{i} code E{i} retry")
    (inc,) = incidents(d.take())
    assert (inc.keys, inc.lines, inc.first_line, inc.first_ts) == (["error"], 7, 2, "2025-06-24 14:36:02")
    assert incident_sentence(inc).startswith('7 lines show error, first at line 2 (2025-06-24 14:36:02): "disk '
                                             'write error on sdb sector 12".')


def test_numbers_are_matched_on_digit_boundaries():
    from sinkchat.apps.summarize.factcheck import Support, unsupported

    s = Support(["2025-06-24 14:36:01 request took 15 ms, 215 bytes, version 1.25"])
    assert unsupported("It took 5 ms.", s) == ["5"]
    assert unsupported("Version 1.2 sent 21 bytes.", s) == ["1.2", "21"]
    assert unsupported("It took 15 ms and sent 215 bytes.", s) == []


def test_the_closing_feeds_events_reach_the_summarizer_so_its_evictions_are_logged(monkeypatch):
    """The closing text of each turn ("<|im_end|>\\n" and the like) is fed too and can evict; its events were
    dropped, so the session log counted fewer evicted tokens than the cache evicted (24,106 of 24,233)."""
    from sinkchat.apps.summarize import answer, summarizer
    from sinkchat.core.events import EvictionEvent

    ev = EvictionEvent(count=3, first=10, last=13, preview="x", policy="sink", cache_len=297)

    class Conv:
        fed = ""

        def closing(self):
            return "</s>"

        def trim(self, keep):
            pass

    class Eng:
        conv = Conv()

        def feed(self, text):
            yield ev

    got = []
    answer.settle_conversation(Eng(), keep=1, sink=got.append)
    assert got == [ev]
    s, eng, out = _summarizer(["The cron job ran."] * 4, every=4)
    calls = []
    monkeypatch.setattr(summarizer, "settle_conversation", lambda e, keep, sink=None: calls.append(sink))
    evicted = []
    s.slog.eviction = evicted.append
    _run(s, DPKG[:4])
    assert calls and all(c is not None for c in calls)
    calls[0](ev)
    assert evicted == [ev]


def _closed_run_batcher(fed_first: bool):
    b = Batcher(lambda t: len(t), chunk_lines=100, chunk_tokens=10**6)
    b.add(Line(1, "A happened"))
    if fed_first:
        b.take_chunk()
        b.commit_chunk()
    for i in range(2, 6):
        b.add(Line(i, "A happened"))  # repeats: deduped
    b.add(Line(6, "B happened"))  # closes the run: its marker joins the pending chunk
    return b


def test_repeats_of_a_line_never_fed_are_skipped_and_the_digest_matches_the_counts():
    for fed_first in (True, False):
        b = _closed_run_batcher(fed_first)
        b.drop_chunk()  # a stop: the pending chunk never reaches the model
        p, rec = b.period, b.digest.record()
        assert rec["lines"] == p.summarized + p.deduped and p.consistent(), (fed_first, p, rec["lines"])
        assert (p.summarized, p.deduped, p.skipped) == ((1, 4, 1) if fed_first else (0, 0, 6))
        b = _closed_run_batcher(fed_first)
        n = b.chunk_summarized
        b.take_chunk()
        b.unfeed(n, 0)  # the engine took the feed back
        b.commit_chunk()
        p, rec = b.period, b.digest.record()
        assert rec["lines"] == p.summarized + p.deduped, (fed_first, p, rec["lines"])


def test_an_incident_is_named_by_what_it_is_about_not_only_its_severity_word():
    from sinkchat.apps.summarize.digest import Digest
    from sinkchat.apps.summarize.factcheck import Support
    from sinkchat.apps.summarize.guard import guard

    lines = ["2025-01-01 10:00:00 cron: backup job failed with exit 1",
             "2025-01-01 10:00:01 kernel: EXT4-fs error (device sda1): remounting filesystem read-only"]
    d = Digest()
    for i, line in enumerate(lines, 1):
        d.add(i, line)
    g = guard("The backup job failed with an error.", False, Support(lines), d.take())
    assert g.text.startswith("The backup job failed with an error. ") and "remounting filesystem" in g.text


def test_true_sentences_about_severities_and_quotes_of_a_line_are_kept():
    from sinkchat.apps.summarize.factcheck import Support
    from sinkchat.apps.summarize.guard import Echo, problems

    lines = ["2025/03/01 11:00:00 [error] 31#31: *5 connect() failed (111: Connection refused) while connecting to "
             "upstream", "2025/03/01 11:00:02 upstream timeout while reading", "[ 12.5] worker[1]: segfault at 0",
             "2025/03/01 11:00:03 nginx: could not start the worker: permission denied"]
    question = ('Kinds of lines: - 1 lines "[error] 31#31: *5 connect() failed (111: Connection refused) while '
                'connecting to upstream". In two or three plain sentences, tell a system administrator what '
                "happened in these log lines.")
    support = Support(lines)
    echo = Echo(question, support.lines)
    for ok in ("The upstream timed out.", "Nginx could not start the worker: permission denied.",
               "A connect() failed (111: Connection refused) while connecting to upstream."):
        assert problems(ok, support, echo) == ([], None), ok
    clean = Support(["2025-01-01 10:00:00 cron: backup ok"])
    assert problems("No errors were found.", clean, echo) == ([], None)
    assert problems("In two or three plain sentences, tell a system administrator what happened.", support,
                    echo) == ([], "echoed the question")
    # the digest's templates as the question shows them, copied back with the slots' stars
    assert problems('2025/03/01 11:00:02 [9] "upstream * while reading" (...)', support, echo)[1] == \
        "echoed the question"


def test_text_in_any_script_after_a_binary_line_is_still_text():
    from sinkchat.apps.summarize.batching import is_binary

    assert is_binary("\ufffd4j\ufffd")
    for text in ("Ошибка: диск заполнен", "磁盘已满，写入失败", "ディスクがいっぱいです"):
        assert not is_binary(text, after_binary=True), text
    assert is_binary("4j", after_binary=True)


def test_what_the_code_writes_passes_the_rule_it_holds_the_model_to():
    """The digest's own summary and the incident sentences are held to the sentence rule too: every word, name,
    number and time in them stands in the lines they cover (written "a/b", two values read back as one name no
    line holds; "of 7 kinds" and "2 lines show error" were counts no support had)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import eval_runs
    import summarize_eval as ev
    from sinkchat.apps.summarize.digest import Digest
    from sinkchat.apps.summarize.factcheck import Support
    from sinkchat.apps.summarize.guard import Echo, digest_summary, problems, sentences

    logs = [ev.inject(ev.syslog_lines(100), 30)[0], ev.inject(ev.access_lines(100), 30)[0],
            ev.inject(eval_runs.journal_lines(100), 30, eval_runs.MIX_INCIDENTS)[0], DPKG * 3]
    checked = 0
    for lines in logs:
        for start in range(0, len(lines), 25):
            part, d = lines[start: start + 25], Digest()
            for i, line in enumerate(part, start + 1):
                d.add(i, line)
            rec = d.take()
            support = Support(part, rec)
            for sentence, _ in sentences(" ".join(digest_summary(rec))):
                assert problems(sentence, support, Echo("")) == ([], None), sentence
                checked += 1
    assert checked >= 30


def test_a_sentence_cut_by_the_token_limit_is_said_to_be_unfinished_in_the_record():
    from sinkchat.apps.summarize.factcheck import Support
    from sinkchat.apps.summarize.guard import guard

    g = guard("libexpat1:amd64 was unpacked. Then gcc:amd64 was", True, Support(DPKG), None)
    assert g.text == "libexpat1:amd64 was unpacked." and g.why == ["unfinished"]

