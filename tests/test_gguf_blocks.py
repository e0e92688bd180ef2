"""Every supported GGUF quant type taken apart (`gguf_blocks`) against gguf-py's own `dequantize`: the fp32 values
bit-exact for every type; the kernel's fp16-rounded scales bit-exact for Q4_0/Q4_1/Q8_0/Q5_0/Q5_1 and within
half an fp16 ulp of each scale for the K-quants (whose scales are products)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from sinkchat.model import gguf_blocks
from sinkchat.model.loader import bundled_gguf

TYPES = [T.Q4_0, T.Q4_1, T.Q4_K, T.Q8_0, T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K]
# byte offsets of the fp16 fields in each block (random bytes there could be NaN / inf)
F16_AT = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q4_K: [0, 2], T.Q8_0: [0], T.Q5_0: [0], T.Q5_1: [0, 2],
          T.Q5_K: [0, 2], T.Q6_K: [208]}


def random_blocks(qtype: int, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Valid random blocks: random bytes, with every fp16 scale field a finite random value. uint8 [rows, bytes]."""
    rng = np.random.default_rng(seed)
    bs, size = GGML_QUANT_SIZES[qtype]
    nb = rows * k // bs
    b = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    for at in F16_AT[qtype]:
        f = (rng.standard_normal(nb) * 0.01).astype(np.float16)
        b[:, at : at + 2] = f.view(np.uint8).reshape(nb, 2)
    return b.reshape(rows, -1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: T(t).name)
def test_float_values_are_gguf_dequantize_bit_for_bit(qtype: int) -> None:
    raw = random_blocks(qtype, rows=8, k=512)
    want = dequantize(raw, qtype)  # [8, 512]
    got = gguf_blocks.to_float(qtype, raw)
    assert got.shape == want.shape == (8, 512)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: T(t).name)
def test_kernel_values_exact_or_within_half_an_fp16_ulp_of_each_scale(qtype: int) -> None:
    raw = random_blocks(qtype, rows=16, k=512, seed=1)
    p = gguf_blocks.unpack(qtype, raw)
    assert p.q.shape == (16, 512) and p.d.shape == p.m.shape == (16, 512 // p.group)
    lo, hi = (0, 15) if p.layout == "q4" else (-128, 127)
    assert p.q.min() >= lo and p.q.max() <= hi
    want = dequantize(raw, qtype)
    got = p.dequantize()
    if qtype in gguf_blocks.EXACT:
        np.testing.assert_array_equal(got, want)
        return
    # K-quants: per group, |Δw| <= |q|·|Δd| + |Δm| with each of Δd, Δm at most half an fp16 ulp (2^-11 relative)
    q = np.abs(p.q.astype(np.float64)).reshape(16, -1, p.group)
    bound = (q * (np.abs(p.d) * 2.0**-11)[..., None] + (np.abs(p.m) * 2.0**-11)[..., None]).reshape(16, 512)
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    assert (err <= bound + 1e-12).all()
    assert err.max() > 0  # random scales: some product is not an fp16 value, else this test proves nothing


def test_real_blocks_of_the_bundled_model_unpack_exactly() -> None:
    """The bundled file's own tensors (Q4_1 linears, the Q8_0 token table): the kernel values are the file's."""
    reader = GGUFReader(str(bundled_gguf()))
    seen = set()
    for t in reader.tensors:
        if t.tensor_type not in gguf_blocks.UNPACK or t.tensor_type in seen:
            continue
        seen.add(t.tensor_type)
        raw = np.asarray(t.data)[:64]  # the first 64 rows: [64, bytes per row]
        np.testing.assert_array_equal(gguf_blocks.unpack(t.tensor_type, raw).dequantize(), dequantize(raw, t.tensor_type))
    assert seen == {T.Q4_1, T.Q8_0}


def test_absmax_q8g_rounds_float_weights_within_half_a_step() -> None:
    w = np.random.default_rng(2).standard_normal((32, 64)).astype(np.float32)
    p = gguf_blocks.absmax_q8g(w)
    step = np.repeat(p.d, 16, axis=1)
    assert (np.abs(p.dequantize() - w) <= step / 2 + 1e-6).all()


def _bits(a: np.ndarray) -> np.ndarray:
    """fp32 values as their bit patterns: equal only if bit for bit, a zero's sign included (-0.0 == 0.0 as floats)."""
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: T(t).name)
def test_float_values_keep_gguf_dequantize_s_signed_zeros(qtype: int) -> None:
    """`to_float` is gguf-py's values bit for bit: d·q with q = 0 and d < 0 is -0.0 there; a re-implementation as
    d·q + m (m = 0, or Q4_0's m = -8d) makes it +0.0 (Q4_0 / Q8_0 / Q5_0 / Q6_K), which value equality misses."""
    raw = random_blocks(qtype, rows=8, k=512)
    want = dequantize(raw, qtype)
    np.testing.assert_array_equal(_bits(gguf_blocks.to_float(qtype, raw)), _bits(want))


def test_float_values_of_the_bundled_model_are_gguf_dequantize_bit_for_bit() -> None:
    """The bundled file's own blocks (the Q8_0 token table, the Q4_1 linears, the F32 norms), by bits."""
    reader = GGUFReader(str(bundled_gguf()))
    for t in reader.tensors:
        raw = np.asarray(t.data).reshape(-1, t.data.shape[-1])[:256]  # a sample of rows: the whole file takes 15 s
        want = np.asarray(dequantize(raw, t.tensor_type), dtype=np.float32)
        np.testing.assert_array_equal(_bits(gguf_blocks.to_float(t.tensor_type, raw)), _bits(want), err_msg=t.name)


def test_q4_0_is_held_at_its_own_bits() -> None:
    """Q4_0 for the native kernels (layout q40, `native.pack_q40`): the bytes held are as many as the file's (16 of
    nibbles and an fp16 d per 32 weights: 18, where q4 held 20) and are the file's bits, put back by
    `native.q40_gguf_bytes`; the weights unpacked from them are gguf-py's, signed zeros included."""
    import torch

    from sinkchat.kernels import native

    raw = random_blocks(T.Q4_0, rows=48, k=256, seed=9)
    raw[0, 0:2] = np.array([3e-6], dtype=np.float16).view(np.uint8)  # a subnormal d
    raw[1, 18:20] = np.array([-0.0], dtype=np.float16).view(np.uint8)  # a -0 d
    p = gguf_blocks.unpack(T.Q4_0, raw)
    qw, sw = native.pack_q40(torch.from_numpy(p.q), torch.from_numpy(p.d))
    assert qw.numel() * qw.element_size() + sw.numel() * sw.element_size() == raw.nbytes == 48 * 8 * 18
    np.testing.assert_array_equal(native.q40_gguf_bytes(qw, sw), raw)
    np.testing.assert_array_equal(_bits(native.q40_unpack(qw, sw).numpy()), _bits(dequantize(raw, T.Q4_0)))
    ids = torch.tensor([47, 0, 16, 1])
    np.testing.assert_array_equal(_bits(native.q40_unpack(qw, sw, ids).numpy()), _bits(dequantize(raw, T.Q4_0)[ids]))
