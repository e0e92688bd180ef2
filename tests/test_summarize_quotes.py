"""What a summary quotes and counts is what the log says (a new user's audit of `summarize` on the bundled model):
an incident's count and quoted line are those of the lines holding it, not of their whole kind; a model sentence
is dropped when its quote is not a line's text as written, its count in front of a quote is wrong, or it says the
quoted line came from somewhere else; incidents stay named beside a kept sentence that shares only the host name
with them; an earlier line backs a sentence once, not in every later summary."""

from __future__ import annotations

from sinkchat.apps.summarize.digest import Digest
from sinkchat.apps.summarize.factcheck import Support
from sinkchat.apps.summarize.guard import Echo, digest_summary, guard, problems

from test_summarize_incidents import _restart_log
from test_summarize_trust import _blocks, _run, _summarizer

NGINX = ("web01 nginx[811]: upstream connect error: connect() failed (111: Connection refused) while connecting to "
         "upstream 127.0.0.1:8080")


def _digest(lines: list[str]) -> tuple[dict, Support]:
    d = Digest()
    for no, line in enumerate(lines, 1):
        d.add(no, line)
    rec = d.record()
    return rec, Support(lines, rec)


def _oom_log() -> list[str]:
    """A syslog with one host: requests, the kernel's OOM kill, systemd's 'oom-kill' result, 7 nginx errors, a
    restart."""
    out = [f"Mar 14 09:03:{10 + i:02d} web01 orders-api[4242]: INFO handled GET /orders/{5000 + i} in {8 + i}ms"
           for i in range(9)]
    out += ["Mar 14 09:03:35 web01 kernel: [123456.789] Out of memory: Killed process 4242 (java) total-vm:81234kB",
            "Mar 14 09:03:38 web01 systemd[1]: orders-api.service: Main process exited, code=killed, status=9/KILL",
            "Mar 14 09:03:39 web01 systemd[1]: orders-api.service: Failed with result 'oom-kill'."]
    out += [f"Mar 14 09:03:{43 + i:02d} {NGINX}" for i in range(7)]
    out += ["Mar 14 09:03:54 web01 systemd[1]: orders-api.service: Scheduled restart job, restart counter is at 1.",
            "Mar 14 09:03:58 web01 systemd[1]: Started Orders API."]
    return out + [f"Mar 14 09:04:{i:02d} web01 orders-api[5001]: INFO handled GET /orders/{7000 + i} in {9 + i}ms"
                  for i in range(3)]


def test_an_incident_counts_and_quotes_the_lines_that_hold_it_not_their_whole_kind():
    """Drain put 200 and 502 lines in one kind; the summary said "15 lines show error" quoting a 200 line."""
    lines = [f'10.0.0.{i % 9} - - [14/Mar/2025:11:01:{i:02d} +0000] "GET /api/v1/items/{i} HTTP/1.1" '
             f'{502 if i % 3 == 2 else 200} {900 + i} "-" "curl/8.5.0"' for i in range(15)]
    rec, support = _digest(lines)
    assert len(rec["templates"]) == 1  # the premise: one kind for both statuses
    text = " ".join(digest_summary(rec))
    assert "5 lines show error, first at line 3 " in text, text
    quoted = text.split("5 lines show error")[1]
    assert " 502 902 " in quoted and " 200 " not in quoted, text
    for sentence in text.split(". 5 lines"):
        assert problems(sentence, support, Echo(""))[0] == [], sentence


def test_a_count_in_front_of_a_quoted_line_must_be_the_lines_holding_it():
    """`24 lines "web01 nginx[811]: ..."` for 7 such lines (24 was the period's line count) was kept."""
    lines = _oom_log()
    rec, support = _digest(lines)
    assert problems(f'7 lines "{NGINX}".', support, Echo(""))[0] == []
    bad, _ = problems(f'{len(lines)} lines "{NGINX}".', support, Echo(""))
    assert bad and "the log has 7" in bad[0], bad
    assert problems(f'7 x "{NGINX}".', support, Echo(""))[0] == []
    assert problems(f'9 x "{NGINX}".', support, Echo(""))[0]
    assert problems(f'Of {len(lines)} lines, 7 lines "{NGINX}".', support, Echo(""))[0] == []  # the count before it
    reqs = [f"INFO app: request ok id={i}" for i in range(5)]
    _, support = _digest(reqs)  # one kind with a variable part: its first line is not in all five
    assert problems('5 x "INFO app: request ok id=0".', support, Echo(""))[0]
    assert problems('1 x "INFO app: request ok id=0".', support, Echo(""))[0] == []


def test_a_quote_must_be_a_line_as_written():
    """`Error Message: "c.e.OrderController - request failed"` for a line that says `Request failed`."""
    lines = [f"2025-03-14 12:02:{i:02d},000 INFO [exec-{i}] c.e.OrderController - created order {1040 + i}"
             for i in range(10)] + ["2025-03-14 12:02:30,000 ERROR [exec-3] c.e.OrderController - Request failed"]
    _, support = _digest(lines)
    assert problems('Error message: "c.e.OrderController - Request failed".', support, Echo(""))[0] == []
    for q in ('"c.e.OrderController - request failed"', "‘c.e.OrderController - request failed’"):
        bad, _ = problems(f"Error message: {q}.", support, Echo(""))
        assert bad and bad[0].startswith("quote not in the log as written"), bad


