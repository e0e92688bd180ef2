"""The pass limits of a soak run: every one a flag of `sinkchat soak` and `sinkchat soak report`, recorded in the
run's start record so a killed run is judged later with the limits it was started with."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Callable

import click


@dataclass(frozen=True)
class Thresholds:
    """Pass limits; every one is a flag of `sinkchat soak` and `sinkchat soak report`."""

    rss_mib_per_h: float = 64.0  # max RSS slope after warm-up
    tput_drop: float = 0.30  # max relative throughput drop, last window vs first
    ppl_rise: float = 0.25  # max relative perplexity rise, last window vs first (plus 2 standard errors)
    latency_ratio: float = 6.0  # max median-over-intervals of p99/p50
    max_errors: int = 0
    min_done: float = 0.8  # min share of steps that did their job (replies, tasks done right, summaries, blocks)
    max_fault_share: float = 0.5  # max share of steps with at least one handled fault or error
    min_valid_calls: float = 0.9  # agent: min share of its tool calls that were valid and ran ok
    max_success_drift: float = 0.10  # max change of the job-done share, last 10 minutes vs first 10 (20 min runs)
    max_recall_drift: float = 0.10  # --memory on: max change of the planted facts recalled from beyond the window,
    # last window vs first, and max shortfall of the last window against the in-window ceiling (each plus 2 SE)
    warmup_s: float | None = None  # default: 10% of the run, at most 10 minutes


THRESHOLD_FLAGS = [
    click.option("--max-rss-growth", "rss_mib_per_h", type=click.FloatRange(0), default=None,
                 help="max RSS growth after warm-up, MiB per hour [64]"),
    click.option("--max-tput-drop", "tput_drop", type=click.FloatRange(0, 1), default=None,
                 help="max throughput drop, last window vs first, as a fraction [0.30]"),
    click.option("--max-ppl-rise", "ppl_rise", type=click.FloatRange(0), default=None,
                 help="max perplexity rise, last window vs first, as a fraction [0.25]"),
    click.option("--max-latency-ratio", "latency_ratio", type=click.FloatRange(1), default=None,
                 help="max p99/p50 per-token latency (median over intervals) [6]"),
    click.option("--max-errors", type=click.IntRange(0), default=None, help="errors allowed [0]"),
    click.option("--min-done", "min_done", type=click.FloatRange(0, 1), default=None,
                 help="min share of steps that did their job: chat replies produced, agent tasks done right (files "
                      "written with the right content, right numbers), complete summaries, stream blocks fed [0.8]"),
    click.option("--max-fault-share", "max_fault_share", type=click.FloatRange(0, 1), default=None,
                 help="max share of steps with a handled fault or an error [0.5]"),
    click.option("--min-valid-calls", "min_valid_calls", type=click.FloatRange(0, 1), default=None,
                 help="agent: min share of its tool calls that were valid (known tool, arguments matching the "
                      "schema) and ran without error; a run with no valid call fails [0.9]"),
    click.option("--max-success-drift", "max_success_drift", type=click.FloatRange(0, 1), default=None,
                 help="max change of the share of steps done right, last 10 minutes vs first 10, beyond two "
                      "standard errors of the difference (judged on runs of 20 minutes or more) [0.10]"),
    click.option("--max-recall-drift", "max_recall_drift", type=click.FloatRange(0, 1), default=None,
                 help="--memory on: max change of the share of planted facts recalled from beyond the window, last "
                      "window (an hour, or a third of a shorter run) vs first, and max shortfall against the share "
                      "answered with the fact in the window; each plus two standard errors [0.10]"),
    click.option("--warmup", "warmup_s", type=click.FloatRange(0), default=None,
                 help="seconds excluded at the start [a tenth of the run, at most 600]"),
]


def threshold_options(f: Callable[..., Any]) -> Callable[..., Any]:
    for opt in reversed(THRESHOLD_FLAGS):
        f = opt(f)
    return f


def pop_thresholds(kwargs: dict[str, Any], base: Thresholds | None = None) -> Thresholds:
    """Thresholds from flags (removed from kwargs) over `base` (e.g. the ones the run recorded)."""
    names = [f.name for f in fields(Thresholds)]
    given = {k: kwargs.pop(k) for k in names if k in kwargs}
    cur = asdict(base or Thresholds())
    cur.update({k: v for k, v in given.items() if v is not None})
    return Thresholds(**cur)


def recorded_thresholds(header: dict[str, Any]) -> Thresholds:
    """The thresholds the run was started with (unknown keys from other versions ignored)."""
    known = {f.name for f in fields(Thresholds)}
    return Thresholds(**{k: v for k, v in (header.get("thresholds") or {}).items() if k in known})
