"""The live view of `sinkchat soak`: a rich panel with sparklines on a terminal, one plain line per sample otherwise.

Only reads a Soak's figures (`duration`, `samples`, `progress()`), so it is testable with a stub and never decides
anything about the run.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from sinkchat.core.metrics import human_bytes


def spark(values: list[float | None], width: int = 40) -> str:
    vals = [v for v in values if v is not None][-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    bars = "▁▂▃▄▅▆▇█"
    return "".join(bars[0 if hi == lo else int((v - lo) / (hi - lo) * 7)] for v in vals)


def _line(soak: Any, rec: dict[str, Any]) -> str:
    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    el = rec["elapsed"]
    ok, failed = rec.get("tool_calls_ok"), rec.get("tool_calls_failed")
    calls = f" | calls ok {ok}/{ok + failed}" if ok is not None and failed is not None else ""
    remain = f" left {max(0.0, soak.duration - el) / 60:.1f}m" if soak.duration else ""
    local = "" if rec.get("gauge_local") is None else f" local {rec['gauge_local']:.2f}"  # hybrid models
    local += "" if rec.get("gauge_recalled") is None else f" · mem {rec['gauge_recalled']:.2f}"  # --memory on
    mem = "" if rec.get("mem_tokens") is None else (
        f" | mem {rec['mem_blocks']} blk {rec['mem_tokens']} tok {human_bytes(rec['mem_disk_bytes'])}"
        + ("" if rec.get("recall_memory") is None else
           f" recall {rec['recall_memory_ok']}/{rec['recall_memory']} (window {rec['recall_window_ok']}/"
           f"{rec['recall_window']})"))
    return (f"[{el / 60:6.1f}m{remain}] steps {rec['steps']} tok {rec['tokens']} evicted {rec['evicted']} | "
            f"rss {human_bytes(rec['rss'])} kv {human_bytes(rec['cache_bytes'])} | dec {f(rec['decode_tok_s'], '.1f')} "
            f"pre {f(rec['prefill_tok_s'], '.0f')} tok/s | p50/p99 {f(rec['p50_ms'], '.0f')}/{f(rec['p99_ms'], '.0f')} ms"
            f" | ppl {f(rec.get('ppl'), '.2f')} | sink {f(rec.get('gauge'), '.2f')}{local} | "
            f"done {rec.get('jobs_ok', '-')}/{rec.get('jobs', '-')}{calls} | "
            f"err {rec['errors']} faults {rec['faults']}{mem}")


class Display:
    """Rich live panel on a TTY (figures + sparklines of RSS, tok/s and ppl); one plain line per sample otherwise."""

    def __init__(self, soak: Any = None, live: bool | None = None) -> None:
        self.soak = soak
        self.live_mode = sys.stderr.isatty() if live is None else live
        self.live: Any = None

    def __enter__(self) -> "Display":
        if self.live_mode:
            from rich.console import Console
            from rich.live import Live

            self.live = Live(console=Console(stderr=True), auto_refresh=False, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.__exit__(None, None, None)

    def update(self, rec: dict[str, Any]) -> None:
        assert self.soak is not None
        if self.live is None:
            click.echo(_line(self.soak, rec), err=True)
            return
        from rich.text import Text

        s = list(self.soak.samples)
        tput = [r.get("decode_tok_s") or r.get("prefill_tok_s") for r in s]
        body = Text(f"sinkchat soak  {self.soak.progress():.0%} done\n{_line(self.soak, rec)}\n", style="bold")
        body.append(f"RSS    {spark([r['rss'] for r in s])}\ntok/s  {spark(tput)}\nppl    {spark([r.get('ppl') for r in s])}")
        self.live.update(body, refresh=True)
