"""The exact digest, binary detection, the invented-fact check, the sentence trim, window fitting and the eval's
scoring: code-only logic, no real model (a tiny random model where an engine is needed)."""

from __future__ import annotations

import io
import json
import queue
import random
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from sinkchat.apps.summarize.batching import Batcher, is_binary
from sinkchat.apps.summarize.digest import Digest, render, severities, split_timestamp
from sinkchat.apps.summarize.factcheck import Support, ban_processor, claims, trim_sentence, unsupported
from sinkchat.apps.summarize.reader import End, Line, clean_line

from fakes import CharTokenizer as CharTok, tiny_model


def claims_of(text: str, kind: str) -> list[str]:
    return [c for k, c in claims(text) if k == kind]

DPKG = [
    "2025-06-24 14:36:25 startup archives unpack",
    "2025-06-24 14:36:25 install libglvnd-core-dev:amd64 <none> 1.6.0-1",
    "2025-06-24 14:36:26 status half-installed libglvnd-core-dev:amd64 1.6.0-1",
    "2025-06-24 14:36:26 status unpacked libglvnd-core-dev:amd64 1.6.0-1",
    "2025-06-24 14:36:27 install libgpg-error-dev:amd64 <none> 1.46-1",
    "2025-06-24 14:36:27 status half-installed libgpg-error-dev:amd64 1.46-1",
    "2025-06-24 14:36:28 status unpacked libgpg-error-dev:amd64 1.46-1",
    "2025-06-24 14:36:29 status installed libglvnd-core-dev:amd64 1.6.0-1",
]


def test_digest_templates_counts_timestamps_and_values_are_exact():
    d = Digest()
    for i, line in enumerate(DPKG, 1):
        d.add(i, line)
    d.add(12, DPKG[-1], count=3)  # a closed run of repeats, lines 10-12
    rec = d.take()
    assert rec["lines"] == 11 and sum(t["count"] for t in rec["templates"]) == 11
    assert (rec["first_ts"], rec["last_ts"]) == ("2025-06-24 14:36:25", "2025-06-24 14:36:29")
    assert rec["severity"] == {}  # "libgpg-error-dev" is a package name, not an error
    status = [t for t in rec["templates"] if t["template"].startswith("status")]
    assert sum(t["count"] for t in status) == 8
    values = {v for t in status for p in t.get("params", []) for v in p["values"]}
    assert {"half-installed", "unpacked", "installed"} <= values
    json.dumps(rec)  # plain JSON data for the record
    assert d.take()["lines"] == 0  # the next period starts empty; the miner keeps its templates
    text = render(rec, len, 10_000)
    assert text.startswith("11 lines, 2025-06-24 14:36:25 to 2025-06-24 14:36:29; severity words: none.")
    assert "more kinds of lines" in render(rec, len, 120)


def test_timestamps_and_severity_words():
    assert split_timestamp("Mar  1 10:00:01 web-01 sshd[1]: x")[0] == "Mar  1 10:00:01"
    ts, rest = split_timestamp('1.2.3.4 - - [01/Mar/2025:10:00:00 +0000] "GET / HTTP/1.1" 503 12')
    assert ts == "01/Mar/2025:10:00:00 +0000" and "503" in rest
    assert set(severities("kernel: Out of memory: Killed process 42; write error: No space left on device")) == {
        "oom", "killed", "error", "disk full"}
    assert severities('1.2.3.4 - - [x] "GET / HTTP/1.1" 503 12') == {"error": 1}
    assert not severities("install libgpg-error-dev:amd64 stderr failover.conf")


def test_binary_lines_are_detected_and_skipped_not_summarized():
    rnd = random.Random(0)
    garbage = [clean_line(b, len(b), 500)[0] for b in rnd.randbytes(20000).split(b"\n") if len(b) > 8]
    assert all(is_binary(t) for t in garbage)
    assert not is_binary(clean_line(b"bad utf8 \xff\xfe\xc3\x28 end", 17, 500)[0])
    assert not is_binary("caf\u00e9 ok") and not is_binary("")
    b = Batcher(lambda s: len(s), chunk_lines=100, chunk_tokens=10**6)
    for i, t in enumerate(["text one"] + garbage[:38] + ["text two"], 1):
        b.add(Line(i, t))
    p = b.period
    assert (p.summarized, p.skipped, p.binary, p.lines) == (2, 38, 38, 40) and p.consistent()
    assert b.chunk == ["text one", "text two"] and b.digest.take()["binary"] == 38


