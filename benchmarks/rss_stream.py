#!/usr/bin/env python
"""Steady RSS from 10^4 to 10^6 tokens: the sink cache must hold memory flat however long the stream runs.

Feeds a text through one Engine again and again (prefill path, `--chunk` tokens per forward, evicting as it goes)
and every `--gen-every` tokens decodes `--gen` tokens with the sink gauge on, so both paths run. RSS is sampled
at each power-of-ten milestone and the script prints the table and the ratio RSS(last) / RSS(10^4).
Target (issue #3): within 2%.

Usage: python benchmarks/rss_stream.py [--tokens 1000000] [--cache 512] [--json] [--memory on [--memory-budget MB]]
With the recall memory on, RSS must flatten too: its index and RAM cache are bounded by the disk budget and
--memory-ram (the blocks themselves live on disk).
Takes ~1 h for 10^6 tokens at cache 512 on one core of this machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--cache", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--gen-every", type=int, default=20_000)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--memory", choices=("on", "off"), default="off", help="the recall memory")
    ap.add_argument("--memory-budget", type=int, default=None, help="its disk budget, MB")
    args = ap.parse_args()

    from sinkchat.api import start
    from sinkchat.bootstrap import build_settings
    from sinkchat.core.metrics import rss_bytes

    settings = build_settings({"cache_size": args.cache, "policy": "sink", "memory": args.memory,
                               "memory_budget": args.memory_budget})
    eng = start(settings, None, lambda m: print(m, file=sys.stderr)).engine
    eng.set_sampling(temperature=0.0)
    ids = eng.encode(Path(args.text).read_text(encoding="utf-8", errors="replace"))
    milestones = [m for m in (10**4, 3 * 10**4, 10**5, 3 * 10**5, 10**6, 3 * 10**6) if m <= args.tokens]
    rows, fed, next_gen, t0 = [], 0, args.gen_every, time.perf_counter()
    while milestones:
        for i in range(0, len(ids), args.chunk):
            list(eng.feed_ids(ids[i : i + args.chunk]))
            fed += len(ids[i : i + args.chunk])
            if fed >= next_gen:
                list(eng.generate(args.gen))
                next_gen += args.gen_every
            if milestones and eng.ledger.seen >= milestones[0]:
                rows.append({"tokens": eng.ledger.seen, "rss_mb": rss_bytes() / 2**20,
                             "kv_bytes": eng.cache.nbytes, "cache_len": eng.cache.length,
                             "memory_disk": eng.memory.disk_bytes if eng.memory else 0,
                             "memory_index": eng.memory.index_bytes if eng.memory else 0,
                             "evicted": eng.ledger.evicted, "seconds": time.perf_counter() - t0})
                r = rows[-1]
                print(f"{r['tokens']:>9} tokens  RSS {r['rss_mb']:8.1f} MB  KV {r['kv_bytes'] / 2**20:6.2f} MiB  "
                      f"in cache {r['cache_len']}  evicted {r['evicted']}  {r['seconds']:7.0f} s", file=sys.stderr)
                milestones.pop(0)
            if not milestones:
                break
    ratio = rows[-1]["rss_mb"] / rows[0]["rss_mb"]
    res = {"cache": args.cache, "rows": rows, "rss_ratio_last_vs_first": ratio, "target": 1.02,
           "pass": ratio <= 1.02, "quant": eng.loaded.quant}
    if args.json:
        print(json.dumps(res))
    else:
        print(f"RSS at {rows[-1]['tokens']} tokens / at {rows[0]['tokens']}: {ratio:.4f} "
              f"({'PASS' if res['pass'] else 'FAIL'}, target <= 1.02)")


if __name__ == "__main__":
    main()
