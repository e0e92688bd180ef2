"""`sinkchat demo` and `sinkchat probe-sinks`: measure, on the loaded model, the three facts sinkchat rests on.

1. Perplexity per bin of one long text under `window`, `sink`, `dense` (and `recompute` on a shorter span): the naive
   window degrades as soon as the stream's first tokens leave the cache; the sink cache does not.
2. The attention share of the newest token on the first 4 positions vs. the most recent 4 vs. uniform, per layer,
   measured at long range in a dense cache (the sink gauge: the model's own attention, recomputed from the cache).
3. The ablation: in a dense cache, evicting only the first 4 tokens hurts the following tokens; evicting 4 from the
   middle does not.
The numbers go to summary.json, summary.md and PNGs under --out; the markdown is rendered from the same dict as the
JSON so they cannot disagree (demo_report.py). The size of the effect depends on the model: the report states what
was measured. The streaming and scoring itself is `ppl.stream_nll` / `recompute_nll` / `summarize` / `plot`.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Callable

import click

from sinkchat.api import start
from sinkchat.bootstrap import build_settings, common_options, pop_common, setup_logging, user_errors
from sinkchat.config import ConfigError
from sinkchat.apps.evals.demo_report import plot_attention, render_markdown
from sinkchat.apps.evals.ppl import PolicyResult, read_text, recompute_nll, stream_bos, stream_nll, summarize

log = logging.getLogger(__name__)

# Real, public-domain / freely licensed English prose that ships with the system, best first.
TEXT_CANDIDATES = (
    "alice29.txt",  # the Canterbury corpus file, if the user keeps one in the working directory
    "/usr/share/common-licenses/GPL-3",
    "/usr/share/common-licenses/GFDL-1.3",
    "/usr/share/common-licenses/Apache-2.0",
)


def default_text_path() -> Path:
    """The first candidate text that exists (also falls back to Python's own LICENSE)."""
    import sysconfig

    cands = [Path(p) for p in TEXT_CANDIDATES] + [Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"]
    for p in cands:
        if p.is_file() and p.stat().st_size > 4000:
            return p
    raise ConfigError("no bundled demo text found on this system; pass --text FILE")


# ----------------------------------------------------------------------------------------------- measurements
def stream_policy(engine: Any, ids: list[int], policy: str, capacity: int, n_sink: int, chunk: int,
                  progress: Callable[[int], None] | None = None) -> PolicyResult:
    """Reset the engine to `policy` at `capacity` and score ids through it (evaluate.stream_nll does the work)."""
    engine.clear()
    cap = len(ids) + 1 if policy == "dense" else capacity
    engine.reconfigure(policy=policy, n_sink=n_sink, capacity=max(cap, n_sink + 8), evict_chunk=0)
    return stream_nll(engine, ids, chunk, progress)


def attention_rows(engine: Any) -> list[Any]:
    """Per measured layer (global, then local): attention probabilities (mean over heads) of the last token fed while
    the gauge was armed, over what the layer attended to ([L] slots; a local ring: [W] tokens, oldest first).

    `SinkGauge.probs`, as the gauge's own measurement uses it, but keeping every slot, so the demo can read single
    positions and the recent tail per layer."""
    gauge, cache = engine.gauge, engine.cache
    if cache.length == 0 or any(q is None for q in gauge.queries):
        return []
    return [gauge.probs(cache, i).mean(dim=(0, 1, 2)) for i in range(len(gauge.attn))]  # per layer [L]


def dense_with_gauge(engine: Any, ids: list[int], chunk: int, n: int, from_pos: int,
                     progress: Callable[[int], None] | None = None) -> tuple[PolicyResult, dict[str, Any]]:
    """Stream ids through a dense cache; after every chunk that ends at or past from_pos, read the attention of the
    chunk's last token. Returns the NLLs and, averaged over those query positions: per-layer share on the first n
    slots and on the most recent n, the uniform share n/L, and each of the first 8 positions' share (mean of layers).
    Hybrid models: those describe the global layers; the local ones get the same figures over their own window
    (`local_*`: its first n tokens, its most recent n, an even spread's n/W)."""
    sums: dict[str, list[float]] = {k: [] for k in ("first", "recent", "per_pos", "local_first", "local_recent")}
    queries: list[int] = []
    uniform: list[float] = []
    local_uniform: list[float] = []
    n_global = len(engine.gauge.layers)

    def add(key: str, vals: list[float]) -> None:
        sums[key] = vals if not sums[key] else [a + b for a, b in zip(sums[key], vals)]

    def on_block(pos: int) -> None:
        if pos >= from_pos:
            rows = attention_rows(engine)  # global layers' rows [L], then local layers' rows [window]
            if rows:
                glob, local = rows[:n_global], rows[n_global:]
                L = len(glob[0])
                queries.append(pos - 1)
                uniform.append(n / L)
                add("first", [float(r[:n].sum()) for r in glob])
                add("recent", [float(r[L - n :].sum()) for r in glob])
                add("per_pos", [sum(float(r[j]) for r in glob) / len(glob) for j in range(min(8, L))])
                if local:
                    local_uniform.append(min(n, len(local[0])) / len(local[0]))
                    add("local_first", [float(r[:n].sum()) for r in local])
                    add("local_recent", [float(r[-n:].sum()) for r in local])
            engine.gauge.queries = [None] * len(engine.gauge.queries)
        if progress:
            progress(pos)

    engine.gauge.armed = True
    try:
        res = stream_policy(engine, ids, "dense", 0, 0, chunk, on_block)
    finally:
        engine.gauge.armed = False
    k = len(queries)
    if k == 0:
        raise ConfigError("the text is too short to measure attention at long range")
    g: dict[str, Any] = {"n": n, "query_positions": queries, "uniform": sum(uniform) / k}
    g["first_per_layer"] = [v / k for v in sums["first"]]
    g["recent_per_layer"] = [v / k for v in sums["recent"]]
    g["per_position"] = [v / k for v in sums["per_pos"]]
    g["layer_index"] = list(engine.gauge.layers)  # the model layer of each row (hybrids: the global layers only)
    g["hybrid"] = len(g["layer_index"]) < engine.spec.n_layers
    g["first_mean"] = sum(g["first_per_layer"]) / len(g["first_per_layer"])
    g["recent_mean"] = sum(g["recent_per_layer"]) / len(g["recent_per_layer"])
    g["layers_first_gt_recent"] = sum(f > r for f, r in zip(g["first_per_layer"], g["recent_per_layer"]))
    if local_uniform:
        g["local"] = {"layer_index": list(engine.gauge.local_layers), "uniform": sum(local_uniform) / k,
                      "first_per_layer": [v / k for v in sums["local_first"]],
                      "recent_per_layer": [v / k for v in sums["local_recent"]]}
        g["local"]["first_mean"] = sum(g["local"]["first_per_layer"]) / len(g["local"]["first_per_layer"])
        g["local"]["recent_mean"] = sum(g["local"]["recent_per_layer"]) / len(g["local"]["recent_per_layer"])
    return res, g


def ablation(engine: Any, ids: list[int], prefix: int, follow: int, n: int, chunk: int,
             progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Dense cache holding ids[:prefix]; then evict nothing / the first n / n from the middle and score the next
    `follow` tokens. One prefill, restored from a snapshot for each variant, so only the eviction differs."""
    from sinkchat.core.cache_policy import Eviction, Ledger

    if prefix + follow > len(ids):
        raise ConfigError(f"the ablation needs {prefix + follow} tokens; the text has {len(ids)}")
    engine.clear()
    engine.reconfigure(policy="dense", n_sink=0, capacity=prefix + follow + 1, evict_chunk=0)
    for _ in engine.feed_ids(ids[: prefix - 1]):
        pass
    state, ledger = engine.cache.state(), engine.ledger.state()
    middle = (prefix - 1) // 2
    variants = {"none": None, "first": Eviction(0, n), "middle": Eviction(middle, n)}
    out: dict[str, Any] = {"prefix": prefix, "follow": follow, "n": n, "middle_start": middle, "ppl": {}}
    for name, ev in variants.items():
        engine.cache.load_state(state)
        engine.ledger = Ledger.from_state(ledger)
        if ev is not None:
            engine._evict(ev)
        # feed ids[prefix-1] as context so the first scored target is ids[prefix]
        res = stream_nll(engine, ids[prefix - 1 : prefix + follow], chunk, progress)
        out["ppl"][name] = res.ppl()
    base = out["ppl"]["none"]
    out["first_ratio"] = out["ppl"]["first"] / base
    out["middle_ratio"] = out["ppl"]["middle"] / base
    return out


def window_jump(res: PolicyResult, cap: int, span: int) -> dict[str, float]:
    """ppl over the `span` targets just before the cache first fills vs. just after (targets are ids[1:])."""
    edge = cap - 1
    before = res.ppl(list(range(max(0, edge - span), edge)))
    after = res.ppl(list(range(edge, min(len(res.nll), edge + span))))
    late = res.ppl(list(range(edge, len(res.nll))))
    return {"before": before, "after": after, "after_all": late}


def _progress(quiet: bool) -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), disable=quiet)


def run_demo(settings: Any, text_path: str | None, tokens: int, bin_size: int, recompute_span: int,
             recompute_every: int, ablation_prefix: int, ablation_tokens: int, out: Path, cache_default: int = 256,
             quiet: bool = False, engine: Any = None) -> dict[str, Any]:
    """Run the three measurements, write summary.json / summary.md / ppl.png / attention.png to `out`."""
    import torch

    path = text_path or str(default_text_path())
    text = read_text(path)
    say = (lambda m: None) if quiet else (lambda m: click.echo(m, err=True))
    engine = engine if engine is not None else start(settings, None, say).engine
    cap = settings.cache.capacity or cache_default
    n_sink = settings.cache.n_sink
    ids = _demo_ids(engine, text, path, tokens, cap, ablation_prefix + ablation_tokens)
    span = min(recompute_span, len(ids))
    with _progress(quiet) as bar:
        results, attention, evict_chunk = _policies(engine, ids, cap, n_sink, span, recompute_every, bar)
        abl = _ablation_with_progress(engine, ids, ablation_prefix, ablation_tokens, n_sink or 4, bar)
    summary: dict[str, Any] = {
        "model": getattr(getattr(engine, "loaded", None), "source", "?"),
        "quant": getattr(getattr(engine, "loaded", None), "quant", "?"),
        "text": path, "tokens": len(ids), "cache": cap, "n_sink": n_sink, "evict_chunk": evict_chunk,
        "threads": torch.get_num_threads(), "bin": bin_size, "jump_span": bin_size,
        "recompute_span": span if "recompute" in results else 0,
        "recompute_every": recompute_every, "ppl": summarize(results, bin_size),
        "jump": {k: window_jump(results[k], cap, bin_size) for k in ("window", "sink", "dense")},
        "attention": attention, "ablation": abl,
    }
    if "recompute" in results:
        idx = [i for i, v in enumerate(results["recompute"].nll) if i >= cap - 1 and not math.isnan(v)]
        summary["recompute_after_targets"] = len(idx)
        if idx:
            summary["recompute_after"] = {k: r.ppl(idx) for k, r in results.items()}
    _write_demo(out, summary, path, bin_size)
    return summary


def _demo_ids(engine: Any, text: str, path: str, tokens: int, cap: int, ablation_needs: int) -> list[int]:
    """The first `tokens` token ids of the text, refused up front when too short for a measurement (the window
    must evict at least once; the ablation needs its prefix and follow-up) or too long for the model's context
    (the dense run holds all of it)."""
    ids = engine.encode_document(text)[:tokens]
    if len(ids) < 2 * cap or len(ids) < ablation_needs:
        raise ConfigError(f"{path} gives {len(ids)} tokens; the demo needs at least 2 x --cache ({2 * cap}) and "
                          f"--ablation-prefix + --ablation-tokens ({ablation_needs})")
    if len(ids) >= engine.max_positions:
        raise ConfigError(f"--tokens {len(ids)} must stay below the model's context ({engine.max_positions})")
    return ids


def _policies(engine: Any, ids: list[int], cap: int, n_sink: int, span: int, recompute_every: int,
              bar: Any) -> tuple[dict[str, PolicyResult], dict[str, Any], int]:
    """Measurements 1 and 2: window and sink at `cap`, dense with the attention gauge, and recompute over the first
    `span` tokens when that reaches past one cache. Returns (results, attention, the sink run's evict chunk)."""
    results: dict[str, PolicyResult] = {}
    for pol in ("window", "sink"):
        task = bar.add_task(f"{pol} (cache {cap})", total=len(ids))
        results[pol] = stream_policy(engine, ids, pol, cap, n_sink, 32,
                                     lambda p, t=task: bar.update(t, completed=p))
    evict_chunk = engine.cache_cfg.evict_chunk
    task = bar.add_task("dense + attention gauge", total=len(ids))
    results["dense"], attention = dense_with_gauge(engine, ids, 32, n_sink or 4, len(ids) // 2,
                                                   lambda p: bar.update(task, completed=p))
    if span > cap:
        task = bar.add_task(f"recompute (first {span})", total=None)
        results["recompute"] = recompute_nll(engine.model, ids[:span], cap, recompute_every, engine.device,
                                             stream_bos(engine, ids))
        bar.update(task, total=1, completed=1)
    return results, attention, evict_chunk


def _ablation_with_progress(engine: Any, ids: list[int], prefix: int, follow: int, n: int,
                            bar: Any) -> dict[str, Any]:
    """Measurement 3 with one progress bar over its three variants (each reports its own position from 0)."""
    total = 3 * (follow + 1)
    task = bar.add_task("ablation (dense)", total=total)
    done = [0]

    def tick(p: int) -> None:
        bar.update(task, completed=min(total, done[0] + p))
        if p >= follow + 1:
            done[0] += p

    return ablation(engine, ids, prefix, follow, n, 32, tick)


def _write_demo(out: Path, summary: dict[str, Any], path: str, bin_size: int) -> None:
    """summary.json, summary.md, ppl.png (recompute is too sparse to bin, so it is left out) and attention.png."""
    from sinkchat.apps.evals.ppl import plot

    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text(render_markdown(summary))
    binned = {k: v for k, v in summary["ppl"].items() if k != "policies"}
    binned["policies"] = {k: v for k, v in summary["ppl"]["policies"].items() if k != "recompute"}
    plot(binned, bin_size, str(out / "ppl.png"),
         f"{Path(path).name}: cache {summary['cache']}, {summary['n_sink']} sinks")
    plot_attention(summary, out / "attention.png")


def run_probe(settings: Any, text_path: str | None, tokens: int, cache_default: int = 128, quiet: bool = False,
              engine: Any = None, counts: tuple[int, ...] = (0, 1, 2, 4, 8)) -> dict[str, Any]:
    """Attention share of positions 0..7 at long range, and ppl after the cache fills with k sinks for each k."""
    path = text_path or str(default_text_path())
    say = (lambda m: None) if quiet else (lambda m: click.echo(m, err=True))
    engine = engine if engine is not None else start(settings, None, say).engine
    ids = engine.encode_document(read_text(path))[:tokens]
    cap = settings.cache.capacity or cache_default
    if len(ids) < 2 * cap or cap < max(counts) + 8:
        raise ConfigError(f"probe-sinks needs --cache >= {max(counts) + 8} and at least 2 x --cache tokens "
                          f"({len(ids)} available)")
    ppl: dict[str, float] = {}
    with _progress(quiet) as bar:
        task = bar.add_task("dense + attention gauge", total=len(ids))
        _, g = dense_with_gauge(engine, ids, 32, 4, max(cap, len(ids) // 4), lambda p: bar.update(task, completed=p))
        for k in counts:
            task = bar.add_task(f"{k} sinks, cache {cap}", total=len(ids))
            r = stream_policy(engine, ids, "sink", cap, k, 32, lambda p, t=task: bar.update(t, completed=p))
            ppl[str(k)] = r.ppl(list(range(cap - 1, len(r.nll))))
    per_pos_uniform = g["uniform"] / g["n"]
    sinks = [i for i, v in enumerate(g["per_position"]) if v >= 10 * per_pos_uniform]
    best = min(v for k, v in ppl.items() if int(k) > 0)
    rec = min(int(k) for k, v in ppl.items() if int(k) > 0 and v <= 1.01 * best)
    return {"text": path, "tokens": len(ids), "cache": cap, "per_position": g["per_position"],
            "uniform_per_position": per_pos_uniform, "query_positions": [g["query_positions"][0],
                                                                         g["query_positions"][-1]],
            "sink_positions": sinks, "ppl_by_sinks": ppl, "recommended_sinks": rec}


def format_probe(r: dict[str, Any]) -> str:
    lines = [f"{r['tokens']} tokens of {r['text']}; attention of queries at {r['query_positions'][0]}-"
             f"{r['query_positions'][1]} (dense cache), mean over layers and heads:"]
    lines += [f"  position {i}: {v:.3f}" + ("  <- sink" if i in r["sink_positions"] else "")
              for i, v in enumerate(r["per_position"])]
    lines.append(f"  uniform: {r['uniform_per_position']:.4f} per position")
    lines.append(f"ppl after the cache ({r['cache']}) fills, by number of sinks:")
    lines += [f"  {k} sinks: {v:.2f}" + (" (= naive window)" if k == "0" else "") for k, v in r["ppl_by_sinks"].items()]
    lines.append(f"recommended: --sinks {r['recommended_sinks']} (fewest sinks within 1% of the best ppl)")
    return "\n".join(lines)


@click.command("demo")
@click.option("--text", "text_path", type=click.Path(dir_okay=False), default=None,
              help="text file (default: a system-provided one, e.g. the GPL-3 text)")
@click.option("--tokens", type=click.IntRange(64, None), default=2048, show_default=True, help="tokens to stream")
@click.option("--bin", "bin_size", type=click.IntRange(8, None), default=128, show_default=True, help="tokens per bin")
@click.option("--recompute-span", type=click.IntRange(0, None), default=768, show_default=True,
              help="recompute scores only the first N tokens (0 = skip)")
@click.option("--recompute-every", type=click.IntRange(1, None), default=16, show_default=True)
@click.option("--ablation-prefix", type=click.IntRange(16, None), default=512, show_default=True)
@click.option("--ablation-tokens", type=click.IntRange(8, None), default=256, show_default=True)
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="sinkchat-demo", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print summary.json to stdout")
@common_options(exclude=("policy", "temperature", "max_tokens", "seed"))
def demo_command(text_path: str | None, tokens: int, bin_size: int, recompute_span: int, recompute_every: int,
                 ablation_prefix: int, ablation_tokens: int, out_dir: str, as_json: bool, **kw: Any) -> None:
    """Show on the loaded model why the first tokens must stay: window vs sink ppl, attention shares, ablation."""
    opts = pop_common(kw)
    setup_logging(opts["verbose"] or 0)
    with user_errors():
        settings = build_settings(opts)
        summary = run_demo(settings, text_path, tokens, bin_size, recompute_span, recompute_every,
                           ablation_prefix, ablation_tokens, Path(out_dir), cache_default=256, quiet=as_json)
    if as_json:
        click.echo(json.dumps(summary))
    else:
        click.echo(render_markdown(summary))
        click.echo(f"wrote {out_dir}/summary.md, summary.json, ppl.png, attention.png", err=True)


@click.command("probe-sinks")
@click.option("--text", "text_path", type=click.Path(dir_okay=False), default=None)
@click.option("--tokens", type=click.IntRange(64, None), default=1024, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@common_options(exclude=("policy", "temperature", "max_tokens", "seed"))
def probe_sinks_command(text_path: str | None, tokens: int, as_json: bool, **kw: Any) -> None:
    """Which early positions act as attention sinks for this model, and how many --sinks it needs (by ppl)."""
    opts = pop_common(kw)
    setup_logging(opts["verbose"] or 0)
    with user_errors():
        res = run_probe(build_settings(opts), text_path, tokens, cache_default=128, quiet=as_json)
    click.echo(json.dumps(res) if as_json else format_probe(res))