def test_fact_check_flags_invented_failures_but_not_true_or_negated_ones():
    support = Support(DPKG)
    bad = "The installation of libglvnd-core-dev failed with error 42 at 14:36:25. nginx.service timed out."
    assert unsupported(bad, support) == ["failed", "error", "timed out", "nginx.service", "42"]
    ok = ("No errors or failures: libglvnd-core-dev 1.6.0-1 and libgpg-error-dev were installed between "
          "14:36:25 and 14:36:29.")
    assert unsupported(ok, support) == []
    real = Support(["2025-06-24 10:00:00 dpkg: error processing package nginx-core (--configure):"])
    assert unsupported("Configuring nginx-core failed with an error.", real) == ["failed"]  # error yes, fail no
    digest = {"lines": 38, "templates": [], "severity": {"fail": 2}}
    assert unsupported("38 lines; 2 installs failed.", Support([], digest)) == []  # counts come from the digest
    assert ("name", "/var/log/x.log") in claims("see /var/log/x.log now")


def test_ban_processor_masks_the_banned_words_first_tokens():
    import torch

    vocab = {"failed": 5, " failed": 6, "Failed": 7, " Failed": 8}
    enc = lambda t: [vocab[t]] if t in vocab else [100 + ord(c) % 20 for c in t]  # noqa: E731
    proc = ban_processor(["failed", "ok"], enc)  # one-token forms are banned; a short multi-token word is not
    assert proc.banned == [5, 6, 7, 8]
    logits = proc([], torch.zeros(128))
    assert all(logits[i] == float("-inf") for i in (5, 6, 7, 8)) and logits[100:].eq(0).all()


def test_trim_sentence_never_leaves_a_cut_sentence():
    assert trim_sentence("Two packages were installed. Then libfoo was") == ("Two packages were installed.", True)
    assert trim_sentence("Version 1.2.3 was installed.") == ("Version 1.2.3 was installed.", False)
    assert trim_sentence("all fine") == ("all fine …", True)
    assert trim_sentence("") == ("", False)


def _fit_summarizer(replies: list[str], capacity: int = 2048, every: int = 0):
    """A Summarizer on a tiny random model whose generated text is replaced by scripted replies (the cache still
    gets the real tokens, so rollback and eviction are real); records the logits processors passed."""
    from sinkchat.config import CacheConfig, SamplingConfig
    from sinkchat.core.engine import Engine
    from sinkchat.core.events import DoneEvent
    from sinkchat.apps.summarize.summarizer import Output, Status, Summarizer

    eng = Engine(tiny_model(max_pos=8192), CharTok(), CacheConfig(capacity=capacity, n_sink=4),
                 SamplingConfig(temperature=0, max_tokens=8))
    real, script, seen = eng.generate, list(replies), []

    def scripted(max_tokens=None, stop=(), sampling=None, logits_processors=()):
        seen.append(list(logits_processors))
        for ev in real(max_tokens, stop, sampling, logits_processors):
            yield replace(ev, text=script.pop(0), reason="eos") if isinstance(ev, DoneEvent) else ev

    eng.generate = scripted
    out = io.StringIO()
    prompt = "Digest:\n{digest}\nSummarize lines {first_line} to {last_line}.{note}"
    s = Summarizer(eng, Batcher(lambda t: len(eng.encode(t)), chunk_lines=4, chunk_tokens=10**6),
                   Output("jsonl", out), Status(io.StringIO(), quiet=True), prompt=prompt, every=every, interval=0,
                   max_tokens=8)
    return s, eng, out, seen


def test_chunks_are_sized_to_the_window_and_every_line_is_read_in_full():
    """--every 0 and no interval: the window alone decides; each question comes before its first line is evicted,
    and the record says the model read every line in full."""
    s, eng, out, _ = _fit_summarizer(["Packages were installed."] * 50, capacity=1024)
    assert s.budget.fits and s.budget.raw < 1024
    q: queue.Queue = queue.Queue()
    n = 200
    for i in range(1, n + 1):
        q.put(Line(i, DPKG[i % len(DPKG)].replace("1.6.0-1", f"1.6.{i}-1")))
    q.put(End(n))
    s.run(q)
    blocks = [json.loads(l) for l in out.getvalue().splitlines()]
    assert len(blocks) >= 4 and blocks[-1]["final"] and sum(b["lines"] for b in blocks) == n
    for b in blocks:
        assert b["lines_in_full"] == b["summarized"] and b["lines_digest_only"] == 0, b
        assert b["tokens_fed"] <= 1024 and b["digest"]["lines"] == b["summarized"] + b["deduped"]


