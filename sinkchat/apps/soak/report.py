"""Verdicts, plots and report.md for a soak run directory (metrics.jsonl written by `sinkchat soak`, records.py).

Pure functions over the recorded series, so a run that was killed can be judged later (`sinkchat soak report DIR`)
exactly as a finished one, and the verdict logic is testable on synthetic series. Early samples are excluded as
warm-up (allocators, lazy cache allocation and the first cache fill make the first minutes unrepresentative); the
drift criteria compare a window at the start of the steady state with a window at its end.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable

import click

from sinkchat.apps.soak.records import load_run

log = logging.getLogger(__name__)

MIB = 1024 * 1024
EXIT_FAIL = 3  # a criterion failed (1 = runtime error, 2 = usage error)
SERIES = {  # file name -> (title, [(field, label)], unit scale, unit)
    "rss": ("process RSS", [("rss", "RSS")], MIB, "MiB"),
    "cache_bytes": ("KV cache bytes", [("cache_bytes", "allocated")], MIB, "MiB"),
    "throughput": ("throughput", [("decode_tok_s", "decode"), ("prefill_tok_s", "prefill")], 1, "tok/s"),
    "latency": ("per-token latency", [("p50_ms", "p50"), ("p99_ms", "p99")], 1, "ms"),
    "ppl": ("perplexity", [("ppl", "criterion"), ("ppl_input", "input via cache"), ("ppl_probe", "probe (dense)")], 1, ""),
    "gauge": ("sink gauge (attention share on first slots)", [("gauge", "share")], 1, ""),
    "tokens": ("tokens", [("tokens", "processed"), ("evicted", "evicted")], 1, ""),
    "errors": ("errors and faults", [("errors", "errors"), ("faults", "faults")], 1, ""),
    "cuda": ("CUDA memory", [("cuda", "allocated"), ("cuda_peak", "peak")], MIB, "MiB"),
}


@dataclass(frozen=True)
class Thresholds:
    """Pass limits; every one is a flag of `sinkchat soak` and `sinkchat soak report`."""

    rss_mib_per_h: float = 64.0  # max RSS slope after warm-up
    tput_drop: float = 0.30  # max relative throughput drop, last window vs first
    ppl_rise: float = 0.25  # max relative perplexity rise, last window vs first
    latency_ratio: float = 6.0  # max median-over-intervals of p99/p50
    max_errors: int = 0
    warmup_s: float | None = None  # default: 10% of the run, at most 10 minutes


@dataclass(frozen=True)
class Verdict:
    name: str
    value: str
    threshold: str
    status: str  # PASS | FAIL | n/a

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"


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


# ------------------------------------------------------------------------------------------------------- verdicts
def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def series(samples: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    """(elapsed, value) for the samples where `key` holds a finite number."""
    out = []
    for s in samples:
        t, v = _num(s.get("elapsed")), _num(s.get(key))
        if t is not None and v is not None:
            out.append((t, v))
    return out


def slope_per_hour(points: list[tuple[float, float]], max_points: int = 300) -> float | None:
    """Theil-Sen slope (median of pairwise slopes) per hour: a leak is a steady trend, while allocator noise and
    transient spikes (a big logits buffer) would swing a least-squares fit on a short run."""
    if len(points) < 3:
        return None
    step = max(1, len(points) // max_points)
    pts = points[::step]
    slopes = [(b[1] - a[1]) / (b[0] - a[0]) for i, a in enumerate(pts) for b in pts[i + 1 :] if b[0] > a[0]]
    return statistics.median(slopes) * 3600.0 if slopes else None


def warmup_seconds(samples: list[dict[str, Any]], th: Thresholds) -> float:
    if th.warmup_s is not None:
        return th.warmup_s
    last = max((_num(s.get("elapsed")) or 0.0 for s in samples), default=0.0)
    return min(600.0, 0.1 * last)


def windows(points: list[tuple[float, float]]) -> tuple[list[float], list[float]] | None:
    """Values in the first and the last window of the steady state: an hour, or a quarter of a shorter span."""
    if len(points) < 2:
        return None
    t0, t1 = points[0][0], points[-1][0]
    w = min(3600.0, 0.25 * (t1 - t0))
    first = [v for t, v in points if t <= t0 + w]
    last = [v for t, v in points if t >= t1 - w]
    return first, last


def _drift(samples: list[dict[str, Any]], key: str) -> tuple[float, float] | None:
    pts = series(samples, key)
    win = windows(pts)
    if win is None:
        return None
    return statistics.median(win[0]), statistics.median(win[1])


def throughput_key(samples: list[dict[str, Any]]) -> str:
    """Decode tok/s where the scenario generates; prefill tok/s for the stream scenario (no decoding)."""
    return "decode_tok_s" if any((_num(s.get("decode_tok_s")) or 0) > 0 for s in samples) else "prefill_tok_s"


def evaluate(samples: list[dict[str, Any]], end: dict[str, Any] | None, th: Thresholds) -> list[Verdict]:
    """One verdict per criterion. 'n/a' (too few samples) never fails a run but is shown as such."""
    warm = warmup_seconds(samples, th)
    steady = [s for s in samples if (_num(s.get("elapsed")) or 0.0) >= warm] or samples
    return [_rss_verdict(steady, th), _cache_verdict(samples), _throughput_verdict(steady, th),
            _ppl_verdict(steady, th), _latency_verdict(steady, th), _errors_verdict(samples, end, th),
            _crash_verdict(end)]


def _rss_verdict(steady: list[dict[str, Any]], th: Thresholds) -> Verdict:
    name, limit = "RSS growth per hour", f"<= {th.rss_mib_per_h:g} MiB/h"
    pts = [(t, v / MIB) for t, v in series(steady, "rss")]
    slope = slope_per_hour(pts)
    if slope is None:
        return Verdict(name, "n/a", limit, "n/a")
    # On a short run allocator noise extrapolated to an hour can exceed any limit: a slope whose whole growth
    # over the run stays inside the noise band is inconclusive, not a leak.
    mid = statistics.median(v - slope / 3600 * t for t, v in pts)
    sigma = 1.4826 * statistics.median(abs(v - mid - slope / 3600 * t) for t, v in pts)
    grown = slope / 3600 * (pts[-1][0] - pts[0][0])
    status = "PASS" if slope <= th.rss_mib_per_h else "FAIL" if grown > 3 * sigma + 1 else "n/a"
    note = f" (+{grown:.1f} MiB in the run, inside the noise of ±{sigma:.1f} MiB)" if status == "n/a" else ""
    return Verdict(name, f"{slope:+.1f} MiB/h{note}", limit, status)


def _cache_verdict(samples: list[dict[str, Any]]) -> Verdict:
    """Over the whole run, warm-up included: the cache is preallocated, so any change at all is a failure."""
    cb = sorted({v for _, v in series(samples, "cache_bytes") if v > 0})
    if not cb:
        return Verdict("cache bytes constant", "n/a", "max == min", "n/a")
    val = f"{cb[0] / MIB:.2f} MiB" if len(cb) == 1 else f"{cb[0] / MIB:.2f}..{cb[-1] / MIB:.2f} MiB"
    return Verdict("cache bytes constant", val, "max == min", "PASS" if len(cb) == 1 else "FAIL")


def _throughput_verdict(steady: list[dict[str, Any]], th: Thresholds) -> Verdict:
    key = throughput_key(steady)
    d = _drift(steady, key)
    if d is None or d[0] <= 0:
        return Verdict("throughput drift", "n/a", f"drop <= {th.tput_drop:.0%}", "n/a")
    drop = 1.0 - d[1] / d[0]
    return Verdict("throughput drift", f"{d[0]:.1f} -> {d[1]:.1f} {key.split('_')[0]} tok/s ({-drop:+.0%})",
                   f"drop <= {th.tput_drop:.0%}", "PASS" if drop <= th.tput_drop else "FAIL")


def _ppl_verdict(steady: list[dict[str, Any]], th: Thresholds) -> Verdict:
    d = _drift(steady, "ppl")
    if d is None or d[0] <= 0:
        return Verdict("perplexity drift", "n/a", f"rise <= {th.ppl_rise:.0%}", "n/a")
    rise = d[1] / d[0] - 1.0
    return Verdict("perplexity drift", f"{d[0]:.2f} -> {d[1]:.2f} ({rise:+.0%})",
                   f"rise <= {th.ppl_rise:.0%}", "PASS" if rise <= th.ppl_rise else "FAIL")


def _latency_verdict(steady: list[dict[str, Any]], th: Thresholds) -> Verdict:
    ratios = [s["p99_ms"] / s["p50_ms"] for s in steady
              if (_num(s.get("p50_ms")) or 0) > 0 and _num(s.get("p99_ms")) is not None]
    if not ratios:
        return Verdict("p99/p50 latency", "n/a", f"<= {th.latency_ratio:g}", "n/a")
    med = statistics.median(ratios)
    return Verdict("p99/p50 latency", f"{med:.2f} (worst interval {max(ratios):.2f})",
                   f"<= {th.latency_ratio:g}", "PASS" if med <= th.latency_ratio else "FAIL")


def _errors_verdict(samples: list[dict[str, Any]], end: dict[str, Any] | None, th: Thresholds) -> Verdict:
    """The end record's totals; for a killed run (no end record) the last sample's running counts."""
    errors = int((end or {}).get("errors", max((int(s.get("errors") or 0) for s in samples), default=0)))
    faults = int((end or {}).get("faults", max((int(s.get("faults") or 0) for s in samples), default=0)))
    return Verdict("errors", f"{errors} (+{faults} handled faults)", f"<= {th.max_errors}",
                   "PASS" if errors <= th.max_errors else "FAIL")


def _crash_verdict(end: dict[str, Any] | None) -> Verdict:
    if end is None:
        return Verdict("crashes", "no end record: the process died (killed or crashed)", "clean end", "FAIL")
    reason = str(end.get("reason", "?"))
    return Verdict("crashes", f"ended: {reason}", "clean end", "FAIL" if reason == "crashed" else "PASS")


def figures(samples: list[dict[str, Any]]) -> dict[str, tuple[Any, Any]]:
    """First and last values of the headline series (the closing figures of a soak)."""
    def ends(key: str) -> tuple[Any, Any]:
        pts = series(samples, key)
        return (pts[0][1], pts[-1][1]) if pts else (None, None)

    return {k: ends(k) for k in ("rss", "cache_bytes", "decode_tok_s", "prefill_tok_s", "ppl", "ppl_input",
                                 "ppl_probe", "gauge", "tokens", "evicted", "p50_ms", "p99_ms")}


# ------------------------------------------------------------------------------------------------------- output
def plot_all(directory: Path, samples: list[dict[str, Any]], warm: float) -> list[str]:
    """One PNG per series that has data; returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    span = max((_num(s.get("elapsed")) or 0.0 for s in samples), default=0.0)
    div, unit = (3600.0, "h") if span > 7200 else (60.0, "min")
    written = []
    for name, (title, keys, scale, yunit) in SERIES.items():
        lines = [(label, series(samples, key)) for key, label in keys]
        lines = [(label, pts) for label, pts in lines if pts]
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=(8, 3.6))
        for label, pts in lines:
            ax.plot([t / div for t, _ in pts], [v / scale for _, v in pts], marker=".", ms=3, label=label)
        if warm > 0:
            ax.axvspan(0, warm / div, color="grey", alpha=0.15, label="warm-up")
        ax.set_xlabel(f"elapsed ({unit})")
        ax.set_ylabel(yunit or name)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        tmp = directory / f".{name}.tmp.png"
        fig.savefig(tmp, dpi=100)
        plt.close(fig)
        tmp.replace(directory / f"{name}.png")
        written.append(f"{name}.png")
    return written