def test_a_quoted_line_is_not_said_to_come_from_another_source():
    """`an error message from the kernel: 'app: ERROR disk full'`: the kernel's lines said `eth0 link up`."""
    lines = ["kernel: eth0 link up"] * 3 + ["app: ERROR disk full writing /data/x.db"] * 20
    _, support = _digest(lines)
    for q in ("'app: ERROR disk full'", '"app: ERROR disk full"'):
        bad, _ = problems(f"The log shows an error message from the kernel: {q}.", support, Echo(""))
        assert bad == ["kernel"], bad
        assert problems(f"The app could not write /data/x.db: {q}.", support, Echo(""))[0] == []
    bad, _ = problems('Error: "kernel: eth0 link up".', support, Echo(""))  # a severity its line does not hold
    assert bad == ["error"], bad
    lines = ["web01 systemd[1]: db.service: Scheduled restart job", "db01 postgres[9]: connection refused to db01:5432",
             "db01 postgres[9]: connection refused to db01:5432", "web01 app[3]: falling back to the cache"]
    _, support = _digest(lines)  # words that are no program's: left to the word checks, which they pass
    said = '"connection refused to db01:5432" appears 2 times, then falling back to the cache.'
    assert problems(said, support, Echo(""))[0] == []
    assert problems(said.replace("then", "then the app is"), support, Echo(""))[0] == ["app"]  # a program, not its


def test_incidents_stay_named_beside_a_kept_sentence_that_shares_only_the_host_name():
    """The model's sentence quoted nginx's lines; every line says "web01", so each incident counted as named, and
    the oom-kill line was in no sentence."""
    rec, support = _digest(_oom_log())
    g = guard(f'7 lines "{NGINX}".', False, support, rec, "")
    assert g.prose == "model+digest" and g.text.startswith("7 lines"), g.text
    assert "Failed with result 'oom-kill'" in g.text and "Out of memory" in g.text, g.text
    assert "restart counter" in g.text, g.text
    lines = [f"web01 app[7]: request ok id={i}" for i in range(10)]
    rec, support = _digest(lines + ["web01 app[7]: request failed", "web01 app[7]: upload to s3 bucket failed"])
    g = guard("One upload failed.", False, support, rec, "")  # every word of "request failed" is in most kinds
    assert '2 lines show fail, first at line 11: "web01 app[7]: request failed"' in g.text, g.text


def test_an_earlier_line_backs_a_sentence_once_not_in_every_later_summary():
    """The model repeated a sentence about an earlier error in every summary after it, each kept citing its line."""
    lines = _restart_log() + [f"2025-06-24 10:03:{i:02d} INFO api: handled request id={3000 + i} in 9 ms"
                              for i in range(40)]
    s, _, out = _summarizer(["The api handled requests.", "The worker.service was restarted.",
                             "The worker.service was restarted."], capacity=8192, every=40)
    _run(s, lines[20:140])
    a, b, c = [x for x in _blocks(out) if x["lines"]][:3]
    assert "(earlier, at line 34)" in b["summary"] and b["earlier"], b
    assert "earlier" not in c["summary"] and not c.get("earlier"), c


def test_an_error_at_the_end_of_a_line_cut_for_length_is_still_named():
    """A line of a long payload ending "-> ERROR upstream failed" was cut at --max-line-chars before its error; the
    summary said "No line shows a severity word (no errors or warnings)." and its header did not say a line was
    cut. Read through the real reader (bytes from a pipe), digest and guard."""
    import io
    import queue
    import threading

    from sinkchat.apps.summarize.output import render_block
    from sinkchat.apps.summarize.reader import Reader, stream_chunks

    lines = [f"2025-03-14T14:00:{i:02d}Z INFO api request ok id={i}" for i in range(11)]
    lines.insert(6, "2025-03-14T14:00:06Z INFO api request payload=" + "a" * 750 + " -> ERROR upstream failed: reset")
    q: queue.Queue = queue.Queue()
    data = ("\n".join(lines) + "\n").encode()
    Reader(stream_chunks(io.BytesIO(data), threading.Event()), q, max_line_chars=500).run()
    s, _, out = _summarizer(["The api handled requests."], capacity=8192)
    s.run(q)
    (b,) = [x for x in _blocks(out) if x["lines"]]
    assert b["truncated"] == 1 and b["lines"] == 12, b
    assert "1 line shows error" in b["summary"] and "No line shows a severity word" not in b["summary"], b
    assert "1 cut (over --max-line-chars)" in render_block(b, "text").splitlines()[0]
    incident = b["summary"][b["summary"].index("1 line shows error"):]
    assert "INFO api request payload=aaa" in incident and "ERROR upstream failed: reset" in incident, incident
    support = Support([i.text for i in _lines_of(data)], b["digest"])
    for sentence in [s + "." for s in b["summary"].split(". ") if s]:  # the code's own sentences pass the rule
        assert problems(sentence.rstrip(".") + ".", support, Echo(""))[0] == [], sentence


