"""`sinkchat soak`: verdict logic on synthetic series, the runner's fault handling on a tiny model, the report CLI,
and one real >= 60 s soak of the agent scenario on the bundled model in a subprocess."""

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

from sinkchat.apps.soak.report import MIB, Thresholds, evaluate, load_run, slope_per_hour, write_report

from conftest import tiny_model

GOOD = dict(cache_bytes=11 * MIB, decode_tok_s=10.0, prefill_tok_s=100.0, p50_ms=100.0, p99_ms=150.0, ppl=10.0,
            errors=0, faults=0)


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


def verdicts(samples, end=None, **th) -> dict[str, str]:
    end = {"kind": "end", "reason": "duration"} if end is None else end
    return {v.name: v.status for v in evaluate(samples, end or None, Thresholds(**th))}


def test_flat_rss_passes_and_growing_rss_fails():
    assert verdicts(synth())["RSS growth per hour"] == "PASS"
    grow = synth(rss=lambda t: 800 * MIB + t / 3600 * 200 * MIB)  # 200 MiB per hour
    assert verdicts(grow)["RSS growth per hour"] == "FAIL"
    assert verdicts(grow, rss_mib_per_h=300)["RSS growth per hour"] == "PASS"
    # three minutes of +-25 MiB allocator noise: the hourly slope is large but the run is too short to call a leak
    noisy = synth(n=18, every=10, rss=lambda t: 1400 * MIB + (25 * MIB if int(t) % 30 == 0 else 0), seed=1)
    assert verdicts(noisy, warmup_s=0)["RSS growth per hour"] in ("PASS", "n/a")
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
    assert verdicts(synth())["cache bytes constant"] == "PASS"
    grown = synth(cache_bytes=lambda t: 11 * MIB if t < 1800 else 22 * MIB)
    assert verdicts(grown)["cache bytes constant"] == "FAIL"


def test_throughput_and_ppl_drift():
    assert verdicts(synth())["throughput drift"] == "PASS"
    slow = synth(decode_tok_s=lambda t: 10.0 if t < 1800 else 5.0)
    assert verdicts(slow)["throughput drift"] == "FAIL"
    # stream scenario: no decoding, prefill throughput is judged
    stream = synth(decode_tok_s=None, prefill_tok_s=lambda t: 100.0 if t < 1800 else 40.0)
    assert verdicts(stream)["throughput drift"] == "FAIL"
    worse = synth(ppl=lambda t: 10.0 + t / 3600 * 20)
    assert verdicts(worse)["perplexity drift"] == "FAIL"
    assert verdicts(synth(ppl=None))["perplexity drift"] == "n/a"


def test_latency_errors_and_crashes():
    assert verdicts(synth())["p99/p50 latency"] == "PASS"
    assert verdicts(synth(p99_ms=1000.0))["p99/p50 latency"] == "FAIL"
    errs = synth(errors=lambda t: 1 if t > 600 else 0)
    assert verdicts(errs)["errors"] == "FAIL"
    assert verdicts(errs, max_errors=1)["errors"] == "PASS"
    assert verdicts(synth(), end=False)["crashes"] == "FAIL"  # no end record: killed
    assert verdicts(synth(), end={"kind": "end", "reason": "crashed"})["crashes"] == "FAIL"
    assert verdicts(synth(), end={"kind": "end", "reason": "interrupted"})["crashes"] == "PASS"


def _write_run(d: Path, samples: list[dict], end: dict | None, torn: bool = False) -> None:
    lines = [json.dumps({"kind": "start", "scenario": "chat", "policy": "sink", "capacity": 256, "n_sink": 4,
                         "thresholds": {"rss_mib_per_h": 64.0}})]
    lines += [json.dumps(s) for s in samples] + ([json.dumps(end)] if end else [])
    text = "\n".join(lines) + "\n" + ('{"kind": "sample", "elaps' if torn else "")
    (d / "metrics.jsonl").write_text(text)


