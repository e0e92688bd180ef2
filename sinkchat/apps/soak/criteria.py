"""The verdicts of a soak run, one function per criterion, over the records in metrics.jsonl (records.py).

Pure functions over the recorded series, so a run that was killed can be judged later (`sinkchat soak report DIR`)
exactly as a finished one, and the verdict logic is testable on synthetic series. Early samples are excluded as
warm-up (allocators, lazy cache allocation and the first cache fill make the first minutes unrepresentative); the
drift criteria compare a window at the start of the steady state with a window at its end.

Every criterion judges what the run did, and each can fail (tests/test_soak.py and test_soak_agent.py build a run
that fails each one): a verdict is PASS, FAIL, SHORT (the run is too short to judge it: counts as not passing when a
--duration was asked for) or n/a (the criterion does not apply, e.g. no CUDA, no tool calls, or a run under 20
minutes for the success-stability row, a run without the recall memory for the recall and memory-disk rows). The
run as a whole (`overall`) is FAIL when any criterion failed, else
INCOMPLETE when it was stopped before its planned end, else INCONCLUSIVE when a timed run was too short to judge a
criterion, else PASS; EXIT_CODES maps those to the command's exit status.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from sinkchat.apps.soak.criteria_memory import MIN_WINDOW_PROBES, memory_disk_verdict, pooled_se, recall_verdict
from sinkchat.apps.soak.series import (drift, num, past_warmup, ppl_bins, segment, series, slope_per_hour,
                                     throughput_key)
from sinkchat.apps.soak.thresholds import Thresholds
from sinkchat.apps.soak.verdict import MIB, Verdict

__all__ = ["EXIT_CODES", "MIB", "MIN_WINDOW_PROBES", "Verdict", "evaluate", "overall", "warmup_seconds"]

EXIT_FAIL = 3  # a criterion failed (1 = runtime error, 2 = usage error)
EXIT_INCOMPLETE = 4  # stopped (SIGTERM, Ctrl-C) before the planned end, nothing failed
EXIT_INCONCLUSIVE = 5  # reached its --duration, nothing failed, but too short to judge a criterion
EXIT_CODES = {"PASS": 0, "FAIL": EXIT_FAIL, "INCOMPLETE": EXIT_INCOMPLETE, "INCONCLUSIVE": EXIT_INCONCLUSIVE}
PLANNED_ENDS = ("duration", "tokens", "steps", "input exhausted")  # end reasons that are the run's planned end
MIN_RSS_SAMPLES = 6  # steady-state samples needed before an RSS slope is judged at all
MIN_PPL_BINS = 3  # perplexity bins needed in each of the first and the last window
SUCCESS_WINDOW_S = 600.0  # the success-stability row compares the first and the last this many seconds
MIN_WINDOW_JOBS = 5  # judged steps needed in each of those windows


def warmup_seconds(samples: list[dict[str, Any]], th: Thresholds) -> float:
    if th.warmup_s is not None:
        return th.warmup_s
    last = max((num(s.get("elapsed")) or 0.0 for s in samples), default=0.0)
    return min(600.0, 0.1 * last)


def evaluate(samples: list[dict[str, Any]], end: dict[str, Any] | None, th: Thresholds,
             header: dict[str, Any] | None = None) -> list[Verdict]:
    """One verdict per criterion (see the module docstring for the statuses)."""
    header = header or {}
    warm = warmup_seconds(samples, th)
    steady = past_warmup(samples, warm, header.get("resumes")) or samples
    return [_rss_verdict(steady, th), _cache_verdict(samples, header), _throughput_verdict(steady, th),
            _ppl_verdict(steady, th), _latency_verdict(steady, th), _jobs_verdict(samples, end, th, header),
            _valid_calls_verdict(samples, end, th, header), _success_stability_verdict(samples, th, header),
            recall_verdict(samples, th, header), memory_disk_verdict(samples, header),
            _errors_verdict(samples, end, th), _fault_share_verdict(samples, end, th), _crash_verdict(end),
            _completion_verdict(end, header)]


def overall(verdicts: list[Verdict], header: dict[str, Any] | None = None) -> str:
    """PASS | FAIL | INCOMPLETE | INCONCLUSIVE for the run (EXIT_CODES gives the exit status). A SHORT verdict
    blocks PASS only when the run was given a --duration: then it was meant to be long enough to judge."""
    statuses = {v.status for v in verdicts}
    if "FAIL" in statuses:
        return "FAIL"
    if "INCOMPLETE" in statuses:
        return "INCOMPLETE"
    timed = ((header or {}).get("limits") or {}).get("duration") is not None
    if "SHORT" in statuses and timed:
        return "INCONCLUSIVE"
    return "PASS"


def _last_count(samples: list[dict[str, Any]], end: dict[str, Any] | None, key: str) -> int | None:
    """A running count from the end record, or for a killed run the last sample's; None when never recorded."""
    if end is not None and key in end:
        return int(end[key] or 0)
    vals = [int(s[key]) for s in samples if isinstance(s.get(key), (int, float))]
    return max(vals) if vals else None


