"""Q5_0, Q5_1 and Q5_K at their own bits (issue #33 item 1): the q5 blocks (`int5.pack_q50` / `pack_q51` /
`pack_q5k`, csrc/layouts.h: sc_q5_block: the nibble tile and one bit-plane), their kernels (the 8-bit loops with the
q5_bytes weight-unpack step) and the `int5` linears.

- The weights are the file's: `rows` / `dequantized` equal gguf-py's dequantize of random real blocks bit for bit,
  and the bytes held are the file's 22 / 24 per 32 and 176 per 256.
- The kernels compute what q8g (Q5_0, Q5_1) and q8k (Q5_K) compute for the same tensor, bit for bit, on every
  variant (q8g and q8k are held to the reference by tests/test_q8g.py and tests/test_qk.py), and SIMD equals the
  scalar reference directly: one row, a few, past the prefill passes, with bias, the 5-bit extremes.
- The loader picks them on the native kernels; the packed cache rebuilds them; the decode step and prefill on them
  give q8g's / q8k's bits.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from kernel_helpers import (  # noqa: F401  (fixtures)
    NATIVE, SHAPES, SIMD, best_or_ref, bits, check_work_buffer, on, outlier_x, same_model_bits, simd,
    simd_gives_refs_bits)
from sinkchat.kernels import native
from sinkchat.model import gguf_blocks, gguf_load, int5
from sinkchat.model.gguf_file import TensorInfo
from sinkchat.model.int8g import Int8GLinear
from sinkchat.model.intk import Int8KLinear
from test_qk import _file_blocks, _rebuilt_by_the_packed_cache, _weights_and_rows_are

pytestmark = NATIVE

TYPES = {"q50": T.Q5_0, "q51": T.Q5_1, "q5k": T.Q5_K}
CLASS = {"q50": int5.Int5Q0Linear, "q51": int5.Int5Q1Linear, "q5k": int5.Int5KLinear}
BYTES = {"q50": 22 / 32, "q51": 24 / 32, "q5k": 176 / 256}


def q5_case(layout: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Values of each field over its whole range: q (Q5_0 −16..15, else 0..31; both extremes in every row), fp16
    scales of either sign (one subnormal), Q5_K's 6-bit sc, mn per 32 (their extremes)."""
    g = torch.Generator().manual_seed(seed)
    lo = -16 if layout == "q50" else 0
    q = torch.randint(lo, lo + 32, (n, k), generator=g, dtype=torch.int8)
    q[:, 0], q[:, 1], q[:, 21] = lo, lo + 31, lo + 16  # u = 0, 31, 16 (the fifth bit alone)
    if layout == "q5k":
        d, dmin = ((torch.randn(n, k // 256, generator=g) * 0.01).half().float() for _ in range(2))
        d[0, 0] = 3e-6  # an fp16 subnormal
        sc, mn = (torch.randint(0, 64, (n, k // 32), generator=g, dtype=torch.uint8) for _ in range(2))
        sc[0, 0], mn[0, 7] = 63, 63
        return q, d, dmin, sc, mn
    d = (torch.randn(n, k // 32, generator=g) * 0.01).half().float()
    d[0, 0] = float(torch.tensor(3e-6).half())
    if layout == "q50":
        return q, d
    return q, d, (torch.randn(n, k // 32, generator=g) * 0.05).half().float()


def _old(layout: str, values: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The same values as q8g / q8k held them before (scales per 16: each per-32 one twice; Q5_0's m = 0)."""
    if layout == "q5k":
        q, d, dmin, sc, mn = values
        return native.pack_q8k(q, d, dmin, sc.repeat_interleave(2, 1).to(torch.int8), mn.repeat_interleave(2, 1))
    q, d = values[0], values[1].repeat_interleave(2, 1)
    m = values[2].repeat_interleave(2, 1) if layout == "q51" else torch.zeros_like(d)
    return native.pack_q8g(q, d, m)


def _pack(layout: str, values: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    return {"q50": int5.pack_q50, "q51": int5.pack_q51, "q5k": int5.pack_q5k}[layout](*values)


def _mm(layout: str, x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor], b: torch.Tensor | None,
        old: bool = False) -> torch.Tensor:
    fn = (native.q8k_matmul if layout == "q5k" else native.q8g_matmul) if old else getattr(native, f"{layout}_matmul")
    return fn(x, *packed, b)


def _file_linear(layout: str, raw: np.ndarray) -> torch.nn.Module:
    qt = TYPES[layout]
    if layout == "q5k":
        p = gguf_blocks.unpack_k(qt, raw)
        arrays = (p.q, p.d, p.dmin, p.sc, p.mn)
    else:
        p = gguf_blocks.unpack(qt, raw)
        arrays = (p.q, p.d) if layout == "q50" else (p.q, p.d, p.m)
    return CLASS[layout].from_values(*[torch.from_numpy(np.ascontiguousarray(a)) for a in arrays])


# ---- the file's weights and bytes --------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", list(TYPES))
def test_rows_and_dequantized_are_gguf_dequantize_bit_for_bit_at_the_files_size(layout):
    raw = _file_blocks(TYPES[layout], rows=48, k=768, seed=41)
    lin = _file_linear(layout, raw)
    assert lin.layout == layout and lin.qw.shape == (3, 24, 5, 16, 4)
    assert lin.qw.nbytes + lin.sw.nbytes == raw.nbytes == 48 * 768 * BYTES[layout]
    _weights_and_rows_are(lin, torch.from_numpy(dequantize(raw, TYPES[layout])))


def test_packing_refuses_what_the_layout_cannot_hold():
    q, d = q5_case("q50", 32, 512)
    with pytest.raises(ValueError, match="0..31"):
        int5.pack_q50(q.clamp(max=14) + 2, d)  # 16: a sixth bit
    with pytest.raises(ValueError, match="N % 16"):
        int5.pack_q50(q[:24], d[:24])
    with pytest.raises(ValueError, match="K/32"):
        int5.pack_q50(q, d[:, :4])
    q, d, m = q5_case("q51", 32, 512)
    with pytest.raises(ValueError, match="halves differ"):
        int5.pack_q51(q, d, torch.randn(32, 32))  # per 16, not one per 32
    q, d, dmin, sc, mn = q5_case("q5k", 32, 512)
    with pytest.raises(ValueError, match="0..63"):
        int5.pack_q5k(q, d, dmin, sc, mn.int() + 1)
    with pytest.raises(ValueError, match="K % 256"):
        int5.pack_q5k(q[:, :288], d, dmin, sc[:, :9], mn[:, :9])
    with pytest.raises(ValueError, match="do not fit"):
        native.q5k_matmul(torch.randn(1, 256), *int5.pack_q5k(q, d, dmin, sc, mn), None)


# ---- the kernels -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", list(TYPES))
@pytest.mark.parametrize("n,k,m", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_simd_is_the_references_bits(simd, layout, n, k, m, bias):
    packed = _pack(layout, q5_case(layout, n, k, seed=n + m))
    simd_gives_refs_bits(simd, lambda x, b: _mm(layout, x, packed, b), n, k, m, bias)


@pytest.mark.parametrize("variant", [*SIMD, "ref"])
@pytest.mark.parametrize("layout", list(TYPES))
@pytest.mark.parametrize("n,k,m", SHAPES)
def test_q5_gives_the_8_bit_layouts_bits(variant, layout, n, k, m):
    """The same tensor as q8g / q8k (their bytes stored) and as q5 (rebuilt in registers): the same outputs."""
    values = q5_case(layout, n, k, seed=3 * n + m)
    x, b = outlier_x(m, k), torch.randn(n)
    with on(variant):
        new = _mm(layout, x, _pack(layout, values), b)
        old = _mm(layout, x, _old(layout, values), b, old=True)
    assert torch.equal(bits(new), bits(old))


@pytest.mark.parametrize("layout", list(TYPES))
@pytest.mark.parametrize("variant", [*SIMD, "ref"])
def test_work_buffers_are_checked(layout, variant):
    with on(variant):
        library = native.library()
    n, k, m = 32, 256, 3
    check_work_buffer(library, layout, torch.randn(m, k), n, *_pack(layout, q5_case(layout, n, k)),
                      least=m * k + 4 * m * k // 32)


# ---- the module, the cache, the loader ---------------------------------------------------------------------------
@pytest.mark.parametrize("layout", list(TYPES))
@pytest.mark.parametrize("bias", [False, True])
def test_the_packed_cache_can_rebuild_them(layout, bias):
    from sinkchat.model import gguf_packed

    lin = CLASS[layout].from_values(*q5_case(layout, 32, 256, seed=2), bias=torch.randn(32) if bias else None)
    assert gguf_packed.VERSION >= 4  # v3 held them as q8g / q8k
    _rebuilt_by_the_packed_cache(lin, bias)


@pytest.mark.parametrize("layout", list(TYPES))
def test_the_loader_holds_them_at_their_bits_on_the_native_kernels(layout):
    raw = _file_blocks(TYPES[layout], rows=48, k=512, seed=9)
    pad = b"\0" * 64
    t = TensorInfo(name="blk.0.attn_q.weight", qtype=int(TYPES[layout]), shape=(48, 512), offset=len(pad),
                   nbytes=raw.nbytes)
    f = io.BytesIO(pad + raw.tobytes())
    want = dequantize(raw, TYPES[layout])
    mod = gguf_load.module_of(f, t, "native")
    assert type(mod) is CLASS[layout] and torch.equal(bits(mod.dequantized()), bits(torch.from_numpy(want)))
    heads = gguf_load.module_of(f, t, "native", heads=4)  # q / k rows permuted back, scales with them
    assert torch.equal(bits(heads.dequantized()), bits(torch.from_numpy(gguf_load._unpermute(want, 4))))
    assert type(gguf_load.module_of(f, t, "torch")) is not CLASS[layout]  # torch's kernels: q4 as before


@pytest.mark.parametrize("layout", list(TYPES))
def test_a_q5_model_gives_the_bits_it_gave_on_8_bits(layout):
    """The native decode step and prefill (lin_type SC_LIN_Q50 / _Q51 / _Q5K): logits bit for bit those of the same
    model held as q8g / q8k."""

    def values(w: torch.Tensor) -> tuple[torch.Tensor, ...]:  # min/max to 5 bits per 32 (Q5_K: 6-bit sc, mn)
        n, k = w.shape
        g = torch.Generator().manual_seed(n + k)
        return q5_case(layout, n, k, seed=int(torch.randint(0, 1000, (1,), generator=g)))

    def old(lin: torch.nn.Linear) -> torch.nn.Module:
        v = values(lin.weight)
        if layout == "q5k":
            return Int8KLinear.from_values(v[0], v[1], v[2], v[3].repeat_interleave(2, 1).to(torch.int8),
                                           v[4].repeat_interleave(2, 1), bias=lin.bias)
        d = v[1].repeat_interleave(2, 1)
        m = v[2].repeat_interleave(2, 1) if layout == "q51" else torch.zeros_like(d)
        return Int8GLinear.from_values(v[0], d, m, bias=lin.bias)

    same_model_bits([lambda i, n, lin: CLASS[layout].from_values(*values(lin.weight), bias=lin.bias),
                     lambda i, n, lin: old(lin)])
