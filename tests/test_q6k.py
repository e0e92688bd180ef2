"""Q6_K at its own bits: the q6k layout (`native.pack_q6k`, csrc/layouts.h: sc_q6k_block / sc_q6k_scales), its
kernels (the q8 family's loops with the q6k_bytes weight-unpack step) and `Int6KLinear`.

- The weights are the file's: `rows` / `dequantized` equal gguf-py's dequantize of random real blocks bit for bit,
  the bytes held are the file's 210 per 256 (and give the file's very bytes back: `q6k_gguf_bytes`).
- The kernels compute what q8k computes for the same tensor, bit for bit, on every variant (q8k itself is held to
  the reference by tests/test_qk.py), and SIMD equals the scalar reference directly: one row, a few, past the
  prefill passes, with bias, the 6-bit extremes, on 1 and 2 threads.
- The loader picks q6k for Q6_K tensors on the native kernels; the packed cache rebuilds it; the decode step and
  prefill on q6k give q8k's bits.
"""

from __future__ import annotations

import io
from typing import Callable

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from kernel_helpers import (  # noqa: F401  (fixtures)
    NATIVE, SHAPES, SIMD, best_or_ref, bits, check_work_buffer, on, outlier_x, same_bits_on_one_and_two_threads,
    same_model_bits, simd, simd_gives_refs_bits)
from sinkchat.kernels import native
from sinkchat.model import gguf_blocks, gguf_load
from sinkchat.model.gguf_file import TensorInfo
from sinkchat.model.intk import Int6KLinear, Int8KLinear
from test_qk import _file_blocks, _rebuilt_by_the_packed_cache, _weights_and_rows_are, q8k_values

pytestmark = NATIVE


