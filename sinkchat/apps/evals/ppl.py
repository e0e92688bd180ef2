"""Perplexity of a long text streamed through the Engine under each cache policy, and `sinkchat ppl`.

`sink`, `window` and `dense` stream the text through a real Engine (the same code path chat uses), chunk by chunk, so
every eviction and re-rotation is exercised. `recompute` is the paper's oracle: for a target token it re-encodes the
last `capacity` tokens from scratch. It costs a full forward per target, so it scores every `recompute_every`-th
target; the streaming policies are also reported on exactly those targets (`sampled_ppl`) for a like-for-like ratio.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import click

from sinkchat.api import start
from sinkchat.bootstrap import build_settings, common_options, pop_common, setup_logging, user_errors
from sinkchat.config import CacheConfig, ConfigError

STREAM_POLICIES = ("sink", "window", "dense")
ALL_POLICIES = STREAM_POLICIES + ("recompute",)


@dataclass
class PolicyResult:
    name: str
    nll: list[float] = field(default_factory=list)  # per target, in stream order (NaN where not scored)
    seconds: float = 0.0
    first_eviction: int | None = None  # target index at which the first eviction happened

    def ppl(self, idx: list[int] | None = None) -> float:
        vals = [self.nll[i] for i in (idx if idx is not None else range(len(self.nll)))]
        vals = [v for v in vals if not math.isnan(v)]
        return math.exp(sum(vals) / len(vals)) if vals else float("nan")

    def bins(self, size: int) -> list[float]:
        return [self.ppl(list(range(i, min(i + size, len(self.nll))))) for i in range(0, len(self.nll), size)]


def stream_nll(engine: Any, ids: list[int], chunk: int, progress: Callable[[int], None] | None = None) -> PolicyResult:
    """NLL of ids[1:] given everything the engine's cache keeps; feeds `chunk` tokens per forward."""
    import torch

    from sinkchat.core.events import EvictionEvent

    res = PolicyResult(engine.cache_cfg.policy)
    t0 = time.perf_counter()
    engine.prefill_chunk = max(1, chunk)
    pos = 0
    prev_logits: torch.Tensor | None = None
    while pos < len(ids):
        block = ids[pos : pos + engine.max_chunk]
        logits_parts = []
        for item in engine.feed_ids(block, all_logits=True):
            if isinstance(item, torch.Tensor):
                logits_parts.append(item)
            elif isinstance(item, EvictionEvent) and res.first_eviction is None:
                res.first_eviction = max(0, len(res.nll) - 1)
        logits = torch.cat(logits_parts).float()  # [n, V]
        logp = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor(block, dtype=torch.long)
        if prev_logits is not None:  # first token of the block was predicted by the previous block's last logits
            res.nll.append(float(-torch.log_softmax(prev_logits, -1)[targets[0]]))
        res.nll.extend((-logp[:-1].gather(1, targets[1:, None])[:, 0]).tolist())
        prev_logits = logits[-1]
        pos += len(block)
        if progress:
            progress(pos)
    res.seconds = time.perf_counter() - t0
    return res


def recompute_nll(model: Any, ids: list[int], capacity: int, every: int, device: Any,
                  bos: int | None = None) -> PolicyResult:
    """Oracle: for targets t = every-1, 2*every-1, ...: a fresh forward over the last `capacity` tokens before t.
    `bos`: where the stream starts with one (`Engine.encode_document`), each window starts with it too, as every
    sequence the model was trained on did (llama.cpp's perplexity does the same per chunk)."""
    import torch

    res = PolicyResult("recompute", nll=[float("nan")] * (len(ids) - 1))
    t0 = time.perf_counter()
    with torch.no_grad():
        for t in range(every, len(ids), every):
            ctx = ids[max(0, t - capacity) : t]
            if bos is not None and ctx[0] != bos:
                ctx = [bos] + ctx[1:]  # the BOS in place of the oldest token: still `capacity` tokens
            out = model(input_ids=torch.tensor([ctx], device=device), use_cache=False, logits_to_keep=1)
            res.nll[t - 1] = float(-torch.log_softmax(out.logits[0, -1].float(), -1)[ids[t]])
    res.seconds = time.perf_counter() - t0
    return res


def stream_bos(engine: Any, ids: list[int]) -> int | None:
    """The BOS id where the stream starts with one (`Engine.encode_document` puts it first), for `recompute_nll`:
    every recompute window must start with it as the streamed cache does. Measured on Gemma 3 270M (`demo`'s
    defaults, 32 targets after the cache fills): recompute 59.29 without it against sink 15.48, 16.36 with it."""
    bos = getattr(engine.tokenizer, "bos_token_id", None)
    return bos if ids and bos is not None and ids[0] == bos else None


def run_ppl(
    engine: Any, ids: list[int], policies: list[str], cache: CacheConfig, chunk: int, recompute_every: int,
    progress: Callable[[str], None] | None = None,
) -> dict[str, PolicyResult]:
    """Score `ids` under each policy, reconfiguring the one engine between policies (the model is shared)."""
    results: dict[str, PolicyResult] = {}
    if "dense" in policies and len(ids) > engine.max_positions:
        raise ConfigError(f"policy dense cannot hold {len(ids)} tokens: the model's context is {engine.max_positions}")
    for pol in policies:
        if progress:
            progress(f"{pol}: {len(ids)} tokens")
        if pol == "recompute":
            cap = cache.resolved(engine.max_positions).capacity
            bos = stream_bos(engine, ids)
            results[pol] = recompute_nll(engine.model, ids, cap, recompute_every, engine.device, bos)
            continue
        engine.clear()
        # dense = no eviction at all: the whole text in context (the paper's dense-attention baseline)
        cap = len(ids) + 1 if pol == "dense" else cache.resolved(engine.max_positions).capacity
        engine.reconfigure(policy=pol, n_sink=cache.n_sink, capacity=max(cap, cache.n_sink + 8),
                           evict_chunk=cache.evict_chunk)
        results[pol] = stream_nll(engine, ids, chunk)
    return results


