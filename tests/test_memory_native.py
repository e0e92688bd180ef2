"""The recall memory's C paths (sinkchat/memory/native.py, csrc/memk.c) give the bits of the torch code they replace:
the bf16 index's dots (and each block's best one), the rotation of keys, and a whole memory's choices, region and
logits over a stream long enough for the index's per-batch path (> 128 blocks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from fakes import WordTokenizer, tiny_model
from sinkchat.config import CacheConfig, MemoryConfig, SamplingConfig
from sinkchat.core.engine import Engine
from sinkchat.decode import select
from sinkchat.kernels import native as kernels
from sinkchat.memory import native
from sinkchat.memory.blocks import cos_sin, rotate, rotate_torch
from sinkchat.memory.index import PER_BATCH_ROWS, Index, _batched
from sinkchat.memory.recall import RecallMemory
from sinkchat.model.spec import ModelSpec

needs_lib = pytest.mark.skipif(native.library() is None, reason="no C compiler for the memory's kernels")
# torch sums bf16 dots in the C kernel's order on AVX2 (ATen's dot_with_fp32_arith); on AVX-512 (16 lanes, or oneDNN)
# it does not, `agrees` is False and the index scores with torch: the C dots are not used there, so not tested either
same_order = pytest.mark.skipif(native.library() is None or not (native.agrees(64, 3) and native.agrees(128, 3)),
                                reason="this torch sums bf16 dots in another order than the C dots (not used here)")
FLAVOURS = ["ref"] + (["avx2"] if native._flavour() == "avx2" else [])


@pytest.fixture
def torch_only() -> Iterator[None]:
    prev = native.use(False)
    yield
    native.use(prev)


def _cancelling(g: torch.Generator, b: int, n: int, w: int) -> torch.Tensor:
    """bf16 rows [b, n, w] whose dots depend on the order of the sum (`native.probe`)."""
    return native.probe(g, b, n, w)[0]


def _queries(g: torch.Generator, b: int, w: int) -> torch.Tensor:
    """bf16 queries [b, w, 3] that bring the order out: ones, powers of two, random values (`native.probe`)."""
    return native.probe(g, b, 1, w)[1]


def test_the_data_tells_summation_orders_apart() -> None:
    """The test data can fail a kernel that sums in another order: torch's own two bf16 kernels (the per-batch
    [G, W] x [W, N] that `_batched` runs, and the one batched [N, W] x [W, G]) disagree on a large share of it."""
    g = torch.Generator().manual_seed(0)
    rows, qs = _cancelling(g, 4, 600, 64), _queries(g, 4, 64)
    prev = native.use(False)
    try:
        differ = int((_batched(rows, qs) != torch.matmul(rows, qs)).sum())
    finally:
        native.use(prev)
    assert differ > 0.2 * rows.shape[0] * rows.shape[1] * 3


@same_order
@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("w", [64, 128])
def test_dots_and_block_maxima_equal_torchs_per_batch_matmul(flavour: str, threads: int, w: int) -> None:
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(w + threads)
        for n in (512, 1000, 2052):
            buf = _cancelling(g, 5, n + 40, w)
            rows, qs = buf[:, 12 : 12 + n], _queries(g, 5, w)  # a slice: batches apart, each contiguous
            with_torch = native.use(False)
            try:
                want = _batched(rows, qs)  # [B, N, G] bf16
            finally:
                native.use(with_torch)
            qt = qs.transpose(1, 2).contiguous()
            got = native.dots(rows, qt, 0, flavour)
            assert got is not None and got.dtype == torch.bfloat16
            assert torch.equal(got.view(torch.int16), want.contiguous().view(torch.int16))
            best = native.dots(rows, qt, 4, flavour)
            assert best is not None and torch.equal(best, want.reshape(5, n // 4, 4, 3).amax(2).float())
    finally:
        torch.set_num_threads(old)


@needs_lib
@pytest.mark.skipif("avx2" not in FLAVOURS, reason="no AVX2 here: only the scalar dots are built")
@pytest.mark.parametrize("r", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("g", [2, 3, 16])
def test_eight_rows_at_once_keep_the_scalar_bits_on_ties_zeros_and_nan(r: int, g: int) -> None:
    """The AVX2 dots take eight rows at a time (their hsums, bf16 rounding and block maxima in vectors); the scalar
    code takes one. Both must give the same bits where the max is a choice: equal dots (the first kept), +0 against
    -0 (the first kept: torch.equal would not see the sign), a NaN anywhere in a block (it wins), blocks that do not
    tile the eight rows (r 3), and a tail of rows after the last eight."""
    gen = torch.Generator().manual_seed(r * 100 + g)
    w, b = 64, 3
    n = r * (40 // r + 1) + (r if r < 8 else 0) * 3  # not a multiple of 8 where r allows: the scalar tail runs too
    rows = torch.randint(-3, 4, (b, n, w), generator=gen).to(torch.bfloat16)  # small integers: many equal dots
    rows[:, 0:8:2] = -0.0  # dots of -0 and +0 in turn: every block of the first eight rows holds only zeros
    rows[:, 1:8:2] = 0.0
    rows[1, 9, 3] = float("nan")
    rows[2, n - 1, 0] = float("inf")
    rows[2, n - 1, 1] = float("-inf")  # inf - inf: a NaN in the tail
    qt = torch.randint(1, 3, (b, g, w), generator=gen).to(torch.bfloat16)  # positive: a -0 row dots to -0
    for rr in (0, r):
        want = native.dots(rows, qt, rr, "ref")
        got = native.dots(rows, qt, rr, "avx2")
        assert want is not None and got is not None
        view = torch.int16 if rr == 0 else torch.int32
        assert torch.equal(got.view(view), want.view(view)), (rr, (got.view(view) != want.view(view)).nonzero()[:5])
    best = native.dots(rows, qt, r, "avx2")
    assert best is not None and best.isnan().any()
    assert (best[:, 0] == 0).all() and torch.signbit(best[:, 0]).all()  # the first of the zeros: -0


@needs_lib
def test_c_dots_that_disagree_with_this_torch_are_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """`agrees` probes the C dots against torch once per width: a kernel off by one bit in one dot is refused, and
    the index scores with torch."""
    real = native._dots

    def off_by_one(*args: Any) -> torch.Tensor | None:
        out = real(*args)
        if out is not None:
            out.view(-1).view(torch.int16)[7] += 1
        return out

    monkeypatch.setattr(native, "_dots", off_by_one)
    native.agrees.cache_clear()
    try:
        rows, qs = native.probe(torch.Generator().manual_seed(1), 2, 600, 64)
        assert native.dots(rows, qs.transpose(1, 2).contiguous()) is None
    finally:
        native.agrees.cache_clear()


@needs_lib
def test_shapes_the_c_dots_do_not_take_fall_back() -> None:
    rows, qt = torch.randn(2, 8, 48).bfloat16(), torch.randn(2, 3, 48).bfloat16()
    assert native.dots(rows, qt) is None  # W not a multiple of 64
    assert native.dots(rows.float(), qt.float()) is None
    assert native.dots(torch.randn(2, 10, 64).bfloat16(), torch.randn(2, 3, 64).bfloat16(), 4) is None  # 10 % 4


@same_order
def test_the_index_scores_the_same_bits_with_its_c_path(torch_only: None) -> None:
    """Rule "mass" past PER_BATCH_ROWS (a slice of the growing buffer, blocks gone from the front), its scores
    from C's block maxima against torch's dots and amax: every bit, zeros' signs included."""
    g = torch.Generator().manual_seed(9)
    m, h, r, d = 3, 2, 4, 64
    idx = Index()
    for b in range(300):
        idx.add(b, _cancelling(g, m * h, r, d).view(m, h, r, d))
    for b in range(0, 40, 3):
        idx.remove(b)
    rows = idx.buf[:, idx.lo * r : idx.hi * r]
    assert rows.shape[1] >= PER_BATCH_ROWS and not rows.is_contiguous()
    scale = torch.full((m,), 0.125)
    for trial in range(4):
        q = _queries(g, m * h, d).float().view(m, h, d, 3) * 2.0**trial  # [M, H_kv, D, G]
        native.use(False)
        want = idx.scores(q, scale)
        native.use(True)
        calls = {"n": 0}
        real = native._dots

        def counted(*args: Any) -> torch.Tensor | None:
            calls["n"] += 1
            return real(*args)

        native._dots = counted  # type: ignore[assignment]
        try:
            got = idx.scores(q, scale)
        finally:
            native._dots = real  # type: ignore[assignment]
        assert calls["n"] > 0  # the C path ran: not torch against torch
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@needs_lib
@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,rot", [((30, 3, 64, 64), 64), ((2, 5, 8), 8), ((3, 2, 16, 16), 8),
                                       ((4, 3, 7, 128), 128)])
