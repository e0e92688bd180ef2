"""The MLP activation silu(g) * u (csrc/kernels.h: sc_silu_mul on sc_exp, the decode step's and the prefill's one
code) against fp64, and every SIMD build bit for bit against the scalar reference build (the same float operations,
vectorized or not)."""

from __future__ import annotations

import pytest
import torch

from sinkchat.kernels import native
from kernel_helpers import simd  # noqa: F401  (the fixture: each SIMD variant in turn)

pytestmark = pytest.mark.skipif(native.unsupported("ref") is not None,
                                reason=f"native kernels: {native.unsupported('ref')}")


def silu_mul(g: torch.Tensor, u: torch.Tensor, variant: str) -> torch.Tensor:
    """silu(g) * u through `variant`'s exported sc_silu (the step's and the prefill's code), into a new tensor."""
    out, u = g.float().contiguous().clone(), u.float().contiguous()
    assert out.shape == u.shape
    assert native.library(variant).sc_silu(out.data_ptr(), u.data_ptr(), out.numel()) == 0
    return out


def _gates() -> torch.Tensor:
    """Every scale a gate takes, and the edges of e^x's range (clamped below -86, infinite above 88)."""
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(20000, generator=g) * torch.logspace(-8, 2.2, 20000).float()
    edges = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 0.5, -0.5, 85.9, 86.0, 86.1, -85.9, -86.0, -86.1, 87.9, -87.9,
                          -88.0, -88.1, -88.72, -88.73, -89.0, -100.0, 100.0, -1e6, 1e6, 17.3, -17.3, 0.3465736])
    return torch.cat([wide, edges, -wide])


def test_it_is_within_a_few_ulp_of_fp64():
    gates = _gates()
    u = torch.linspace(-3, 3, gates.numel())
    got = silu_mul(gates, u, "ref").double()
    g64 = gates.double()
    want = g64 / (1 + torch.exp(-g64)) * u.double()
    # ~1e-36 absolute where e^-g overflows float (g < -88.7: the float result is -0, the true one ~g e^g u)
    err = (got - want).abs() - 1e-35
    assert (err <= 6e-7 * want.abs()).all(), f"worst {float((err / want.abs().clamp_min(1e-38)).max()):.2e}"
    assert torch.equal(silu_mul(torch.tensor([-1e6, 1e6]), torch.ones(2), "ref"), torch.tensor([-0.0, 1e6]))


def test_nan_and_infinities_as_torch_has_them():
    g = torch.tensor([float("nan"), float("inf"), -float("inf")])  # silu(-inf) = -inf / inf: NaN in torch too
    out = silu_mul(g, torch.ones(3), "ref")
    assert torch.equal(out.isnan(), torch.nn.functional.silu(g).isnan()) and out[1] == float("inf")


def test_every_simd_build_has_the_reference_bits(simd):
    gates = _gates()
    u = torch.linspace(-3, 3, gates.numel())
    a, b = silu_mul(gates, u, simd), silu_mul(gates, u, "ref")
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
