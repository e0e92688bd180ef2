"""The kernels before and after a source change, side by side in one run (issue #33 item 4: one row loop per
instruction set, the scale-forming step passed in; it had to stay bit-exact and as fast).

    python benchmarks/kernel_dedup.py                        # against git HEAD's csrc: avx512, avx2, avxvnni, ref
    python benchmarks/kernel_dedup.py --base REV --variants avx512 --rounds 9

Builds each variant's library twice with its own flags (abi.CFLAGS): from `git show BASE:sinkchat/kernels/csrc/*`
into a temp dir, and from the working tree. Both load into this process (one thread each), get the same inputs,
and must give the same bits (checked first, every case; ref's and q8k with dmin 0 too, untimed). Then rounds, the
two libraries alternating (the first swapped each round), each timing the fastest of its calls (other load only
adds time). Printed: each library's median over the rounds, new/old, and the quartiles of each round's new/old (its
pair timed back to back), per layout (q4, q8g, q4k, q8k), path (decode: one row; prefill: 64 rows) and size (L2:
one 1024 x 1024 weight repeated; stream: 12 copies of 2048 x 2048 in turn, more than a 32 MB L3), and for the
decode step's attention (sc_attend). It also checks that no indirect call is left in the new objects' run functions
(the steps are inlined). Noisy on a shared machine: read the ratios of one run, not figures across runs.

Where a layout itself changed between the two trees (issue #33 item 1, ABI 12), each library gets the same values in
its own layout (`OLD`): q4k's 6-bit scales packed as ABI 11 held them (a byte each, 320 bytes per 16 rows and 256),
q80 (Q8_0 at 34 bytes a block) against q8g (d per 16, m = 0: how Q8_0 was held), and the q5 blocks (q50, q51, q5k:
Q5_0 / Q5_1 / Q5_K at 5 bits) against q8g / q8k, whose outputs each must equal. `--layouts q4k,q80` times only those.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sinkchat.kernels import abi, native  # noqa: E402

LAYOUTS = ("q4", "q8g", "q4k", "q8k", "q80", "q6k6")  # q6k6: the q6k layout itself (Q6_K at its 6.56 bits)
BITS_ONLY = ("q6k",)  # q8k with dmin 0 (Q6_K): the avx512 prefill's m-free path; its bits checked, not timed
FN = {"q6k": "q8k", "q6k6": "q6k"}
OLD = {"q80": "q8g", "q50": "q8g", "q51": "q8g", "q5k": "q8k"}  # the old tree's function for a layout it did not
# have: the same values in the layout the loader held them in before


def build(variant: str, src: Path, out: Path) -> Path:
    cmd = ["gcc", *abi.CFLAGS[variant], "-o", str(out), *[str(src / f) for f in abi.SOURCES[variant]], "-lm"]
    subprocess.run(cmd, check=True)
    return out


def old_tree(rev: str, dst: Path) -> Path:
    """BASE's csrc into dst (every file it had), by git show."""
    names = subprocess.run(["git", "ls-tree", "--name-only", rev, "sinkchat/kernels/csrc/"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        blob = subprocess.run(["git", "show", f"{rev}:{name}"], cwd=ROOT, check=True, capture_output=True).stdout
        (dst / Path(name).name).write_bytes(blob)
    return dst


def indirect_calls(so: Path) -> list[str]:
    """Indirect calls inside the new build's per-layout run functions (there must be none)."""
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(so)], capture_output=True, text=True).stdout
    bad, fn = [], ""
    for line in asm.splitlines():
        if line.endswith(">:"):
            fn = line.split("<")[-1][:-2]
        elif fn.startswith("sc_") and fn.endswith("_run") and "call" in line and "*" in line:
            bad.append(f"{fn}: {line.strip()}")
    return bad


