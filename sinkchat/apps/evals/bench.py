"""`sinkchat bench`: prefill / decode speed, per-token latency, RSS and KV bytes per cache policy and size.

What it measures, and why this way:
- `sink` and `dense` run the real Engine path chat uses (`feed_ids` for the prefill, `generate` for decoding), so
  evictions, re-rotation and the sink gauge are all in the timings. The prefill fills the cache to capacity, so the
  decode phase of `sink` crosses evictions; `--evict-chunk` defaults to 16 here (not capacity/16) so that a short
  run crosses several of them at every cache size.
- `dense` never evicts: its cache holds prefill + decode tokens (the no-eviction baseline; KV grows with the text).
- `recompute` is the paper's sliding window with re-computation: every new token re-encodes the last `cache` tokens
  from scratch (no KV cache at all). It is O(cache) per token, hence few tokens (`--recompute-tokens`).
- One untimed prefill and a few tokens go first (`warm_up`), as llama-bench's warmup run.
- Decoding is greedy with the stop tokens disabled, so every run produces exactly `--decode` tokens.
- Latency is the wall time between consecutive tokens as a client sees them (sampling, eviction and gauge included).
- The gauge overhead is measured on one already-full sink cache by alternating blocks with the gauge off
  (gauge_every=0) and on (the configured gauge_every), which cancels slow drifts in machine load.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

import click

from sinkchat.api import start
from sinkchat.bootstrap import build_settings, common_options, pop_common, setup_logging, user_errors
from sinkchat.config import ConfigError
from sinkchat.core.metrics import percentile, rss_bytes

log = logging.getLogger(__name__)

BENCH_POLICIES = ("sink", "dense", "recompute")
DEFAULT_CACHES = (256, 512, 1024, 2048)
MB = 1024 * 1024


@dataclass
class Run:
    """One (policy, cache) measurement; the first eight fields are the documented JSON schema."""

    policy: str
    cache: int
    prefill_tok_s: float
    decode_tok_s: float
    p50_ms: float
    p99_ms: float
    peak_rss_mb: float
    kv_bytes: int
    steady_rss_mb: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    max_ms: float = 0.0
    evictions: int = 0
    evict_ms_max: float = 0.0  # the longest single eviction (shift + re-rotation), from EvictionEvent.seconds
    kv_bytes_start: int = 0  # KV bytes right after the prefill (sink: equal to kv_bytes, the cache never grows)
    gauge_every: int = 0
    latencies_ms: list[float] = field(default_factory=list, repr=False)


def kv_bytes_per_token(engine: Any) -> int:
    """Bytes of K and V for one token over all layers at the cache's dtype: what a cache of N tokens holds x N."""
    import torch

    return engine.spec.kv_bytes_per_token(torch.finfo(engine.kv_store).bits)


