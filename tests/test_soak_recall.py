"""`sinkchat soak --memory on`: the recall probes (facts planted, asked for in the window and after they left it) and
the two verdict rows they feed, "recall" and "memory disk". The rows on synthetic series built to pass, to fail
(a run that recalls nothing, a last window that recalls nothing, a drop, a gap to the in-window ceiling, a disk over
its budget), to be too short and to be n/a with the memory off; then short real runs through the scenario code on
a tiny model with a real recall memory."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from sinkchat.apps.soak.criteria import MIB, MIN_WINDOW_PROBES, evaluate, overall
from sinkchat.apps.soak.recall import held, in_window, recalled
from sinkchat.apps.soak.thresholds import Thresholds

HEADER_ON = {"kind": "start", "scenario": "chat", "capacity": 512, "limits": {"duration": 3.5 * 3600.0},
             "memory": {"mode": "on", "budget": 64 * MIB, "block": 64, "topk": 4}}
HEADER_OFF = {**HEADER_ON, "memory": {"mode": "off"}}
END = {"kind": "end", "reason": "duration"}


def recall_run(hours: float = 3.5, every: float = 30.0, start: float = 600.0, per_sample: float = 1.0,
               share=lambda t: 0.6, ceiling=0.7, disk=lambda t: 10 * MIB, budget: int = 64 * MIB,
               peak=None) -> list[dict]:
    """Samples every `every` s of a run with the memory on: from `start` on, `per_sample` probes beyond the window
    per sample answered right at `share(t)`, as many in the window at `ceiling` (a share, or a function of t)
    (running counts, as the runner writes them); the memory's disk bytes `disk(t)` of `budget` (`peak(t)`: the
    peak between samples)."""
    out, acc = [], {"m": 0.0, "mk": 0.0, "w": 0.0, "wk": 0.0}
    for i in range(int(hours * 3600 / every)):
        t = (i + 1) * every
        if t > start:
            acc["m"] += per_sample
            acc["mk"] += per_sample * share(t)
            acc["w"] += per_sample
            acc["wk"] += per_sample * (ceiling(t) if callable(ceiling) else ceiling)
        out.append({"kind": "sample", "elapsed": t, "rss": 800 * MIB, "cache_len": 400, "ledger_len": 400,
                    "capacity": 512, "errors": 0, "faults": 0, "attempts": i + 1, "faulted_steps": 0,
                    "jobs": i + 1, "jobs_ok": i + 1, "recall_memory": int(acc["m"]),
                    "recall_memory_ok": int(acc["mk"] + 1e-9), "recall_window": int(acc["w"]),
                    "recall_window_ok": int(acc["wk"] + 1e-9), "recall_planted": int(acc["w"]),
                    "mem_blocks": int(t), "mem_tokens": int(t) * 64, "mem_forgotten": 0, "mem_disk_bytes": disk(t),
                    "mem_disk_files": disk(t), "mem_disk_peak": (peak or disk)(t), "mem_budget": budget})
    return out


def rows(samples: list[dict], header: dict = HEADER_ON, end: dict | None = END, **th) -> dict:
    return {v.name: v for v in evaluate(samples, end, Thresholds(**th), header)}


# ------------------------------------------------------------------------------------------------ the recall row
def test_recall_that_holds_passes():
    v = rows(recall_run())["recall"]
    assert v.status == "PASS", v
    assert "-> 60% beyond the window" in v.value and "ceiling 70%" in v.value, v.value


def test_a_run_that_recalls_nothing_fails():
    """The memory kept the facts but no answer held one: FAIL, even with the model answering nothing in the
    window either (the soak proved no recall)."""
    v = rows(recall_run(share=lambda t: 0.0))["recall"]
    assert v.status == "FAIL" and "recalled none of" in v.value, v
    v = rows(recall_run(share=lambda t: 0.0, ceiling=0.0))["recall"]
    assert v.status == "FAIL", v
    assert overall(list(rows(recall_run(share=lambda t: 0.0)).values()), HEADER_ON) == "FAIL"
    # a run too short to judge its windows (SHORT when it recalls some) still fails when it recalls none
    short = dict(hours=0.25, every=30, start=300, per_sample=0.5)
    assert rows(recall_run(**short))["recall"].status == "SHORT"
    v = rows(recall_run(**short, share=lambda t: 0.0))["recall"]
    assert v.status == "FAIL" and "recalled none of 10 facts asked after they left the window" in v.value, v


def test_a_last_window_that_recalls_nothing_fails():
    """Three and a half hours: the first hour recalls 60%, the last hour none (the memory stopped working)."""
    v = rows(recall_run(share=lambda t: 0.6 if t < 2.5 * 3600 else 0.0))["recall"]
    assert v.status == "FAIL" and "the last 60 min recalled none" in v.value, v
    # a short run with just enough probes: 3/9 then 0/10 is within the noise allowance, but recalling nothing
    # at the end fails whatever the noise
    few = recall_run(hours=0.5, every=30, start=60, per_sample=0.5, share=lambda t: 0.375 if t < 1200 else 0.0,
                     ceiling=0.375)
    v = rows(few, header={**HEADER_ON, "limits": {"duration": 1800.0}})["recall"]
    assert v.status == "FAIL" and "recalled none" in v.value, v


def test_a_drop_past_the_limit_fails_and_one_within_it_passes():
    drop = recall_run(share=lambda t: 0.8 if t < 2.5 * 3600 else 0.5, ceiling=0.5)  # the ceiling is no help
    v = rows(drop)["recall"]
    assert v.status == "FAIL" and "80% -> 50%" in v.value and "ceiling 50%" in v.value, v
    assert rows(drop, max_recall_drift=0.5)["recall"].status == "PASS"
    slight = recall_run(share=lambda t: 0.8 if t < 2.5 * 3600 else 0.75, ceiling=0.8)
    assert rows(slight)["recall"].status == "PASS"


def test_recall_far_below_the_in_window_ceiling_fails():
    """Stable, but the facts beyond the window are recalled far less often than in it: the memory is the limit."""
    v = rows(recall_run(share=lambda t: 0.3, ceiling=0.9))["recall"]
    assert v.status == "FAIL" and "-> 30%" in v.value and "ceiling 90%" in v.value, v
    # above the ceiling is no shortfall
    assert rows(recall_run(share=lambda t: 0.9, ceiling=0.5))["recall"].status == "PASS"
    # the ceiling is the last window's: a model that answers worse in the window late in the run (the chat around
    # it drifts) is the model's limit, not the memory's
    late = recall_run(share=lambda t: 0.3, ceiling=lambda t: 0.9 if t < 2.5 * 3600 else 0.35)
    v = rows(late)["recall"]
    assert v.status == "PASS" and "ceiling 35%" in v.value, v


def test_too_few_probes_is_short_never_a_pass():
    few = recall_run(hours=0.2, every=30, start=300, per_sample=0.5)  # 12 min: a handful of probes a window
    v = rows(few, header={**HEADER_ON, "limits": {"duration": 720.0}})["recall"]
    assert v.status == "SHORT" and "too few probes" in v.value, v
    assert overall(list(rows(few).values()), HEADER_ON) == "INCONCLUSIVE"
    none = recall_run(start=1e9)  # no fact ever left the window
    v = rows(none)["recall"]
    assert v.status == "SHORT" and "no planted fact was asked after it left the window" in v.value, v


def test_the_windows_are_an_hour_or_a_third_of_a_shorter_run():
    v = rows(recall_run(hours=8))["recall"]
    assert "first 60 min" in v.value, v
    v = rows(recall_run(hours=1.5, start=0))["recall"]
    assert "first 30 min" in v.value, v


def test_memory_off_is_not_judged():
    off = [{k: v for k, v in s.items() if not k.startswith(("recall_", "mem_"))} for s in recall_run()]
    r = rows(off, header=HEADER_OFF)
    assert r["recall"].status == "n/a" and r["recall"].value == "memory off", r["recall"]
    assert r["memory disk"].status == "n/a" and r["memory disk"].value == "memory off", r["memory disk"]
    r = rows(off, header={"kind": "start", "scenario": "chat"})  # a run recorded before the memory existed
    assert r["recall"].status == r["memory disk"].status == "n/a"


# ------------------------------------------------------------------------------------------------ the disk row
def test_disk_within_the_budget_passes_and_over_it_fails():
    assert rows(recall_run())["memory disk"].status == "PASS"
    # copies of blocks read again, let go as they left the window, are not told as lost (their blocks are held)
    let_go = [{**s, "mem_forgotten": 200, "mem_copies": 192} for s in recall_run()]
    v = rows(let_go)["memory disk"]
    assert v.value.endswith("blocks, 8 forgotten (and 192 copies of blocks read again let go, their blocks held)"), v
    over = recall_run(disk=lambda t: 10 * MIB if t < 3600 else 65 * MIB)
    v = rows(over)["memory disk"]
    assert v.status == "FAIL" and "over the budget" in v.value, v
    # over it between two samples only (the peak after an eviction), back under it at every sample
    between = recall_run(peak=lambda t: 70 * MIB if 5000 < t < 5040 else 10 * MIB)
    assert rows(between)["memory disk"].status == "FAIL"
    # the files on disk are judged too, not only the store's own count
    files = recall_run()
    for s in files[200:]:
        s["mem_disk_files"] = 80 * MIB
    assert rows(files)["memory disk"].status == "FAIL"


# ------------------------------------------------------------------------------------------------ the probe's parts
def test_an_answer_is_right_when_it_holds_the_value_as_a_number_of_its_own():
    assert recalled("The code word is 4821.", "4821")
    assert recalled("4,821", "4821")
    assert not recalled("The code word is 48210.", "4821")
    assert not recalled("I do not remember.", "4821")


def test_where_a_fact_is():
    window = [0, 1, 2, 3, 40, 41, 42, 43, 44, 45]  # four sinks, then the window from 40
    assert in_window(window, 40, 44) == "all"
    assert in_window(window, 38, 42) == "some"
    assert in_window(window, 10, 20) == "none"
    spans = [(4, 30, 26), (32, 40, 8)]
    assert held(spans, 10, 20) and not held(spans, 28, 34) and not held(spans, 40, 41)


def test_which_facts_are_asked_where(monkeypatch):
    """A fact wholly in the window is the window probe's (the newest not yet asked); one wholly out of it and held
    by the memory is the memory probe's; one out of the window that the memory no longer holds is dropped as lost,
    and one half out of the window is asked nowhere."""
    from types import SimpleNamespace

    from sinkchat.apps.soak import recall as r

    probe = r.RecallProbe()
    probe.facts = [r.Fact("old harbor", "1111", 10, 30, 0.0), r.Fact("kept tower", "2222", 50, 70, 1.0),
                   r.Fact("edge bridge", "3333", 95, 110, 2.0), r.Fact("mid lantern", "6666", 111, 118, 2.5),
                   r.Fact("new garden", "4444", 120, 140, 3.0), r.Fact("newer garden", "5555", 150, 170, 4.0)]
    probe.facts[-1].window_probed = True
    engine = SimpleNamespace(ledger=SimpleNamespace(abs_index=[0, 1, 2, 3, *range(100, 180)], seen=180), memory=None)
    monkeypatch.setattr(r, "memory_spans", lambda memory: [(4, 8, 4), (40, 100, 60)])  # 10..30 forgotten
    assert [f.topic for f in probe.memory_candidates(engine)] == ["kept tower"]
    assert probe.window_candidate(engine).topic == "new garden"
    probe.facts[3].window_probed = probe.facts[4].window_probed = True
    assert probe.window_candidate(engine) is None  # the edge bridge is half out of the window
    probe._sync(engine)
    assert [f.topic for f in probe.facts] == ["kept tower", "edge bridge", "mid lantern", "new garden", "newer garden"]
    assert probe.counts["lost"] == 1


# ------------------------------------------------------------------------------------------------ real runs
def _memory_engine(tmp_path: Path, capacity: int = 256):
    from fakes import CharTokenizer, tiny_model
    from sinkchat.config import CacheConfig, MemoryConfig, SamplingConfig
    from sinkchat.core.engine import Engine
    from sinkchat.memory.recall import RecallMemory
    from sinkchat.model.spec import ModelSpec

    model = tiny_model(max_pos=4096)
    mem = RecallMemory.for_spec(MemoryConfig("on", 1, 8, 2, 64), ModelSpec.from_model(model), tmp_path / "mem")
    return Engine(model, CharTokenizer(), CacheConfig(policy="sink", n_sink=4, capacity=capacity),
                  SamplingConfig(temperature=0, max_tokens=6, repetition_penalty=1.0), memory=mem)


def _soak(eng, scen, out: Path, **kw):
    """The soak command's sequence: session log, recorder, the loop, a last sample, the end record."""
    from sinkchat.apps.runlog import open_log
    from sinkchat.apps.soak.command import _end_records, _memory_record
    from sinkchat.apps.soak.records import Recorder, load_run
    from sinkchat.apps.soak.runner import Soak

    out.mkdir(exist_ok=True)
    slog = open_log(eng, "soak", False, None, warn=print)
    scen.slog = slog
    rec = Recorder(out, slog)
    rec.write({"kind": "start", "scenario": scen.name, "capacity": eng.cache_cfg.capacity,
               "limits": {"steps": kw.get("steps")}, "memory": _memory_record(eng)})
    soak = Soak(eng, scen, rec, **kw)
    reason = soak.run()
    soak.sample()
    _end_records(rec, soak, reason, None)
    header, samples, end = load_run(out)
    probes = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if '"probe"' in ln]
    return slog.id, header, samples, end, probes


