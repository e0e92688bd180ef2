"""Q4_0 at its own bits (issue #33 item 1, first step): the q40 layout (an fp16 d per 32 weights, 18 bytes a block,
as the file) against the q4 layout Q4_0 was held in before (an fp16 d and m = -8·d, 20 bytes), side by side in one
run on the linears of the 135M and ~1B models' shapes (synthetic weights: a Q4_0 file of either needs
llama-quantize, which is not here).

    python benchmarks/q4_0_bits.py                              # 135m and 1b, decode and prefill, 7 rounds
    python benchmarks/q4_0_bits.py --models 1b --layers 8 --rounds 11 --threads 1

For each model: the bytes each layout holds for all its decoder linears (and the GGUF's Q4_0 bytes for them), then
the same random Q4_0 tensors packed both ways, checked to give the same bits (one row and a prefill's rows), then
rounds, the two layouts alternating (the first swapped each round): decode is every linear of every layer at one
row in turn, as a token reads them (the weights stream from memory: far more than the L3), prefill is one layer's
linears at 64 rows. Each figure is the fastest of `--repeat` passes in a round; printed: each layout's median over
the rounds, q40/q4, and the quartiles of each round's q40/q4 (its pair timed back to back). The C entry points are
called directly (ctypes), so the binding's Python checks are not in the figures. Noisy on a shared machine: read the
ratios of one run.
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

# (hidden, intermediate, q heads x head dim, kv heads x head dim, layers): SmolLM2-135M, Llama-3.2-1B
MODELS = {"135m": (576, 1536, 576, 192, 30), "1b": (2048, 8192, 2048, 512, 16)}


def shapes(model: str) -> list[tuple[int, int]]:
    """(N, K) of one layer's linears: q, k, v, o, gate, up, down."""
    c, inter, qd, kvd, _ = MODELS[model]
    return [(qd, c), (kvd, c), (kvd, c), (c, qd), (inter, c), (inter, c), (c, inter)]


class Linear:
    """One Q4_0 tensor packed both ways, with what the C calls take."""

    def __init__(self, n: int, k: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        d = (torch.randn(n, k // 32, generator=g) * 0.01).half().float()
        self.n, self.k = n, k
        self.packs = {"q40": native.pack_q40(q, d), "q4": native.pack_q4_dm(q, d, -8 * d)}

    def nbytes(self, layout: str) -> int:
        return sum(t.numel() * t.element_size() for t in self.packs[layout])


def run(lib: ctypes.CDLL, layout: str, lin: Linear, x: torch.Tensor, y: torch.Tensor, work: torch.Tensor) -> None:
    qw, sw = lin.packs[layout]
    rc = getattr(lib, f"{layout}_matmul")(x.data_ptr(), x.shape[0], lin.k, lin.n, qw.data_ptr(), sw.data_ptr(), None,
                                          y.data_ptr(), work.data_ptr(), work.numel())
    assert rc == 0, rc


def check_bits(lib: ctypes.CDLL, lins: list[Linear], work: torch.Tensor) -> None:
    for i, lin in enumerate(lins[:7]):
        for m in (1, 64):
            x = torch.randn(m, lin.k, generator=torch.Generator().manual_seed(i))
            ys = {lay: torch.empty(m, lin.n) for lay in ("q4", "q40")}
            for lay, y in ys.items():
                run(lib, lay, lin, x, y, work)
            assert torch.equal(ys["q4"].view(torch.int32), ys["q40"].view(torch.int32)), (lin.n, lin.k, m)


def timed(lib: ctypes.CDLL, lins: list[Linear], m: int, work: torch.Tensor, rounds: int, repeat: int
          ) -> dict[str, list[float]]:
    xs = {k: torch.randn(m, k) for k in {lin.k for lin in lins}}
    ys = {n: torch.empty(m, n) for n in {lin.n for lin in lins}}
    out: dict[str, list[float]] = {"q4": [], "q40": []}
    for r in range(rounds):
        for lay in (("q4", "q40") if r % 2 == 0 else ("q40", "q4")):
            best = float("inf")
            for _ in range(repeat):
                t0 = time.perf_counter_ns()
                for lin in lins:
                    run(lib, lay, lin, xs[lin.k], ys[lin.n], work)
                best = min(best, time.perf_counter_ns() - t0)
            out[lay].append(best / 1e3)  # us
    return out


def report(name: str, t: dict[str, list[float]], mb: dict[str, float]) -> None:
    a, b = statistics.median(t["q4"]), statistics.median(t["q40"])
    q = statistics.quantiles([y / x for x, y in zip(t["q4"], t["q40"])], n=4)
    gbs = f"{mb['q4'] / a * 1e3:6.1f} {mb['q40'] / b * 1e3:6.1f}" if mb else " " * 13
    print(f"{name:28} {a:10.0f} {b:10.0f} {b / a:8.3f}  {q[0]:6.3f} {q[1]:5.3f} {q[2]:5.3f}   {gbs}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["135m", "1b"], choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=0, help="decoder layers to build (0: the model's own)")
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
    for model in args.models:
        layers = args.layers or MODELS[model][4]
        one = shapes(model)
        full = sum(n * k for n, k in one) * MODELS[model][4]  # the model's own weights in its linears
        print(f"\n{model}: {MODELS[model][4]} layers of {one} (N, K)")
        print(f"  bytes held for its linears: q4 {full * 20 / 32 / 1e6:.1f} MB, q40 {full * 18 / 32 / 1e6:.1f} MB, "
              f"the GGUF's Q4_0 tensors {full * 18 / 32 / 1e6:.1f} MB (q40/q4 {18 / 20:.3f})")
        lins = [Linear(n, k, seed=1000 * layer + i) for layer in range(layers) for i, (n, k) in enumerate(one)]
        held = {lay: sum(lin.nbytes(lay) for lin in lins) for lay in ("q4", "q40")}
        want = sum(lin.n * lin.k // 32 * 18 for lin in lins)
        assert held["q40"] == want and held["q4"] * 18 == want * 20, (held, want)
        print(f"  built {layers} layers: q4 {held['q4'] / 1e6:.1f} MB, q40 {held['q40'] / 1e6:.1f} MB held "
              f"(= the Q4_0 bytes {want / 1e6:.1f} MB); checked: the same bits, 1 and 64 rows")
        m_max = max(64, args.prefill)  # check_bits runs 64 rows
        work = torch.empty(max(int(lib.sc_q4_work(m_max, k, args.threads)) for _, k in one), dtype=torch.uint8)
        assert all(int(lib.sc_q40_work(m_max, k, args.threads)) <= work.numel() for _, k in one)
        check_bits(lib, lins, work)
        print(f"  {'case':26} {'q4 us':>10} {'q40 us':>10} {'q40/q4':>8}  {'pairs: q1':>9} {'q2':>5} {'q3':>5}   "
              f"{'GB/s q4 q40':>13}")
        mb = {lay: held[lay] / 1e6 for lay in held}
        report(f"decode ({layers} layers, 1 row)", timed(lib, lins, 1, work, args.rounds, args.repeat), mb)
        if args.prefill:
            report(f"prefill (1 layer, {args.prefill} rows)",
                   timed(lib, lins[:7], args.prefill, work, args.rounds, max(1, args.repeat // 2)), {})


if __name__ == "__main__":
    main()
