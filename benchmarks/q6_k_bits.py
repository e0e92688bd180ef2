"""Q6_K at its own bits (issue #33 item 1): the q6k layout (the q4 nibble tile of q + 32, two bit-planes of its high 2
bits, the file's fp16 d and int8 scale per 16: 210 bytes per 256 weights, as the file) against the q8k layout Q6_K
was held in before (q + 128 as a byte, 292 bytes per 256), side by side in one run on big Q6_K linears of a ~1B
Q4_K_M model's shapes (synthetic weights: llama-quantize is not here).

    python benchmarks/q6_k_bits.py                              # down and head, decode and prefill, 7 rounds
    python benchmarks/q6_k_bits.py --cases head --rounds 11 --threads 2

Cases: "down" is `--copies` ffn_down tensors of Llama-3.2-1B (N x K = 2048 x 8192; a Q4_K_M file holds half its
layers' ffn_down as Q6_K), run one after another at one row as a token reads them, so the weights stream from memory
(far more than the L3); "head" is one output head slice of 32768 x 2048 (Q4_K_M's output.weight is Q6_K). For each:
the bytes each layout holds (and the GGUF's Q6_K bytes), the same random Q6_K tensors packed both ways checked to
give the same bits (one row and a prefill's rows), then rounds, the two layouts alternating (the first swapped each
round). Each figure is the fastest of `--repeat` passes in a round; printed: each layout's median over the rounds,
q6k/q8k, the quartiles of each round's q6k/q8k (its pair timed back to back), the ratio of the two layouts' fastest
rounds (other load only adds time, so on a busy machine that is the steadiest figure), and the weight bytes streamed
per second in those fastest rounds. The C entry points are called directly (ctypes), so the binding's Python checks
are not in the figures. Noisy on a shared machine: read the ratios of one run.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sinkchat.kernels import native  # noqa: E402

CASES = {"down": (2048, 8192), "head": (32768, 2048)}  # (N, K)
LAYOUTS = ("q8k", "q6k")


class Linear:
    """One Q6_K tensor packed both ways (q int8 in -32..31, fp16 d per 256, int8 sc per 16), with what C takes."""

    def __init__(self, n: int, k: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        q = torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8)
        d = (torch.rand(n, k // 256, generator=g) * 1e-3 + 1e-4).half().float()
        sc = torch.randint(-128, 128, (n, k // 16), generator=g, dtype=torch.int8)
        zeros = (torch.zeros_like(d), torch.zeros(n, k // 16, dtype=torch.uint8))
        self.n, self.k = n, k
        self.packs = {"q8k": native.pack_q8k(q, d, zeros[0], sc, zeros[1]),
                      "q6k": native.pack_q6k(q, d, zeros[0], sc, zeros[1])}

    def nbytes(self, layout: str) -> int:
        return sum(t.numel() * t.element_size() for t in self.packs[layout])


def run(lib: ctypes.CDLL, layout: str, lin: Linear, x: torch.Tensor, y: torch.Tensor, work: torch.Tensor) -> None:
    w, sw = lin.packs[layout]
    rc = getattr(lib, f"{layout}_matmul")(x.data_ptr(), x.shape[0], lin.k, lin.n, w.data_ptr(), sw.data_ptr(), None,
                                          y.data_ptr(), work.data_ptr(), work.numel())
    assert rc == 0, rc


def check_bits(lib: ctypes.CDLL, lin: Linear, work: torch.Tensor, m_max: int) -> None:
    for m in sorted({1, m_max}):
        x = torch.randn(m, lin.k, generator=torch.Generator().manual_seed(m))
        ys = {lay: torch.empty(m, lin.n) for lay in LAYOUTS}
        for lay, y in ys.items():
            run(lib, lay, lin, x, y, work)
        assert torch.equal(ys["q8k"].view(torch.int32), ys["q6k"].view(torch.int32)), (lin.n, lin.k, m)


def timed(lib: ctypes.CDLL, lins: list[Linear], m: int, work: torch.Tensor, rounds: int, repeat: int
          ) -> dict[str, list[float]]:
    x, y = torch.randn(m, lins[0].k), torch.empty(m, lins[0].n)
    out: dict[str, list[float]] = {lay: [] for lay in LAYOUTS}
    for r in range(rounds):
        for lay in (LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]):
            best = float("inf")
            for _ in range(repeat):
                t0 = time.perf_counter_ns()
                for lin in lins:
                    run(lib, lay, lin, x, y, work)
                best = min(best, time.perf_counter_ns() - t0)
            out[lay].append(best / 1e3)  # us
    return out


def report(name: str, t: dict[str, list[float]], mb: dict[str, float] | None) -> None:
    a, b = statistics.median(t["q8k"]), statistics.median(t["q6k"])
    q = statistics.quantiles([y / x for x, y in zip(t["q8k"], t["q6k"])], n=4)
    lo = min(t["q8k"]), min(t["q6k"])  # the least disturbed rounds (a shared machine only adds time)
    gbs = f"{mb['q8k'] / lo[0] * 1e3:6.1f} {mb['q6k'] / lo[1] * 1e3:6.1f}" if mb else " " * 13
    pairs = f"{q[0]:6.3f} {q[1]:5.3f} {q[2]:5.3f}"
    print(f"{name:30} {a:10.0f} {b:10.0f} {b / a:8.3f}  {pairs}  {lo[1] / lo[0]:8.3f}   {gbs}")


def bench(lib: ctypes.CDLL, case: str, args: argparse.Namespace) -> None:
    n, k = CASES[case]
    copies = args.copies if case == "down" else 1
    lins = [Linear(n, k, seed=i) for i in range(copies)]
    held = {lay: sum(lin.nbytes(lay) for lin in lins) for lay in LAYOUTS}
    gguf = copies * n * k // 256 * 210
    assert held["q6k"] == gguf and held["q8k"] * 210 == gguf * 292, (held, gguf)
    w = copies * n * k
    print(f"\n{case}: {copies} x {n} x {k} (N x K), {w / 1e6:.1f}M weights: held q8k {held['q8k'] / 1e6:.1f} MB "
          f"({held['q8k'] / w:.4f} B/weight), q6k {held['q6k'] / 1e6:.1f} MB ({held['q6k'] / w:.4f}), the GGUF's "
          f"Q6_K {gguf / 1e6:.1f} MB ({gguf / w:.4f}); q6k/q8k {held['q6k'] / held['q8k']:.3f}")
    m_max = max(1, args.prefill)
    work = torch.empty(max(int(getattr(lib, f"sc_{lay}_work")(m_max, k, args.threads)) for lay in LAYOUTS),
                       dtype=torch.uint8)
    check_bits(lib, lins[0], work, m_max)
    print(f"  checked: the same bits, 1 and {m_max} rows")
    print(f"  {'case':28} {'q8k us':>10} {'q6k us':>10} {'q6k/q8k':>8}  {'pairs: q1':>9} {'q2':>5} {'q3':>5}  "
          f"{'min/min':>8}   {'GB/s q8k q6k (min)':>18}")
    report(f"decode ({copies} x 1 row)", timed(lib, lins, 1, work, args.rounds, args.repeat),
           {lay: held[lay] / 1e6 for lay in LAYOUTS})
    if args.prefill:
        report(f"prefill (1 tensor, {args.prefill} rows)",
               timed(lib, lins[:1], args.prefill, work, args.rounds, max(1, args.repeat // 2)), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=sorted(CASES))
    ap.add_argument("--copies", type=int, default=8, help="ffn_down tensors in the down case (streamed in turn)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeat", type=int, default=3, help="passes per layout per round (the fastest counts)")
    ap.add_argument("--prefill", type=int, default=64, help="rows of the prefill case (0: none)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variant", default=None, help="kernel variant (default: the best this CPU runs)")
    args = ap.parse_args()
    if args.variant:
        native.use(args.variant)
    native.set_threads(args.threads)
    lib = native.library()
    if lib is None:
        sys.exit(f"native kernels unavailable: {native.load_error()}")
    print(f"variant {native.variant()}, {args.threads} thread(s), {args.rounds} rounds x {args.repeat} passes")
    for case in args.cases:
        bench(lib, case, args)


if __name__ == "__main__":
    main()