def test_unsupported_claim_is_regenerated_with_its_words_banned_then_flagged():
    s, eng, out, seen = _fit_summarizer(["The install of libfoo failed.", "It failed again.", "Fine."])
    q: queue.Queue = queue.Queue()
    for i, line in enumerate(DPKG, 1):
        q.put(Line(i, line))
    q.put(End(len(DPKG)))
    s.run(q)
    (b,) = [json.loads(l) for l in out.getvalue().splitlines()]
    assert b["regenerated"] and b["unsupported"] == ["failed"] and b["dropped"] == ["It failed again."]
    assert seen[0] == [] and len(seen[1]) == 1  # the retry ran with the ban processor
    assert b["lines_in_full"] == len(DPKG) and b["digest"]["lines"] == len(DPKG)
    # nothing of the model's is left: the summary is written by code from the digest, and says so
    assert b["prose"] == "digest" and "failed" not in b["summary"] and b["summary"].endswith(".")
    assert b["summary"].startswith("8 lines from 2025-06-24 14:36:25 to 2025-06-24 14:36:29, of 4 kinds; most "
                                   'frequent: 3 x "status {half-installed, unpacked, … 3 in all} libglvnd-core-dev:amd64 '
                                   '1.6.0-1"; ')
    assert "No line shows a severity word (no errors or warnings)." in b["summary"] and not claims_of(b["summary"], "severity")
    from sinkchat.apps.summarize.output import render_block
    text = render_block(b, "text")
    assert "[dropped 1 sentence of the model's summary: unsupported by the log: failed; summary written from the " \
           "digest]" in text


def test_jsonl_ends_with_a_final_record_even_when_the_last_summary_was_on_a_boundary():
    s, eng, out, _ = _fit_summarizer(["Done."] * 5, every=4)
    q: queue.Queue = queue.Queue()
    for i, line in enumerate(DPKG, 1):
        q.put(Line(i, line))
    s.run_started = True
    t = __import__("threading").Timer(1.0, lambda: q.put(End(len(DPKG))))  # End arrives after the boundary
    t.start()
    s.run(q)
    blocks = [json.loads(l) for l in out.getvalue().splitlines()]
    assert [(b["first_line"], b["last_line"], b["final"]) for b in blocks] == [(1, 4, False), (5, 8, False),
                                                                               (9, 8, True)]
    assert blocks[-1]["lines"] == 0


def test_eval_scoring_on_a_small_slice():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import summarize_eval as ev

    lines, labels = ev.inject(ev.syslog_lines(40), every=20)
    assert [k for _, k in labels] == ["failed install", "oom kill"]
    assert all(lines[no - 1] for no, _ in labels) and "error" in lines[labels[0][0]]
    clean = {"clean": True, "lines": 100, "labels": [], "blocks": [
        {"lines": 50, "first_line": 1, "last_line": 50, "summary": "Cron ran. No errors.", "unsupported": []},
        {"lines": 50, "first_line": 51, "last_line": 100, "summary": "A disk failed and", "unsupported": ["failed"]}]}
    inj = {"clean": False, "lines": 10, "labels": [(3, "oom kill")], "blocks": [
        {"lines": 10, "first_line": 1, "last_line": 10, "summary": "A process was killed (out of memory).",
         "digest": {"severity": {"oom": 1}}}]}
    f = ev.score([clean, inj])
    assert f["invented_per_10k"] == 100.0 and f["recall_prose"] == 1.0 and f["recall_digest"] == 1.0
    assert f["cut_share"] == round(1 / 3, 3) and f["flagged_share"] == round(1 / 3, 3)
    assert ev.digest_rate(ev.access_lines(200)) > 100


def test_the_question_never_backs_a_severity_claim():
    support = Support(DPKG, None, numbers="lines 1 to 8, 1-8: 8 lines")
    assert unsupported("An error occurred in lines 1-8 and the server crashed.", support) == ["error", "crashed"]