def _lines_of(data: bytes) -> list:
    import io
    import queue
    import threading

    from sinkchat.apps.summarize.reader import Line, Reader, stream_chunks

    q: queue.Queue = queue.Queue()
    Reader(stream_chunks(io.BytesIO(data), threading.Event()), q, max_line_chars=500).run()
    return [i for i in q.queue if isinstance(i, Line)]


def test_the_time_range_is_the_earliest_and_latest_timestamp_not_the_first_and_last_line():
    """A line logged late (out of order) ended the period and the summary said "from 13:00:00 to 12:59:58"."""
    from sinkchat.apps.summarize.digest import ts_order

    lines = [f"2025-03-14T13:00:{i:02d}Z INFO worker heartbeat seq={i}" for i in range(10)]
    lines.append("2025-03-14T12:59:58Z INFO late line out of order seq=999")
    rec, _ = _digest(lines)
    assert (rec["first_ts"], rec["last_ts"]) == ("2025-03-14T12:59:58Z", "2025-03-14T13:00:09Z"), rec
    syslog = ["Dec 31 23:59:58 web01 app: ok", "Jan  1 00:00:02 web01 app: ok"]  # no year: in line order
    rec, _ = _digest(syslog)
    assert (rec["first_ts"], rec["last_ts"]) == ("Dec 31 23:59:58", "Jan  1 00:00:02"), rec
    apt = ["Start-Date: 2024-01-05  10:22:33", "Start-Date: 2024-01-05  09:00:00", "Start-Date: 2024-01-05  10:00:00"]
    rec, _ = _digest(apt)
    assert (rec["first_ts"], rec["last_ts"]) == ("2024-01-05  09:00:00", "2024-01-05  10:22:33"), rec
    assert ts_order("14/Mar/2025:11:00:01 +0000") < ts_order("01/Apr/2025:00:00:00 +0000")  # not as text
    mixed = ["2025/03/01 11:00:00 [error] 31#31: upstream refused", "[ 1003.000000] usb 1-2: new device",
             "2025/03/01 11:00:21 [notice] 13#44: signal process started"]  # dmesg seconds beside dates: unordered
    rec, _ = _digest(mixed)
    assert (rec["first_ts"], rec["last_ts"]) == ("2025/03/01 11:00:00", "2025/03/01 11:00:21"), rec


def test_json_lines_records_are_read_as_time_level_message_and_fields():
    """`{"ts": ..., "level": "info", "msg": ...}` records were mined as `{'ts': {'2025-...Z',, ...`, with no time
    range; an error record's level was a word inside quotes."""
    import json

    from sinkchat.apps.summarize.reader import clean_line

    recs = [{"ts": f"2025-03-14T10:00:{i:02d}Z", "level": "info", "svc": "payments", "msg": "payment processed",
             "amount": 100 + i} for i in range(12)]
    recs.insert(5, {"ts": "2025-03-14T10:00:30Z", "level": "error", "svc": "payments", "msg": "card declined",
                    "err": {"code": 51}})
    lines = [clean_line(json.dumps(r).encode(), len(json.dumps(r).encode()), 500)[0] for r in recs]
    assert lines[5] == '2025-03-14T10:00:30Z ERROR card declined svc=payments err={"code":51}', lines[5]
    rec, _ = _digest(lines)
    text = " ".join(digest_summary(rec))
    assert text.startswith("13 lines from 2025-03-14T10:00:00Z to 2025-03-14T10:00:30Z"), text
    assert '12 x "INFO payment processed svc=payments {amount=100, amount=101, … 12 in all}"' in text, text
    assert "1 line shows error, first at line 6" in text and "'ts'" not in text and ",," not in text, text
    assert clean_line(b'{"a": 1', 7, 500)[0] == '{"a": 1'  # not a whole JSON object: as it was
    deep = b'{"a":' + b"[" * 1200 + b"]" * 1200 + b"}"  # json's RecursionError stopped the reader
    assert clean_line(deep, len(deep), 5000)[0] == deep.decode()
    for raw, want in [(rb'{"log":"\u001b[32mINFO\u001b[0m server started\n","stream":"stdout"}',
                       "INFO server started stream=stdout"),  # Docker's json-file: escapes cleaned as in a line
                      (rb'{"level":"info\nERROR fake","x":1}', "INFO ERROR FAKE x=1"),  # one record, one line
                      (rb'{"level":50,"time":1710412800123,"msg":"db down","pid":3}',  # pino: numbers
                       "2024-03-14T10:40:00.123Z ERROR db down pid=3")]:
        assert clean_line(raw, len(raw), 500)[0] == want, raw