def test_a_chat_soak_with_memory_plants_and_asks_for_facts(tmp_path, monkeypatch):
    """Through ChatScenario and the runner: facts planted every other step, asked in the window after the step and
    beyond it (held by the memory) before a later one; every probe recorded; the memory's figures in every sample;
    the probes' tokens in the run's total (the same as the session log's) but no step, no job and no perplexity bin
    of theirs, and each probe taken back out of the conversation."""
    from sinkchat.apps.soak.scenario_chat import ChatScenario
    from sinkchat.store.transcript import get_session

    from sinkchat.apps.soak.recall import RecallProbe
    from sinkchat.memory.report import spans

    seen_where = []  # where each asked fact was, told from the ledger and the memory's blocks, not by the probe
    inner = RecallProbe._ask

    def ask(self, engine, f, where):
        toks = set(range(f.first, f.end))
        in_memory = {i for a, b, _ in spans(engine.memory) for i in range(a, b)}
        seen_where.append("window" if toks <= set(engine.ledger.abs_index) else
                          "memory" if toks <= in_memory else "elsewhere")
        return (yield from inner(self, engine, f, where))

    monkeypatch.setattr(RecallProbe, "_ask", ask)
    eng = _memory_engine(tmp_path)
    scen = ChatScenario(["Say hi.", "Name a color."], max_tokens=6)
    sid, header, samples, end, probes = _soak(eng, scen, tmp_path / "run", sample_every=1e-6, steps=8)
    assert seen_where == [p["where"] for p in probes]
    assert header["memory"]["mode"] == "on"
    wheres = [p["where"] for p in probes]
    assert "window" in wheres and "memory" in wheres, wheres
    for p in probes:
        assert p["end"] > p["first"] and p["value"].isdigit() and p["age_tokens"] > 0
        assert p["right"] == recalled(p["answer"], p["value"])
    assert len({p["value"] for p in probes if p["where"] == "window"}) == wheres.count("window")  # never twice
    last = samples[-1]
    assert last["recall_window"] == wheres.count("window") and last["recall_memory"] == wheres.count("memory")
    assert last["recall_planted"] == 3  # before steps 3, 5, 7 (every other step, none before the first)
    assert last["recall_memory_block"] == sum(p["where"] == "memory" and p["block_layers"] > 0 for p in probes)
    mem = eng.memory
    assert last["mem_tokens"] == mem.tokens and last["mem_forgotten"] == mem.forgotten and last["mem_blocks"] > 0
    assert last["mem_disk_bytes"] == last["mem_disk_files"] == mem.disk_bytes <= last["mem_budget"]
    assert eng.ledger.evicted == mem.tokens + mem.forgotten  # probes keep the memory's books
    assert end["steps"] == end["jobs"] == 8 and end["errors"] == 0  # a probe is no step and no job
    # ...but its tokens count; then it is taken back: the ledger holds the plants but no probe
    assert end["tokens"] == get_session(sid).tokens == eng.ledger.seen + last["recall_tokens_taken_back"]
    assert last["recall_kept"] == 0 and last["recall_tokens_taken_back"] > 0
    said = " ".join(m["content"] for m in eng.conv.messages)
    assert "Remember this: the code word" in said and "What is the code word" not in said
    # the perplexity bins hold the scenario's feeds only: fewer scored tokens than the run fed
    scored = sum(s["nll_n"] for s in samples)
    assert 0 < scored < end["tokens"] - sum(len(p["answer"]) for p in probes)
    r = {v.name: v for v in evaluate(samples, end, Thresholds(), header)}
    assert r["memory disk"].status == "PASS", r["memory disk"]
    assert r["recall"].status in ("SHORT", "FAIL") and r["recall"].status != "n/a", r["recall"]  # a random model


