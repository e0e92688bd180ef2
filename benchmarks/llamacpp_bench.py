#!/usr/bin/env python
"""Side by side, one run: llama.cpp's `llama-bench` against `sinkchat bench` on the same GGUF, at the same prompt
length, decoded tokens and cache fill, at threads 1 and 2, with this machine's memory bandwidth and each side's
decode as a share of its roofline (bytes read per token / bandwidth).

- llama.cpp: `llama-bench -p 512 -n 0 -d 0` and `-p 0 -n 128 -d 0,512,2048` (`-t T -r 3 -o json`): pp512 into an
  empty cache, tg128 at depth 0, 512 and 2048 (`-d`: the KV cache already holds that many tokens). Decode is
  compared at the same cache fill: sinkchat's cache of 512 (full, evicting) against llama.cpp's depth 512, 2048
  against 2048; depth 0 (an empty cache, which sinkchat's bench never decodes at) is printed for reference.
- sinkchat: `sinkchat bench --policies sink --caches 512,2048 --decode 128 --threads T`: the prefill of 512 tokens,
  then 128 tokens decoded with the cache full (evicting), and the same at 2,048.
- Bandwidth: a streaming read of a 1 GiB buffer (C, `-O3 -march=native`, T OpenMP threads, passive waits).
- Roofline tok/s = bandwidth / (weight bytes read per token + KV bytes at that fill). sinkchat's weight bytes are
  its packed layouts' (the token table once, as the head); llama.cpp's the file's tensors minus the embedding
  lookup (plus the head: the table again when tied). Both are printed (MB read a token at fill 512): where decode
  is bound by memory, a side that reads more bytes is slower by about their ratio.

Models: (a) the bundled 135M Q4_1; (b) with `--big`, a ~1B Llama-shaped model with random weights in Q4_0 and
Q4_K_M, written by `benchmarks/gguf_memory.py`'s writer (kept under the user cache dir). Every figure is a ratio of
two measurements taken minutes apart on the same machine; machines here are shared, so run it on a quiet one.

Rounds (`--rounds`, default 2): everything is measured that many times, alternating (which side goes first too),
and each side keeps its best round (llama.cpp's round figure the mean of its 3 repetitions, sinkchat's one run; the
bandwidth its best probe): other tenants of a shared host only slow a run down. The table shows the spread.

`--bytes-only` skips the speed runs and prints the MB read a token at fill 512 alone (each file loaded once, no
timing: the figure does not depend on the machine's load), also for any `--file PATH` given (repeatable); run it
with `PYTHONPATH=<another checkout>` from outside this one to get that checkout's figures for a before / after table.

Usage: python benchmarks/llamacpp_bench.py [--threads 1,2] [--big] [--rounds 2] [--json] [--bytes-only] [--file P]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp_tools as lt  # noqa: E402

BW_C = r"""
#include <stddef.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
/* A streaming read: 64 floats (256 bytes) a step, summed so the loads cannot be dropped. The widest vectors this
   CPU has (the probe is compiled with -march=native on the machine it runs on): AVX-512, else AVX2, else scalar. */
double sc_stream(const float* a, size_t n, int reps) {
    double total = 0;
    for (int r = 0; r < reps; r++) {
        #pragma omp parallel for reduction(+:total)
        for (size_t i = 0; i < n; i += 64) {
#if defined(__AVX512F__)
            __m512 x = _mm512_add_ps(_mm512_add_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(a + i + 16)),
                                     _mm512_add_ps(_mm512_loadu_ps(a + i + 32), _mm512_loadu_ps(a + i + 48)));
            total += _mm512_reduce_add_ps(x);
#elif defined(__AVX2__)
            __m256 x = _mm256_setzero_ps();
            for (int j = 0; j < 64; j += 32)
                x = _mm256_add_ps(x, _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(a + i + j), _mm256_loadu_ps(a + i + j + 8)),
                                                   _mm256_add_ps(_mm256_loadu_ps(a + i + j + 16), _mm256_loadu_ps(a + i + j + 24))));
            float v[8];
            _mm256_storeu_ps(v, x);
            total += v[0] + v[1] + v[2] + v[3] + v[4] + v[5] + v[6] + v[7];