def _rss_verdict(steady: list[dict[str, Any]], th: Thresholds) -> Verdict:
    """Theil-Sen slope of RSS over the steady state, with its standard error from the robust scatter around the
    fit: FAIL when even slope - 2 SE is above the limit, PASS when slope + 2 SE is within it, else SHORT (the run
    is too short, or too noisy, to tell a leak of the limit's size from allocator noise)."""
    name, limit = "RSS growth per hour", f"<= {th.rss_mib_per_h:g} MiB/h"
    rows = [(segment(s), t, v / MIB) for s in steady if (t := num(s.get("elapsed"))) is not None
            and (v := num(s.get("rss"))) is not None]
    pts, groups = [(t, v) for _, t, v in rows], [g for g, _, _ in rows]
    slope = slope_per_hour(pts, groups=groups) if len(pts) >= MIN_RSS_SAMPLES else None
    if slope is None:
        return Verdict(name, f"too short to judge: {len(pts)} steady samples (need {MIN_RSS_SAMPLES})", limit,
                       "SHORT")
    resid, spread2 = [], 0.0  # each process (resumed runs) about its own level: a restart's RSS is no trend
    for g in sorted(set(groups)):
        seg = [(t, v) for gg, t, v in rows if gg == g]
        mid = statistics.median(v - slope / 3600 * t for t, v in seg)
        resid += [abs(v - mid - slope / 3600 * t) for t, v in seg]
        tbar = statistics.fmean(t for t, _ in seg)
        spread2 += sum((t - tbar) ** 2 for t, _ in seg)
    sigma = 1.4826 * statistics.median(resid)
    spread = math.sqrt(spread2) / 3600.0  # hours
    se = sigma / spread if spread > 0 else math.inf
    n_seg = len(set(groups))
    val = f"{slope:+.1f} ± {2 * se:.1f} MiB/h over {len(pts)} samples" + (f" of {n_seg} processes" if n_seg > 1
                                                                          else "")
    if slope - 2 * se > th.rss_mib_per_h:
        return Verdict(name, val, limit, "FAIL")
    if slope + 2 * se <= th.rss_mib_per_h:
        return Verdict(name, val, limit, "PASS")
    return Verdict(name, f"too short to judge: {val}", limit, "SHORT")


def _cache_verdict(samples: list[dict[str, Any]], header: dict[str, Any]) -> Verdict:
    """Over the whole run, warm-up included: the cache never held more tokens than its capacity (`cache_peak`: the
    longest it was after any model call of the interval, not just at the sample: an agent task rewound before the
    next sample would hide its peak), at every sample exactly as many as the ledger, its bytes never change, and
    its buffers are never reallocated (their addresses stay the same within a process). RSS growth (the slope
    above) is what catches memory leaked anywhere else. A run recorded before `cache_peak` existed is judged by its
    samples' lengths."""
    name, limit = "cache bounded", "len <= capacity, == ledger; bytes and buffers unchanged"
    cap_h = num(header.get("capacity"))
    rows = [s for s in samples if num(s.get("cache_len")) is not None]
    if not rows:
        return Verdict(name, "no cache figures recorded", limit, "n/a")
    bad: list[str] = []
    for s in rows:
        cap = num(s.get("capacity")) or cap_h
        n = int(s["cache_len"])
        top = max(n, int(num(s.get("cache_peak")) or 0))
        if cap is not None and top > cap:
            bad.append(f"{top} tokens > capacity {int(cap)} by {s.get('elapsed')} s")
        led = num(s.get("ledger_len"))
        if led is not None and int(led) != n:
            bad.append(f"cache {n} != ledger {int(led)} at {s.get('elapsed')} s")
    cb = sorted({v for _, v in series(rows, "cache_bytes") if v > 0})
    if len(cb) > 1:
        bad.append(f"bytes changed {cb[0] / MIB:.2f}..{cb[-1] / MIB:.2f} MiB")
    ptrs: dict[int, set[Any]] = {}  # per process: a resumed run's new process has buffers of its own
    for s in rows:
        if s.get("cache_ptrs") is not None:
            ptrs.setdefault(segment(s), set()).add(s.get("cache_ptrs"))
    moved = max((len(p) for p in ptrs.values()), default=0)
    if moved > 1:
        bad.append(f"buffers reallocated ({moved} different addresses in one process)")
    cap = cap_h or num(rows[-1].get("capacity"))
    peak = max(max(int(s["cache_len"]), int(num(s.get("cache_peak")) or 0)) for s in rows)
    val = (f"peak {peak} of {int(cap)} tokens" if cap else f"peak {peak} tokens") + \
        (f", {cb[-1] / MIB:.2f} MiB" if cb else "")
    if bad:
        return Verdict(name, f"{val}; " + "; ".join(bad[:3]), limit, "FAIL")
    return Verdict(name, val, limit, "PASS")


