"""The figures a soak reports must be what the run did: the perplexity-drift noise term is a standard error, the cache
peak is the true peak over the run (not the largest of a few samples), and the report's token total is the one the
session log (`sinkchat logs`) shows for the same run."""

from __future__ import annotations

import math

import pytest

from sinkchat.apps.runlog import open_log
from sinkchat.apps.soak.criteria import evaluate
from sinkchat.apps.soak.thresholds import Thresholds

from test_soak import HEADER, synth


# ------------------------------------------------------------------------------------------------ perplexity noise
def _ppl_run(hours: float, scatter: float, rise: float, every: float = 30.0) -> str:
    """A run whose perplexity is flat for its first half and `rise` higher for its second; each sample's bin
    scatters by exactly +-`scatter` nats around that (alternating, so the windows' means are the stated levels)."""
    half = hours * 3600 / 2

    def nll_sum(t: float) -> float:
        level = 2.3 + (math.log1p(rise) if t > half else 0.0)
        return 100 * (level + (scatter if round(t / every) % 2 else -scatter))

    samples = synth(n=int(hours * 3600 / every), every=every, nll_sum=nll_sum, nll_n=100)
    v = {x.name: x for x in evaluate(samples, {"kind": "end", "reason": "duration"}, Thresholds(), HEADER)}
    return v["perplexity drift"]


@pytest.mark.parametrize("hours,scatter", [(1, 0.15), (4, 0.3)])
@pytest.mark.parametrize("rise", [0.38, 0.49, 0.60])
def test_a_ppl_rise_well_past_the_limit_fails_however_many_bins(hours, scatter, rise):
    """Mutation 10: the noise allowance is two standard errors of the difference of the windows' means (the bins'
    variance over their count, square-rooted). With the bins' variance (or their standard deviation) in its place the
    allowance grows with the scatter instead of shrinking with the number of bins, and a +38%, +49% or +60% rise
    after an hour passed. 28 and 116 bins per window, each scattered by 0.15 / 0.3 nats: 2 SE is ~0.08 nats."""
    v = _ppl_run(hours, scatter, rise)
    assert v.status == "FAIL", v
    assert f"+{rise:.0%}" in v.value, v  # the rise it judged is the one built in


def test_a_ppl_rise_under_the_limit_passes():
    """The other side of the same run: +20% is within the 25% limit whatever the noise."""
    v = _ppl_run(4, 0.3, 0.20)
    assert v.status == "PASS", v


def test_few_noisy_bins_give_a_wide_allowance():
    """An hour of bins scattered by 0.6 nats: a +40% difference between the windows is within two standard errors
    (~0.33 nats), so it passes. A noise term without the square root (the variance of the mean, ~0.03 nats here)
    would fail it: the allowance must be a standard error, neither larger nor smaller."""
    v = _ppl_run(1, 0.6, 0.40)
    assert v.status == "PASS", v


# ------------------------------------------------------------------------------------------------ the run's figures
def _engine(capacity: int = 256):
    from sinkchat.config import CacheConfig, SamplingConfig
    from sinkchat.core.engine import Engine

    from fakes import CharTokenizer, tiny_model

    return Engine(tiny_model(max_pos=4096), CharTokenizer(), CacheConfig(policy="sink", n_sink=4, capacity=capacity),
                  SamplingConfig(temperature=0, max_tokens=6, repetition_penalty=1.0))


def _soak(eng, scen, out, **kw):
    """The soak command's own sequence on `scen`: session log, recorder, the loop, a last sample, the end record;
    returns (session id, samples, end record) as `soak report` and `sinkchat logs` read them."""
    from sinkchat.apps.soak.command import _end_records
    from sinkchat.apps.soak.records import Recorder, load_run
    from sinkchat.apps.soak.runner import Soak

    slog = open_log(eng, "soak", False, None, warn=print)
    scen.slog = slog
    rec = Recorder(out, slog)
    soak = Soak(eng, scen, rec, **kw)
    reason = soak.run()
    soak.sample()
    _end_records(rec, soak, reason, None)
    _, samples, end = load_run(out)
    return slog.id, samples, end