def test_probes_are_not_scored_by_the_tap(tmp_path):
    from sinkchat.apps.soak.tap import NllTap

    eng = _memory_engine(tmp_path)
    tap = NllTap(eng)
    list(eng.feed("Hello there."))
    n = len(tap.drain())
    tap.paused = True
    list(eng.feed(" Remember this: the code word is 1234."))
    assert n == len("Hello there.") - 1 and tap.drain() == []
    tap.paused = False
    list(eng.feed(" More."))
    assert len(tap.drain()) == len(" More.")


def test_a_stream_soak_with_memory_plants_facts_as_text(tmp_path):
    from sinkchat.apps.soak.scenario_stream import StreamScenario

    text = tmp_path / "in.txt"
    text.write_text(" ".join(f"word{i}" for i in range(400)))
    eng = _memory_engine(tmp_path)
    scen = StreamScenario(eng, str(text), block=48)
    _, header, samples, end, probes = _soak(eng, scen, tmp_path / "run", sample_every=1e-6, steps=12)
    assert {p["where"] for p in probes} == {"window", "memory"}, probes
    assert samples[-1]["recall_planted"] == 5 and end["jobs"] == end["steps"] == 12
    assert samples[-1]["recall_kept"] == 0 and end["tokens"] == eng.ledger.seen + end["recall_tokens_taken_back"]
    assert all(s.get("decode_tok_s") is None for s in samples)  # the probes' answers are not the stream's figures
    assert eng.ledger.evicted == eng.memory.tokens + eng.memory.forgotten
    shares = [(s["gauge"], s["gauge_recalled"]) for s in samples if s.get("gauge_recalled") is not None]
    assert shares and all(s["gauge"] is not None for s in samples if s.get("gauge_recalled") is not None)
    assert max(r for _, r in shares) > 0 and all(0 <= r and g + r <= 1 for g, r in shares)  # the recalled share


