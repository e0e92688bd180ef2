"""What the native-kernel tests share: which variants to test and how to switch to one, raw bits, random weight blocks
of each layout over their whole ranges, and the work-buffer check every matmul gets. One copy here (they were
copied into test_kernels, test_q8g, test_qk and the test_native* files, and drifted).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import pytest
import torch

from sinkchat.kernels import abi, native, variants

# Skip only where no kernels can exist (no C compiler): a library that fails to build fails the tests instead.
NATIVE = pytest.mark.skipif(native.unsupported("ref") is not None,
                            reason=f"native kernels: {native.unsupported('ref')}")


def lib(variant: str) -> Any:
    """`variant`'s loaded library; skips where the CPU or compiler cannot run it, fails where it should and did not."""
    reason = native.unsupported(variant)
    if reason:
        pytest.skip(f"{variant} kernels: {reason}")
    out = native.library(variant)
    assert out is not None, f"the {variant} kernels did not load: {native.load_error(variant)}"
    return out


def simd_variants() -> list[str]:
    """The SIMD variants to test: all of this machine's architecture (each skips where the CPU lacks it; neon on x86
    runs under qemu in tests/test_neon.py), and avxvnni_evex where that stands in for avxvnni (the CPU has AVX-512
    VNNI, not AVX-VNNI)."""
    out = [v for v in native.SIMD if abi.ARCH[v] == variants.machine()]
    if native.lacks("avxvnni") and not native.lacks("avxvnni_evex"):
        out.append("avxvnni_evex")
    return out


SIMD = simd_variants()


@pytest.fixture(params=SIMD)
def simd(request: pytest.FixtureRequest) -> str:
    """Each SIMD variant in turn (skipped where the CPU lacks it; the reference must load too)."""
    lib(request.param)
    lib("ref")
    return request.param


def best_or_ref() -> str:
    """The variant the product would run here: the best SIMD one, or the scalar reference where none runs."""
    return native.best() if native.unsupported(native.best()) is None else "ref"


@pytest.fixture(scope="module")
def best_kernels() -> Iterator[None]:
    """A module's tests on best_or_ref() (test_kernels holds every SIMD variant to the reference)."""
    prev = native.use(best_or_ref())
    yield
    native.use(prev)


