"""Plots, report.md and report.json for a soak run directory (metrics.jsonl written by `sinkchat soak`,
records.py): the run judged by the criteria (criteria.py), its closing figures and one PNG per recorded series.
report.json holds the same verdicts and figures for scripts (CI, the README's closing notes)."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click

from sinkchat.apps.soak.criteria import MIB, Verdict, evaluate, overall, warmup_seconds
from sinkchat.apps.soak.records import load_run
from sinkchat.apps.soak.series import num, series, with_call_shares
from sinkchat.apps.soak.thresholds import Thresholds, recorded_thresholds
from sinkchat.store.atomic import atomic_write
from sinkchat.textutil import plural

log = logging.getLogger(__name__)

SERIES = {  # file name -> (title, [(field, label)], unit scale, unit)
    "rss": ("process RSS", [("rss", "RSS")], MIB, "MiB"),
    "cache_bytes": ("KV cache bytes", [("cache_bytes", "allocated")], MIB, "MiB"),
    "throughput": ("throughput", [("decode_tok_s", "decode"), ("prefill_tok_s", "prefill")], 1, "tok/s"),
    "latency": ("per-token latency", [("p50_ms", "p50"), ("p99_ms", "p99")], 1, "ms"),
    "ppl": ("perplexity of the input fed through the cache (per sample)", [("ppl", "input via cache")], 1, ""),
    "gauge": ("sink gauge (attention share on first slots)", [("gauge", "share"),
                                                              ("gauge_local", "local layers, window start"),
                                                              ("gauge_recalled", "recalled share (memory)")], 1, ""),
    "tokens": ("tokens", [("tokens", "processed"), ("evicted", "evicted")], 1, ""),
    "errors": ("errors and faults", [("errors", "errors"), ("faults", "faults"), ("faulted_steps", "faulted steps")],
               1, ""),
    "jobs": ("steps that did their job", [("jobs", "judged"), ("jobs_ok", "done right")], 1, ""),
    "valid_calls": ("agent tool calls valid and ran ok", [("valid_call_share", "run so far"),
                                                          ("interval_valid_call_share", "per interval")], 0.01, "%"),
    "cuda": ("CUDA memory", [("cuda", "allocated"), ("cuda_peak", "peak")], MIB, "MiB"),
    "memory": ("recall memory (--memory on)", [("mem_tokens", "tokens held"), ("mem_forgotten", "tokens forgotten")],
               1, "tokens"),
    "memory_disk": ("recall memory on disk", [("mem_disk_peak", "on disk (peak)"), ("mem_budget", "budget")], MIB,
                    "MiB"),
    "recall": ("planted facts recalled (run so far)", [("recall_memory_share", "asked beyond the window"),
                                                       ("recall_window_share", "asked in the window")], 0.01, "%"),
}


LABELS = {"gauge_recalled": "recalled share (gauge_recalled)"}  # report.md's name of a figure, where not its key


def figures(samples: list[dict[str, Any]]) -> dict[str, tuple[Any, Any]]:
    """First and last values of the headline series (the closing figures of a soak)."""
    def ends(key: str) -> tuple[Any, Any]:
        pts = series(samples, key)
        return (pts[0][1], pts[-1][1]) if pts else (None, None)

    return {k: ends(k) for k in ("rss", "cache_bytes", "cache_len", "decode_tok_s", "prefill_tok_s", "ppl", "gauge",
                                 "gauge_recalled", "tokens", "evicted", "p50_ms", "p99_ms", "jobs", "jobs_ok",
                                 "faulted_steps", "tool_calls_ok", "tool_calls_failed", "mem_blocks", "mem_tokens",
                                 "mem_forgotten", "mem_disk_bytes", "recall_planted", "recall_window",
                                 "recall_window_ok", "recall_memory", "recall_memory_ok", "recall_lost", "recall_kept",
                                 "recall_tokens_taken_back", "recall_memory_block")}


PlotLines = list[tuple[str, list[tuple[float, float]]]]


def plot_data(samples: list[dict[str, Any]]) -> dict[str, tuple[str, PlotLines, float, str]]:
    """What each PNG shows: file name -> (title, [(label, [(elapsed, value)])], unit scale, unit), for the series
    that have data (derived ones, like the valid-call share, included)."""
    rows = with_call_shares(samples)
    out = {}
    for name, (title, keys, scale, yunit) in SERIES.items():
        lines = [(label, series(rows, key)) for key, label in keys]
        lines = [(label, pts) for label, pts in lines if pts]
        if lines:
            out[name] = (title, lines, scale, yunit)
    return out


def plot_all(directory: Path, samples: list[dict[str, Any]], warm: float, th: Thresholds | None = None) -> list[str]:
    """One PNG per series that has data (plot_data); returns the file names written. The valid-call plot shows
    the --min-valid-calls line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    span = max((num(s.get("elapsed")) or 0.0 for s in samples), default=0.0)
    div, unit = (3600.0, "h") if span > 7200 else (60.0, "min")
    written = []
    for name, (title, lines, scale, yunit) in plot_data(samples).items():
        fig, ax = plt.subplots(figsize=(8, 3.6))
        for label, pts in lines:
            ax.plot([t / div for t, _ in pts], [v / scale for _, v in pts], marker=".", ms=3, label=label)
        if name in ("valid_calls", "recall"):
            ax.set_ylim(-5, 105)
        if name == "valid_calls" and th is not None:
            ax.axhline(th.min_valid_calls / scale, color="red", ls="--", lw=1, label="threshold")
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
    if key in ("rss", "cache_bytes", "mem_disk_bytes"):
        return f"{v / MIB:.1f} MiB"
    if key.startswith("recall_") or key in ("mem_blocks", "mem_tokens", "mem_forgotten"):
        return str(int(v))  # counts
    return str(int(v)) if isinstance(v, float) and v.is_integer() and abs(v) >= 10 else f"{v:.2f}"