def summarize(results: dict[str, PolicyResult], bin_size: int) -> dict[str, Any]:
    sampled = [i for i, v in enumerate(results["recompute"].nll) if not math.isnan(v)] if "recompute" in results else None
    out: dict[str, Any] = {"policies": {}}
    for name, r in results.items():
        entry: dict[str, Any] = {
            "ppl": r.ppl(), "bins": r.bins(bin_size), "targets": sum(not math.isnan(v) for v in r.nll),
            "seconds": round(r.seconds, 2), "first_eviction_target": r.first_eviction,
        }
        if sampled is not None:
            entry["sampled_ppl"] = r.ppl(sampled)
        out["policies"][name] = entry
    if sampled is not None:
        out["recompute_targets"] = len(sampled)
    return out


def plot(summary: dict[str, Any], bin_size: int, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, entry in summary["policies"].items():
        xs = [(i + 0.5) * bin_size for i in range(len(entry["bins"]))]
        sample = f", {summary['recompute_targets']} sampled targets" if name == "recompute" else ""
        ax.plot(xs, entry["bins"], marker="o", label=f"{name} ({entry['ppl']:.2f}{sample})")
    ax.set_xlabel("token index")
    ax.set_ylabel(f"perplexity per {bin_size}-token bin")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = Path(path).with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def read_text(path: str, max_chars: int | None = None) -> str:
    if path == "-":
        data = sys.stdin.buffer.read()
    else:
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise click.ClickException(f"cannot read {path}: {e.strerror}") from None
    text = data.decode("utf-8", errors="replace")
    if not text.strip():
        raise click.ClickException(f"{path} holds no text")
    return text[:max_chars] if max_chars else text


@click.command("ppl")
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--policy", "policies", multiple=True, type=click.Choice(ALL_POLICIES),
              help="policies to compare (repeatable; default: sink and window)")
@click.option("--bin", "bin_size", type=click.IntRange(1, None), default=1000, show_default=True, help="tokens per bin")
@click.option("--tokens", "limit", type=click.IntRange(2, None), default=None, help="score only the first N tokens")
@click.option("--chunk", type=click.IntRange(1, None), default=None, help="tokens per forward (default: max(32, --evict-chunk); 1 = token by token)")
@click.option("--recompute-every", type=click.IntRange(1, None), default=None, help="recompute scores every Nth target (default capacity/16)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None, help="write a PNG of ppl per bin")
@common_options(exclude=("policy", "temperature", "max_tokens", "seed"))
def ppl_command(file: str, policies: tuple[str, ...], bin_size: int, limit: int | None, chunk: int | None,
                recompute_every: int | None, as_json: bool, plot_path: str | None, **kw: Any) -> None:
    """Stream FILE through the engine token by token and print perplexity per bin and overall, per policy."""
    opts = pop_common(kw)
    setup_logging(opts["verbose"] or 0)
    with user_errors():
        settings = build_settings(opts)
        pols = list(dict.fromkeys(policies or ("sink", "window")))
        text = read_text(file)
        engine = start(settings, None, lambda m: click.echo(m, err=True)).engine
        ids = engine.encode_document(text)
        if limit:
            ids = ids[:limit]
        if len(ids) < 2:
            raise click.ClickException(f"{file} has fewer than 2 tokens")
        cache = settings.cache
        resolved = cache.resolved(engine.max_positions)
        every = recompute_every or max(1, resolved.capacity // 16)
        results = run_ppl(engine, ids, pols, cache, chunk or max(32, resolved.evict_chunk), every,
                          progress=lambda m: click.echo(m, err=True))
        summary = summarize(results, bin_size)
        summary.update({"file": file, "tokens": len(ids), "capacity": resolved.capacity, "n_sink": resolved.n_sink,
                        "evict_chunk": resolved.evict_chunk, "model": engine.loaded.source, "quant": engine.loaded.quant})
        if plot_path:
            plot(summary, bin_size, plot_path, f"{Path(file).name}: cache {resolved.capacity}, {resolved.n_sink} sinks")
        if as_json:
            click.echo(json.dumps(summary))
        else:
            click.echo(format_table(summary, bin_size))


def format_table(summary: dict[str, Any], bin_size: int) -> str:
    pols = summary["policies"]
    names = list(pols)
    lines = [f"{summary['tokens']} tokens, cache {summary['capacity']} ({summary['n_sink']} sinks)"]
    lines.append("bin".ljust(14) + "".join(n.rjust(12) for n in names))
    nbins, targets = max(len(p["bins"]) for p in pols.values()), summary["tokens"] - 1

    def cell(name: str, v: float) -> str:  # recompute scores a sample of the targets: only its "sampled" row counts
        return "—".rjust(12) if name == "recompute" else f"{v:12.2f}"

    for b in range(nbins):
        label = f"{b * bin_size}-{min((b + 1) * bin_size, targets)}"
        row = [pols[n]["bins"][b] if b < len(pols[n]["bins"]) else float("nan") for n in names]
        lines.append(label.ljust(14) + "".join(cell(n, v) for n, v in zip(names, row)))
    lines.append("overall".ljust(14) + "".join(cell(n, pols[n]["ppl"]) for n in names))
    if "recompute_targets" in summary:
        lines.append(f"on the {summary['recompute_targets']} recompute targets".ljust(14))
        lines.append("sampled".ljust(14) + "".join(f"{pols[n]['sampled_ppl']:12.2f}" for n in names))
    return "\n".join(lines)
