#!/usr/bin/env python
"""Bounded memory while loading a big GGUF: peak RSS during the load and RSS after it, against the file's size.

Targets (issue "Any llama.cpp GGUF straight into the kernels"): peak <= 1.15 x file + 150 MB; after loading
<= 1.1 x file + KV + 150 MB. The interpreter with torch and transformers imported holds ~250 MB before any weight is
read; the script prints that baseline and every figure both as measured and above it.

The model: a 3B-parameter Llama-shaped file (hidden 3072, 28 layers, 24 heads / 8 KV heads, head dim 128, FFN
8192; the bundled model's tokenizer, so vocab 49,152, tied) with random weights, written straight in Q4_K_M's type
mix: Q4_K everywhere except Q6_K for attn_v and ffn_down in the layers llama.cpp's `use_more_bits` picks (the first
and last eighth, and every third between) -- the mix `llama-quantize ... Q4_K_M` produces. Blocks are random bytes
with finite scales (valid blocks; quality is meaningless, shapes, types and bytes are real). `--check` runs
llama.cpp's llama-bench on it once to show llama.cpp reads the same file. Kept under the user cache dir.

Usage: python benchmarks/gguf_memory.py [--layers 28] [--bundled] [--check] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp_tools as lt  # noqa: E402

SHAPE = dict(hidden=3072, layers=28, heads=24, kv=8, head_dim=128, ffn=8192)  # Llama 3.2 3B
SHAPE_1B = dict(hidden=2048, layers=16, heads=32, kv=8, head_dim=64, ffn=8192)  # Llama 3.2 1B
F16_AT = {"Q4_K": [0, 2], "Q6_K": [208], "Q4_0": [0]}
BLOCK = {"Q4_K": (256, 144), "Q6_K": (256, 210), "Q4_0": (32, 18)}
MEASURE = """
import json, os, resource, sys, time
import torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
from sinkchat.config import ModelConfig
from sinkchat.model import loader
t0 = time.perf_counter()
L = loader.load(ModelConfig(model=sys.argv[1]))
sec = time.perf_counter() - t0
print(json.dumps({"baseline_mb": base, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "after_mb": rss(), "seconds": sec}))
"""


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get more bits in Q4_K_M (llama-quant.cpp)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def random_blocks(qtype: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    bs, size = BLOCK[qtype]
    nb = rows * k // bs
    b = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    for at in F16_AT[qtype]:
        b[:, at : at + 2] = (rng.random(nb, dtype=np.float32) * 0.002).astype(np.float16).view(np.uint8).reshape(nb, 2)
    return b.reshape(rows, -1)


def tensors(s: dict[str, int], mix: str = "Q4_K_M") -> list[tuple[str, str, tuple[int, int] | tuple[int]]]:
    """(name, type, torch-order shape) of every tensor, in file order. mix: "Q4_K_M" (llama.cpp's mix) or one
    type for every matrix (e.g. "Q4_0")."""
    h, f, d = s["hidden"], s["ffn"], s["head_dim"]
    base = "Q4_K" if mix == "Q4_K_M" else mix
    out: list = [("token_embd.weight", base, (49152, h))]
    for i in range(s["layers"]):
        more = "Q6_K" if mix == "Q4_K_M" and use_more_bits(i, s["layers"]) else base
        out += [(f"blk.{i}.attn_norm.weight", "F32", (h,)), (f"blk.{i}.attn_q.weight", base, (s["heads"] * d, h)),
                (f"blk.{i}.attn_k.weight", base, (s["kv"] * d, h)), (f"blk.{i}.attn_v.weight", more, (s["kv"] * d, h)),
                (f"blk.{i}.attn_output.weight", base, (h, s["heads"] * d)), (f"blk.{i}.ffn_norm.weight", "F32", (h,)),
                (f"blk.{i}.ffn_gate.weight", base, (f, h)), (f"blk.{i}.ffn_up.weight", base, (f, h)),
                (f"blk.{i}.ffn_down.weight", more, (h, f))]
    return out + [("output_norm.weight", "F32", (h,))]


def write(path: Path, s: dict[str, int], mix: str = "Q4_K_M") -> None:
    """Stream the file out tensor by tensor (GGUFWriter's header, then each tensor's bytes): never all in memory."""
    import gguf
    from gguf import GGMLQuantizationType as T

    src = gguf.GGUFReader(str(lt.bundled()))
    w = gguf.GGUFWriter(str(path), "llama")
    for key, field in src.fields.items():
        if key.startswith("tokenizer."):
            val = field.contents()
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, val, field.types[0], sub_type=sub)
    w.add_context_length(8192)
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv"])
    w.add_rope_dimension_count(s["head_dim"])
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(49152)
    w.add_file_type(15 if mix == "Q4_K_M" else 2)  # MOSTLY_Q4_K_M / MOSTLY_Q4_0
    rng = np.random.default_rng(0)
    plan = tensors(s, mix)
    for name, qt, shape in plan:
        if qt == "F32":
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0])
        else:
            bs, size = BLOCK[qt]
            w.add_tensor_info(name, (shape[0], shape[1] // bs * size), np.dtype(np.uint8), shape[0] * shape[1] // bs * size,
                              raw_dtype=T[qt])  # the byte shape: gguf-py turns it into the weight shape
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, qt, shape in plan:
        w.write_tensor_data(np.ones(shape, np.float32) if qt == "F32" else random_blocks(qt, shape[0], shape[1], rng))
    w.close()


def ensure_1b(mix: str) -> Path:
    """The ~1B Llama-shaped random-weight file in `mix` ("Q4_0" or "Q4_K_M"), written once under the cache dir."""
    model = lt.cache_root() / "gguf-bench" / f"llama-1b-random-{mix}.gguf"
    if not model.is_file():
        model.parent.mkdir(parents=True, exist_ok=True)
        write(model.with_suffix(".tmp"), SHAPE_1B, mix)
        model.with_suffix(".tmp").replace(model)
    return model


def measure(model: Path, env: dict[str, str]) -> dict[str, float]:
    p = subprocess.run([sys.executable, "-c", MEASURE, str(model)], env=env, capture_output=True, text=True, timeout=7200)
    if p.returncode:
        raise SystemExit(f"load failed: {p.stderr[-1500:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def report(name: str, size_mb: float, r: dict[str, float], kv_mb: float) -> dict[str, object]:
    peak_above, after_above = r["peak_mb"] - r["baseline_mb"], r["after_mb"] - r["baseline_mb"]
    peak_t, after_t = 1.15 * size_mb + 150, 1.1 * size_mb + kv_mb + 150
    row = {"start": name, **{k: round(v, 1) for k, v in r.items()}, "peak_above_baseline_mb": round(peak_above),
           "after_above_baseline_mb": round(after_above), "peak_target_mb": round(peak_t),
           "after_target_mb": round(after_t), "peak_ok": peak_above <= peak_t, "after_ok": after_above <= after_t}
    print(f"{name:>6}: load {r['seconds']:.1f} s; peak {r['peak_mb']:.0f} MB ({peak_above:.0f} above the "
          f"{r['baseline_mb']:.0f} MB baseline; target {peak_t:.0f}: {'ok' if row['peak_ok'] else 'OVER'}); after "
          f"{r['after_mb']:.0f} MB ({after_above:.0f} above; target {after_t:.0f}: {'ok' if row['after_ok'] else 'OVER'})")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=SHAPE["layers"])
    ap.add_argument("--bundled", action="store_true", help="measure the bundled model instead")
    ap.add_argument("--check", action="store_true", help="llama-bench reads the written file (sanity)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.bundled:
        model = lt.bundled()
    else:
        s = dict(SHAPE, layers=a.layers)
        model = lt.cache_root() / "gguf-bench" / f"llama-3b-random-{a.layers}L-Q4_K_M.gguf"
        if not model.is_file():
            model.parent.mkdir(parents=True, exist_ok=True)
            print(f"writing {model} ...", file=sys.stderr)
            write(model.with_suffix(".tmp"), s)
            model.with_suffix(".tmp").replace(model)
        if a.check:
            print(lt.run_tool(lt.ensure_tools(), "llama-bench", "-m", str(model), "-p", "0", "-n", "4", "-t", "2")[-600:])
    size_mb = model.stat().st_size / 2**20
    print(f"{model.name}: {size_mb:.0f} MB", file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, SINKCHAT_CACHE_DIR=cache, OMP_WAIT_POLICY="PASSIVE")
        for name in ("first", "later"):  # first: packs from the GGUF; later: reads the packed cache
            rows.append(report(name, size_mb, measure(model, env), kv_mb=0.0))
    if a.json:
        print(json.dumps({"file": str(model), "size_mb": size_mb, "rows": rows}))


if __name__ == "__main__":
    main()