def _run(s, lines):
    q: queue.Queue = queue.Queue()
    for i, line in enumerate(lines, 1):
        q.put(Line(i, line))
    q.put(End(len(lines)))
    s.run(q)


def test_sentences_still_unsupported_after_the_retry_are_dropped_and_counted():
    s, eng, out, seen = _fit_summarizer(["libglvnd-core-dev was unpacked. The install of libfoo failed.",
                                         "libglvnd-core-dev was unpacked. nginx.service timed out at 14:36:25."])
    status = io.StringIO()
    s.status.stream, s.status.quiet = status, False
    _run(s, DPKG)
    (b,) = [json.loads(l) for l in out.getvalue().splitlines()]
    assert b["regenerated"] and b["prose"] == "model"
    assert b["summary"] == "libglvnd-core-dev was unpacked."  # the invented incident is never shown as fact
    assert b["dropped"] == ["nginx.service timed out at 14:36:25."]
    assert b["unsupported"] == ["timed out", "nginx.service"]
    assert "dropped 1 sentence(s) of the summary (unsupported: timed out, nginx.service)" in status.getvalue()
    from sinkchat.apps.summarize.output import render_block
    assert "[dropped 1 sentence of the model's summary: unsupported by the log: timed out, nginx.service]" in \
        render_block(b, "text")


def test_an_incident_the_digest_shows_but_the_prose_leaves_out_is_appended_by_code():
    lines = DPKG[:4] + ["2025-06-24 14:36:30 dpkg: error processing package nginx-core (--configure):",
                        "2025-06-24 14:36:31 kernel: Out of memory: Killed process 4242 (postgres)"] + DPKG[4:]
    # the model says nothing of either incident, and "no errors" where there is one is a false sentence too
    s, eng, out, _ = _fit_summarizer(["libglvnd-core-dev was unpacked and installed. There were no errors."])
    _run(s, lines)
    (b,) = [json.loads(l) for l in out.getvalue().splitlines()]
    assert b["prose"] == "model+digest" and b["dropped"] == ["There were no errors."] and b["unsupported"] == [
        "no errors"]
    assert b["summary"].startswith("libglvnd-core-dev was unpacked and installed. ")
    assert b["added"] == [
        '1 line shows error, first at line 5 (2025-06-24 14:36:30): "dpkg: error processing package nginx-core '
        '(--configure):".',
        '1 line shows oom and killed, first at line 6 (2025-06-24 14:36:31): "kernel: Out of memory: Killed process '
        '4242 (postgres)".']
    assert b["summary"].endswith(b["added"][-1])
    assert {"error", "oom", "killed"} <= {c.split(":")[0] for c in claims_of(b["summary"], "severity")}


def test_an_incident_the_prose_names_is_not_repeated_and_the_last_sentence_is_closed():
    lines = DPKG[:2] + ["2025-06-24 14:36:30 dpkg: error processing package nginx-core (--configure):"]
    s, eng, out, _ = _fit_summarizer(["Configuring nginx-core ended with an error"])  # EOS without a full stop
    _run(s, lines)
    (b,) = [json.loads(l) for l in out.getvalue().splitlines()]
    assert (b["summary"], b["prose"], b["added"], b["dropped"]) == (
        "Configuring nginx-core ended with an error.", "model", [], [])


