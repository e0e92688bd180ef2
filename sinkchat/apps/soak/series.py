"""The recorded series of a soak run as numbers: the finite values of a field over elapsed time, their robust slope,
the first and last windows of the steady state, and the perplexity bins. Shared by the criteria and the report."""

from __future__ import annotations

import math
import statistics
from typing import Any

MIN_BIN_TOKENS = 8  # tokens a sample must have scored to count as a perplexity bin


def num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def series(samples: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    """(elapsed, value) for the samples where `key` holds a finite number."""
    out = []
    for s in samples:
        t, v = num(s.get("elapsed")), num(s.get(key))
        if t is not None and v is not None:
            out.append((t, v))
    return out


def slope_per_hour(points: list[tuple[float, float]], max_points: int = 300,
                   groups: list[int] | None = None) -> float | None:
    """Theil-Sen slope (median of pairwise slopes) per hour: a leak is a steady trend, while allocator noise and
    transient spikes (a big logits buffer) would swing a least-squares fit on a short run. `groups` (one per point):
    only pairs within a group count, e.g. the processes of a resumed run, each of which starts its RSS afresh."""
    if len(points) < 3:
        return None
    step = max(1, len(points) // max_points)
    pts, gs = points[::step], (groups or [0] * len(points))[::step]
    slopes = [(b[1] - a[1]) / (b[0] - a[0]) for i, a in enumerate(pts) for j, b in enumerate(pts[i + 1 :], i + 1)
              if b[0] > a[0] and gs[i] == gs[j]]
    return statistics.median(slopes) * 3600.0 if slopes else None


def segment(s: dict[str, Any]) -> int:
    """Which process recorded a sample: 0, then one more after each `soak resume` (older runs: 0)."""
    v = num(s.get("segment"))
    return int(v) if v is not None else 0


def past_warmup(samples: list[dict[str, Any]], warm: float,
                resumes: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The samples `warm` seconds after the start of the run and after the start of their process (a resumed run
    warms up again: allocators, lazy buffers): its `resume` record's elapsed, else its first sample's."""
    starts: dict[int, float] = {0: 0.0}
    for r in resumes or []:
        if num(r.get("elapsed")) is not None and num(r.get("segment")) is not None:
            starts[int(r["segment"])] = float(r["elapsed"])
    for s in samples:
        t = num(s.get("elapsed"))
        if t is not None and segment(s) not in starts:
            starts[segment(s)] = t
    return [s for s in samples if (num(s.get("elapsed")) or 0.0) >= starts.get(segment(s), 0.0) + warm]


def windows(points: list[tuple[float, float]]) -> tuple[list[float], list[float]] | None:
    """Values in the first and the last window of the steady state: an hour, or a quarter of a shorter span."""
    if len(points) < 2:
        return None
    t0, t1 = points[0][0], points[-1][0]
    w = min(3600.0, 0.25 * (t1 - t0))
    first = [v for t, v in points if t <= t0 + w]
    last = [v for t, v in points if t >= t1 - w]
    return first, last


def drift(samples: list[dict[str, Any]], key: str) -> tuple[float, float] | None:
    pts = series(samples, key)
    win = windows(pts)
    if win is None:
        return None
    return statistics.median(win[0]), statistics.median(win[1])


def throughput_key(samples: list[dict[str, Any]]) -> str:
    """Decode tok/s where the scenario generates; prefill tok/s for the stream scenario (no decoding)."""
    return "decode_tok_s" if any((num(s.get("decode_tok_s")) or 0) > 0 for s in samples) else "prefill_tok_s"


def ppl_bins(samples: list[dict[str, Any]]) -> list[tuple[float, float, int]]:
    """(elapsed, mean NLL, tokens) of each sample that scored >= MIN_BIN_TOKENS tokens fed through the cache."""
    out = []
    for s in samples:
        t, tot, n = num(s.get("elapsed")), num(s.get("nll_sum")), num(s.get("nll_n"))
        if t is not None and tot is not None and n is not None and n >= MIN_BIN_TOKENS:
            out.append((t, tot / n, int(n)))
    return out


def _share(ok: Any, failed: Any) -> float | None:
    a, b = num(ok), num(failed)
    return a / (a + b) if a is not None and b is not None and a + b > 0 else None


def _ratio(ok: Any, total: Any) -> float | None:
    a, n = num(ok), num(total)
    return a / n if a is not None and n else None


def with_call_shares(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The samples with the agent's valid-call share added, for the plot: `valid_call_share` over the run so far
    and `interval_valid_call_share` over each sample's own interval (absent where no call was counted, so an
    interval without calls is a gap, not a 0%); with the recall memory on, the share of planted facts recalled so far,
    asked beyond the window (`recall_memory_share`) and in it (`recall_window_share`)."""
    out = []
    for s in samples:
        extra = {"valid_call_share": _share(s.get("tool_calls_ok"), s.get("tool_calls_failed")),
                 "interval_valid_call_share": _share(s.get("interval_tool_calls_ok"),
                                                     s.get("interval_tool_calls_failed")),
                 "recall_memory_share": _ratio(s.get("recall_memory_ok"), s.get("recall_memory")),
                 "recall_window_share": _ratio(s.get("recall_window_ok"), s.get("recall_window"))}
        out.append({**s, **{k: v for k, v in extra.items() if v is not None}})
    return out
