"""Q8_0 and Q4_K at their own bits (issue #33 item 1): the q80 layout (`native.pack_q80`, csrc/kernels.h:
sc_q80_scales: the q8 bytes and one fp16 d per 32, 34 bytes a row and block as the file) with its kernels (the q8
family's loop, d for both half blocks, m = +0) and `Int8Q0Linear`; and q4k's scales at Q4_K's 6 bits (sc_q4k_scales:
low nibbles + 2-bit planes, 144 bytes a row and 256 as the file).

- The weights are the file's: `rows` / `dequantized` equal gguf-py's dequantize of random real blocks bit for bit,
  and the bytes held are the file's (q80 gives the file's very bytes back: `q80_gguf_bytes`).
- q80 computes what q8g computes for the same tensor, bit for bit, on every variant (q8g itself is held to the
  reference by tests/test_q8g.py), and SIMD equals the scalar reference directly: one row, a few, past the prefill
  passes, with bias, the int8 extremes, on 1 and 2 threads. (q4k's kernels: tests/test_qk.py, over the 6-bit
  extremes.)
- The loader picks q80 for Q8_0 tensors on the native kernels, the token table included; the packed cache rebuilds
  it; the decode step and prefill on q80 give q8g's bits.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from kernel_helpers import (  # noqa: F401  (fixtures)
    NATIVE, SIMD, best_or_ref, bits, check_work_buffer, on, outlier_x, same_bits_on_one_and_two_threads,
    same_model_bits, simd, simd_gives_refs_bits)
from sinkchat.kernels import native
from sinkchat.model import gguf_blocks, gguf_load
from sinkchat.model.gguf_file import TensorInfo
from sinkchat.model.int8g import Int8GLinear
from sinkchat.model.int8q0 import Int8Q0Linear
from sinkchat.model.intk import Int4KLinear
from test_qk import _file_blocks, _rebuilt_by_the_packed_cache, _weights_and_rows_are

pytestmark = NATIVE


def q80_case(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 values: q int8 [N, K] over the whole range (both extremes in every row), d [N, K/32] fp16 values of
    either sign, one subnormal and one zero."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    q[:, 0], q[:, 1] = -128, 127  # the extremes of the +128 storage
    d = (torch.randn(n, k // 32, generator=g) * 0.01).half().float()
    d[0, 0], d[-1, -1] = float(torch.tensor(3e-6).half()), 0.0
    return q, d


def _as_q8g(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same values as q8g held them before q80: d per 16 (each block's twice), m = 0."""
    dd = d.repeat_interleave(2, dim=1)
    return native.pack_q8g(q, dd, torch.zeros_like(dd))


def _parts(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    p = gguf_blocks.unpack(T.Q8_0, raw)
    return torch.from_numpy(np.ascontiguousarray(p.q)), torch.from_numpy(np.ascontiguousarray(p.d[:, ::2]))


# ---- the file's weights and bytes --------------------------------------------------------------------------------
def test_rows_and_dequantized_are_gguf_dequantize_bit_for_bit():
    raw = _file_blocks(T.Q8_0, rows=48, k=768, seed=31)
    want = torch.from_numpy(dequantize(raw, T.Q8_0))
    lin = Int8Q0Linear.from_values(*_parts(raw))
    assert lin.layout == "q80" and lin.qw.shape == (3, 24, 8, 16, 4) and lin.sw.shape == (3, 24, 16)
    _weights_and_rows_are(lin, want)
    assert torch.equal(bits(lin.rows(torch.tensor([5]))), bits(want[5:6]))  # one id: the view path


def test_the_bytes_held_are_the_files():
    """34 bytes per row and 32 weights, as the file: 8.5 bits a weight, where q8g held 10 (40 per 32)."""
    raw = _file_blocks(T.Q8_0, rows=48, k=768, seed=32)
    lin, old = Int8Q0Linear.from_values(*_parts(raw)), Int8GLinear.from_values(*_as_q8g_values(raw))
    held, was = lin.qw.nbytes + lin.sw.nbytes, old.qw.nbytes + old.sw.nbytes
    assert held == raw.nbytes and held * 8 / (48 * 768) == 8.5 and was * 8 / (48 * 768) == 10
    np.testing.assert_array_equal(native.q80_gguf_bytes(lin.qw, lin.sw), raw)  # every bit the file had


def _as_q8g_values(raw: np.ndarray) -> tuple[torch.Tensor, ...]:
    p = gguf_blocks.unpack(T.Q8_0, raw)
    return tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in (p.q, p.d, p.m))