def _fmt(key: str, v: Any) -> str:
    if key in ("rss", "cache_bytes"):
        return f"{v / MIB:.1f} MiB"
    return str(int(v)) if isinstance(v, float) and v.is_integer() and abs(v) >= 10 else f"{v:.2f}"


def render_markdown(header: dict[str, Any], samples: list[dict[str, Any]], end: dict[str, Any] | None,
                    verdicts: list[Verdict], th: Thresholds, plots: list[str]) -> str:
    ok = not any(v.failed for v in verdicts)
    last = samples[-1] if samples else {}
    info = [("scenario", header.get("scenario")), ("policy", header.get("policy")),
            ("cache", f"{header.get('capacity')} tokens, {header.get('n_sink')} sinks"),
            ("model", header.get("model")), ("started", header.get("started")),
            ("elapsed", f"{(_num(last.get('elapsed')) or 0) / 60:.1f} min"),
            ("steps", last.get("steps")), ("tokens processed", last.get("tokens")),
            ("end", (end or {}).get("reason", "missing")), ("samples", len(samples)),
            ("warm-up excluded", f"{warmup_seconds(samples, th):.0f} s"),
            ("handled faults", ", ".join(f"{k} {v}" for k, v in ((end or {}).get("fault_kinds") or {}).items()) or "-")]
    out = [f"# sinkchat soak report: {'PASS' if ok else 'FAIL'}", ""]
    out += [f"- **{k}**: {v}" for k, v in info] + ["", "## Verdicts", "",
                                                   "| criterion | value | threshold | verdict |", "|---|---|---|---|"]
    out += [f"| {v.name} | {v.value} | {v.threshold} | {v.status} |" for v in verdicts]
    out += ["", "## Figures (first / last sample)", "", "| series | first | last |", "|---|---|---|"]
    for key, (a, b) in figures(samples).items():
        if a is not None:
            out.append(f"| {key} | {_fmt(key, a)} | {_fmt(key, b)} |")
    out += ["", "## Plots", ""] + [f"![{p[:-4]}]({p})" for p in plots]
    out += ["", f"Thresholds: `{json.dumps(asdict(th))}`", ""]
    return "\n".join(out)