@contextlib.contextmanager
def on(variant: str | None) -> Iterator[None]:
    """Run the block on `variant` (skipped where it cannot run here; None: as SINKCHAT_KERNELS says)."""
    if variant is not None and native.unsupported(variant):
        pytest.skip(f"{variant} kernels: {native.unsupported(variant)}")
    prev = native.use(variant)
    try:
        yield
    finally:
        native.use(prev)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (NaNs compare equal by payload, -0 differs from +0)."""
    return t.contiguous().view({4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])


# ---- random weights of each layout --------------------------------------------------------------------------------
def q4_case(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed q4 weights [N, K]: nibbles over 0..15, positive scales, zero points of either sign."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    scale = torch.rand(n, k // 32, generator=g) * 0.05 + 0.001
    zero = torch.randn(n, k // 32, generator=g) * 0.05
    return native.pack_q4(q, scale, zero)


def q40_case(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 values: q [N, K] over 0..15 and d [N, K/32] fp16 values of either sign (Q4_0's d is the signed max / -8),
    one of them subnormal and one zero."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d = (torch.randn(n, k // 32, generator=g) * 0.01).half().float()
    d[0, 0], d[-1, -1] = float(torch.tensor(3e-6).half()), 0.0  # an fp16 subnormal (vcvtph2ps = h2f), a zero d
    return q, d


def q8g_case(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q int8 [N, K] over the whole range, d > 0 and m of either sign [N, K/16], all exact fp16 values."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    q[:, 0], q[:, 1] = -128, 127  # the extremes of the +128 storage
    d = (torch.rand(n, k // 16, generator=g) * 0.02 + 1e-4).half().float()
    m = (torch.randn(n, k // 16, generator=g) * 0.05).half().float()
    return q, d, m


def k_case(layout: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """K-quant values over each field's whole range: q, d, dmin [N, K/256] (fp16 values of either sign, one
    subnormal), sc, mn [N, K/sub] (q4k: per 32, 6-bit unsigned; q8k: per 16, signed scales)."""
    g = torch.Generator().manual_seed(seed)
    s = k // 256
    d = (torch.randn(n, s, generator=g) * 0.01).half().float()
    dmin = (torch.randn(n, s, generator=g) * 0.01).half().float()
    d[0, 0], dmin[-1, -1] = 3e-6, -5e-7  # fp16 subnormals: vcvtph2ps and the reference's h2f agree on them too
    if layout == "q4k":
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        sc = torch.randint(0, 64, (n, k // 32), generator=g, dtype=torch.uint8)
        mn = torch.randint(0, 64, (n, k // 32), generator=g, dtype=torch.uint8)
        sc[0, 0], mn[0, 1] = 63, 63  # the 6 bits' extremes (both planes' bits set)
        return q, d, dmin, sc, mn
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    q[:, 0], q[:, 1] = -128, 127  # the extremes of the +128 storage
    sc = torch.randint(-128, 128, (n, k // 16), generator=g, dtype=torch.int8)
    mn = torch.randint(0, 256, (n, k // 16), generator=g, dtype=torch.uint8)
    return q, d, dmin, sc, mn


def k_pack(layout: str, *values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (native.pack_q4k if layout == "q4k" else native.pack_q8k)(*values)


def k_matmul(layout: str, x: torch.Tensor, w: torch.Tensor, sw: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return (native.q4k_matmul if layout == "q4k" else native.q8k_matmul)(x, w, sw, b)


# ---- work buffers -------------------------------------------------------------------------------------------------
def check_work_buffer(library: Any, layout: str, x: torch.Tensor, n: int, w: torch.Tensor, s: torch.Tensor,
                      least: int) -> None:
    """One matmul's work buffer (`layout`_matmul, sized by sc_`layout`_work for one thread): at least `least` bytes;
    one byte short refused (SC_EWORK) at any alignment; that size taken at any alignment; none given, one allocated
    in C. Every run the same bits."""
    m, k = x.shape
    need = getattr(library, f"sc_{layout}_work")(m, k, 1)
    assert need >= least
    buf, fn = torch.empty(need + 64, dtype=torch.uint8), getattr(library, f"{layout}_matmul")
    outs = []
    for work, size in [(None, 0)] + [(buf.data_ptr() + off, need) for off in (0, 1, 17, 63)]:
        y = torch.full((m, n), float("nan"))
        args = (x.data_ptr(), m, k, n, w.data_ptr(), s.data_ptr(), None, y.data_ptr())
        assert fn(*args, buf.data_ptr() + 1, need - 1) == -2  # SC_EWORK
        assert fn(*args, work, size) == 0
        outs.append(y)
    assert all(torch.equal(bits(o), bits(outs[0])) for o in outs)


def same_bits_on_one_and_two_threads(new: Any, old: Any, x: torch.Tensor) -> None:
    """A layout's linear `new` and the one it replaces `old` (the same values), on this machine's best variant:
    batch x [M, K] and its first row on 2 threads (every group split) give the 1-thread bits, and new = old."""
    with on(best_or_ref()):
        prev, grain = native.set_threads(2), native.library().sc_set_grain(0)
        try:
            y2 = [new(x), new(x[:1]), old(x), old(x[:1])]
        finally:
            native.library().sc_set_grain(grain)
            native.set_threads(1)
        y1 = [new(x), new(x[:1]), old(x), old(x[:1])]
    assert prev >= 1 and all(torch.equal(bits(a), bits(b)) for a, b in zip(y1, y2))
    assert torch.equal(bits(y1[0]), bits(y1[2])) and torch.equal(bits(y1[1]), bits(y1[3]))


# ---- the layout tests' shared cases ------------------------------------------------------------------------------
# (N, K, M): one row, a few, past the prefill's 128-row passes; N = 48, 208: not multiples of 64
SHAPES = [(16, 256, 1), (48, 512, 1), (208, 768, 1), (48, 512, 5), (80, 256, 300)]


def outlier_x(m: int, k: int) -> torch.Tensor:
    """Activations [M, K], seeded by the shape, with an outlier block (column 5 at 30)."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k))
    x[:, 5] = 30.0
    return x


def simd_gives_refs_bits(simd: str, mm: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor], n: int, k: int,
                         m: int, bias: bool) -> None:
    """A layout's matmul `mm(x, bias)` on variant `simd` gives ref's bits (and ref's output is finite, not all 0)."""
    x, b = outlier_x(m, k), (torch.randn(n) if bias else None)
    with on(simd):
        y_simd = mm(x, b)
    with on("ref"):
        y_ref = mm(x, b)
    assert torch.isfinite(y_ref).all() and y_ref.abs().max() > 0
    assert torch.equal(bits(y_simd), bits(y_ref))


def same_model_bits(makes: list[Callable[..., torch.nn.Module]], kind: str = "llama", least: float = 0.0,
                    **kw: Any) -> None:
    """A tiny `kind` model packed once per linear-maker in `makes` (`make(i, name, linear)`), run through the native
    prefill (40 tokens) and decode step (10 more) on this machine's best variant: every run's logits bit for bit the
    first's, finite, and somewhere above `least` in size."""
    from test_native_archs import build, engines, pack
    from test_qk import K_SHAPE

    prev = native.use(best_or_ref())
    try:
        runs = []
        for make in makes:
            _, fast = engines(pack(build(kind, **K_SHAPE, **kw), make), "float32")
            assert fast.step.prefill is not None
            ids = [(37 * i + 3) % 500 + 1 for i in range(50)]
            list(fast.feed_ids(ids[:40]))
            logits = [fast.last_logits.clone()]
            for tok in ids[40:]:
                list(fast.feed_ids([tok]))
                logits.append(fast.last_logits.clone())
            runs.append(torch.stack(logits))
    finally:
        native.use(prev)
    assert torch.isfinite(runs[0]).all() and runs[0].abs().max() > least
    assert all(torch.equal(bits(r), bits(runs[0])) for r in runs[1:])