def q6k_case(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Q6_K values over each field's whole range: q int8 in -32..31 (both extremes in every row), d fp16 values of
    either sign (one subnormal), int8 sc over -128..127; dmin, mn zero (as `pack_q8k` takes them too)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8)
    q[:, 0], q[:, 1], q[:, 17] = -32, 31, -1  # u = 0, 63 (both high bits), 31 (high bits 01)
    d = (torch.randn(n, k // 256, generator=g) * 0.01).half().float()
    d[0, 0] = 3e-6  # an fp16 subnormal
    sc = torch.randint(-128, 128, (n, k // 16), generator=g, dtype=torch.int8)
    sc[0, 0], sc[0, 1] = -128, 127
    return q, d, torch.zeros_like(d), sc, torch.zeros(n, k // 16, dtype=torch.uint8)


def _parts(raw: np.ndarray) -> list[torch.Tensor]:
    p = gguf_blocks.unpack_k(T.Q6_K, raw)
    return [torch.from_numpy(np.ascontiguousarray(a)) for a in (p.q, p.d, p.dmin, p.sc, p.mn)]


# ---- the file's weights and bytes --------------------------------------------------------------------------------
def test_rows_and_dequantized_are_gguf_dequantize_bit_for_bit():
    raw = _file_blocks(T.Q6_K, rows=48, k=768, seed=21)
    want = torch.from_numpy(dequantize(raw, T.Q6_K))
    lin = Int6KLinear.from_values(*_parts(raw))
    assert lin.layout == "q6k" and lin.qw.shape == (3, 24, 6, 16, 4) and lin.sw.shape == (3, 3, 288)
    _weights_and_rows_are(lin, want)


def test_the_bytes_held_are_the_files():
    """210 bytes per row and 256 weights, as the file: 0.8203 a weight, where q8k held 1.1406 (292 per 256)."""
    raw = _file_blocks(T.Q6_K, rows=48, k=768, seed=22)
    lin, old = Int6KLinear.from_values(*_parts(raw)), Int8KLinear.from_values(*_parts(raw))
    held, was = lin.qw.nbytes + lin.sw.nbytes, old.hw.nbytes + old.sw.nbytes
    assert held == raw.nbytes and held / (48 * 768) == 210 / 256 and was / (48 * 768) == 292 / 256
    np.testing.assert_array_equal(native.q6k_gguf_bytes(lin.qw, lin.sw), raw)  # every bit the file had


def test_packing_refuses_what_the_layout_cannot_hold():
    q, d, dmin, sc, mn = q6k_case(32, 512)
    with pytest.raises(ValueError, match="-32..31"):
        native.pack_q6k(q.clamp(max=30) + 2, d, dmin, sc, mn)  # 32: a seventh bit
    with pytest.raises(ValueError, match="-32..31"):
        native.pack_q6k(q.int(), d, dmin, sc, mn)
    with pytest.raises(ValueError, match="no mins"):
        native.pack_q6k(q, d, dmin + 0.5, sc, mn)  # Q5_K's shape: q8k's, not this
    with pytest.raises(ValueError, match="no mins"):
        native.pack_q6k(q, d, dmin, sc, mn + 1)
    with pytest.raises(ValueError, match="K % 256"):
        native.pack_q6k(q[:, :288], d, dmin, sc[:, :18], mn[:, :18])
    with pytest.raises(ValueError, match="outside torch.int8"):
        native.pack_q6k(q, d, dmin, sc.int() * 2, mn)
    with pytest.raises(ValueError, match="do not fit"):
        native.q6k_matmul(torch.randn(1, 256), *native.pack_q6k(q, d, dmin, sc, mn), None)


# ---- the kernels -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,k,m", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_simd_is_the_references_bits(simd, n, k, m, bias):
    w, sw = native.pack_q6k(*q6k_case(n, k, seed=n + m))
    simd_gives_refs_bits(simd, lambda x, b: native.q6k_matmul(x, w, sw, b), n, k, m, bias)


@pytest.mark.parametrize("variant", [*SIMD, "ref"])
@pytest.mark.parametrize("n,k,m", SHAPES)
def test_q6k_gives_q8ks_bits(variant, n, k, m):
    """The same tensor as q8k (its bytes q + 128 stored) and as q6k (rebuilt in registers): the same outputs."""
    values = q6k_case(n, k, seed=3 * n + m)
    x, b = outlier_x(m, k), torch.randn(n)
    with on(variant):
        new = native.q6k_matmul(x, *native.pack_q6k(*values), b)
        old = native.q8k_matmul(x, *native.pack_q8k(*values), b)
    assert torch.equal(bits(new), bits(old))


def test_real_blocks_give_q8ks_bits_on_two_threads():
    """From the file's blocks, on this machine's best variant: 1 and 2 threads (every group split), q6k = q8k."""
    raw = _file_blocks(T.Q6_K, rows=64, k=1024, seed=5)
    new, old = Int6KLinear.from_values(*_parts(raw)), Int8KLinear.from_values(*_parts(raw))
    same_bits_on_one_and_two_threads(new, old, outlier_x(7, 1024))


@pytest.mark.parametrize("variant", [*SIMD, "ref"])
def test_work_buffers_are_checked(variant):
    with on(variant):
        library = native.library()
    n, k, m = 32, 256, 3
    w, sw = native.pack_q6k(*q6k_case(n, k))
    check_work_buffer(library, "q6k", torch.randn(m, k), n, w, sw, least=m * k + 4 * m * k // 32)


# ---- the module, the cache, the loader ---------------------------------------------------------------------------
@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_q6k_linears_are_linears(kernels):
    values = q6k_case(64, 512, seed=5)
    bias = torch.randn(64)
    lin = Int6KLinear.from_values(*values, bias=bias, kernels=kernels)
    assert lin.sw.shape[:2] == (4, 2) and lin.weights.shape[:2] == (4, 16)  # row groups first
    x = torch.randn(2, 3, 512)
    y = lin(x)
    ref = Int8KLinear.from_values(*values, bias=bias, kernels=kernels)(x)
    assert y.shape == (2, 3, 64) and torch.equal(bits(y), bits(ref))
    state = Int6KLinear(512, 64, bias=True, kernels=kernels)
    state.load_state_dict(lin.state_dict())  # the buffers are the whole weight
    assert torch.equal(state(x), y)
    with pytest.raises(ValueError, match="% 256"):
        Int6KLinear(384, 64)


@pytest.mark.parametrize("bias", [False, True])
def test_the_packed_cache_can_rebuild_q6k(bias):
    from sinkchat.model import gguf_packed

    lin = Int6KLinear.from_values(*q6k_case(32, 256, seed=2), bias=torch.randn(32) if bias else None)
    assert gguf_packed.VERSION >= 3  # v2 held every Q6_K as q8k
    _rebuilt_by_the_packed_cache(lin, bias)


def _q6k_tensor(rows: int, k: int) -> tuple[io.BytesIO, TensorInfo, np.ndarray]:
    raw = _file_blocks(T.Q6_K, rows=rows, k=k, seed=9)
    pad = b"\0" * 64
    t = TensorInfo(name="blk.0.ffn_down.weight", qtype=int(T.Q6_K), shape=(rows, k), offset=len(pad),
                   nbytes=raw.nbytes)
    return io.BytesIO(pad + raw.tobytes()), t, raw


def test_the_loader_holds_q6_k_as_q6k_on_the_native_kernels():
    f, t, raw = _q6k_tensor(48, 512)
    mod = gguf_load.module_of(f, t, "native")
    assert type(mod) is Int6KLinear
    assert torch.equal(bits(mod.dequantized()), bits(torch.from_numpy(dequantize(raw, T.Q6_K))))
    assert type(gguf_load.module_of(f, t, "torch")) is not Int6KLinear  # torch's kernels: q4 as before


@pytest.mark.parametrize("kind,kw", [("llama", {}), ("phi3", {"partial_rotary_factor": 0.5})])
def test_a_q6_k_model_on_q6k_gives_the_bits_it_gave_on_q8k(kind, kw):
    """The native decode step and prefill (lin_type SC_LIN_Q6K; Phi-3's fused projections as row-group views of q6k
    buffers): logits and caches bit for bit those of the same model held as q8k."""
    made: list[str] = []

    def maker(cls: type) -> Callable[..., torch.nn.Module]:
        def make(i: int, n: str, lin: torch.nn.Linear) -> torch.nn.Module:
            made.append(cls.layout)
            return cls.from_values(*q8k_values(lin.weight, False), bias=lin.bias)
        return make

    same_model_bits([maker(Int6KLinear), maker(Int8KLinear)], kind, least=0.1, **kw)
    assert set(made) == {Int6KLinear.layout, Int8KLinear.layout}