def render_markdown(header: dict[str, Any], samples: list[dict[str, Any]], end: dict[str, Any] | None,
                    verdicts: list[Verdict], th: Thresholds, plots: list[str]) -> str:
    word = overall(verdicts, header)
    last = samples[-1] if samples else {}
    info = [("scenario", header.get("scenario")), ("policy", header.get("policy")),
            ("cache", f"{header.get('capacity')} tokens, {header.get('n_sink')} sinks"),
            ("model", header.get("model")), ("started", header.get("started")),
            ("elapsed", f"{(num(last.get('elapsed')) or 0) / 60:.1f} min"),
            ("steps", last.get("steps")), ("tokens processed", last.get("tokens")),
            ("end", (end or {}).get("reason", "missing")), ("samples", len(samples)),
            ("resumed", _resumes_line(header)),
            ("warm-up excluded", f"{warmup_seconds(samples, th):.0f} s" + (" (and after each resume)"
                                                                              if header.get("resumes") else "")),
            ("recall memory", _memory_line(header)),
            ("handled faults", ", ".join(f"{k} {v}" for k, v in ((end or {}).get("fault_kinds") or {}).items()) or "-")]
    out = [f"# sinkchat soak report: {word}", ""]
    out += [f"- **{k}**: {v}" for k, v in info] + ["", "## Verdicts", "",
                                                   "| criterion | value | threshold | verdict |", "|---|---|---|---|"]
    out += [f"| {v.name} | {v.value} | {v.threshold} | {v.status} |" for v in verdicts]
    out += ["", "## Figures (first / last sample)", "", "| series | first | last |", "|---|---|---|"]
    for key, (a, b) in figures(samples).items():
        if a is not None:
            out.append(f"| {LABELS.get(key, key)} | {_fmt(key, a)} | {_fmt(key, b)} |")
    out += ["", "## Plots", ""] + [f"![{p[:-4]}]({p})" for p in plots]
    out += ["", f"Thresholds: `{json.dumps(asdict(th))}`", ""]
    return "\n".join(out)


def _resumes_line(header: dict[str, Any]) -> str:
    """How often the run was resumed from a checkpoint (`soak resume`) and the work that was done again."""
    rs = header.get("resumes") or []
    if not rs:
        return "no (one process)"
    redo = sum(num(r.get("discarded_s")) or 0.0 for r in rs)
    at = ", ".join(f"{(num(r.get('elapsed')) or 0) / 60:.1f}" for r in rs)
    return (f"{plural(len(rs), 'time')} from a checkpoint, at {at} min of soak time ({len(rs) + 1} processes); the "
            f"{redo / 60:.1f} min of work after the checkpoints was done again (its records: metrics.discarded.jsonl)")


def _memory_line(header: dict[str, Any]) -> str:
    mem = header.get("memory")
    if not isinstance(mem, dict) or mem.get("mode") != "on":
        return "off"
    return (f"on: budget {(num(mem.get('budget')) or 0) / MIB:g} MiB, blocks of {mem.get('block')} tokens, top-"
            f"{mem.get('topk')}; facts planted and asked every other step")


def render_json(header: dict[str, Any], samples: list[dict[str, Any]], end: dict[str, Any] | None,
                verdicts: list[Verdict], th: Thresholds, plots: list[str]) -> str:
    """report.json: the overall word, every verdict row, the closing figures and totals, the thresholds."""
    totals = {k: v for k, v in (end or {}).items() if k not in ("kind",)}
    doc = {"overall": overall(verdicts, header), "scenario": header.get("scenario"),
           "verdicts": [asdict(v) for v in verdicts],
           "figures": {k: {"first": a, "last": b} for k, (a, b) in figures(samples).items() if a is not None},
           "end": totals or None, "samples": len(samples), "resumes": header.get("resumes") or [],
           "thresholds": asdict(th), "plots": plots}
    return json.dumps(doc, indent=1, default=str) + "\n"


def _write_atomic(path: Path, text: str) -> None:
    try:
        atomic_write(path, text.encode("utf-8"))
    except OSError as e:
        raise click.ClickException(f"cannot write {path}: {e.strerror}") from None


def write_report(directory: str | Path, th: Thresholds | None = None, plots: bool = True) -> list[Verdict]:
    """Judge the run in `directory`, write report.md, report.json (and PNGs); return the verdicts."""
    d = Path(directory)
    header, samples, end = load_run(d)
    th = th or recorded_thresholds(header)
    verdicts = evaluate(samples, end, th, header)
    names: list[str] = []
    if plots and samples:
        try:
            names = plot_all(d, samples, warmup_seconds(samples, th), th)
        except Exception as e:  # noqa: BLE001 - a plotting failure must not lose the verdicts
            log.warning("plots failed: %s", e)
    _write_atomic(d / "report.md", render_markdown(header, samples, end, verdicts, th, names))
    _write_atomic(d / "report.json", render_json(header, samples, end, verdicts, th, names))
    return verdicts


def verdict_table(verdicts: list[Verdict]) -> str:
    w = max(len(v.name) for v in verdicts)
    return "\n".join(f"{v.status:>10}  {v.name.ljust(w)}  {v.value}  ({v.threshold})" for v in verdicts)
