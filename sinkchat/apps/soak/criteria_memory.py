"""The soak's rows for the recall memory (`--memory on`): planted facts recalled beyond the window as well at the
end as at the start and as in the window (`recall`), and the store within its disk budget (`memory disk`). Pure
functions over the recorded samples, like criteria.py; both n/a with the memory off."""

from __future__ import annotations

import math
from typing import Any

from sinkchat.apps.soak.series import num
from sinkchat.apps.soak.thresholds import Thresholds
from sinkchat.apps.soak.verdict import MIB, Verdict

RECALL_WINDOW_S = 3600.0  # the recall row compares the first and the last hour (a third of a shorter run)
MIN_WINDOW_PROBES = 8  # recall probes needed in each of its windows, and in-window probes for the ceiling


def _memory_off(header: dict[str, Any]) -> bool:
    mem = header.get("memory")
    return not (isinstance(mem, dict) and mem.get("mode") == "on")


RecallRow = tuple[float, int, int, int, int]  # elapsed, memory probes, right, window probes, right (running)


def _recall_rows(samples: list[dict[str, Any]]) -> list[RecallRow]:
    keys = ("recall_memory", "recall_memory_ok", "recall_window", "recall_window_ok")
    out = []
    for s in samples:
        t, vals = num(s.get("elapsed")), [num(s.get(k)) for k in keys]
        if t is not None and all(v is not None for v in vals):
            out.append((t, *(int(v) for v in vals)))  # type: ignore[arg-type]
    return sorted(out)


def pooled_se(k1: int, n1: int, k2: int, n2: int) -> float:
    """Standard error of the difference of two shares (k1/n1, k2/n2) under their pooled share."""
    p = (k1 + k2) / (n1 + n2)
    return math.sqrt(p * (1 - p) * (1 / n1 + 1 / n2))


def _blocks_note(samples: list[dict[str, Any]], n: int) -> str:
    """Whether the memory recalled the asked fact's block (a wrong answer: the memory's miss, or the model's?)."""
    blocks = num(samples[-1].get("recall_memory_block")) if samples else None
    return "" if blocks is None else f"; the fact's block recalled for {int(blocks)}/{n} asked beyond the window"