def weights(layout: str, n: int, k: int, seed: int, old: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights of `layout` (`old`: the same values as the base tree's kernels take them)."""
    g = torch.Generator().manual_seed(seed)
    if layout in ("q50", "q51", "q5k"):
        return _q5(layout, n, k, g, old)
    if layout == "q6k6":
        q = torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8)
        d = (torch.rand(n, k // 256, generator=g) * 0.01).half().float()
        sc = torch.randint(-128, 128, (n, k // 16), generator=g, dtype=torch.int8)
        return native.pack_q6k(q, d, torch.zeros_like(d), sc, torch.zeros(n, k // 16, dtype=torch.uint8))
    if layout == "q80":
        q, d = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n, k // 32, generator=g)
        d = (d * 0.02).half().float()
        if old:
            dd = d.repeat_interleave(2, dim=1)
            return native.pack_q8g(q, dd, torch.zeros_like(dd))
        return native.pack_q80(q, d)
    if layout == "q4":
        return native.pack_q4(torch.randint(0, 16, (n, k), generator=g), torch.rand(n, k // 32, generator=g) * 0.05,
                              torch.randn(n, k // 32, generator=g) * 0.05)
    if layout == "q8g":
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        d, m = torch.rand(n, k // 16, generator=g) * 0.02, torch.randn(n, k // 16, generator=g) * 0.05
        return native.pack_q8g(q, d, m)
    d = (torch.rand(n, k // 256, generator=g) * 0.01).half().float()
    dmin = (torch.rand(n, k // 256, generator=g) * 0.01 * (layout != "q6k")).half().float()
    if layout == "q4k":
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        sc, mn = (torch.randint(0, 64, (n, k // 32), generator=g, dtype=torch.uint8) for _ in range(2))
        qw, sw = native.pack_q4k(q, d, dmin, sc, mn)
        return (qw, _q4k_v11(d, dmin, sc, mn)) if old else (qw, sw)
    return native.pack_q8k(torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8), d, dmin,
                           torch.randint(-128, 128, (n, k // 16), generator=g, dtype=torch.int8),
                           torch.randint(0, 256, (n, k // 16), generator=g, dtype=torch.uint8))


def _q5(layout: str, n: int, k: int, g: torch.Generator, old: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Random Q5_0 / Q5_1 / Q5_K values as q50 / q51 / q5k, or (`old`) as q8g / q8k held them (scales per 16)."""
    from sinkchat.model import int5

    lo = -16 if layout == "q50" else 0
    q = torch.randint(lo, lo + 32, (n, k), generator=g, dtype=torch.int8)
    if layout == "q5k":
        d, dmin = ((torch.rand(n, k // 256, generator=g) * 0.01).half().float() for _ in range(2))
        sc, mn = (torch.randint(0, 64, (n, k // 32), generator=g, dtype=torch.uint8) for _ in range(2))
        if old:
            return native.pack_q8k(q, d, dmin, sc.repeat_interleave(2, 1).to(torch.int8), mn.repeat_interleave(2, 1))
        return int5.pack_q5k(q, d, dmin, sc, mn)
    d, m = ((torch.rand(n, k // 32, generator=g) * 0.02).half().float() for _ in range(2))
    m = m if layout == "q51" else torch.zeros_like(m)
    if old:
        return native.pack_q8g(q, d.repeat_interleave(2, 1), m.repeat_interleave(2, 1))
    return int5.pack_q50(q, d) if layout == "q50" else int5.pack_q51(q, d, m)


def _q4k_v11(d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """ABI 11's sc_q4k_scales bytes, uint8 [N/16, K/256, 320]: fp16 d[16], dmin[16], then sc[8][16], mn[8][16]."""
    n, s = d.shape
    f16 = torch.stack([d.half(), dmin.half()], -1).reshape(n // 16, 16, s, 2).permute(0, 2, 3, 1).contiguous()
    ints = torch.stack([sc.reshape(n, s, 8), mn.reshape(n, s, 8)], -2).reshape(n // 16, 16, s, 2, 8)
    ints = ints.permute(0, 2, 3, 4, 1)  # [g, S, sc|mn, j, r]
    return torch.cat([f16.view(torch.uint8).reshape(n // 16, s, -1), ints.reshape(n // 16, s, -1)], -1).contiguous()


class Case:
    """One layout, path and size: the weights (copies), the input, each library's output buffer and work buffer."""

    def __init__(self, layout: str, m: int, n: int, k: int, copies: int, libs: dict[str, ctypes.CDLL]) -> None:
        self.name = f"{layout:4} {'decode' if m == 1 else f'prefill {m}':11} {'L2' if copies == 1 else 'stream':6}"
        self.layout, self.m, self.n, self.k = layout, m, n, k
        self.fn = {"new": FN.get(layout, layout), "old": OLD.get(layout, FN.get(layout, layout))}
        self.w = {key: [weights(layout, n, k, seed, key == "old") for seed in range(copies)] for key in libs}
        self.x = torch.randn(m, k, generator=torch.Generator().manual_seed(9))
        self.y = {v: torch.empty(m, n) for v in libs}
        work = max(getattr(lib, f"sc_{self.fn[key]}_work")(m, k, 1) for key, lib in libs.items())
        self.work = torch.empty(work, dtype=torch.uint8)
        self.calls = max(5, 2 * copies, 200_000_000 // (n * k * m))
        self.at = 0

    def run(self, lib: ctypes.CDLL, key: str) -> None:
        w, s = self.w[key][self.at % len(self.w[key])]
        self.at += 1
        rc = getattr(lib, f"{self.fn[key]}_matmul")(self.x.data_ptr(), self.m, self.k, self.n, w.data_ptr(),
                                                    s.data_ptr(),
                                               None, self.y[key].data_ptr(), self.work.data_ptr(), self.work.numel())
        assert rc == 0, rc

    def time(self, lib: ctypes.CDLL, key: str) -> float:
        ts = []
        for _ in range(self.calls):
            t0 = time.perf_counter_ns()
            self.run(lib, key)
            ts.append(time.perf_counter_ns() - t0)
        return min(ts) / 1000  # the least disturbed call: the other tenants of a shared machine only add time


class Attention(Case):
    """The decode step's attention alone (sc_attend: 8 query heads on 2 kv heads over `n` slots of a bf16 or fp32
    cache): its output and scores are `y`."""

    def __init__(self, d: int, n: int, bf16: bool, libs: dict[str, ctypes.CDLL]) -> None:
        g = torch.Generator().manual_seed(d + n)
        self.name = f"attn D{d} {'bf16' if bf16 else 'fp32'} {n}"
        self.layout, self.n, self.at = "attn", n, 0
        dtype = torch.bfloat16 if bf16 else torch.float32
        self.m = abi.StepModel(n_heads=8, n_kv=2, head_dim=d, kv_bf16=int(bf16), scaling=d**-0.5)
        self.q = torch.randn(8 * d, generator=g) * 3
        self.kv = [torch.randn(1, 2, n, d, generator=g).to(dtype) for _ in range(2)]
        self.y = {v: torch.empty(8 * d + 8 * n) for v in libs}  # out, then scores
        self.gauge = torch.empty(2)
        self.calls = max(5, 50_000_000 // (8 * n * d))

    def run(self, lib: ctypes.CDLL, key: str) -> None:
        y, d = self.y[key], self.m.head_dim
        rc = lib.sc_attend(ctypes.byref(self.m), self.q.data_ptr(), self.kv[0].data_ptr(), self.kv[1].data_ptr(),
                           self.n, self.n - 1, 4, y.data_ptr(), self.gauge.data_ptr(), y[8 * d :].data_ptr())
        assert rc == 0, rc


def same_bits(cases: list[Case], libs: dict[str, ctypes.CDLL]) -> None:
    for case in cases:
        for key, lib in libs.items():
            case.at = 0
            case.run(lib, key)
        assert torch.equal(case.y["old"].view(torch.int32), case.y["new"].view(torch.int32)), case.name


def timed(cases: list[Case], libs: dict[str, ctypes.CDLL], rounds: int) -> None:
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(rounds):
        for case in cases:
            for key in (("old", "new") if r % 2 == 0 else ("new", "old")):
                times.setdefault((case.name, key), []).append(case.time(libs[key], key))
    print(f"{'case':24} {'old us':>9} {'new us':>9} {'new/old':>8}  {'per round: quartiles':>20}")
    for case in cases:
        old, new = times[(case.name, "old")], times[(case.name, "new")]
        q = statistics.quantiles([b / a for a, b in zip(old, new)], n=4)  # each round's back-to-back pair
        print(f"{case.name:24} {statistics.median(old):9.1f} {statistics.median(new):9.1f} "
              f"{statistics.median(new) / statistics.median(old):8.3f}  {q[0]:9.3f} {q[1]:5.3f} {q[2]:5.3f}")


def open_old(path: Path, variant: str) -> ctypes.CDLL:
    """The base tree's library: the binding's checks where it speaks this ABI; another ABI's (a layout changed: see
    OLD) with only the functions timed here declared, from the binding's table (their signatures did not change)."""
    lib = ctypes.CDLL(str(path))
    lib.sc_abi.restype = ctypes.c_int
    if lib.sc_abi() == abi.ABI:
        return abi.open_library(path, variant)
    for name, (res, args) in abi.API.items():
        if hasattr(lib, name):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
    return lib


def compare(variant: str, old_src: Path, tmp: Path, args: argparse.Namespace) -> None:
    libs = {"old": open_old(build(variant, old_src, tmp / f"old-{variant}.so"), variant),
            "new": abi.open_library(build(variant, abi.CSRC, tmp / f"new-{variant}.so"), variant)}
    bad = indirect_calls(tmp / f"new-{variant}.so")
    print(f"\n{variant} ({args.base} vs working tree): indirect calls in the run functions: {bad or 'none'}")
    for lib in libs.values():
        lib.sc_set_threads(1)
    shapes = [(1, 1024, 1024, 1), (1, 2048, 2048, 12), (64, 1024, 1024, 1)]
    if variant == "ref":  # scalar: its bits only, on small shapes (past a prefill pass: 300 rows)
        shapes = [(1, 256, 512, 1), (300, 64, 512, 1)]
    layouts = args.layouts.split(",") if args.layouts else LAYOUTS + BITS_ONLY
    cases = [Case(lay, m, n, k, c, libs) for lay in layouts for m, n, k, c in shapes]
    if not args.layouts:
        cases += [Attention(d, n, bf, libs) for d in (64, 128) for n, bf in [(1000, True), (333, False)]]
    same_bits(cases, libs)  # before any timing
    print(f"bits: old == new on all {len(cases)} cases")
    if variant != "ref":
        timed([c for c in cases if args.only in c.name and c.layout not in BITS_ONLY], libs, args.rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="the git revision whose csrc is 'old' (default HEAD)")
    ap.add_argument("--variants", default="avx512,avx2,avxvnni_evex,ref", help="ref: the bits only, not timed")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layouts", default="", help="only these layouts (e.g. 'q4k,q80'; all and attention: '')")
    ap.add_argument("--only", default="", help="time only the cases whose name has this (e.g. 'decode'; all: '')")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kernel_dedup_") as d:
        tmp = Path(d)
        (tmp / "old_csrc").mkdir()
        old_src = old_tree(args.base, tmp / "old_csrc")
        for variant in args.variants.split(","):
            if native.unsupported(variant):
                print(f"{variant}: skipped ({native.unsupported(variant)})")
            else:
                compare(variant, old_src, tmp, args)


if __name__ == "__main__":
    main()