def _tokens(ids: list[int], n: int) -> list[int]:
    """The first n ids, cycling the text if it is shorter (timings do not depend on the words)."""
    if not ids:
        raise ConfigError("the bench text holds no tokens")
    return (ids * (n // len(ids) + 1))[:n]


def _finish(run: Run, lat: list[float], rss: list[int]) -> Run:
    run.latencies_ms = [1000 * x for x in lat]
    run.decode_tokens = len(lat)
    run.decode_tok_s = len(lat) / sum(lat) if lat and sum(lat) > 0 else 0.0
    run.p50_ms = percentile(run.latencies_ms, 50)
    run.p99_ms = percentile(run.latencies_ms, 99)
    run.max_ms = max(run.latencies_ms, default=0.0)
    run.peak_rss_mb = max(rss, default=0) / MB
    tail = rss[len(rss) // 2 :] or rss
    run.steady_rss_mb = statistics.median(tail) / MB if tail else 0.0
    return run


def _decode(engine: Any, n: int) -> tuple[list[float], list[int], list[float]]:
    """Greedy-decode exactly n tokens (stop tokens disabled); per-token wall latency, RSS samples, eviction secs."""
    from sinkchat.core.events import EvictionEvent, TokenEvent

    saved_stop = engine.stop_ids
    engine.stop_ids = set()
    lat: list[float] = []
    rss: list[int] = []
    evictions: list[float] = []
    try:
        t_prev = time.perf_counter()
        for ev in engine.generate(max_tokens=n):
            if isinstance(ev, TokenEvent):
                now = time.perf_counter()
                lat.append(now - t_prev)
                t_prev = now
                rss.append(rss_bytes())
            elif isinstance(ev, EvictionEvent):
                evictions.append(ev.seconds)
    finally:
        engine.stop_ids = saved_stop
    return lat, rss, evictions


def bench_stream(engine: Any, policy: str, cache: int, ids: list[int], decode: int, n_sink: int,
                 evict_chunk: int) -> Run:
    """Prefill `cache` tokens through the Engine, then decode `decode` tokens (sink: crossing evictions)."""
    from sinkchat.core.events import PrefillEvent

    engine.clear()
    cap = cache + decode + 1 if policy == "dense" else cache
    engine.reconfigure(policy=policy, n_sink=n_sink, capacity=cap, evict_chunk=min(evict_chunk, cap - n_sink - 1))
    prompt = _tokens(ids, cache)
    rss = [rss_bytes()]
    toks = secs = 0.0
    for ev in engine.feed_ids(prompt):
        if isinstance(ev, PrefillEvent):
            toks += ev.tokens
            secs += ev.seconds
            rss.append(rss_bytes())
    kv_start = engine.cache.nbytes
    lat, rss_dec, evictions = _decode(engine, decode)
    run = Run(policy, cache, toks / secs if secs else 0.0, 0.0, 0.0, 0.0, 0.0, engine.cache.nbytes,
              prefill_tokens=int(toks), evictions=len(evictions), evict_ms_max=1000 * max(evictions, default=0.0),
              kv_bytes_start=kv_start, gauge_every=engine.gauge_every)
    return _finish(run, lat, rss + rss_dec)


def bench_recompute(engine: Any, cache: int, ids: list[int], decode: int) -> Run:
    """Each new token re-encodes the last `cache` tokens from scratch (greedy, fixed length)."""
    import torch

    engine.clear()
    ctx = _tokens(ids, cache)
    lat: list[float] = []
    rss: list[int] = [rss_bytes()]
    first = 0.0
    with torch.no_grad():
        t_prev = time.perf_counter()
        for i in range(decode):
            x = torch.tensor([ctx[-cache:]], dtype=torch.long, device=engine.device)
            out = engine.model(input_ids=x, use_cache=False, logits_to_keep=1)
            ctx.append(int(torch.argmax(out.logits[0, -1])))
            now = time.perf_counter()
            lat.append(now - t_prev)
            if i == 0:
                first = now - t_prev
            t_prev = now
            rss.append(rss_bytes())
    # No cache is kept; the transient K/V of one forward over `cache` tokens is what attention holds at its peak.
    run = Run("recompute", cache, cache / first if first else 0.0, 0.0, 0.0, 0.0, 0.0,
              kv_bytes_per_token(engine) * cache, prefill_tokens=cache)
    return _finish(run, lat, rss)


def gauge_overhead(engine: Any, tokens: int, rounds: int = 2) -> dict[str, Any]:
    """On the current (full, sink) cache: alternate blocks of gauge off / on; compare decode tok/s."""
    default_every = engine.gauge_every or 4
    block = max(1, tokens // rounds)
    lat: dict[str, list[float]] = {"off": [], "on": []}
    calls: list[float] = []
    measure = engine.measure_gauge

    def timed(*a: Any, **k: Any) -> Any:  # the gauge's own cost, robust to machine load unlike tok/s on vs off
        t0 = time.perf_counter()
        try:
            return measure(*a, **k)
        finally:
            calls.append(time.perf_counter() - t0)

    engine.measure_gauge = timed
    try:
        for _ in range(rounds):
            for name, every in (("off", 0), ("on", default_every)):
                engine.gauge_every = every
                lat[name].extend(_decode(engine, block)[0])
    finally:
        engine.gauge_every = default_every
        del engine.measure_gauge  # back to the class method
    off, on = (len(lat[k]) / sum(lat[k]) if sum(lat[k]) else 0.0 for k in ("off", "on"))
    return {
        "cache": engine.cache_cfg.capacity, "gauge_every": default_every, "tokens_each": len(lat["on"]),
        "off_tok_s": off, "on_tok_s": on, "off_p50_ms": percentile([1000 * x for x in lat["off"]], 50),
        "on_p50_ms": percentile([1000 * x for x in lat["on"]], 50),
        "overhead_pct": 100.0 * (off / on - 1.0) if on else float("nan"),
        "measure_calls": len(calls), "measure_ms_p50": percentile([1000 * x for x in calls], 50),
        # the measured call cost spread over the tokens it covers, relative to the median token latency
        "est_overhead_pct": 100.0 * percentile(calls, 50) / default_every / statistics.median(lat["off"])
        if calls and lat["off"] else float("nan"),
    }


def warm_up(engine: Any, ids: list[int], cache: int, n_sink: int, evict_chunk: int) -> None:
    """One untimed prefill (two chunks at most) and 4 tokens before the timed runs, as llama-bench's warmup run: the
    first pass faults in the weights' pages, allocates the work buffers and starts the thread pool. Measured (the
    ~1B Q4_K_M file, 512 tokens at 2 threads, tok/s): the first prefill of a process 180-204, the next ones 196-218."""
    engine.clear()
    engine.reconfigure(policy="sink", n_sink=n_sink, capacity=cache, evict_chunk=min(evict_chunk, cache - n_sink - 1))
    list(engine.feed_ids(_tokens(ids, min(cache, 2 * engine.max_chunk))))
    _decode(engine, 4)
    engine.clear()


def run_bench(engine: Any, ids: list[int], policies: list[str], caches: list[int], decode: int,
              recompute_tokens: int, n_sink: int, evict_chunk: int, gauge_tokens: int,
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """All runs (largest cache last so RSS peaks are attributable) plus the gauge overhead; a JSON-ready dict."""
    import torch

    runs: list[Run] = []
    gauge: dict[str, Any] | None = None
    if set(policies) & {"sink", "dense"}:  # recompute runs transformers' forward, which this would not warm
        if progress:
            progress("warming up (untimed)")
        warm_up(engine, ids, min(caches), n_sink, evict_chunk)
    for pol in policies:
        for cache in sorted(caches):
            if progress:
                progress(f"{pol} cache {cache}")
            if pol == "recompute":
                runs.append(bench_recompute(engine, cache, ids, recompute_tokens))
            else:
                runs.append(bench_stream(engine, pol, cache, ids, decode, n_sink, evict_chunk))
                if pol == "sink" and cache == max(caches) and gauge_tokens > 0:
                    if progress:
                        progress(f"sink gauge overhead at cache {cache}")
                    gauge = gauge_overhead(engine, gauge_tokens)
    by = {(r.policy, r.cache): r for r in runs}
    speedup = {str(c): by[("sink", c)].decode_tok_s / by[("recompute", c)].decode_tok_s
               for c in caches if ("sink", c) in by and ("recompute", c) in by and by[("recompute", c)].decode_tok_s}
    return {
        "runs": [{k: v for k, v in asdict(r).items() if k != "latencies_ms"} for r in runs],
        "gauge_overhead": gauge,
        "sink_vs_recompute_decode_speedup": speedup,
        "threads": torch.get_num_threads(),
        "model": getattr(getattr(engine, "loaded", None), "source", None),
        "quant": getattr(getattr(engine, "loaded", None), "quant", None),
        "decoder": engine.step.status if engine.step is not None else "hf",
        "kv_dtype": str(engine.kv_store).removeprefix("torch."),
        "n_sink": n_sink, "evict_chunk": evict_chunk, "decode_tokens": decode, "recompute_tokens": recompute_tokens,
        "kv_bytes_per_token": kv_bytes_per_token(engine),
        "process_rss_mb": rss_bytes() / MB,
        "process_peak_rss_mb": _max_rss_mb(),  # includes loading and quantizing the model
    }


def _max_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def format_report(res: dict[str, Any]) -> str:
    lines = [f"threads {res['threads']}, {res['n_sink']} sinks, evict chunk {res['evict_chunk']}, "
             f"decode {res['decode_tokens']} tokens (recompute {res['recompute_tokens']}), "
             f"decoder {res.get('decoder')}, kv {res.get('kv_dtype')}"]
    hdr = ("policy", "cache", "prefill t/s", "decode t/s", "p50 ms", "p99 ms", "max ms", "evict", "evict ms",
           "peak MB", "steady MB", "KV MiB")
    lines.append(f"{hdr[0]:<10}{hdr[1]:>6}" + "".join(f"{h:>12}" for h in hdr[2:]))
    for r in res["runs"]:
        lines.append(
            f"{r['policy']:<10}{r['cache']:>6}{r['prefill_tok_s']:>12.1f}{r['decode_tok_s']:>12.2f}"
            f"{r['p50_ms']:>12.1f}{r['p99_ms']:>12.1f}{r['max_ms']:>12.1f}{r['evictions']:>12}"
            f"{r['evict_ms_max']:>12.1f}"
            f"{r['peak_rss_mb']:>12.0f}{r['steady_rss_mb']:>12.0f}{r['kv_bytes'] / MB:>12.2f}")
    for c, s in res["sink_vs_recompute_decode_speedup"].items():
        lines.append(f"sink decode is {s:.1f}x recompute at cache {c}")
    lines.append(f"process RSS now {res['process_rss_mb']:.0f} MB, peak {res['process_peak_rss_mb']:.0f} MB "
                 "(the peak includes loading the model)")
    g = res.get("gauge_overhead")
    if g:
        lines.append(f"sink gauge (every {g['gauge_every']} tokens, cache {g['cache']}): {g['on_tok_s']:.2f} tok/s on "
                     f"vs {g['off_tok_s']:.2f} off ({g['overhead_pct']:+.1f}% time), {g['tokens_each']} tokens each; "
                     f"one measurement {g['measure_ms_p50']:.2f} ms = {g['est_overhead_pct']:.1f}% of decode time")
    lines.append("timings come from one run on a shared machine: compare runs of the same invocation")
    return "\n".join(lines)


def _parse_list(raw: str, cast: Callable[[str], Any], name: str) -> list[Any]:
    try:
        vals = [cast(x) for x in raw.replace(",", " ").split()]
    except ValueError:
        raise click.BadParameter(f"expected a comma-separated list, got {raw!r}", param_hint=name) from None
    if not vals:
        raise click.BadParameter("empty list", param_hint=name)
    return vals


@click.command("bench")
@click.option("--policies", default=",".join(BENCH_POLICIES), show_default=True,
              help="comma-separated subset of sink,dense,recompute")
@click.option("--caches", default=",".join(map(str, DEFAULT_CACHES)), show_default=True, help="cache sizes (tokens)")
@click.option("--decode", "decode", type=click.IntRange(1, None), default=64, show_default=True,
              help="tokens decoded per sink/dense run")
@click.option("--recompute-tokens", type=click.IntRange(1, None), default=3, show_default=True,
              help="tokens decoded per recompute run (each costs a full forward over the cache)")
@click.option("--gauge-tokens", type=click.IntRange(0, None), default=48, show_default=True,
              help="tokens per setting for the gauge on/off comparison (0 = skip)")
@click.option("--text", "text_path", type=click.Path(dir_okay=False), default=None,
              help="text to prefill with (default: the demo's bundled text)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@common_options(exclude=("policy", "cache_size", "temperature", "max_tokens", "seed"))
def bench_command(policies: str, caches: str, decode: int, recompute_tokens: int, gauge_tokens: int,
                  text_path: str | None, as_json: bool, **kw: Any) -> None:
    """Measure prefill/decode speed, p50/p99 latency, RSS and KV bytes for sink, dense and recompute."""
    from sinkchat.apps.evals.demo import default_text_path
    from sinkchat.apps.evals.ppl import read_text

    opts = pop_common(kw)
    setup_logging(opts["verbose"] or 0)
    pols = _parse_list(policies, str, "--policies")
    bad = [p for p in pols if p not in BENCH_POLICIES]
    if bad:
        raise click.BadParameter(f"unknown policy {bad[0]!r} (choose from {', '.join(BENCH_POLICIES)})",
                                 param_hint="--policies")
    sizes = _parse_list(caches, int, "--caches")
    with user_errors():
        settings = build_settings(opts)
        if settings.model.decoder == "auto":  # the native step, else the compiled one built before timing, not in
            from sinkchat.kernels import native  # the background during it

            decoder = "native" if native.available() else "compiled"
            settings = replace(settings, model=replace(settings.model, decoder=decoder))
        n_sink = settings.cache.n_sink
        if min(sizes) < n_sink + 8:
            raise ConfigError(f"--caches: {min(sizes)} is too small (need at least sinks + 8 = {n_sink + 8})")
        evict_chunk = opts["evict_chunk"] or 16
        text = read_text(text_path or str(default_text_path()))
        say = (lambda m: None) if as_json else (lambda m: click.echo(m, err=True))
        engine = start(settings, None, say).engine
        engine.set_sampling(temperature=0.0, repetition_penalty=1.0)
        if engine.step is not None and engine.step.mode == "compiled":
            say("building the compiled decode step (first run only: ~1.5 min; cached after)")
        engine.prepare_decoder()
        if max(sizes) + (decode if "dense" in pols else 0) >= engine.max_positions:
            raise ConfigError(f"--caches {max(sizes)} + --decode {decode} exceed the model's context "
                              f"({engine.max_positions})")
        res = run_bench(engine, engine.encode_document(text), list(dict.fromkeys(pols)), sorted(set(sizes)), decode,
                        recompute_tokens, n_sink, evict_chunk, gauge_tokens, progress=say)
    click.echo(json.dumps(res) if as_json else format_report(res))