def test_memory_off_soak_records_no_recall(tmp_path):
    from fakes import CharTokenizer, tiny_model
    from sinkchat.apps.soak.scenario_chat import ChatScenario
    from sinkchat.config import CacheConfig, SamplingConfig
    from sinkchat.core.engine import Engine

    eng = Engine(tiny_model(max_pos=4096), CharTokenizer(), CacheConfig(policy="sink", n_sink=4, capacity=160),
                 SamplingConfig(temperature=0, max_tokens=6, repetition_penalty=1.0))
    _, header, samples, end, probes = _soak(eng, ChatScenario(["Say hi."], max_tokens=6), tmp_path, steps=3,
                                            sample_every=1e-6)
    assert probes == [] and header["memory"] == {"mode": "off"}
    assert not any(k.startswith(("recall_", "mem_")) for s in samples for k in s)
    assert all(s["gauge_recalled"] is None for s in samples)  # no recalled share without the memory
    r = {v.name: v.status for v in evaluate(samples, end, Thresholds(), header)}
    assert r["recall"] == r["memory disk"] == "n/a"


@pytest.mark.parametrize("n", [MIN_WINDOW_PROBES])
def test_min_window_probes_is_what_short_means(n):
    """Exactly the minimum in each window is judged; one fewer is SHORT."""
    def run(per):
        return recall_run(hours=1.5, every=60, start=0, per_sample=per, share=lambda t: 0.5, ceiling=0.5)
    per_window = 30  # samples in a 30-minute window
    assert rows(run(math.ceil(n / per_window * 100) / 100))["recall"].status == "PASS"
    assert rows(run((n - 1) / per_window - 1e-3))["recall"].status == "SHORT"
