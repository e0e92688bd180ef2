"""The q8g layout (int8 weights, an fp16 (d, m) per 16 along K) and its kernel, and the constructors the GGUF loader
calls (`Int8GLinear.from_values`, `Int4Linear.from_values`, `.rows`).

- SIMD against the scalar reference (csrc/ref.c): bit-exact, one-row (decode) and many-row (prefill) paths, with and
  without bias, across the prefill's 128-row passes.
- Against an fp64 model of its integer arithmetic on the very int8 activations the kernel made (so only float
  rounding separates them: any wrong byte, half block, scale or offset shows), and against the float product with
  the dequantized weights (the activation rounding: loose).
- The weights are held exactly: fp16 d and m give back d·q + m rounded once, from `dequantized` and from `rows`.
"""

from __future__ import annotations

import pytest
import torch

from kernel_helpers import NATIVE, SIMD, bits, check_work_buffer, on, simd  # noqa: F401  (simd: the fixture)
from kernel_helpers import q8g_case as _case
from sinkchat.kernels import native
from sinkchat.model import int4
from sinkchat.model.int8g import Int8GLinear

pytestmark = NATIVE


def _exact_weights(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """d·q + m per 16, in fp64: [N, K]."""
    n, k = q.shape
    return (q.double().reshape(n, -1, 16) * d.double()[..., None] + m.double()[..., None]).reshape(n, k)


def _integer_model(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """What the q8g kernel computes, in fp64, on the kernel's own int8 activations: per half block h of 16,
    d_h·dx·dot(q, xq) + m_h·dx·sum(xq)."""
    n, k = q.shape
    xq, dx, _ = native.quantize_activations(x)  # [M, K] int8, [M, K/32]
    xh = xq.double().reshape(-1, k // 16, 16)  # [M, H, 16]
    dxh = dx.double().repeat_interleave(2, 1)  # [M, H]: each 32-block's scale on both its halves
    isum = torch.einsum("mhi,nhi->mnh", xh, q.double().reshape(n, k // 16, 16))  # [M, N, H]
    return ((isum * d.double()[None] + m.double()[None] * xh.sum(-1)[:, None]) * dxh[:, None]).sum(-1)


# (N, K, M): one row, a few rows, and past the prefill's 128-row pass
@pytest.mark.parametrize("n,k,m", [(16, 32, 1), (48, 96, 1), (192, 576, 1), (48, 96, 5), (32, 64, 300)])
@pytest.mark.parametrize("bias", [False, True])
def test_q8g_matmul_is_bit_exact_against_the_reference(simd, n, k, m, bias):
    q, d, mm = _case(n, k, seed=n + k + m)
    hw, sw = native.pack_q8g(q, d, mm)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[:, 5] = 30.0  # an outlier block
    b = torch.randn(n) if bias else None
    with on(simd):
        y_simd = native.q8g_matmul(x, hw, sw, b)
    with on("ref"):
        y_ref = native.q8g_matmul(x, hw, sw, b)
    assert torch.isfinite(y_ref).all() and y_ref.abs().max() > 0
    assert torch.equal(bits(y_simd), bits(y_ref))


@pytest.mark.parametrize("variant", [*SIMD, "ref"])
@pytest.mark.parametrize("n,k,m", [(48, 96, 1), (192, 576, 7), (64, 128, 200)])
def test_q8g_matmul_does_exactly_its_integer_arithmetic(variant, n, k, m):
    q, d, mm = _case(n, k, seed=k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    x[:, 3] = -40.0
    b = torch.randn(n)
    with on(variant):
        y = native.q8g_matmul(x, *native.pack_q8g(q, d, mm), b).double()
        ref = _integer_model(x, q, d, mm) + b.double()
    # fp32 accumulation over K/16 terms of size ~|y|: ~1e-6 relative
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    # and it is a good matmul: within int8 activation rounding (the outlier block's step is 40/127) of the product
    exact = x.double() @ _exact_weights(q, d, mm).T + b.double()
    assert (y - exact).norm() < 0.03 * exact.norm()


def test_q8g_rows_do_not_leak_into_each_other():
    q, d, mm = _case(64, 128)
    hw, sw = native.pack_q8g(q, d, mm)
    x = torch.randn(9, 128)
    with on("ref" if native.unsupported(native.best()) else native.best()):
        full = native.q8g_matmul(x, hw, sw, None)
        for i in (0, 4, 8):
            assert torch.equal(native.q8g_matmul(x[i : i + 1], hw, sw, None), full[i : i + 1])


def test_q8g_work_buffer_is_checked():
    with on("ref"):
        library = native.library()
    n, k, m = 32, 64, 3
    hw, sw = native.pack_q8g(*_case(n, k))
    check_work_buffer(library, "q8g", torch.randn(m, k), n, hw, sw, least=m * k + 8 * m * k // 16)  # xq, per-16 sums


def test_pack_q8g_refuses_what_the_kernel_cannot_take():
    q, d, m = _case(32, 64)
    with pytest.raises(ValueError, match="N % 16"):
        native.pack_q8g(q[:24], d[:24], m[:24])
    with pytest.raises(ValueError, match="K/16"):
        native.pack_q8g(q, d[:, :2], m)
    with pytest.raises(ValueError, match="do not fit"):
        native.q8g_matmul(torch.randn(1, 32), *native.pack_q8g(q, d, m), None)


# ---- Int8GLinear --------------------------------------------------------------------------------------------------
def test_fp16_scales_and_offsets_stay_exact_in_the_dequantized_weights():
    q, d, m = _case(48, 96, seed=3)
    lin = Int8GLinear.from_values(q, d, m)
    exact = _exact_weights(q, d, m).float()  # d·q is exact in fp32: d·q + m rounds once, as fp32 of the fp64 value
    assert torch.equal(lin.dequantized(), exact)
    ids = torch.tensor([[0, 47, 5], [16, 16, 31]])
    assert lin.rows(ids).shape == (2, 3, 96)
    assert torch.equal(lin.rows(ids), exact[ids])
    assert lin.rows(torch.tensor(7)).shape == (96,) and lin.rows(torch.tensor([], dtype=torch.long)).shape == (0, 96)
    for one in (0, 17, 31, 47):  # a decode step's single id takes the indexing path: the same row
        assert torch.equal(lin.rows(torch.tensor([one])), exact[[one]]) and torch.equal(lin.rows(torch.tensor(one)), exact[one])
    for bad in ([48], [-1], 48):
        with pytest.raises(IndexError):
            lin.rows(torch.tensor(bad))


def test_from_values_rounds_d_and_m_to_fp16_only():
    q, d, m = _case(32, 64, seed=4)
    d2, m2 = d * (1 + 1e-4), m * (1 - 1e-4)  # off the fp16 grid: rounded once, to the nearest fp16
    lin = Int8GLinear.from_values(q, d2, m2)
    assert torch.equal(lin.dequantized(), _exact_weights(q, d2.half().float(), m2.half().float()).float())


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_int8g_linear_is_a_linear(kernels):
    q, d, m = _case(64, 128, seed=5)
    bias = torch.randn(64)
    lin = Int8GLinear.from_values(q, d, m, bias, kernels=kernels)
    assert lin.layout == "q8g" and lin.bias.dtype == torch.float32 and not lin.bias.requires_grad
    x = torch.randn(2, 3, 128)
    y = lin(x)
    assert y.shape == (2, 3, 64) and y.dtype == torch.float32
    exact = x.double() @ _exact_weights(q, d, m).T + bias.double()
    assert (y.double() - exact).abs().max() < (0.02 if kernels == "native" else 1e-5) * exact.abs().max()
    assert lin(x.to(torch.bfloat16)).dtype == torch.bfloat16
    state = Int8GLinear(128, 64, bias=True, kernels=kernels)
    state.load_state_dict(lin.state_dict())  # the buffers are the whole weight
    assert torch.equal(state(x), y)


# ---- Int4Linear.from_values / rows --------------------------------------------------------------------------------
def _q4_case(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(n, k // 32, generator=g) * 0.2).half().float()
    return q, d, m


def test_int4_from_values_holds_fp16_d_and_m_exactly():
    """w = d·q + m with fp16 d, m (a Q4_1 block): stored as those fp16 values, not via torch's zero = m + 8·d."""
    q, d, m = _q4_case(48, 96)
    lin = int4.Int4Linear.from_values(q, d, m, kernels="native")
    exact = (q.double().reshape(48, -1, 32) * d.double()[..., None] + m.double()[..., None]).reshape(48, 96)
    assert lin.layout == "q4"
    assert torch.equal(lin.sw[:, :, 0].float().permute(0, 2, 1).reshape(48, -1), d)  # [g, b, r] -> [N, K/32]
    assert torch.equal(lin.sw[:, :, 1].float().permute(0, 2, 1).reshape(48, -1), m)
    ids = torch.tensor([[3, 0], [47, 20]])
    assert torch.equal(lin.rows(ids), exact.float()[ids])
    assert (lin.dequantized() - exact.float()).abs().max() < 1e-6  # through the kernel (one-hot rows)


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_int4_from_values_matches_the_linear_it_describes(kernels):
    torch.manual_seed(6)
    lin = torch.nn.Linear(96, 80, bias=True)
    q, scale, zero = int4.quantize(lin.weight.data)
    d, m = scale.float(), (zero - 8 * scale).float()
    a = int4.Int4Linear.from_values(q, d, m, lin.bias.data, kernels=kernels)
    b = int4.Int4Linear(lin, kernels=kernels)
    x = torch.randn(4, 96)
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=1e-3)
    ids = torch.tensor([0, 63, 64, 79, 5])  # both of torch's 64-row pack blocks
    torch.testing.assert_close(a.rows(ids), b.dequantized()[ids], rtol=0, atol=1e-3)
    assert torch.equal(b.rows(ids), b.dequantized()[ids]) if kernels == "torch" else True
    assert b.rows(ids[None]).shape == (1, 5, 96)
