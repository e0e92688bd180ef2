"""A code review of the incident sentences and the stop-time chunk sizing: a summary never contradicts itself
(an exception with no severity word beside "No line shows a severity word"); routine and negated lines are no
state change (systemd's "Started Session 42", "no exception occurred", "exit code 0", "Resume uploaded"), and a
journal full of them neither gets a sentence per window nor pushes the real incidents out of the run's notable
lines; an earlier citation is backed by one line (or two of one kind), not words pooled from unrelated ones; the
prefill chunk sized for a fast stop has a floor and does not feed on its own rate. Log shapes beyond the issue's
samples: Python and Java traces, systemd journal, Kubernetes, nginx, JSON lines."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sinkchat.apps.summarize.digest import Digest, changes
from sinkchat.apps.summarize.factcheck import Support
from sinkchat.apps.summarize.guard import Echo, digest_summary, earlier_lines, guard, problems, sentences

from test_summarize_trust import _run, _summarizer

NO_SEVERITY = "No line shows a severity word"


def _digest(lines: list[str], first: int = 1, d: Digest | None = None) -> tuple[dict, Digest]:
    d = d or Digest()
    for i, line in enumerate(lines, first):
        d.add(i, line)
    return d.take(), d


def _requests(n: int, minute: int = 0) -> list[str]:
    return [f"2025-06-24 10:{minute:02d}:{i % 60:02d} INFO api: handled request id={1000 + i} in {10 + i % 7} ms"
            for i in range(n)]


PY_TRACE = ["2025-06-24 10:00:21 app: Traceback (most recent call last):",
            '2025-06-24 10:00:21 app:   File "/srv/app/handlers.py", line 88, in parse',
            "2025-06-24 10:00:21 app:     return int(value)",
            "2025-06-24 10:00:21 app: KeyError: 'user_id'"]
JAVA_TRACE = ['Exception in thread "pool-2-thread-1" java.lang.NullPointerException',
              "\tat com.acme.billing.Invoice.total(Invoice.java:42)",
              "\tat com.acme.billing.Runner.run(Runner.java:17)"]


@pytest.mark.parametrize("trace", [PY_TRACE, JAVA_TRACE], ids=["python", "java"])
def test_an_exception_without_a_severity_word_is_never_called_no_error(trace):
    """The review: `2 lines show exception, first at line 21: "Traceback (most recent call last):".` and `No line
    shows a severity word (no errors or warnings).` in one summary."""
    lines = _requests(20) + trace + _requests(10, 1)
    rec, _ = _digest(lines)
    assert not rec["severity"] and "exception" in rec["changes"], rec["severity"]
    text = " ".join(digest_summary(rec))
    assert "exception" in text and NO_SEVERITY not in text, text
    support = Support(lines, rec)
    for sentence, _ in sentences(text):
        assert problems(sentence, support, Echo("")) == ([], None), sentence
    # nor may the model say it: "no errors" beside a traceback is dropped like beside an error line
    g = guard("The api handled requests. No errors were found.", False, support, rec)
    assert "No errors were found." in g.dropped and "no errors" in g.unsupported, g
    assert "exception" in g.text


@pytest.mark.parametrize("line,key", [
    ("Jun 24 10:00:00 host systemd[1]: Started Session 42 of User root.", "start"),  # still a start ...
    ("Resume uploaded: resume.pdf", "recovered"),
    ("2025-06-24 10:00:00 INFO worker: no exception occurred in batch 7", "exception"),
    ("2025-06-24 10:00:00 INFO job: finished, exit code 0", "exit"),
    ("Jun 24 10:00:00 host systemd[1]: app.service: Main process exited, code=exited, status=0/SUCCESS", "exit"),
    ('{"level":"info","msg":"node drained","pods evicted: 0"}', "evicted"),
    ("Jun 24 10:00:00 host kubelet[9]: 0 pods evicted from node-3", "evicted"),
    ("2025-06-24 10:00:00 INFO admin: promoted user bob to admin", "leader"),
    ("2025-06-24 10:00:00 INFO gateway: rate limit 100 req/s configured", "throttled"),
    ("2025-06-24 10:00:00 INFO debug: Traceback settings: depth=5", "exception"),
    ("*** System restart required ***", "restart"),
])
def test_routine_negated_and_zero_lines_are_no_such_change(line, key):
    found = changes(line)
    if key == "start":  # ... but a routine one: see the journal test below
        assert found == {"start": 1}, dict(found)
    else:
        assert key not in found, (line, dict(found))


@pytest.mark.parametrize("line,key", [
    ("Jun 24 10:00:00 host systemd[1]: app.service: Main process exited, code=exited, status=1/FAILURE", "exit"),
    ("2025-06-24 10:00:00 INFO job: worker exited with code 137", "exit"),
    ("Jun 24 10:00:00 host systemd[1]: app.service: Scheduled restart job, restart counter is at 5.", "restart"),
    ("Jun 24 10:00:00 host kubelet[9]: evicted 3 pods from node-3", "evicted"),
    ('{"level":"info","msg":"replica db-2 promoted to primary"}', "leader"),
    ("2025-06-24 10:00:00 INFO gateway: client 10.0.0.7 throttled: rate limit exceeded", "throttled"),
    ("2025-06-24 10:00:00 INFO queue: consumer resumed after pause", "recovered"),
    ("2025/06/24 10:00:00 [notice] 1#1: worker process 77 exited on signal 9", "exit"),
])
def test_real_state_changes_are_still_found(line, key):
    assert key in changes(line), (line, dict(changes(line)))


def _journal(n: int) -> list[str]:
    """A quiet journal: sessions opened and closed all day, nothing wrong."""
    out = []
    for i in range(n):
        t = f"Jun 24 10:{i // 60:02d}:{i % 60:02d} host"
        out.append([f"{t} systemd[1]: Started Session {40 + i} of User root.",
                    f"{t} systemd[1]: Stopping User Manager for UID {1000 + i}...",
                    f"{t} CRON[{900 + i}]: (root) CMD (run-parts /etc/cron.hourly)",
                    f"{t} systemd-logind[612]: New session {40 + i} of user root."][i % 4])
    return out


def test_a_quiet_journal_gets_no_start_or_stop_sentence_and_a_crash_gets_its_start():
    lines = _journal(40)
    rec, _ = _digest(lines)
    text = " ".join(digest_summary(rec))
    assert "show start" not in text and "show stop" not in text and NO_SEVERITY in text, text
    g = guard("New sessions of root were started.", False, Support(lines, rec), rec)
    assert g.prose == "model" and not g.added, g.added
    # a start beside an ended process is the interesting one: named
    crash = lines[:20] + ["Jun 24 10:00:20 host systemd[1]: app.service: Main process exited, code=exited, "
                          "status=1/FAILURE"] + lines[20:]
    rec, _ = _digest(crash)
    text = " ".join(digest_summary(rec))
    assert "show exit" in text or "shows exit" in text, text
    assert "start" in text.split("exit", 1)[1] or "show start" in text, text


def test_routine_lines_do_not_push_an_earlier_incident_out_of_the_notable_lines():
    """One deque of 64 for every notable line: 100 "Started Session" lines after an OutOfMemoryError left no line
    to back a model sentence about it."""
    d = Digest()
    d.add(1, "2025-06-24 10:00:00 ERROR worker: java.lang.OutOfMemoryError: Java heap space")
    d.add(2, "2025-06-24 10:00:01 INFO systemd: worker.service restarted")
    for i, line in enumerate(_journal(200), 3):
        d.add(i, line)
    kept = [no for no, _ in d.notable]
    assert 1 in kept and 2 in kept and len(kept) <= 64 + 32 + 8, kept[:5]


def test_an_earlier_claim_is_not_backed_by_words_pooled_from_unrelated_lines():
    """"database restarted" and "worker exited" together backed "The database exited (earlier, at lines ...)"."""
    earlier = [(10, "2025-06-24 10:00:10 INFO db: database restarted"),
               (20, "2025-06-24 10:00:20 INFO jobs: worker exited with code 3")]
    lines = _requests(20, 2)
    rec, _ = _digest(lines, 100)
    support = Support(lines, rec)
    assert earlier_lines("The database exited.", support, Echo(""), earlier) == []
    assert earlier_lines("The database restarted.", support, Echo(""), earlier) == [10]
    pair = [(10, "Jun 24 10:00:10 host systemd[1]: db.service restarted"),
            (20, "Jun 24 10:00:20 host systemd[1]: cache.service restarted")]
    assert earlier_lines("The db.service and cache.service restarted.", support, Echo(""), pair) == [10, 20]
    unrelated = [pair[0], (20, "Jun 24 10:00:20 host systemd[1]: cache.service exited with code 3")]
    assert earlier_lines("The db.service and cache.service exited.", support, Echo(""), unrelated) == []


def _timed_run(seconds_for) -> list[int]:
    """Run a log through the Summarizer with each prefill chunk's time given by `seconds_for(tokens)` (a box of
    that speed); the prefill chunk in effect at each feed."""
    from sinkchat.core.events import PrefillEvent

    s, eng, out = _summarizer(["The api handled requests."] * 50, capacity=8192, every=0)
    real, sizes = eng.add_message, []

    def timed(*a, **k):
        sizes.append(eng.prefill_chunk)
        for ev in real(*a, **k):
            yield replace(ev, seconds=seconds_for(ev.tokens)) if isinstance(ev, PrefillEvent) else ev

    eng.add_message = timed
    _run(s, [f"{line} path=/srv/app/{'x' * 40}" for line in _requests(80)])
    return sizes


def test_the_prefill_chunk_has_a_floor_on_a_slow_box():
    """0.1 s per call plus 400 tokens/s: the old sizing shrank each chunk by the rate of the last (~75 tokens)."""
    sizes = _timed_run(lambda n: 0.1 + n / 400)
    assert sizes[0] == 256 and min(sizes) >= 128, sizes


def test_the_prefill_chunk_does_not_feed_on_its_own_rate():
    """0.1 s per call plus 1000 tokens/s: 256 tokens take 0.356 s (719 tokens/s), so 215 tokens fit 0.3 s; fed at
    215 the rate reads lower, and the old sizing drifted on (204, 201, 200)."""
    sizes = _timed_run(lambda n: 0.1 + n / 1000)
    assert set(sizes[2:]) == {215}, sizes