def _throughput_verdict(steady: list[dict[str, Any]], th: Thresholds) -> Verdict:
    key = throughput_key(steady)
    d = drift(steady, key)
    if d is None or d[0] <= 0:
        return Verdict("throughput drift", "n/a", f"drop <= {th.tput_drop:.0%}", "n/a")
    drop = 1.0 - d[1] / d[0]
    return Verdict("throughput drift", f"{d[0]:.1f} -> {d[1]:.1f} {key.split('_')[0]} tok/s ({-drop:+.0%})",
                   f"drop <= {th.tput_drop:.0%}", "PASS" if drop <= th.tput_drop else "FAIL")



def _ppl_verdict(steady: list[dict[str, Any]], th: Thresholds) -> Verdict:
    """Perplexity of the input the run fed through the live cache, binned per sample: the token-weighted mean NLL
    of the last window's bins against the first window's. FAIL when the rise exceeds ln(1 + ppl_rise) plus two
    standard errors of the difference (from the spread of the bins' means: the noise allowance)."""
    name, limit = "perplexity drift", f"rise <= {th.ppl_rise:.0%} + 2 SE"
    bins = ppl_bins(steady)
    if len(bins) < 2 * MIN_PPL_BINS:
        return Verdict(name, f"too short to judge: {len(bins)} bins of scored input (need {2 * MIN_PPL_BINS})",
                       limit, "SHORT")
    t0, t1 = bins[0][0], bins[-1][0]
    w = min(3600.0, 0.25 * (t1 - t0))
    first = [b for b in bins if b[0] <= t0 + w]
    last = [b for b in bins if b[0] >= t1 - w]
    if len(first) < MIN_PPL_BINS or len(last) < MIN_PPL_BINS:  # windows by time, then at least 3 bins each
        k = max(MIN_PPL_BINS, len(bins) // 4)
        first, last = bins[:k], bins[-k:]

    def mean(bs: list[tuple[float, float, int]]) -> float:
        return sum(m * n for _, m, n in bs) / sum(n for _, _, n in bs)

    def var_of_mean(bs: list[tuple[float, float, int]]) -> float:
        return statistics.variance([m for _, m, _ in bs]) / len(bs)

    a, b = mean(first), mean(last)
    se = math.sqrt(var_of_mean(first) + var_of_mean(last))
    rise = math.exp(b - a) - 1.0
    allowed = math.log1p(th.ppl_rise) + 2 * se
    val = (f"{math.exp(a):.2f} -> {math.exp(b):.2f} ({rise:+.0%}; noise ±{math.expm1(2 * se):.0%}; "
           f"{len(first)}+{len(last)} bins)")
    return Verdict(name, val, limit, "PASS" if b - a <= allowed else "FAIL")


def _latency_verdict(steady: list[dict[str, Any]], th: Thresholds) -> Verdict:
    ratios = [s["p99_ms"] / s["p50_ms"] for s in steady
              if (num(s.get("p50_ms")) or 0) > 0 and num(s.get("p99_ms")) is not None]
    if not ratios:
        return Verdict("p99/p50 latency", "n/a", f"<= {th.latency_ratio:g}", "n/a")
    med = statistics.median(ratios)
    return Verdict("p99/p50 latency", f"{med:.2f} (worst interval {max(ratios):.2f})",
                   f"<= {th.latency_ratio:g}", "PASS" if med <= th.latency_ratio else "FAIL")


JOB_UNITS = {"chat": "replies produced", "agent": "tasks done right", "summarize": "complete summaries",
             "stream": "blocks fed"}


def _jobs_verdict(samples: list[dict[str, Any]], end: dict[str, Any] | None, th: Thresholds,
                  header: dict[str, Any]) -> Verdict:
    """Did the scenario do its job: the share of judged steps whose Outcome was ok, against --min-done. A run that
    judged no step at all did nothing, which fails."""
    unit = JOB_UNITS.get(str(header.get("scenario")), "steps done")
    name, limit = f"job done: {unit}", f">= {th.min_done:.0%}"
    jobs, ok = _last_count(samples, end, "jobs"), _last_count(samples, end, "jobs_ok")
    if jobs is None:
        return Verdict(name, "not recorded (a run from an older version)", limit, "n/a")
    if jobs == 0:
        return Verdict(name, "no step finished", limit, "FAIL")
    share = (ok or 0) / jobs
    return Verdict(name, f"{ok}/{jobs} ({share:.0%})", limit, "PASS" if share >= th.min_done else "FAIL")


def _valid_calls_verdict(samples: list[dict[str, Any]], end: dict[str, Any] | None, th: Thresholds,
                         header: dict[str, Any]) -> Verdict:
    """The agent's tool calls: the share that were valid (a known tool, arguments matching its schema) and ran
    without error, against --min-valid-calls. An agent run with no valid call fails whatever else happened: its
    tasks cannot have been done with the tools (before the calls were grammar-constrained, a 120 s soak made 0 valid
    calls and passed every other row). A scenario that calls no tools records no counts: n/a."""
    scenario = str(header.get("scenario"))
    name, limit = "agent valid-call share", f">= {th.min_valid_calls:.0%} of calls valid and ran ok"
    ok, failed = _last_count(samples, end, "tool_calls_ok"), _last_count(samples, end, "tool_calls_failed")
    if ok is None or failed is None:
        why = "not recorded (a run from an older version)" if scenario == "agent" else f"{scenario}: no tool calls"
        return Verdict(name, why, limit, "n/a")
    total, invalid = ok + failed, _last_count(samples, end, "tool_calls_invalid")
    if total == 0:
        return Verdict(name, "no tool call made", limit, "FAIL")
    share = ok / total
    val = f"{ok}/{total} ({share:.1%})"
    if invalid is not None:
        val += f"; failed: {invalid} rejected, {failed - invalid} tool errors"
    if ok == 0:
        return Verdict(name, f"no valid call: {val}", limit, "FAIL")
    return Verdict(name, val, limit, "PASS" if share >= th.min_valid_calls else "FAIL")


def _window_counts(samples: list[dict[str, Any]]) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """(jobs, jobs ok) in the first SUCCESS_WINDOW_S seconds and in the last ones, from the running counts of the
    samples; None when the counts were not recorded or no sample falls in the first window. Both windows end (or
    start) at a sample, so each covers at most SUCCESS_WINDOW_S seconds."""
    pts = [(t, int(j), int(k)) for s in samples
           if (t := num(s.get("elapsed"))) is not None and (j := num(s.get("jobs"))) is not None
           and (k := num(s.get("jobs_ok"))) is not None]
    first = [p for p in pts if p[0] <= SUCCESS_WINDOW_S]
    if not pts or not first:
        return None
    t_end, j_end, k_end = pts[-1]
    base = next(p for p in pts if p[0] >= t_end - SUCCESS_WINDOW_S)
    return (first[-1][1], first[-1][2]), (j_end - base[1], k_end - base[2])


def _success_stability_verdict(samples: list[dict[str, Any]], th: Thresholds, header: dict[str, Any]) -> Verdict:
    """Quality on a long loop: the share of judged steps done right in the last 10 minutes against the first 10
    ("stable quality on long agent loops", measured), within --max-success-drift plus two standard errors of the
    difference (binomial, pooled, as the recall row: an 8-hour agent soak's first 10 minutes held 26 tasks). A run
    under 20 minutes is not judged (n/a, never PASS); a window with fewer than MIN_WINDOW_JOBS judged steps is
    SHORT."""
    unit = JOB_UNITS.get(str(header.get("scenario")), "steps done")
    mins = SUCCESS_WINDOW_S / 60
    name = f"success stability: {unit}"
    limit = f"last {mins:g} min within {th.max_success_drift * 100:g} points (+2 SE) of first {mins:g} min"
    span = max((num(s.get("elapsed")) or 0.0 for s in samples), default=0.0)
    if span < 2 * SUCCESS_WINDOW_S:
        return Verdict(name, f"not judged (run < {2 * mins:g} min: {span / 60:.1f} min)", limit, "n/a")
    win = _window_counts(samples)
    if win is None:
        return Verdict(name, "not recorded (no counts in the first window)", limit, "n/a")
    (j1, k1), (j2, k2) = win
    if min(j1, j2) < MIN_WINDOW_JOBS:
        return Verdict(name, f"too few steps judged: {j1} first, {j2} last (need {MIN_WINDOW_JOBS} each)", limit,
                       "SHORT")
    a, b = k1 / j1, k2 / j2
    se = pooled_se(k1, j1, k2, j2)  # 26 tasks in a window: a 16-point swing is within the noise (2 SE: 23 points)
    val = (f"{a:.0%} -> {b:.0%} ({(b - a) * 100:+.1f} points; {k1}/{j1} first, {k2}/{j2} last; noise "
           f"±{2 * se * 100:.0f} points)")
    return Verdict(name, val, limit, "PASS" if abs(b - a) <= th.max_success_drift + 2 * se + 1e-9 else "FAIL")


def _errors_verdict(samples: list[dict[str, Any]], end: dict[str, Any] | None, th: Thresholds) -> Verdict:
    """The end record's totals; for a killed run (no end record) the last sample's running counts."""
    errors = int((end or {}).get("errors", max((int(s.get("errors") or 0) for s in samples), default=0)))
    faults = int((end or {}).get("faults", max((int(s.get("faults") or 0) for s in samples), default=0)))
    return Verdict("errors", f"{errors} (+{faults} handled faults)", f"<= {th.max_errors}",
                   "PASS" if errors <= th.max_errors else "FAIL")


def _fault_share_verdict(samples: list[dict[str, Any]], end: dict[str, Any] | None, th: Thresholds) -> Verdict:
    """Handled faults are expected now and then; a run where most steps fault is not working."""
    name, limit = "faulted steps", f"<= {th.max_fault_share:.0%} of steps"
    steps, faulted = _last_count(samples, end, "attempts"), _last_count(samples, end, "faulted_steps")
    if steps is None or faulted is None:
        return Verdict(name, "not recorded (a run from an older version)", limit, "n/a")
    if steps == 0:
        return Verdict(name, "no step ran", limit, "FAIL")
    share = faulted / steps
    return Verdict(name, f"{faulted}/{steps} attempted ({share:.0%})", limit,  # attempts: the cut-off one too
                   "PASS" if share <= th.max_fault_share else "FAIL")


def _crash_verdict(end: dict[str, Any] | None) -> Verdict:
    if end is None:
        return Verdict("crashes", "no end record: the process died (killed or crashed)", "clean end", "FAIL")
    reason = str(end.get("reason", "?"))
    return Verdict("crashes", f"ended: {reason}", "clean end", "FAIL" if reason == "crashed" else "PASS")


def _completion_verdict(end: dict[str, Any] | None, header: dict[str, Any]) -> Verdict:
    """A run stopped before its planned end (SIGTERM, Ctrl-C) is INCOMPLETE, never PASS; reaching a limit, or the
    end of a stdin stream, is the planned end. A missing end record is the crash verdict's FAIL."""
    limits = header.get("limits") or {}
    plan = ", ".join(f"{k} {_plan(k, v)}" for k, v in limits.items() if v is not None) or "a limit"
    name, limit = "ran as planned", plan
    if end is None:
        return Verdict(name, "no end record", limit, "INCOMPLETE")
    reason = str(end.get("reason", "?"))
    el = num(end.get("elapsed")) or 0.0
    done = f"ended: {reason} after {el / 60:.1f} min, {end.get('steps', '?')} steps"
    if reason in PLANNED_ENDS:
        return Verdict(name, done, limit, "PASS")
    if reason == "crashed":
        return Verdict(name, done, limit, "FAIL")
    return Verdict(name, done, limit, "INCOMPLETE")


def _plan(key: str, v: Any) -> str:
    """A limit as the user gave it: "20 s", "30 min", "8 h" (not "0.333333 min")."""
    if key != "duration":
        return str(v)
    sec = float(v)
    if sec < 120:
        return f"{sec:g} s"
    if sec % 3600 == 0:
        return f"{sec / 3600:g} h"
    return f"{sec / 60:g} min" if sec % 60 == 0 else f"{sec / 60:.1f} min"