def test_q4k_holds_q4_k_at_the_files_144_bytes():
    """Q4_K's 6-bit scales and mins as the file packs them (12 bytes a row and 256, not 16): 0.5625 bytes a weight,
    where v11's q4k held 0.578; the weights still gguf-py's."""
    raw = _file_blocks(T.Q4_K, rows=48, k=768, seed=33)
    p = gguf_blocks.unpack_k(T.Q4_K, raw)
    lin = Int4KLinear.from_values(*[torch.from_numpy(np.ascontiguousarray(a)) for a in (p.q, p.d, p.dmin, p.sc, p.mn)])
    assert lin.qw.nbytes + lin.sw.nbytes == raw.nbytes == 48 * 768 * 144 // 256
    assert torch.equal(bits(lin.dequantized()), bits(torch.from_numpy(dequantize(raw, T.Q4_K))))


def test_packing_refuses_what_the_layout_cannot_hold():
    q, d = q80_case(32, 512)
    with pytest.raises(ValueError, match="want int8"):
        native.pack_q80(q.int(), d)
    with pytest.raises(ValueError, match="N % 16"):
        native.pack_q80(q[:24], d[:24])
    with pytest.raises(ValueError, match="K/32"):
        native.pack_q80(q, d[:, :8])
    with pytest.raises(ValueError, match="do not fit"):
        native.q80_matmul(torch.randn(1, 256), *native.pack_q80(q, d), None)
    with pytest.raises(ValueError, match="do not fit"):  # q8g's scales for q80's bytes
        native.q80_matmul(torch.randn(1, 512), native.pack_q80(q, d)[0], _as_q8g(q, d)[1], None)


# ---- the kernels -------------------------------------------------------------------------------------------------
# (N, K, M): one row, a few, past the prefill's 128-row passes; N = 48, 208: not multiples of 64
SHAPES = [(16, 32, 1), (48, 512, 1), (208, 768, 1), (48, 512, 5), (80, 256, 300)]