def test_c_rotation_has_the_torch_bits(flavour: str, dtype: torch.dtype, shape: tuple[int, ...], rot: int) -> None:
    g = torch.Generator().manual_seed(shape[-1] + rot)
    k = (torch.randn(*shape, generator=g) * 4).to(dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    shifts = torch.randint(-50000, 50000, (shape[-2],), generator=g)
    want = rotate_torch(k, inv, shifts)
    cos, sin = cos_sin(inv, shifts, torch.float32)
    for out in (torch.float32, torch.bfloat16):
        got = native.rotate(k, cos, sin, out, flavour)
        assert got is not None and got.dtype == out
        assert torch.equal(got.view(-1).view(torch.int32 if out == torch.float32 else torch.int16),
                           want.to(out).view(-1).view(torch.int32 if out == torch.float32 else torch.int16))
    assert torch.equal(rotate(k, inv, shifts, torch.bfloat16), want.to(torch.bfloat16))


def _engine(root: Path) -> Engine:
    model = tiny_model("llama", layers=2, score_std=3.0, head_dim=64)
    from sinkchat.model import int4

    int4.quantize_model(model.model.layers, kernels="native")
    mem = RecallMemory.for_spec(MemoryConfig("on", 64, 8, 2, 64), ModelSpec.from_model(model), root)
    return Engine(model, WordTokenizer(), CacheConfig("sink", 4, 40, 5), SamplingConfig(temperature=0),
                  step=select(model, "native"), prefill_chunk=12, memory=mem, kv_dtype="bfloat16")


def _run(eng: Engine, on: bool, ids: list[int]) -> Any:
    prev = native.use(on)
    try:
        list(eng.feed_ids(ids))
        return list(eng.generate(max_tokens=2))
    finally:
        native.use(prev)


@needs_lib
@pytest.mark.skipif(kernels.unsupported("ref") is not None, reason="native kernels unavailable")
def test_a_memory_on_its_c_paths_chooses_recalls_and_answers_as_on_torchs(tmp_path: Path) -> None:
    """Two engines fed the same 1,150 tokens (~140 blocks of 8: the index's per-batch path), one with the memory's C
    paths, one without: the same blocks in every layer at every call, the same region bits, the same logits."""
    fast, slow = _engine(tmp_path / "f"), _engine(tmp_path / "s")
    ids = [(37 * i + 3) % 120 + 1 for i in range(1150)]
    per_batch = 0
    for at in range(0, len(ids), 25):
        _run(fast, True, ids[at : at + 25])
        _run(slow, False, ids[at : at + 25])
        assert fast.memory.chosen == slow.memory.chosen and fast.last_reply_ids == slow.last_reply_ids
        assert torch.equal(fast.last_logits, slow.last_logits)
        for a, b in zip(fast.cache.layers, slow.cache.layers):
            assert torch.equal(a.keys.view(torch.int16), b.keys.view(torch.int16))
            assert torch.equal(a.values.view(torch.int16), b.values.view(torch.int16))
        per_batch += fast.memory.blocks * 4 >= PER_BATCH_ROWS  # 4 rows a block
    assert per_batch >= 3 and fast.memory.blocks > 128 and fast.cache.layers[0].used > 0


def test_tensors_off_the_cpu_are_left_to_torch() -> None:
    """The C paths read host pointers: a CUDA (here: meta) tensor must go to torch's code, never to C."""
    k = torch.empty(2, 3, 8, 8, dtype=torch.bfloat16, device="meta")
    cos = torch.empty(8, 4, device="meta")
    assert native.rotate(k, cos, cos, torch.bfloat16) is None
    rows, qt = torch.empty(2, 8, 64, dtype=torch.bfloat16, device="meta"), torch.empty(2, 3, 64, dtype=torch.bfloat16,
                                                                                       device="meta")
    assert native.dots(rows, qt) is None