def test_guard_pieces():
    from sinkchat.apps.summarize.digest import _SEVERITY_WORDS
    from sinkchat.apps.summarize.guard import digest_summary, guard, incidents, sentences

    for key in _SEVERITY_WORDS:  # a code sentence names a severity by its key, which the check reads back as it
        assert set(severities(f"1 line shows {key}, first at line 3.")) == {key}, key
    assert sentences("1. Cron ran. 2. It stopped. And then") == [("1. Cron ran.", True), ("2. It stopped.", True),
                                                                 ("And then", False)]
    g = guard("Lines:\n1. Cron ran\n2. DHCPACK of 10.0.0.1 from 10.0.0.1\n3.", False, Support(["cron ran", "DHCPACK of "
                                                                                             "10.0.0.1 from 10.0.0.1"]), None)
    assert (g.text, g.dropped) == ("Cron ran. DHCPACK of 10.0.0.1 from 10.0.0.1.", ["Lines:", "3."])
    support = Support(DPKG)
    g = guard("libgpg-error-dev was installed. Then libfoo", True, support, None)  # cut by the token limit
    assert (g.text, g.dropped) == ("libgpg-error-dev was installed.", ["Then libfoo"])
    d = Digest()
    for i, line in enumerate(DPKG, 1):
        d.add(i, line)
    d.add(9, '10.1.2.3 - - [01/Mar/2025:10:00:00 +0000] "POST /api/orders HTTP/1.1" 503 162 "-" "curl/8.0"', count=5)
    rec = d.take()
    (inc,) = incidents(rec)  # an HTTP 5xx counts as an error, with its count and first line
    assert (inc.keys, inc.lines, inc.first_line, inc.first_ts) == (["error"], 5, 5, "01/Mar/2025:10:00:00 +0000")
    text = " ".join(digest_summary(rec))
    assert text.startswith("13 lines from 2025-06-24 14:36:25 to 01/Mar/2025:10:00:00 +0000, of 5 kinds; most "
                           'frequent: 5 x "10.1.2.3 - - \'POST /api/orders HTTP/1.1\' 503 162 \'-\' \'curl/8.0\'"')
    assert "5 lines show error, first at line 5 (01/Mar/2025:10:00:00 +0000)" in text and text.endswith('".')


def test_the_question_turn_is_logged_with_its_tokens_and_feed_time():
    s, eng, out, _ = _fit_summarizer(["libglvnd-core-dev was unpacked."])
    turns = []

    class Log:
        def __getattr__(self, name):
            return lambda *a, **k: turns.append((a, k)) if name == "turn" else None

    s.slog = Log()
    _run(s, DPKG)
    (q, _), (a, _) = turns
    assert q[0] == "user" and q[2] > 0 and q[3] > 0.0  # tokens fed for the question, seconds spent feeding them
    assert a[0] == "assistant" and a[1] == "libglvnd-core-dev was unpacked."


def test_the_labelled_slice_through_the_summarizer_with_a_model_that_invents_and_omits():
    """The eval's labelled set, a small slice, through the real Summarizer on a tiny model whose every reply invents
    a failure and names no real incident (the worst a small model does): nothing invented may reach a clean log's
    summaries, and every injected incident must be named."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import summarize_eval as ev

    lie = "The backup job failed with a fatal error on host db-9."
    runs = []
    for name, lines in (("syslog", ev.syslog_lines(60)), ("access", ev.access_lines(60))):
        for clean in (True, False):
            log, labels = (lines, []) if clean else ev.inject(lines, every=20)
            s, eng, out, _ = _fit_summarizer([lie] * 400, capacity=1024)
            _run(s, log)
            blocks = [json.loads(l) for l in out.getvalue().splitlines()]
            runs.append({"clean": clean, "lines": len(log), "labels": labels, "blocks": blocks})
    f = ev.score(runs)
    assert f["incidents"] >= 4 and f["clean_lines"] == 120
    assert f["invented_per_10k"] == 0.0 and f["recall_prose"] == 1.0 and f["cut_share"] == 0.0, f


def test_a_summary_that_only_copies_a_log_line_gets_the_digests_sentences():
    """A whole summary was `WARN disk: /var usage at 91%".`: a piece of one line, kept (every word is backed), with
    no count and no time, so nothing else was written. The digest's own summary of the period says it instead; a
    sentence in words of its own is left alone."""
    from sinkchat.apps.summarize.digest import Digest
    from sinkchat.apps.summarize.guard import guard

    lines = [f"2026-12-01 10:00:{i:02d} INFO api: GET /health 200" for i in range(8)]
    lines.insert(4, "2026-12-01 10:00:04 WARN disk: /var usage at 91%")
    d = Digest()
    for i, line in enumerate(lines, 1):
        d.add(i, line)
    rec = d.take()
    g = guard('WARN disk: /var usage at 91%".', False, Support(lines, rec), rec)
    assert g.prose == "digest" and g.text.startswith("9 lines from 2026-12-01 10:00:00"), g.text
    assert "1 line shows warning, first at line 5 (2026-12-01 10:00:04)" in g.text, g.text
    assert g.dropped == ['WARN disk: /var usage at 91%".'] and "copied a log line" in g.why
    g = guard("One warning: disk usage on /var at 91%.", False, Support(lines, rec), rec)
    assert g.prose == "model" and g.text == "One warning: disk usage on /var at 91%.", g.text