class _Rewinding:
    """Like the agent's tasks: each step starts from a checkpoint (the system prompt) and feeds a long task, which
    the next task's start rewinds. Here the task is rewound at once, so no sample can see it in the cache."""

    name, recover = "agent", None

    def __init__(self, task_tokens: int) -> None:
        from sinkchat.apps.agent.checkpoint import TaskCheckpoint

        self.n, self.checkpoint = task_tokens, TaskCheckpoint()

    def step(self, engine):
        from sinkchat.apps.soak.steps import Outcome

        if not engine.cache.length:
            yield from engine.feed("a system prompt")
        self.checkpoint.restore(engine)
        yield from engine.feed_ids([7] * self.n)
        assert self.checkpoint.restore(engine)  # rewound: the cache is back at the checkpoint
        yield Outcome(True, "fed")


def test_the_cache_peak_is_the_longest_the_cache_was_not_the_longest_sample(tmp_path):
    """Before: "peak 256 of 2048 tokens" while each agent task fed 1,191: the peak was the largest `cache_len` of
    two samples, taken after the tasks had been rewound. The peak is now tracked at every model call."""
    eng = _engine()
    scen = _Rewinding(150)
    _, samples, end = _soak(eng, scen, tmp_path, sample_every=3600.0, steps=4)
    base = scen.checkpoint.length
    assert base > 0 and max(s["cache_len"] for s in samples) == base  # the samples never saw a task
    v = {x.name: x for x in evaluate(samples, end, Thresholds(), HEADER)}["cache bounded"]
    assert v.status == "PASS" and v.value.startswith(f"peak {base + 150} of 256 tokens"), v


def test_a_peak_over_capacity_between_samples_fails():
    """The peak is judged against the capacity too, not only the samples' lengths."""
    over = synth(cache_peak=lambda t: 300 if 1800 < t < 1900 else 200)  # capacity 256; every cache_len is 200
    v = {x.name: x for x in evaluate(over, {"kind": "end", "reason": "duration"}, Thresholds(), HEADER)}
    assert v["cache bounded"].status == "FAIL" and "300 tokens > capacity 256" in v["cache bounded"].value


@pytest.mark.parametrize("scenario", ["summarize", "chat"])
def test_the_report_and_the_session_log_count_the_same_tokens(scenario, tmp_path):
    """Before: 14,070 tokens in the soak report and 13,514 in `sinkchat logs` for the same agent run: the log
    summed its turns (leaving out what is fed between them: the agent's tool results, summarize's log lines) and
    the report counted events (leaving out generated EOS tokens). Both now count every token the model processed;
    with no rewinds that is the ledger's `seen`, counted independently."""
    from sinkchat.apps.soak.scenario_chat import ChatScenario
    from sinkchat.apps.soak.scenario_summarize import SummarizeScenario
    from sinkchat.store.transcript import get_session, turns

    eng = _engine(capacity=512)
    scen = (SummarizeScenario(max_tokens=6, lines_per_summary=6, chunk_lines=3) if scenario == "summarize"
            else ChatScenario(["Say hi.", "Name a color."], max_tokens=6))
    sid, samples, end = _soak(eng, scen, tmp_path, sample_every=1e-6, steps=3)
    info = get_session(sid)
    assert end["tokens"] == info.tokens == eng.ledger.seen, (end["tokens"], info.tokens, eng.ledger.seen)
    assert samples[-1]["tokens"] == end["tokens"]
    asked = [t for t in turns(sid) if t.role == "user"]  # each question's turn says what feeding it took
    assert len(asked) == 3 and all(t.tokens > 0 and t.seconds > 0 for t in asked), asked