def test_report_command_on_killed_and_finished_runs(tmp_path):
    from sinkchat.apps.soak.command import soak_command

    killed, good = tmp_path / "killed", tmp_path / "good"
    killed.mkdir(), good.mkdir()
    _write_run(killed, synth(n=20), None, torn=True)  # killed mid-write: torn last line, no end record
    _write_run(good, synth(n=20), {"kind": "end", "reason": "duration", "errors": 0, "faults": 3})
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

    from sinkchat.apps.soak.command import Soak
    from sinkchat.apps.soak.records import Recorder
    from sinkchat.apps.soak.scenarios import StreamScenario

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


def test_probe_does_not_disturb_the_cache(word_tok):
    import torch

    from sinkchat.apps.soak.scenarios import Probe

    a, b = _tiny_engine(word_tok), _tiny_engine(word_tok)
    probe = Probe(b, text=" ".join(str(i) for i in range(40)))
    ids = [random.Random(2).randrange(128) for _ in range(50)]
    for eng in (a, b):
        list(eng.feed_ids(ids[:30]))
    p1 = probe.ppl()
    for eng in (a, b):
        list(eng.feed_ids(ids[30:]))
    assert math.isfinite(p1) and probe.ppl() == p1  # a dense forward: independent of the cache
    assert a.cache.length == b.cache.length and a.ledger.ids == b.ledger.ids
    for la, lb in zip(a.cache.layers, b.cache.layers):
        assert torch.equal(la.keys[:, :, : la.length], lb.keys[:, :, : lb.length])
    assert torch.equal(a.last_logits, b.last_logits)


def test_scored_feed_matches_a_dense_forward(word_tok):
    """Running ppl of the input: the NLL per token equals a plain forward's while nothing was evicted."""
    import torch

    from sinkchat.apps.soak.scenarios import Scores, scored_feed

    eng = _tiny_engine(word_tok, capacity=64)
    ids = [random.Random(3).randrange(128) for _ in range(40)]
    list(eng.feed_ids(ids[:1]))
    nll = [v for item in scored_feed(eng, ids[1:]) if isinstance(item, Scores) for v in item]
    with torch.no_grad():
        logits = eng.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1]
    ref = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
    assert len(nll) == 39 and torch.allclose(torch.tensor(nll), ref, atol=1e-4)


# ------------------------------------------------------------------------------------------------ real soak
def test_agent_soak_on_the_bundled_model(tmp_path):
    """>= 60 s of the agent scenario (built-in tools, generated tasks) on the bundled 4-bit model, cache 256."""
    out, home = tmp_path / "run", tmp_path / "home"
    env = {**os.environ, "SINKCHAT_HOME": str(home), "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [sys.executable, "-m", "sinkchat.cli", "soak", "--scenario", "agent", "--duration", "60s",
           "--sample-every", "5", "--cache", "256", "--max-tokens", "48", "--seed", "0", "--out", str(out),
           "--warmup", "15", "--max-rss-growth", "2048", "--max-tput-drop", "0.9", "--max-latency-ratio", "50"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    header, samples, end = load_run(out)
    assert end is not None and end["reason"] == "duration" and end["elapsed"] >= 60
    assert header["scenario"] == "agent" and header["capacity"] == 256
    assert len(samples) >= 10
    # cache bytes constant (and nonzero), evictions happened, no errors
    assert len({s["cache_bytes"] for s in samples}) == 1 and samples[0]["cache_bytes"] > 0
    assert samples[-1]["evicted"] > 0 and samples[-1]["tokens"] > 256
    assert end["errors"] == 0 and all(s["errors"] == 0 for s in samples)
    steady = [s["rss"] for s in samples if s["elapsed"] >= 15]
    assert max(steady) - steady[0] < 150 * MIB, [r // MIB for r in steady]
    verdicts = {v.name: v for v in write_report(out, plots=False)}
    for name in ("cache bytes constant", "RSS growth per hour", "errors", "crashes"):
        assert verdicts[name].status == "PASS", verdicts[name]
    assert p.returncode == (3 if any(v.failed for v in verdicts.values()) else 0), p.stdout + p.stderr[-2000:]
    assert (out / "report.md").is_file() and (out / "rss.png").is_file()
    # the samples also went to the SQLite session log
    con = sqlite3.connect(home / "sinkchat.db")
    n = con.execute("SELECT COUNT(*) FROM metrics m JOIN sessions s ON s.id = m.session_id "
                    "WHERE s.mode = 'soak'").fetchone()[0]
    assert n == len(samples)


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