#else
            float acc = 0;
            for (int j = 0; j < 64; j++) acc += a[i + j];
            total += acc;
#endif
        }
    }
    return total;
}
"""
INFO = """
import json, sys
from sinkchat.config import ModelConfig
from sinkchat.model import loader
L = loader.load(ModelConfig(model=sys.argv[1]))
seen, nbytes = set(), 0
for name, mod in L.model.named_modules():
    if name.endswith("embed_tokens"):
        continue
    for t in list(mod.buffers(recurse=False)) + list(mod.parameters(recurse=False)):
        if t.data_ptr() not in seen and t.dim() >= 2:
            seen.add(t.data_ptr()); nbytes += t.numel() * t.element_size()
print(json.dumps({"weight_bytes": nbytes, "kv_bytes_per_token_bf16": L.spec.kv_bytes_per_token(16)}))
"""


def bandwidth(threads: int) -> float:
    """GB/s of a streaming read over 1 GiB with `threads` threads."""
    import numpy as np

    lib_dir = lt.cache_root() / "bench"
    lib_dir.mkdir(parents=True, exist_ok=True)
    so = lib_dir / f"stream-{zlib.crc32(BW_C.encode()):08x}.so"  # a changed probe is rebuilt, not reused
    if not so.is_file():
        src = lib_dir / "stream.c"
        src.write_text(BW_C)
        tmp = so.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(src), "-o", str(tmp)],
                       check=True)
        tmp.replace(so)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    lib = ctypes.CDLL(str(so))
    lib.sc_stream.restype = ctypes.c_double
    lib.sc_stream.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    a = np.ones(2**28, dtype=np.float32)
    lib.sc_stream(a.ctypes.data, a.size, 1)  # touch every page first
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        lib.sc_stream(a.ctypes.data, a.size, 4)
        best = max(best, 4 * a.nbytes / (time.perf_counter() - t) / 1e9)
    return best


def run_bandwidth(threads: int) -> float:
    """In a child process: OpenMP reads OMP_NUM_THREADS once per process."""
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import llamacpp_bench as b; print(b.bandwidth({threads}))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(p.stdout.strip().splitlines()[-1])


def llama_bench(bin_dir: Path, model: Path, threads: int, reps: int = 3) -> dict[str, float]:
    """pp512 into an empty cache, and tg128 at depths 0, 512 and 2048: two invocations, since one `-p 512 -n 128
    -d 0,512,2048` also runs pp512 at every depth, each repetition first filling the cache to it (~5 of a 1B
    model's ~11 minutes at 1 thread, for figures nothing compares)."""
    common = ("-m", str(model), "-t", str(threads), "-r", str(reps), "-o", "json")
    pp = lt.run_tool(bin_dir, "llama-bench", "-p", "512", "-n", "0", "-d", "0", *common)
    tg = lt.run_tool(bin_dir, "llama-bench", "-p", "0", "-n", "128", "-d", "0,512,2048", *common)
    return {**parse_llama_bench(pp), **parse_llama_bench(tg)}


def parse_llama_bench(out: str) -> dict[str, float]:
    """`llama-bench -o json` output -> {"pp512@d0": tok/s, "tg128@d512": ..., ...}: each test's mean over its
    repetitions (`avg_ts`), one figure a round as sinkchat's side has (the best of 3 repetitions x 2 rounds against
    the best of 2 runs would lean towards llama.cpp)."""
    rows = json.loads(out[out.index("[") : out.rindex("]") + 1])
    res = {}
    for r in rows:  # llama-bench runs pp512 at every depth too: each key names its depth
        kind = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
        res[f"{kind}@d{r.get('n_depth', 0)}"] = float(r["avg_ts"])
    return res


def best(samples: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's best (highest tok/s) over the rounds: a shared machine's other tenants only ever slow a run
    down, so the best of a few runs is the steadiest estimate of what each side does on this machine (one run's
    roofline share read 80% in one run and 93-111% in another, 40 minutes apart)."""
    return {k: max(s[k] for s in samples) for k in samples[0]}


def spread(values: list[float]) -> str:
    """"40-44" over the rounds ("40" for one)."""
    lo, hi = min(values), max(values)
    return f"{lo:.0f}" if len(values) == 1 else f"{lo:.0f}-{hi:.0f}"


def tree_env(tree: str | None) -> dict[str, str]:
    """The environment a sinkchat child runs in: the sinkchat this interpreter imports, or (`tree`) another
    checkout's through PYTHONPATH. Children start in an empty folder (`CWD`): `python -m` puts the working folder
    first on sys.path, and a checkout there would shadow PYTHONPATH."""
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    if tree is None:
        import sinkchat

        tree = str(Path(sinkchat.__file__).resolve().parent.parent)
    else:  # its own packed models and kernels: each checkout deletes the other's packed-cache version and repacks
        env["SINKCHAT_CACHE_DIR"] = str(lt.cache_root() / "bench" / f"against-{zlib.crc32(tree.encode()):08x}")
    env["PYTHONPATH"] = tree
    return env


CWD = str(lt.cache_root() / "bench" / "cwd")  # an empty folder the children start in (made in `main`)


def sinkchat_bench(model: Path, threads: int, tree: str | None = None) -> dict[str, float]:
    p = subprocess.run([sys.executable, "-m", "sinkchat", "bench", "--model", str(model), "--policies", "sink",
                        "--caches", "512,2048", "--decode", "128", "--gauge-tokens", "0", "--threads", str(threads),
                        "--json"], capture_output=True, text=True, env=tree_env(tree), cwd=CWD, timeout=7200)
    if p.returncode:
        raise RuntimeError(f"sinkchat bench failed: {p.stderr[-800:]}")
    data = json.loads(p.stdout.strip().splitlines()[-1])
    res = {}
    for row in data["runs"]:
        if row.get("policy") != "sink":
            continue
        cap = int(row["cache"])
        res[f"decode@{cap}"] = float(row["decode_tok_s"])
        res[f"prefill@{cap}"] = float(row["prefill_tok_s"])
    return res


def info(model: Path, tree: str | None = None) -> dict[str, float]:
    p = subprocess.run([sys.executable, "-c", INFO, str(model)], capture_output=True, text=True, check=True,
                       env=tree_env(tree), cwd=CWD)
    return json.loads(p.stdout.strip().splitlines()[-1])


def llama_weight_bytes(model: Path) -> int:
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(model)).tensors if len(t.shape) >= 2}
    total = sum(tensors.values())
    return total if "output.weight" not in tensors else total - tensors.get("token_embd.weight", 0)


def models(big: bool) -> list[Path]:
    out = [lt.bundled()]
    if big:
        import gguf_memory as gm

        for qt in ("Q4_0", "Q4_K_M"):
            out.append(gm.ensure_1b(qt))
    return out


def ratios(sc: dict[str, float], ll: dict[str, float], bw: float, sc_info: dict[str, float], ll_bytes: int
           ) -> dict[str, float]:
    """Decode ratios at the same cache fill (sinkchat's full cache of C against llama.cpp at depth C), each side's
    decode as a share of its roofline (bandwidth / bytes of weights and KV read per token), and pp512's ratio."""
    kv = sc_info["kv_bytes_per_token_bf16"]
    out = {}
    for depth in (512, 2048):
        sc_tok, ll_tok = sc[f"decode@{depth}"], ll[f"tg128@d{depth}"]
        sc_read, ll_read = sc_info["weight_bytes"] + kv * depth, ll_bytes + kv * depth
        out[f"decode_ratio@{depth}"] = sc_tok / ll_tok
        out[f"sinkchat_mb_per_token@{depth}"], out[f"llama_mb_per_token@{depth}"] = sc_read / 1e6, ll_read / 1e6
        out[f"sinkchat_roofline_share@{depth}"] = sc_tok / (bw * 1e9 / sc_read)
        out[f"llama_roofline_share@{depth}"] = ll_tok / (bw * 1e9 / ll_read)
    out["prefill_ratio"] = sc["prefill@512"] / ll["pp512@d0"]  # both into an empty cache
    return out


def bytes_rows(model_list: list[Path]) -> list[dict[str, Any]]:
    """The MB read a token at fill 512 on each side (`ratios`' column) without any timed run."""
    rows = []
    for model in model_list:
        sc_info, ll_bytes = info(model), llama_weight_bytes(model)
        kv = sc_info["kv_bytes_per_token_bf16"] * 512
        rows.append({"model": model.name, "sinkchat_mb_per_token@512": (sc_info["weight_bytes"] + kv) / 1e6,
                     "llama_mb_per_token@512": (ll_bytes + kv) / 1e6})
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def measure(model_list: list[Path], threads: list[int], rounds: int, bin_dir: Path, against: str | None = None
            ) -> list[dict[str, Any]]:
    """`rounds` rounds, each measuring every (model, threads) pair once on every side (llama.cpp first in even
    rounds, last in odd ones; with `against`, that checkout's sinkchat beside this one) and the bandwidth, so a slow
    spell of the host lands on every side; then each side's best round (`best`)."""
    cells: dict[tuple[Path, int], dict[str, list[Any]]] = {}
    for i in range(rounds):
        for model in model_list:
            for t in threads:
                c = cells.setdefault((model, t), {"bw": [], "ll": [], "sc": [], "old": []})
                c["bw"].append(run_bandwidth(t))
                sides = [("ll", lambda: llama_bench(bin_dir, model, t)), ("sc", lambda: sinkchat_bench(model, t))]
                if against:
                    sides.append(("old", lambda: sinkchat_bench(model, t, against)))
                for key, run in sides[:: 1 if i % 2 == 0 else -1]:  # odd rounds reversed: no order effect
                    c[key].append(run())
                print(json.dumps({"model": model.name, "threads": t, "bandwidth_gbs": c["bw"][-1],
                                  "llama": c["ll"][-1], "sinkchat": c["sc"][-1],
                                  **({"against": c["old"][-1]} if against else {})}), file=sys.stderr)
    return summarize(cells, model_list, threads, against)


def summarize(cells: dict[tuple[Path, int], dict[str, list[Any]]], model_list: list[Path], threads: list[int],
              against: str | None) -> list[dict[str, Any]]:
    """Each (model, threads) cell's best rounds and their ratios (cells never measured are left out)."""
    rows = []
    for model in model_list:
        if not any((model, t) in cells for t in threads):
            continue
        sc_info, ll_bytes = info(model), llama_weight_bytes(model)
        old_info = info(model, against) if against else None
        for t in [t for t in threads if (model, t) in cells]:
            c = cells[(model, t)]
            bw, ll, sc = max(c["bw"]), best(c["ll"]), best(c["sc"])
            sp = {"sinkchat_decode@512": spread([x["decode@512"] for x in c["sc"]]),
                  "llama_tg128@d512": spread([x["tg128@d512"] for x in c["ll"]]), "bandwidth_gbs": spread(c["bw"])}
            rows.append({"model": model.name, "threads": t, "rounds": len(c["sc"]), "bandwidth_gbs": bw, "llama": ll,
                         "sinkchat": sc, "spread": sp,
                         **ratios(sc, ll, bw, sc_info, ll_bytes)})
            if against and old_info is not None and c.get("old"):
                old = best(c["old"])
                rows[-1]["against"] = {"tree": against, "sinkchat": old,
                                       "decode_spread@512": spread([x["decode@512"] for x in c["old"]]),
                                       **ratios(old, ll, bw, old_info, ll_bytes)}
    return rows


def from_log(log: Path, model_list: list[Path], against: str | None) -> list[dict[str, Any]]:
    """The table of a run cut short, from the cells it printed to stderr (one JSON line each)."""
    by_name = {m.name: m for m in model_list}
    cells: dict[tuple[Path, int], dict[str, list[Any]]] = {}
    threads: list[int] = []
    for line in log.read_text().splitlines():
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        if r["model"] not in by_name:
            raise SystemExit(f"{log}: {r['model']} is none of the models given (--big, --file)")
        c = cells.setdefault((by_name[r["model"]], r["threads"]), {"bw": [], "ll": [], "sc": [], "old": []})
        c["bw"].append(r["bandwidth_gbs"])
        c["ll"].append(r["llama"])
        c["sc"].append(r["sinkchat"])
        if "against" in r:
            c["old"].append(r["against"])
        threads += [r["threads"]] if r["threads"] not in threads else []
    return summarize(cells, model_list, threads, against)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--big", action="store_true", help="also the ~1B random-weight Q4_0 and Q4_K_M files")
    ap.add_argument("--rounds", type=int, default=2, help="measure everything this many times; keep each best")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--bytes-only", action="store_true", help="only the MB read a token (no timed runs)")
    ap.add_argument("--file", action="append", type=Path, default=[], help="another GGUF to measure (repeatable)")
    ap.add_argument("--against", metavar="TREE", help="also time this checkout's sinkchat in every round (before / after)")
    ap.add_argument("--from-log", type=Path, help="no runs: the table of the cells a run printed to stderr (cut short)")
    a = ap.parse_args()
    Path(CWD).mkdir(parents=True, exist_ok=True)
    if a.bytes_only:
        rows = bytes_rows(models(a.big) + a.file)
        print(json.dumps(rows) if a.json else "\n".join(
            ["| model | MB read a token sc / llama (fill 512) | ratio |", "|---|---|---|"]
            + [f"| {r['model']} | {r['sinkchat_mb_per_token@512']:.1f} / {r['llama_mb_per_token@512']:.1f} | "
               f"{r['sinkchat_mb_per_token@512'] / r['llama_mb_per_token@512']:.3f} |" for r in rows]))
        return
    against = str(Path(a.against).resolve()) if a.against else None
    if a.from_log:
        rows = from_log(a.from_log, models(a.big) + a.file, against)
    else:
        rows = measure(models(a.big) + a.file, [int(x) for x in a.threads.split(",")], max(1, a.rounds),
                       lt.ensure_tools(), against)
    if not rows:
        raise SystemExit("no cell was measured" + (f" in {a.from_log}" if a.from_log else ""))
    saved = lt.cache_root() / "bench" / "llamacpp_bench.json"  # every figure, kept past a failed print
    saved.write_text(json.dumps(rows))
    if a.json:
        print(json.dumps(rows))
        return
    print(f"best of {min(r['rounds'] for r in rows)}-{max(r['rounds'] for r in rows)} rounds each (the spread of decode at fill 512 and of the bandwidth in brackets;"
          f" every figure in {saved})")
    table(rows)
    before = [r for r in rows if "against" in r]
    if before:
        print(f"\nthe same rounds, sinkchat of {against} (before) against the same llama.cpp runs:")
        table([{**r, **r["against"], "spread": {**r["spread"], "sinkchat_decode@512": r["against"]["decode_spread@512"]}}
               for r in before])


def table(rows: list[dict[str, Any]]) -> None:
    print("| model | t | GB/s | decode sc / llama, fill 512 | ratio | roofline sc / llama | decode @2048 ratio | "
          "MB read a token sc / llama | llama tg128 empty | prefill sc / llama pp512 | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        sc, ll, sp = r["sinkchat"], r["llama"], r["spread"]
        print(f"| {r['model']} | {r['threads']} | {r['bandwidth_gbs']:.1f} ({sp['bandwidth_gbs']}) | "
              f"{sc['decode@512']:.0f} ({sp['sinkchat_decode@512']}) / {ll['tg128@d512']:.0f} "
              f"({sp['llama_tg128@d512']}) | {r['decode_ratio@512']:.2f} | {r['sinkchat_roofline_share@512']:.0%} / "
              f"{r['llama_roofline_share@512']:.0%} | {r['decode_ratio@2048']:.2f} | "
              f"{r['sinkchat_mb_per_token@512']:.0f} / {r['llama_mb_per_token@512']:.0f} | {ll['tg128@d0']:.0f} | "
              f"{sc['prefill@512']:.0f} / {ll['pp512@d0']:.0f} | {r['prefill_ratio']:.2f} |")


if __name__ == "__main__":
    main()
