"""`sinkchat soak`: verdict logic on synthetic series, the runner's fault handling on a tiny model, the report CLI,
and one real 25 s soak of the agent scenario on the bundled model in a subprocess."""

from __future__ import annotations

import json
import math
import os
import random
import sqlite3
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from sinkchat.apps.soak.criteria import EXIT_CODES, MIB, evaluate, overall
from sinkchat.apps.soak.records import load_run
from sinkchat.apps.soak.report import write_report
from sinkchat.apps.soak.series import slope_per_hour
from sinkchat.apps.soak.thresholds import Thresholds

from fakes import FakeTokenizer, ScriptedEngine, tiny_model

GOOD = dict(cache_bytes=11 * MIB, cache_len=200, ledger_len=200, capacity=256, cache_ptrs=1234, decode_tok_s=10.0,
            prefill_tok_s=100.0, p50_ms=100.0, p99_ms=150.0, ppl=10.0, nll_sum=lambda t: 2.3 * 100, nll_n=100,
            errors=0, faults=0, attempts=lambda t: int(t // 30), faulted_steps=lambda t: int(t // 300),
            jobs=lambda t: int(t // 30), jobs_ok=lambda t: int(t // 30))
HEADER = {"kind": "start", "scenario": "chat", "capacity": 256, "limits": {"duration": 3600.0}}


def synth(n: int = 120, every: float = 30.0, rss=lambda t: 800 * MIB, seed: int = 0, **over) -> list[dict]:
    """n samples every `every` s; any field may be a function of elapsed seconds."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        t = (i + 1) * every
        rec = {"kind": "sample", "elapsed": t, "rss": rss(t) + rng.uniform(-4, 4) * MIB}
        for k, v in {**GOOD, **over}.items():
            rec[k] = v(t) if callable(v) else v
        out.append(rec)
    return out


def verdicts(samples, end=None, header=None, **th) -> dict[str, str]:
    end = {"kind": "end", "reason": "duration"} if end is None else end
    return {v.name: v.status for v in evaluate(samples, end or None, Thresholds(**th), header or HEADER)}


def test_flat_rss_passes_and_growing_rss_fails():
    assert verdicts(synth())["RSS growth per hour"] == "PASS"
    grow = synth(rss=lambda t: 800 * MIB + t / 3600 * 200 * MIB)  # 200 MiB per hour
    assert verdicts(grow)["RSS growth per hour"] == "FAIL"
    assert verdicts(grow, rss_mib_per_h=300)["RSS growth per hour"] == "PASS"
    # three minutes of +-25 MiB allocator noise: too short to tell a leak from noise, said so (never a silent n/a)
    noisy = synth(n=18, every=10, rss=lambda t: 1400 * MIB + (25 * MIB if int(t) % 30 == 0 else 0), seed=1)
    assert verdicts(noisy, warmup_s=0)["RSS growth per hour"] == "SHORT"
    short_leak = synth(n=18, every=10, rss=lambda t: 1400 * MIB + t * MIB)  # 1 MiB/s: far outside the noise
    assert verdicts(short_leak, warmup_s=0)["RSS growth per hour"] == "FAIL"


def test_rss_slope_is_robust_to_spikes_and_warmup_is_excluded():
    pts = [(t, 100.0 + (500.0 if t % 600 == 0 else 0.0)) for t in range(30, 3600, 30)]
    assert abs(slope_per_hour(pts)) < 1.0
    # a long climb at the start (allocator warm-up, first cache fill) is not a leak once excluded as warm-up
    warm = synth(rss=lambda t: 400 * MIB + min(t, 1440) / 1440 * 400 * MIB)
    assert verdicts(warm, warmup_s=1500)["RSS growth per hour"] == "PASS"
    assert verdicts(warm, warmup_s=0)["RSS growth per hour"] == "FAIL"


def test_cache_bytes_must_stay_constant():
    assert verdicts(synth())["cache bounded"] == "PASS"
    grown = synth(cache_bytes=lambda t: 11 * MIB if t < 1800 else 22 * MIB)
    assert verdicts(grown)["cache bounded"] == "FAIL"


def test_throughput_and_ppl_drift():
    assert verdicts(synth())["throughput drift"] == "PASS"
    slow = synth(decode_tok_s=lambda t: 10.0 if t < 1800 else 5.0)
    assert verdicts(slow)["throughput drift"] == "FAIL"
    # stream scenario: no decoding, prefill throughput is judged
    stream = synth(decode_tok_s=None, prefill_tok_s=lambda t: 100.0 if t < 1800 else 40.0)
    assert verdicts(stream)["throughput drift"] == "FAIL"
    worse = synth(nll_sum=lambda t: 100 * math.log(10.0 + t / 3600 * 20))
    assert verdicts(worse)["perplexity drift"] == "FAIL"
    assert verdicts(synth(nll_sum=None, nll_n=None))["perplexity drift"] == "SHORT"


def test_latency_errors_and_crashes():
    assert verdicts(synth())["p99/p50 latency"] == "PASS"
    assert verdicts(synth(p99_ms=1000.0))["p99/p50 latency"] == "FAIL"
    errs = synth(errors=lambda t: 1 if t > 600 else 0)
    assert verdicts(errs)["errors"] == "FAIL"
    assert verdicts(errs, max_errors=1)["errors"] == "PASS"
    assert verdicts(synth(), end=False)["crashes"] == "FAIL"  # no end record: killed
    assert verdicts(synth(), end={"kind": "end", "reason": "crashed"})["crashes"] == "FAIL"
    assert verdicts(synth(), end={"kind": "end", "reason": "interrupted"})["crashes"] == "PASS"  # not a crash...
    assert verdicts(synth(), end={"kind": "end", "reason": "interrupted"})["ran as planned"] == "INCOMPLETE"


def _write_run(d: Path, samples: list[dict], end: dict | None, torn: bool = False) -> None:
    lines = [json.dumps({"kind": "start", "scenario": "chat", "policy": "sink", "capacity": 256, "n_sink": 4,
                         "limits": {"duration": 600.0}, "thresholds": {"rss_mib_per_h": 64.0}})]
    lines += [json.dumps(s) for s in samples] + ([json.dumps(end)] if end else [])
    text = "\n".join(lines) + "\n" + ('{"kind": "sample", "elaps' if torn else "")
    (d / "metrics.jsonl").write_text(text)


def test_report_command_on_killed_and_finished_runs(tmp_path):
    from sinkchat.apps.soak.command import soak_command

    killed, good = tmp_path / "killed", tmp_path / "good"
    killed.mkdir(), good.mkdir()
    _write_run(killed, synth(n=20), None, torn=True)  # killed mid-write: torn last line, no end record
    _write_run(good, synth(n=20), {"kind": "end", "reason": "duration", "errors": 0, "faults": 3, "jobs": 20,
                                   "jobs_ok": 19, "attempts": 20, "faulted_steps": 3})
    r = CliRunner().invoke(soak_command, ["report", str(killed)])
    assert r.exit_code == 3, r.output
    assert "FAIL  crashes" in r.output
    md = (killed / "report.md").read_text()
    assert "| crashes |" in md and "FAIL" in md and (killed / "rss.png").stat().st_size > 1000
    r = CliRunner().invoke(soak_command, ["report", str(good)])
    assert r.exit_code == 0, r.output
    assert "report: " in r.output and (good / "report.md").read_text().startswith("# sinkchat soak report: PASS")
    # thresholds given to `report` override the recorded ones
    r = CliRunner().invoke(soak_command, ["report", str(good), "--max-latency-ratio", "1.2"])
    assert r.exit_code == 3 and "FAIL  p99/p50 latency" in r.output


def test_parse_duration():
    from sinkchat.apps.soak.command import parse_duration

    assert parse_duration("8h") == 8 * 3600
    assert parse_duration("1h30m") == 5400
    assert parse_duration("90") == 90
    assert parse_duration("2.5m") == 150
    for bad in ("", "5x", "h", "-3m", "0s"):
        with pytest.raises(click.BadParameter):
            parse_duration(bad)


# ------------------------------------------------------------------------------------------------ runner, tiny model
def _tiny_engine(word_tok, capacity=32):
    from sinkchat.config import CacheConfig
    from sinkchat.core.engine import Engine

    return Engine(tiny_model(), word_tok, CacheConfig(policy="sink", n_sink=4, capacity=capacity, evict_chunk=4))


class Flaky:
    """Wraps a scenario: every third step raises mid-way, like a tool or a parser blowing up."""

    recover = None

    def __init__(self, inner):
        self.inner, self.n = inner, 0

    def step(self, engine):
        self.n += 1
        for i, ev in enumerate(self.inner.step(engine)):
            if self.n % 3 == 0 and i == 1:
                raise RuntimeError("injected fault")
            yield ev


def test_runner_survives_faults_and_nan_logits(tmp_path, word_tok):
    import torch

    from sinkchat.apps.soak.runner import Soak
    from sinkchat.apps.soak.records import Recorder
    from sinkchat.apps.soak.scenario_stream import StreamScenario

    text = tmp_path / "ids.txt"
    text.write_text(" ".join(str(random.Random(1).randrange(128)) for _ in range(300)))
    eng = _tiny_engine(word_tok)
    real = eng.model
    calls = {"n": 0}

    class NanSometimes(torch.nn.Module):  # every 7th forward returns NaN logits (a broken kernel, say)
        def __init__(self):
            super().__init__()
            self.inner = real
            self.config = real.config

        def forward(self, **kw):
            out = self.inner(**kw)
            calls["n"] += 1
            if calls["n"] % 7 == 0:
                out.logits = out.logits * float("nan")
            return out

    eng.model = NanSometimes()
    scen = Flaky(StreamScenario(eng, str(text), block=8))
    rec = Recorder(tmp_path)
    soak = Soak(eng, scen, rec, sample_every=1.0, steps=15)
    reason = soak.run()
    soak.sample()
    rec.close()
    assert reason == "steps" and soak.steps == 15
    assert soak.errors >= 7 + 2  # 7 injected raises + the NaN guards that tripped
    assert eng.cache.length == len(eng.ledger) <= 32
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    kinds = {x["kind"] for x in lines}
    assert {"sample", "error"} <= kinds
    errs = [x for x in lines if x["kind"] == "error"]
    assert any("injected fault" in e["detail"] for e in errs) and any(e["error"] == "nonfinite_logits" for e in errs)
    assert lines[-1]["errors"] == soak.errors


def test_nll_tap_scores_what_the_cache_is_fed(word_tok):
    """The perplexity criterion's input: every token fed through the live cache (whoever feeds it) is scored from the
    logits of that very forward; while nothing was evicted that equals a dense forward's NLL per token."""
    import torch

    from sinkchat.apps.soak.tap import NllTap

    eng = _tiny_engine(word_tok, capacity=64)
    tap = NllTap(eng)
    ids = [random.Random(3).randrange(128) for _ in range(40)]
    list(eng.feed_ids(ids[:1]))
    list(eng.feed(" ".join(map(str, ids[1:]))))  # through feed(), as add_message and the agent feed
    nll = tap.drain()
    with torch.no_grad():
        logits = eng.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1]
    ref = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
    assert len(nll) == 39 and torch.allclose(torch.tensor(nll), ref, atol=1e-4)
    assert eng.cache.length == len(eng.ledger) == 40
    tap.detach()
    list(eng.feed_ids(ids[:5]))
    assert tap.drain() == []


# ------------------------------------------------------------------------------------------------ real soak
def test_agent_soak_on_the_bundled_model(tmp_path):
    """>= 16 s of the agent scenario (built-in tools, generated tasks) on the bundled 4-bit model, cache 256 (long
    enough for evictions, several tasks and a steady RSS after the 6 s warm-up; the overnight runs are `-m slow`)."""
    out, home = tmp_path / "run", tmp_path / "home"
    env = {**os.environ, "SINKCHAT_HOME": str(home), "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [sys.executable, "-m", "sinkchat.cli", "soak", "--scenario", "agent", "--duration", "16s",
           "--sample-every", "1.5", "--cache", "256", "--pin", "none", "--max-tokens", "48", "--seed", "0", "--out", str(out),
           "--warmup", "6", "--max-rss-growth", "2048", "--max-tput-drop", "0.9", "--max-latency-ratio", "50"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    header, samples, end = load_run(out)
    assert end is not None and end["reason"] == "duration" and end["elapsed"] >= 16
    assert header["scenario"] == "agent" and header["capacity"] == 256
    assert len(samples) >= 10
    # cache bytes constant (and nonzero), evictions happened, no errors
    assert len({s["cache_bytes"] for s in samples}) == 1 and samples[0]["cache_bytes"] > 0
    assert samples[-1]["evicted"] > 0 and samples[-1]["tokens"] > 256
    assert end["errors"] == 0 and all(s["errors"] == 0 for s in samples)
    steady = [s["rss"] for s in samples if s["elapsed"] >= 6]
    assert max(steady) - steady[0] < 150 * MIB, [r // MIB for r in steady]
    verdicts = {v.name: v for v in write_report(out, plots=False)}
    for name in ("cache bounded", "errors", "crashes", "ran as planned"):
        assert verdicts[name].status == "PASS", verdicts[name]
    # the agent's tool calls are counted in every sample and judged (whatever the share, it is a verdict, not n/a)
    assert all("tool_calls_ok" in s and "interval_tool_calls_failed" in s for s in samples)
    assert end["tool_calls_ok"] + end["tool_calls_failed"] > 0
    assert verdicts["agent valid-call share"].status in ("PASS", "FAIL")
    statuses = {v.status for v in verdicts.values()}
    want = 3 if "FAIL" in statuses else 4 if "INCOMPLETE" in statuses else 5 if "SHORT" in statuses else 0
    assert p.returncode == want, p.stdout + p.stderr[-2000:]
    assert (out / "report.md").is_file() and (out / "rss.png").is_file()
    # the samples also went to the SQLite session log
    con = sqlite3.connect(home / "sinkchat.db")
    n = con.execute("SELECT COUNT(*) FROM metrics m JOIN sessions s ON s.id = m.session_id "
                    "WHERE s.mode = 'soak' AND m.data NOT LIKE '%task_done%'").fetchone()[0]
    assert n == len(samples)
    roles = [r[0] for r in con.execute("SELECT t.role FROM turns t JOIN sessions s ON s.id = t.session_id "
                                       "WHERE s.mode = 'soak' ORDER BY t.seq")]
    assert roles[:2] == ["user", "assistant"] and roles.count("user") >= end["jobs"]
    # the report's figures are the log's: the same token total, and a peak no lower than what one task fed at once
    assert con.execute("SELECT tokens FROM sessions WHERE mode = 'soak'").fetchone()[0] == end["tokens"]
    fed = con.execute("SELECT MAX(t.tokens) FROM turns t JOIN sessions s ON s.id = t.session_id "
                      "WHERE s.mode = 'soak' AND t.role = 'user'").fetchone()[0]
    peak = int(verdicts["cache bounded"].value.split()[1])
    assert peak >= min(fed, 256), (peak, fed)


def test_display_plain_line_and_live_panel(capsys):
    from collections import deque
    from types import SimpleNamespace

    from sinkchat.apps.soak.display import Display, spark

    s = spark([1.0, 2.0, None, 3.0, 4.0])
    assert len(s) == 4 and s[0] == "▁" and s[-1] == "█" and spark([]) == ""
    rec = {**GOOD, "elapsed": 90.0, "steps": 3, "tokens": 500, "evicted": 200, "rss": 900 * MIB, "ppl_input": None,
           "gauge": 0.4}
    stub = SimpleNamespace(duration=600.0, samples=deque([rec, rec]), progress=lambda: 0.15)
    Display(stub, live=False).update(rec)
    err = capsys.readouterr().err
    assert "left 8.5m" in err and "steps 3" in err and "rss 900.0 MiB" in err and "sink 0.40" in err
    with Display(stub, live=True) as d:  # the rich panel renders without a terminal too
        d.update(rec)
    assert "RSS" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ every check can fail
def _run_soak(eng, scen, tmp_path, **kw):
    """The runner on `scen` to its limit, then its records: (samples, end) as `soak report` reads them."""
    from sinkchat.apps.soak.command import _end_records
    from sinkchat.apps.soak.runner import Soak
    from sinkchat.apps.soak.records import Recorder

    rec = Recorder(tmp_path)
    soak = Soak(eng, scen, rec, **{"sample_every": 1e-6, **kw})
    reason = soak.run()
    soak.sample()
    _end_records(rec, soak, reason, None)
    _, samples, end = load_run(tmp_path)
    return soak, samples, end


def _chars_engine(capacity=64, model=None):
    from sinkchat.config import CacheConfig
    from sinkchat.core.engine import Engine

    return Engine(model or tiny_model(), FakeTokenizer(), CacheConfig(policy="sink", n_sink=4, capacity=capacity,
                                                                      evict_chunk=4))


class _Degrading:
    """A model whose logits get noisier with every forward: the live stream's perplexity must rise."""

    def __new__(cls, real, rate):
        import torch

        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner, self.config, self.calls = real, real.config, 0
                self.gen = torch.Generator().manual_seed(0)

            def forward(self, **kw):
                out = self.inner(**kw)
                self.calls += 1
                noise = torch.randn(out.logits.shape, generator=self.gen)
                out.logits = out.logits + noise * rate * self.calls
                return out

        return M()


@pytest.mark.parametrize("rate,want", [(0.0, "PASS"), (0.15, "FAIL")])
def test_ppl_drift_judges_the_stream_fed_through_the_live_cache(rate, want, tmp_path, word_tok):
    """Criterion 1: perplexity of what the run fed, binned per sample, late bins against early ones; a run whose model
    degrades as it goes fails, the same run without the degradation passes (noise allowance included)."""
    from sinkchat.apps.soak.scenario_stream import StreamScenario

    text = tmp_path / "ids.txt"
    text.write_text(" ".join(str(random.Random(1).randrange(128)) for _ in range(2000)))
    eng = _tiny_engine(word_tok)
    eng.model = _Degrading(eng.model, rate)
    soak, samples, end = _run_soak(eng, StreamScenario(eng, str(text), block=16), tmp_path, steps=60)
    bins = [s for s in samples if (s.get("nll_n") or 0) >= 8]
    assert len(bins) >= 50 and sum(s["nll_n"] for s in samples) >= 60 * 15
    v = {x.name: x for x in evaluate(samples, end, Thresholds(warmup_s=0), HEADER)}["perplexity drift"]
    assert v.status == want, v


def test_ppl_drift_has_a_noise_allowance_and_a_too_short_verdict():
    rng = random.Random(5)
    noisy = synth(nll_sum=lambda t: 100 * (2.3 + rng.gauss(0, 0.3)))  # flat but noisy bins: passes
    assert verdicts(noisy)["perplexity drift"] == "PASS"
    assert verdicts(synth(n=4))["perplexity drift"] == "SHORT"


def test_jobs_criterion_fails_when_the_scenario_did_not_do_its_job():
    """Criterion 2 on recorded counts: a share of steps done right below --min-done fails; no judged step fails."""
    half = synth(jobs_ok=lambda t: int(t // 60))
    assert verdicts(half)["job done: replies produced"] == "FAIL"
    assert verdicts(half, min_done=0.4)["job done: replies produced"] == "PASS"
    assert verdicts(synth(jobs=0, jobs_ok=0))["job done: replies produced"] == "FAIL"
    agent = {**HEADER, "scenario": "agent"}
    assert verdicts(half, header=agent)["job done: tasks done right"] == "FAIL"


def _agent_scen(script, ws):
    from sinkchat.apps.soak.scenario_agent import AgentScenario

    eng = ScriptedEngine(script)
    eng.last_logits = None
    eng.cache = type("C", (), {"length": 0})()
    eng.ledger = type("L", (), {"seen": 0, "evicted": 0})()
    return eng, AgentScenario(eng, ws, max_steps=3)


@pytest.mark.parametrize("content,ok", [("apple", True), ("banana", False), (None, False)])
def test_agent_task_is_judged_by_the_file_it_asked_for(content, ok, tmp_path):
    """Criterion 2, agent: a write task is done right only when the file exists with the asked-for word in it (a
    stale copy from an earlier task is removed first); a reply with no call at all leaves no file."""
    from sinkchat.apps.soak.scenario_agent import AgentTask
    from sinkchat.apps.soak.steps import Outcome

    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "file1.txt").write_text("apple")  # stale: must not count
    call = json.dumps({"tool": "write_file", "args": {"path": "file1.txt", "content": content}})
    script = ([call] if content is not None else ["I cannot do that."]) + ['{"final": "done"}'] * 3
    eng, scen = _agent_scen(script, ws)
    scen.next_task = lambda: AgentTask("write", "Write the word 'apple' into the file file1.txt.", "file1.txt",
                                       "apple")
    outs = [e for e in scen.step(eng) if isinstance(e, Outcome)]
    assert len(outs) == 1 and outs[0].ok is ok, outs


def test_agent_calculation_is_judged_by_its_answer(tmp_path):
    from sinkchat.apps.soak.scenario_agent import AgentTask
    from sinkchat.apps.soak.steps import Outcome

    calc = json.dumps({"tool": "calculator", "args": {"expression": "6*7"}})  # an answer must come from a tool
    for answer, ok in (("42", True), ("41", False)):
        eng, scen = _agent_scen([calc, json.dumps({"final": f"It is {answer}."})] + [calc] * 4, tmp_path)
        scen.next_task = lambda: AgentTask("mul", "What is 6 times 7?", number=42)
        assert [e.ok for e in scen.step(eng) if isinstance(e, Outcome)] == [ok]


class _Cut(ScriptedEngine):
    def generate(self, max_tokens=None, stop=(), sampling=None):
        from sinkchat.core.events import DoneEvent

        text = self.replies.popleft()
        self.reply = text
        yield DoneEvent("length" if text.endswith("...") else "eos", len(text), 0.0, text)


@pytest.mark.parametrize("reply,ok", [("Two errors from db; all else fine.", True), ("", False),
                                      ("The log shows that the...", False)])
def test_summaries_and_replies_must_be_produced_and_complete(reply, ok):
    """Criterion 2, summarize and chat: an empty summary or one cut off at --max-tokens is not done; same for an
    empty chat reply."""
    from sinkchat.apps.soak.scenario_chat import ChatScenario
    from sinkchat.apps.soak.scenario_summarize import SummarizeScenario
    from sinkchat.apps.soak.steps import Outcome

    for scen in (SummarizeScenario(max_tokens=16, lines_per_summary=6, chunk_lines=3), ChatScenario(["hi there"])):
        eng = _Cut([reply])
        eng.last_logits, eng.cache = None, type("C", (), {"length": 0})()
        outs = [e for e in scen.step(eng) if isinstance(e, Outcome)]
        want = ok if scen.name == "summarize" else bool(reply)
        assert [o.ok for o in outs] == [want], (scen.name, outs)
        if scen.name == "summarize":  # two chunks of log lines, then the summarize prompt with their range
            assert [g for _, _, g in eng.fed] == [False, False, True] and "lines 1 to 6" in eng.fed[-1][1]
            assert "{" not in eng.fed[-1][1]  # every placeholder filled


def test_fault_share_fails_when_every_step_faulted(tmp_path, word_tok):
    """Criterion 3: a run in which every step met a handled fault fails the faulted-steps limit (and the counts come
    from the runner, not from the test)."""
    from sinkchat.apps.soak.steps import Fault, Outcome

    class Faulty:
        name, recover = "chat", None

        def step(self, engine):
            yield from engine.feed_ids([1, 2, 3, 4, 5, 6, 7, 8, 9])
            yield Fault("empty_reply", "scripted")
            yield Outcome(True, "but it did its job")

    eng = _tiny_engine(word_tok)
    soak, samples, end = _run_soak(eng, Faulty(), tmp_path, steps=5)
    assert end["attempts"] == 5 and end["faulted_steps"] == 5 and end["jobs_ok"] == 5 and end["errors"] == 0
    v = {x.name: x.status for x in evaluate(samples, end, Thresholds(), HEADER)}
    assert v["faulted steps"] == "FAIL" and v["errors"] == "PASS"
    v = {x.name: x.status for x in evaluate(samples, end, Thresholds(max_fault_share=1.0), HEADER)}
    assert v["faulted steps"] == "PASS"
    assert verdicts(synth(faulted_steps=lambda t: int(t // 30)))["faulted steps"] == "FAIL"


def test_cache_criterion_fails_on_overfull_mismatched_or_reallocated_buffers():
    """Criterion 4: not true by construction: length within capacity and equal to the ledger's, same buffers."""
    assert verdicts(synth(cache_len=300, ledger_len=300))["cache bounded"] == "FAIL"  # capacity 256
    assert verdicts(synth(ledger_len=199))["cache bounded"] == "FAIL"
    assert verdicts(synth(cache_ptrs=lambda t: 1 if t < 1800 else 2))["cache bounded"] == "FAIL"


def test_rss_leak_of_75_mib_an_hour_fails_and_a_short_run_is_not_a_pass():
    """Criterion 5: an hour leaking 75 MiB (over a 64 MiB/h limit) fails, inside ±4 MiB of noise; a 60 s run cannot
    be judged: SHORT, which makes a timed run INCONCLUSIVE (exit 5), not PASS."""
    leak = synth(rss=lambda t: 800 * MIB + t / 3600 * 75 * MIB)
    assert verdicts(leak)["RSS growth per hour"] == "FAIL"
    short = synth(n=12, every=5, rss=lambda t: 800 * MIB)
    v = evaluate(short, {"kind": "end", "reason": "duration"}, Thresholds(), HEADER)
    assert {x.name: x.status for x in v}["RSS growth per hour"] == "SHORT"
    assert overall(v, HEADER) == "INCONCLUSIVE"
    assert overall(v, {**HEADER, "limits": {"steps": 10, "duration": None}}) == "PASS"  # no duration asked for


def test_a_run_stopped_before_its_planned_end_is_incomplete():
    """Criterion 6: terminated / interrupted runs are INCOMPLETE (exit 4), never PASS; a FAIL still wins."""
    for reason in ("terminated", "interrupted"):
        v = evaluate(synth(), {"kind": "end", "reason": reason}, Thresholds(), HEADER)
        assert {x.name: x.status for x in v}["ran as planned"] == "INCOMPLETE" and overall(v, HEADER) == "INCOMPLETE"
    v = evaluate(synth(errors=3), {"kind": "end", "reason": "terminated"}, Thresholds(), HEADER)
    assert overall(v, HEADER) == "FAIL"
    assert overall(evaluate(synth(), {"kind": "end", "reason": "duration"}, Thresholds(), HEADER), HEADER) == "PASS"


def test_exit_code_matches_the_verdicts(tmp_path):
    """Criterion 8: `soak report` exits 0 / 3 / 4 / 5 on runs built to pass, fail, stop early and be too short."""
    from sinkchat.apps.soak.command import soak_command

    end = {"kind": "end", "reason": "duration", "errors": 0, "jobs": 120, "jobs_ok": 120, "attempts": 120,
           "faulted_steps": 4}
    cases = {
        "pass": (synth(), end, 0, "PASS"),
        "fail": (synth(), {**end, "jobs_ok": 10}, 3, "FAIL"),
        "stopped": (synth(), {**end, "reason": "terminated"}, 4, "INCOMPLETE"),
        "short": (synth(n=12, every=5), end, 5, "INCONCLUSIVE"),
    }
    for name, (samples, e, code, word) in cases.items():
        d = tmp_path / name
        d.mkdir()
        _write_run(d, samples, e)
        r = CliRunner().invoke(soak_command, ["report", str(d)])
        assert r.exit_code == code, (name, r.output)
        assert r.output.rstrip().endswith(word) and (d / "report.md").read_text().startswith(f"# sinkchat soak report: {word}")
    assert EXIT_CODES == {"PASS": 0, "FAIL": 3, "INCOMPLETE": 4, "INCONCLUSIVE": 5}
    help_text = CliRunner().invoke(soak_command, ["--help"]).output
    assert all(f"{c}  {w}" in help_text for w, c in EXIT_CODES.items() if c)


def test_soak_turns_go_to_the_session_log(tmp_path):
    """Criterion 7: the soak's turns are in the session log (`sinkchat logs show` prints them), not just figures."""
    from sinkchat.apps.runlog import open_log
    from sinkchat.apps.soak.scenario_chat import ChatScenario
    from sinkchat.store import transcript

    eng = _chars_engine(capacity=128)
    slog = open_log(eng, "soak", False, None, warn=print, extra={"scenario": "chat"})
    scen = ChatScenario(["Say hi.", "Name a color."], max_tokens=6)
    scen.slog = slog
    soak, samples, end = _run_soak(eng, scen, tmp_path, steps=3)
    turns = transcript.turns(slog.id)
    assert [t.role for t in turns] == ["user", "assistant"] * 3
    assert turns[0].text in ("Say hi.", "Name a color.") and turns[0].tokens > 0
    assert end["jobs"] == 3


def test_a_stream_soak_starts_with_the_bos_the_model_was_trained_with(tmp_path, word_tok):
    """A model whose tokenizer puts a BOS first (Gemma, Llama) gets it at the start of the fed stream, once, and a
    tokenizer without one gets nothing extra: the soak measures the model as it was trained to read."""
    from sinkchat.apps.soak.scenario_stream import StreamScenario

    text = tmp_path / "t.txt"
    text.write_text("1 2 3 4 5 6 7 8 9 10 11 12")
    eng = _tiny_engine(word_tok)
    plain = StreamScenario(eng, str(text), block=4)
    list(plain.step(eng))
    assert eng.ledger.ids[:4] == eng.encode("1 2 3 4")

    from types import SimpleNamespace

    from fakes import FakeTokenizer

    class BosTok(FakeTokenizer):  # a tokenizer that puts its BOS (id 1) in front of every encoding
        bos_token, bos_token_id = "<s>", 1

        def __call__(self, text, **kw):
            return SimpleNamespace(input_ids=[1, *self.encode("2")])

    text.write_text("10 11 12 13 14 15 16 17 18 19")
    eng = _tiny_engine(BosTok("words", chat_template=None))
    scen = StreamScenario(eng, str(text), block=4)
    list(scen.step(eng))
    list(scen.step(eng))
    assert eng.ledger.ids == [1, *eng.encode("10 11 12 13 14 15 16")]  # the BOS once, first
    eng.clear()  # what recovery does to a broken cache: the refilled stream starts with the BOS again
    list(scen.step(eng))
    assert eng.ledger.ids == [1, *eng.encode("17 18 19")]


def test_the_planned_duration_reads_as_the_user_gave_it():
    from sinkchat.apps.soak import criteria

    got = [criteria._plan("duration", s) for s in (20, 90, 1800, 28800, 3601, 4e6)]
    assert got == ["20 s", "90 s", "30 min", "8 h", "60.0 min", "66666.7 min"]
    assert criteria._plan("steps", 5) == "5"


def test_tokens_the_memory_lost_to_its_disk_are_a_handled_fault_and_said(tmp_path, word_tok, caplog):
    """A block that failed its checksum when read back (or could not be written) showed only in the session log: the
    report said "errors 0 (+0 handled faults)". Now each is a fault record, counted by kind, and a warning line."""
    from sinkchat.apps.soak.records import Recorder
    from sinkchat.apps.soak.runner import MEMORY_FAULTS, Soak
    from sinkchat.memory.events import ForgottenEvent

    class Quiet:
        def step(self, engine):
            yield from ()

    rec = Recorder(tmp_path)
    soak = Soak(_tiny_engine(word_tok), Quiet(), rec, sample_every=1e9, steps=1)
    with caplog.at_level("WARNING"):
        for ev in (ForgottenEvent(64, 4, 68, "damaged"), ForgottenEvent(64, 68, 132, "damaged"),
                   ForgottenEvent(8, 200, 208, "re-read"), ForgottenEvent(64, 300, 364, "budget")):
            soak.fold(ev)
    rec.close()
    assert soak.faults == 2 and soak.fault_kinds == {MEMORY_FAULTS["damaged"]: 2} and soak.errors == 0
    faults = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["detail"]) for r in faults if r["kind"] == "fault"] == [
        ("fault", "64 tokens [4,68) forgotten"), ("fault", "64 tokens [68,132) forgotten")]
    assert [r.message for r in caplog.records if "damaged" in r.message] == [
        "memory block damaged (checksum): 64 tokens [4,68) forgotten",
        "memory block damaged (checksum): 64 tokens [68,132) forgotten"]