def recall_verdict(samples: list[dict[str, Any]], th: Thresholds, header: dict[str, Any]) -> Verdict:
    """With the recall memory on (recall.py): the share of planted facts answered right when asked after they left
    the window, in the last window of the run against the first (an hour each, a third of the span of a shorter
    run, counted from the last sample before the first such probe) and against the in-window ceiling (the share
    answered right with the fact in the window, in the same last window: the model's own limit at that point of the
    run, so a model that drifts answers worse in the window too). Each may differ by --max-recall-drift plus two
    standard errors of the difference (binomial, pooled: the noise of a few dozen probes). A run whose facts were
    never recalled from beyond the window, or whose last window recalled none, FAILs whatever the noise. SHORT when a
    window or the ceiling has fewer than MIN_WINDOW_PROBES probes; n/a with the memory off."""
    d = th.max_recall_drift
    name = "recall"
    limit = (f"beyond the window: last window within {d * 100:g} points (+2 SE) of the first, and of the "
             "in-window ceiling of the last window")
    rows = _recall_rows(samples)
    if not rows:
        why = "memory off" if _memory_off(header) else "no recall probes recorded"
        return Verdict(name, why, limit, "n/a")
    end = rows[-1]
    _, n, k, nc, kc = end
    if n >= MIN_WINDOW_PROBES and k == 0:
        return Verdict(name, f"recalled none of {n} facts asked after they left the window "
                             f"(in the window: {kc}/{nc}){_blocks_note(samples, n)}", limit, "FAIL")
    if n == 0:
        return Verdict(name, f"no planted fact was asked after it left the window (in the window: {kc}/{nc})",
                       limit, "SHORT")
    before = [r for r in rows if r[1] == 0]
    t_b = before[-1][0] if before else 0.0
    w = min(RECALL_WINDOW_S, (end[0] - t_b) / 3)
    first = ([r for r in rows if r[1] > 0 and r[0] <= t_b + w] or [next(r for r in rows if r[1] > 0)])[-1]
    base = next(r for r in rows if r[0] >= end[0] - w)
    n1, k1 = first[1], first[2]
    n2, k2, nc2, kc2 = end[1] - base[1], end[2] - base[2], end[3] - base[3], end[4] - base[4]
    span = f"{w / 60:.0f} min" if w >= 120 else f"{w:.0f} s"
    if first[0] > base[0]:  # too few samples to tell two windows apart
        n2 = k2 = nc2 = kc2 = 0
    if min(n1, n2) >= MIN_WINDOW_PROBES and k2 == 0:
        return Verdict(name, f"the last {span} recalled none of {n2} facts beyond the window (first {span}: "
                             f"{k1}/{n1}; in the window, last {span}: {kc2}/{nc2}){_blocks_note(samples, n)}", limit,
                       "FAIL")
    if min(n1, n2, nc2) < MIN_WINDOW_PROBES:
        return Verdict(name, f"too few probes: beyond the window {n1} in the first {span}, {n2} in the last; "
                             f"{nc2} in the window in the last (need {MIN_WINDOW_PROBES} each); {k}/{n} right "
                             f"beyond, {kc}/{nc} in the window", limit, "SHORT")
    a, b, c = k1 / n1, k2 / n2, kc2 / nc2
    se_d, se_c = pooled_se(k1, n1, k2, n2), pooled_se(k2, n2, kc2, nc2)
    val = (f"{a:.0%} -> {b:.0%} beyond the window ({k1}/{n1} first {span}, {k2}/{n2} last; noise ±"
           f"{2 * se_d * 100:.0f} points); in-window ceiling {c:.0%} ({kc2}/{nc2} last {span}; noise ±"
           f"{2 * se_c * 100:.0f})")
    val += _blocks_note(samples, n)
    ok = abs(b - a) <= d + 2 * se_d + 1e-9 and c - b <= d + 2 * se_c + 1e-9
    return Verdict(name, val, limit, "PASS" if ok else "FAIL")


def memory_disk_verdict(samples: list[dict[str, Any]], header: dict[str, Any]) -> Verdict:
    """With the recall memory on: its bytes on disk (the store's count, the folder's files, and the peak after
    every eviction between samples) never above its budget (--memory-budget). n/a with the memory off."""
    name = "memory disk"
    rows = [s for s in samples if num(s.get("mem_budget")) is not None]
    if not rows:
        why = "memory off" if _memory_off(header) else "no memory figures recorded"
        return Verdict(name, why, "<= --memory-budget", "n/a")
    budget = min(int(num(s["mem_budget"]) or 0) for s in rows)
    limit = f"<= {budget / MIB:g} MiB (--memory-budget)"
    over = []
    peak = 0
    for s in rows:
        top = max(int(num(s.get(k)) or 0) for k in ("mem_disk_bytes", "mem_disk_files", "mem_disk_peak"))
        peak = max(peak, top)
        if top > budget:
            over.append(f"{top / MIB:.1f} MiB by {s.get('elapsed')} s")
    last = rows[-1]
    gone, copies = int(num(last.get("mem_forgotten")) or 0), int(num(last.get("mem_copies")) or 0)
    val = (f"peak {peak / MIB:.1f} MiB; at the end {int(num(last.get('mem_tokens')) or 0)} tokens held in "
           f"{int(num(last.get('mem_blocks')) or 0)} blocks, {gone - copies} forgotten"
           + (f" (and {copies} copies of blocks read again let go, their blocks held)" if copies else ""))
    if over:
        return Verdict(name, f"{val}; over the budget: " + "; ".join(over[:3]), limit, "FAIL")
    return Verdict(name, val, limit, "PASS")
