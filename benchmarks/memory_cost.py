#!/usr/bin/env python
"""What the recall memory costs, side by side in one run: memory off and on, same model, cache and threads.

Both engines stream the same text (prefill chunks, evicting as they go) in alternation, chunk by chunk, so machine
noise falls on both alike; after `--tokens` tokens each decodes `--decode` tokens (alternating again). Printed:
prefill and decode tokens/s of each and the ratio on / off (target >= 0.7 with 100k tokens in memory), the memory's
blocks, tokens, index bytes and disk bytes (and per token), and RSS. Beside the wall-clock ratios, the same ratios
in the process's CPU time (`time.process_time` around each engine's calls: on a machine shared with other jobs,
time spent waiting for a core is no part of either engine's cost).

`--off-tail N` feeds the memory-off engine only the last N tokens before the timed window (then the window, in
alternation as ever): its cost per token does not depend on what it saw before (a full sink cache), and at 100k
tokens feeding it everything doubled a run (~40 min on a busy 2-core machine). 0 (the default) feeds it all.

Usage: python benchmarks/memory_cost.py [--tokens 100000] [--cache 1024] [--threads 1] [--decode 128] [--json]
       [--budget MB] [--text FILE] [--off-tail N]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def open_both(args: argparse.Namespace) -> dict[str, Any]:
    from sinkchat.api import start
    from sinkchat.bootstrap import build_settings

    out = {}
    for mode in ("off", "on"):
        opts = {"cache_size": args.cache, "policy": "sink", "temperature": 0.0, "threads": args.threads,
                "memory": mode, "memory_budget": args.budget}
        out[mode] = start(build_settings(opts)).engine
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--cache", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--window", type=int, default=10_000, help="prefill tokens timed (the last ones fed)")
    ap.add_argument("--budget", type=int, default=4096, help="the memory's disk budget, MB")
    ap.add_argument("--text", default=None, help="default: the long_stream benchmark's public-domain text")
    ap.add_argument("--off-tail", type=int, default=0,
                    help="feed memory off only this many tokens before the timed window (0: all of them)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from sinkchat.core.metrics import rss_bytes

    if args.text is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import llamacpp_tools as lt  # type: ignore[import-not-found]

        args.text = str(lt.canterbury("lcet10.txt"))
    engines = open_both(args)
    ids = engines["off"].encode(Path(args.text).read_text(encoding="utf-8", errors="replace"))
    fed, t_pre, c_pre = 0, {"off": 0.0, "on": 0.0}, {"off": 0.0, "on": 0.0}
    while fed < args.tokens:
        at = fed % len(ids)
        chunk = ids[at : at + min(args.chunk, args.tokens - fed)]
        for mode, eng in engines.items():
            if mode == "off" and args.off_tail and fed < args.tokens - args.window - args.off_tail:
                continue
            t0, c0 = time.perf_counter(), time.process_time()
            list(eng.feed_ids(chunk))
            if fed >= args.tokens - args.window:
                t_pre[mode] += time.perf_counter() - t0
                c_pre[mode] += time.process_time() - c0
        fed += len(chunk)
    timed = min(args.window, args.tokens)
    t_dec, c_dec = {"off": 0.0, "on": 0.0}, {"off": 0.0, "on": 0.0}
    made = {"off": 0, "on": 0}  # tokens each really decoded: a reply can end early at EOS
    for _ in range(args.decode // 16):
        for mode, eng in engines.items():
            t0, c0 = time.perf_counter(), time.process_time()
            list(eng.generate(max_tokens=16))
            t_dec[mode] += time.perf_counter() - t0
            c_dec[mode] += time.process_time() - c0
            made[mode] += len(eng.last_reply_ids)
    mem = engines["on"].memory
    res = {"tokens": args.tokens, "cache": args.cache, "threads": args.threads, "off_tail": args.off_tail,
           "prefill_tok_s": {m: timed / t for m, t in t_pre.items()},
           "decode_tok_s": {m: made[m] / t for m, t in t_dec.items()}, "decoded": made,
           "memory": {"blocks": mem.blocks, "tokens": mem.tokens, "forgotten": mem.forgotten,
                      "index_bytes": mem.index_bytes, "disk_bytes": mem.disk_bytes, "lru_bytes": mem.lru_bytes},
           "rss_mb": rss_bytes() / 2**20}
    res["prefill_ratio"] = res["prefill_tok_s"]["on"] / res["prefill_tok_s"]["off"]
    res["decode_ratio"] = res["decode_tok_s"]["on"] / res["decode_tok_s"]["off"]
    res["prefill_ratio_cpu"] = c_pre["off"] / c_pre["on"]
    res["decode_ratio_cpu"] = (c_dec["off"] / made["off"]) / (c_dec["on"] / made["on"])
    mem.close()
    if args.json:
        print(json.dumps(res, indent=1))
        return
    m = res["memory"]
    per = max(1, m["tokens"])
    print(f"{args.tokens} tokens streamed, cache {args.cache}, threads {args.threads}")
    print(f"prefill tok/s  off {res['prefill_tok_s']['off']:8.1f}  on {res['prefill_tok_s']['on']:8.1f}  "
          f"ratio {res['prefill_ratio']:.2f}  (the last {timed} tokens)")
    print(f"decode  tok/s  off {res['decode_tok_s']['off']:8.1f}  on {res['decode_tok_s']['on']:8.1f}  "
          f"ratio {res['decode_ratio']:.2f}  ({made['off']} / {made['on']} tokens)")
    print(f"in CPU time: prefill ratio {res['prefill_ratio_cpu']:.2f}, decode ratio {res['decode_ratio_cpu']:.2f}")
    print(f"memory: {m['blocks']} blocks, {m['tokens']} tokens ({m['forgotten']} forgotten), index "
          f"{m['index_bytes'] / 2**20:.1f} MiB ({m['index_bytes'] / per:.0f} B/token), disk "
          f"{m['disk_bytes'] / 2**20:.1f} MiB ({m['disk_bytes'] / per:.0f} B/token), LRU {m['lru_bytes'] / 2**20:.1f} "
          f"MiB; RSS of both engines {res['rss_mb']:.0f} MiB")


if __name__ == "__main__":
    main()
