"""What `sinkchat demo` writes besides summary.json: summary.md and attention.png, both rendered from the summary
dict alone, so the markdown, the plot and the JSON cannot disagree."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def fmt(x: float) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def render_markdown(s: dict[str, Any]) -> str:
    """The summary as markdown; every number comes from `s` (the same dict written as summary.json)."""
    pol, jump, g, ab = s["ppl"]["policies"], s["jump"], s["attention"], s["ablation"]
    L = [f"# sinkchat demo: {s['model']} ({s['quant']})", "",
         f"Text: `{s['text']}`, {s['tokens']} tokens; cache {s['cache']} tokens ({s['n_sink']} sinks), "
         f"threads {s['threads']}. Measured on this model only: the size of each effect depends on the model.", "",
         "## 1. Perplexity by policy", "",
         "| policy | ppl, all targets | ppl after the cache fills | ppl on recompute's targets after it fills "
         "| first eviction at target |", "|---|---|---|---|---|"]
    rec = s.get("recompute_after", {})
    for name, e in pol.items():
        allt = fmt(e["ppl"]) if name != "recompute" else "—"
        after = fmt(jump[name]["after_all"]) if name in jump else "—"
        first = e["first_eviction_target"] if e["first_eviction_target"] is not None else "never"
        L.append(f"| {name} | {allt} | {after} | {fmt(rec[name]) if name in rec else '—'} | {first} |")
    w, k = jump.get("window"), jump.get("sink")
    if w and k:
        L += ["", f"Over the {s['jump_span']} targets before / after the cache first fills: window "
              f"{fmt(w['before'])} -> {fmt(w['after'])} (x{fmt(w['after'] / w['before'])}); sink "
              f"{fmt(k['before'])} -> {fmt(k['after'])} (x{fmt(k['after'] / k['before'])})."]
    if rec:
        L += ["", f"recompute re-encodes the last {s['cache']} tokens for every {s['recompute_every']}th target of the "
              f"first {s['recompute_span']} tokens; {s['recompute_after_targets']} of its targets come after the "
              f"cache fills (sink / recompute there: {fmt(rec['sink'] / rec['recompute'])}; few targets, so noisy)."]
    L += ["", f"Per-bin ppl ({s['bin']} tokens per bin; recompute is too sparse to bin): see `ppl.png`.", "",
          f"## 2. Where attention goes at long range (dense cache, {len(g['query_positions'])} query positions "
          f"from {g['query_positions'][0]} to {g['query_positions'][-1]})", "",
          f"Mean over {'the global (full-attention) ' if g.get('hybrid') else ''}layers and heads: first {g['n']} positions {g['first_mean']:.3f}, most recent {g['n']} "
          f"{g['recent_mean']:.3f}, uniform {g['uniform']:.4f}. In {g['layers_first_gt_recent']} of "
          f"{len(g['first_per_layer'])} layers the first {g['n']} get more than the most recent {g['n']}.", "",
          "| position | " + " | ".join(str(i) for i in range(len(g["per_position"]))) + " |",
          "|---|" + "---|" * len(g["per_position"]),
          "| share | " + " | ".join(f"{v:.3f}" for v in g["per_position"]) + " |", "",
          "| layer | first | recent | uniform |", "|---|---|---|---|"]
    index = g.get("layer_index") or list(range(len(g["first_per_layer"])))
    for i, f, r in zip(index, g["first_per_layer"], g["recent_per_layer"]):
        L.append(f"| {i} | {f:.3f} | {r:.3f} | {g['uniform']:.4f} |")
    if g.get("local"):
        L += local_rows(g["local"], g["n"])
    L += ["", f"## 3. Ablation (dense cache of {ab['prefix']} tokens, ppl of the next {ab['follow']})", "",
          "| evicted | ppl | vs none |", "|---|---|---|",
          f"| nothing | {fmt(ab['ppl']['none'])} | 1.00 |",
          f"| first {ab['n']} | {fmt(ab['ppl']['first'])} | {fmt(ab['first_ratio'])} |",
          f"| {ab['n']} from slot {ab['middle_start']} | {fmt(ab['ppl']['middle'])} | {fmt(ab['middle_ratio'])} |",
          ""]
    return "\n".join(L)


def local_rows(loc: dict[str, Any], n: int) -> list[str]:
    """The local (sliding-window) layers' part of section 2: shares over each layer's own window."""
    L = ["", f"Local (sliding-window) layers, over their own window: first {n} tokens of the window "
         f"{loc['first_mean']:.3f}, most recent {n} {loc['recent_mean']:.3f}, uniform {loc['uniform']:.4f}. "
         "The window's first tokens are just the tokens W back, not the stream's start; the sink policy never "
         "evicts from this window.", "", "| local layer | window's first | recent | uniform |", "|---|---|---|---|"]
    for i, f, r in zip(loc["layer_index"], loc["first_per_layer"], loc["recent_per_layer"]):
        L.append(f"| {i} | {f:.3f} | {r:.3f} | {loc['uniform']:.4f} |")
    return L


def plot_attention(s: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g, ab = s["attention"], s["ablation"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
    xs = g.get("layer_index") or list(range(len(g["first_per_layer"])))
    a1.plot(xs, g["first_per_layer"], marker="o", label=f"first {g['n']} positions")
    a1.plot(xs, g["recent_per_layer"], marker="s", label=f"most recent {g['n']}")
    if g.get("local"):
        loc = g["local"]
        a1.plot(loc["layer_index"], loc["first_per_layer"], marker="^", ls=":",
                label=f"local layers: first {g['n']} of their window")
    a1.axhline(g["uniform"], color="gray", ls="--", label="uniform")
    a1.set_xlabel("layer")
    a1.set_ylabel("attention share of the newest token")
    a1.set_title(f"long range (query at {g['query_positions'][0]}-{g['query_positions'][-1]})")
    a1.legend()
    a1.grid(alpha=0.3)
    names = ["none", "first", "middle"]
    a2.bar(names, [ab["ppl"][k] for k in names], color=["gray", "tab:red", "tab:blue"])
    a2.set_title(f"ppl after evicting {ab['n']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