def write_report(directory: str | Path, th: Thresholds | None = None, plots: bool = True) -> list[Verdict]:
    """Judge the run in `directory`, write report.md (and PNGs); return the verdicts."""
    d = Path(directory)
    header, samples, end = load_run(d)
    th = th or recorded_thresholds(header)
    verdicts = evaluate(samples, end, th)
    names: list[str] = []
    if plots and samples:
        try:
            names = plot_all(d, samples, warmup_seconds(samples, th))
        except Exception as e:  # noqa: BLE001 - a plotting failure must not lose the verdicts
            log.warning("plots failed: %s", e)
    text = render_markdown(header, samples, end, verdicts, th, names)
    try:
        tmp = d / ".report.md.tmp"
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(d / "report.md")
    except OSError as e:
        raise click.ClickException(f"cannot write {d / 'report.md'}: {e.strerror}") from None
    return verdicts


def verdict_table(verdicts: list[Verdict]) -> str:
    w = max(len(v.name) for v in verdicts)
    return "\n".join(f"{v.status:>4}  {v.name.ljust(w)}  {v.value}  ({v.threshold})" for v in verdicts)


def recorded_thresholds(header: dict[str, Any]) -> Thresholds:
    """The thresholds the run was started with (unknown keys from other versions ignored)."""
    known = {f.name for f in fields(Thresholds)}
    return Thresholds(**{k: v for k, v in (header.get("thresholds") or {}).items() if k in known})