@pytest.mark.parametrize("n,k,m", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_simd_is_the_references_bits(simd, n, k, m, bias):
    w, sw = native.pack_q80(*q80_case(n, k, seed=n + m))
    simd_gives_refs_bits(simd, lambda x, b: native.q80_matmul(x, w, sw, b), n, k, m, bias)


@pytest.mark.parametrize("variant", [*SIMD, "ref"])
@pytest.mark.parametrize("n,k,m", SHAPES)
def test_q80_gives_q8gs_bits(variant, n, k, m):
    """The same tensor as q8g (d per 16, m = 0, as the loader held Q8_0 before) and as q80: the same outputs."""
    values = q80_case(n, k, seed=3 * n + m)
    x, b = outlier_x(m, k), torch.randn(n)
    with on(variant):
        new = native.q80_matmul(x, *native.pack_q80(*values), b)
        old = native.q8g_matmul(x, *_as_q8g(*values), b)
    assert torch.equal(bits(new), bits(old))


def test_real_blocks_give_q8gs_bits_on_two_threads():
    """From the file's blocks, on this machine's best variant: 1 and 2 threads (every group split), q80 = q8g."""
    raw = _file_blocks(T.Q8_0, rows=64, k=1024, seed=5)
    new, old = Int8Q0Linear.from_values(*_parts(raw)), Int8GLinear.from_values(*_as_q8g_values(raw))
    same_bits_on_one_and_two_threads(new, old, outlier_x(7, 1024))


@pytest.mark.parametrize("variant", [*SIMD, "ref"])
def test_work_buffers_are_checked(variant):
    with on(variant):
        library = native.library()
    n, k, m = 32, 256, 3
    w, sw = native.pack_q80(*q80_case(n, k))
    check_work_buffer(library, "q80", torch.randn(m, k), n, w, sw, least=m * k + 4 * m * k // 32)


# ---- the module, the cache, the loader ---------------------------------------------------------------------------
@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_q80_linears_are_linears(kernels):
    q, d = q80_case(64, 512, seed=5)
    bias = torch.randn(64)
    lin = Int8Q0Linear.from_values(q, d, bias=bias, kernels=kernels)
    assert lin.sw.shape[:2] == (4, 16) and lin.qw.shape[:2] == (4, 16)  # row groups first
    x = torch.randn(2, 3, 512)
    y = lin(x)
    dd = d.repeat_interleave(2, dim=1)
    ref = Int8GLinear.from_values(q, dd, torch.zeros_like(dd), bias=bias, kernels=kernels)(x)
    assert y.shape == (2, 3, 64) and torch.equal(bits(y), bits(ref))
    state = Int8Q0Linear(512, 64, bias=True, kernels=kernels)
    state.load_state_dict(lin.state_dict())  # the buffers are the whole weight
    assert torch.equal(state(x), y)
    with pytest.raises(ValueError, match="% 32"):
        Int8Q0Linear(48, 64)


@pytest.mark.parametrize("bias", [False, True])
def test_the_packed_cache_can_rebuild_q80(bias):
    from sinkchat.model import gguf_packed

    q, d = q80_case(32, 256, seed=2)
    lin = Int8Q0Linear.from_values(q, d, bias=torch.randn(32) if bias else None)
    assert gguf_packed.VERSION >= 4  # v3 held Q8_0 as q8g, Q4_K's scales a byte each
    _rebuilt_by_the_packed_cache(lin, bias)


def _tensor(qtype: int, rows: int, k: int, name: str) -> tuple[io.BytesIO, TensorInfo, np.ndarray]:
    raw = _file_blocks(qtype, rows=rows, k=k, seed=9)
    pad = b"\0" * 64
    t = TensorInfo(name=name, qtype=int(qtype), shape=(rows, k), offset=len(pad), nbytes=raw.nbytes)
    return io.BytesIO(pad + raw.tobytes()), t, raw


def test_the_loader_holds_q8_0_as_q80_on_the_native_kernels():
    f, t, raw = _tensor(T.Q8_0, 48, 512, "blk.0.ffn_down.weight")
    mod = gguf_load.module_of(f, t, "native")
    assert type(mod) is Int8Q0Linear
    assert torch.equal(bits(mod.dequantized()), bits(torch.from_numpy(dequantize(raw, T.Q8_0))))
    assert type(gguf_load.module_of(f, t, "torch")) is not Int8Q0Linear  # torch's kernels: q4 as before
    heads = gguf_load.module_of(f, t, "native", heads=4)  # q / k rows permuted back, d with them
    want = torch.from_numpy(gguf_load._unpermute(dequantize(raw, T.Q8_0), 4))
    assert type(heads) is Int8Q0Linear and torch.equal(bits(heads.dequantized()), bits(want))


def test_a_q8_0_token_table_is_q80_in_row_chunks(monkeypatch):
    """The table packed in chunks (as a 128k-row one is) and assembled: q80, the file's values, lookups by id."""
    monkeypatch.setattr(gguf_load, "TABLE_CHUNK", 32)
    f, t, raw = _tensor(T.Q8_0, 80, 256, "token_embd.weight")
    table = gguf_load._table(f, t, "native")
    assert type(table) is Int8Q0Linear and table.out_features == 80
    want = torch.from_numpy(dequantize(raw, T.Q8_0))
    assert torch.equal(bits(table.dequantized()), bits(want))
    assert torch.equal(bits(table.rows(torch.tensor([79, 0, 33]))), bits(want[[79, 0, 33]]))


@pytest.mark.parametrize("kind,kw", [("llama", {}), ("phi3", {"partial_rotary_factor": 0.5}), ("qwen2", {})])
def test_a_q8_0_model_on_q80_gives_the_bits_it_gave_on_q8g(kind, kw):
    """The native decode step and prefill (lin_type SC_LIN_Q80; Phi-3's fused projections as row-group views of q80
    buffers; Qwen2's biases): logits bit for bit those of the same model held as q8g."""

    def values(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # ggml's Q8_0: d = amax / 127 (fp16)
        wg = w.detach().float().reshape(w.shape[0], -1, 32)
        d = (wg.abs().amax(-1) / 127).half().float()
        inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
        return (wg * inv[..., None]).round().clamp(-127, 127).to(torch.int8).reshape(w.shape), d

    def q8g(lin: torch.nn.Linear) -> Int8GLinear:
        q, d = values(lin.weight)
        dd = d.repeat_interleave(2, dim=1)
        return Int8GLinear.from_values(q, dd, torch.zeros_like(dd), bias=lin.bias)

    same_model_bits([lambda i, n, lin: Int8Q0Linear.from_values(*values(lin.weight), bias=lin.bias),
                     lambda i, n, lin: q8g(lin)], kind, least=0.1, **kw)
