#!/usr/bin/env python
"""Side by side on the same GGUF files: llama.cpp's `llama-perplexity` and `sinkchat ppl --policy dense`, same text,
same 2,048-token context, targets 1,024-2,047 (llama-perplexity scores the second half of its chunk; sinkchat's
second 1,024-token bin); plus each file's load time (first start, with an empty cache dir, and a later start) and
peak RSS of a load, in a fresh process each.

Files: the bundled Q4_1 model requantized by `llama-quantize --allow-requantize` to each type (both sides run the
same file, so requantizing an already-4-bit model is fine here). Target: sinkchat / llama.cpp <= 1.005 on every file.

Usage: python benchmarks/llamacpp_ppl.py [--types Q4_0,Q4_1,Q4_K_M,Q5_K_M,Q6_K,Q8_0] [--chars 20000] [--json]
Builds llama.cpp's tools into the user cache dir on first use (benchmarks/llamacpp_tools.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp_tools as lt  # noqa: E402

TYPES = "Q4_0,Q4_1,Q4_K_M,Q5_K_M,Q6_K,Q8_0"
LOAD = """
import json, resource, sys, time
t0 = time.perf_counter()
from sinkchat.config import ModelConfig
from sinkchat.model import loader
L = loader.load(ModelConfig(model=sys.argv[1]))
print(json.dumps({"seconds": time.perf_counter() - t0, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def llama_ppl(bin_dir: Path, model: Path, text: Path, ctx: int, threads: int) -> float:
    out = lt.run_tool(bin_dir, "llama-perplexity", "-m", str(model), "-f", str(text), "-c", str(ctx), "--chunks", "1",
                      "-t", str(threads))
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", out)
    if not m:
        raise RuntimeError(f"no PPL in llama-perplexity's output: {out[-500:]}")
    return float(m.group(1))


def sinkchat_ppl(model: Path, text: Path, ctx: int, env: dict[str, str]) -> float:
    p = subprocess.run([sys.executable, "-m", "sinkchat", "ppl", str(text), "--model", str(model), "--policy", "dense",
                        "--tokens", str(ctx), "--bin", str(ctx // 2), "--json"], env=env, capture_output=True,
                       text=True, timeout=3600)
    if p.returncode:
        raise RuntimeError(f"sinkchat ppl failed: {p.stderr[-800:]}")
    return float(json.loads(p.stdout.strip().splitlines()[-1])["policies"]["dense"]["bins"][1])


def load_stats(model: Path, env: dict[str, str]) -> dict[str, float]:
    p = subprocess.run([sys.executable, "-c", LOAD, str(model)], env=env, capture_output=True, text=True, timeout=3600)
    if p.returncode:
        raise RuntimeError(f"load failed: {p.stderr[-800:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def file_types(model: Path) -> str:
    from gguf import GGUFReader

    counts: dict[str, int] = {}
    for t in GGUFReader(str(model)).tensors:
        if len(t.shape) == 2:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return " ".join(f"{k}x{v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=TYPES)
    ap.add_argument("--chars", type=int, default=20000, help="characters of alice29.txt to score")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    bin_dir = lt.ensure_tools()
    text = Path(tempfile.mkdtemp()) / "alice-20k.txt"
    text.write_text(lt.alice().read_text(encoding="latin-1")[: a.chars])
    rows = []
    for qtype in a.types.split(","):
        model = lt.quantized(bin_dir, qtype)
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, XDG_CACHE_HOME=cache, OMP_WAIT_POLICY="PASSIVE")
            first = load_stats(model, env)
            later = load_stats(model, env)
            ours = sinkchat_ppl(model, text, a.ctx, env)
        theirs = llama_ppl(bin_dir, model, text, a.ctx, a.threads)
        rows.append({"type": qtype, "file_mb": model.stat().st_size / 2**20, "tensors": file_types(model),
                     "llama_cpp": theirs, "sinkchat": ours, "ratio": ours / theirs, "load_first_s": first["seconds"],
                     "load_later_s": later["seconds"], "peak_first_mb": first["peak_mb"],
                     "peak_later_mb": later["peak_mb"]})
        print(f"{qtype}: {rows[-1]}", file=sys.stderr)
    if a.json:
        print(json.dumps(rows))
        return
    print("| file | MB | 2-D tensors | llama.cpp | sinkchat | ratio | load first / later s | peak RSS first / later MB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['type']} | {r['file_mb']:.0f} | {r['tensors']} | {r['llama_cpp']:.2f} | {r['sinkchat']:.2f} | "
              f"{r['ratio']:.3f} | {r['load_first_s']:.1f} / {r['load_later_s']:.1f} | "
              f"{r['peak_first_mb']:.0f} / {r['peak_later_mb']:.0f} |")
    worst = max(rows, key=lambda r: r["ratio"])
    print(f"worst ratio {worst['ratio']:.3f} ({worst['type']}); target <= 1.005: "
          f"{'met' if worst['ratio'] <= 1.005 else 'NOT met'}")


if __name__ == "__main__":
    main()
