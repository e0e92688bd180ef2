"""`--quant q4`: the asymmetric int4 layout must hold Q4_1 blocks exactly and the kernel must compute with them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sinkchat.model import int4
pytestmark = pytest.mark.skipif(not int4.available(), reason="no CPU int4 kernel in this torch build")


def q4_1_weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Weights as ggml's Q4_1 produces them: per 32-block, m = min, d = (max-min)/15 (fp16), w = d*q + m."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).reshape(n, k // 32, 32)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    d = ((hi - lo) / 15).half().float()
    m = lo.half().float()
    q = torch.round((w - m) / d).clamp(0, 15)
    return (d * q + m).reshape(n, k)


def test_requantizing_q4_1_recovers_the_same_integers_and_values():
    w = q4_1_weights(64, 256)
    q, scale, zero = int4.quantize(w)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    assert torch.allclose(int4.dequantize(q, scale, zero), w.double(), atol=1e-6, rtol=0)


def test_plain_weights_round_to_within_half_a_step():
    w = torch.randn(32, 128)
    q, scale, zero = int4.quantize(w)
    err = (int4.dequantize(q, scale, zero) - w.double()).abs().reshape(32, 4, 32)
    assert (err <= scale[..., None] / 2 + 1e-9).all()


def test_constant_block_is_exact():
    w = torch.full((16, 32), 0.25)
    q, scale, zero = int4.quantize(w)
    assert torch.equal(int4.dequantize(q, scale, zero).float(), w)


@pytest.mark.parametrize("bias", [False, True])
def test_int4_linear_matches_its_dequantized_weight(bias):
    torch.manual_seed(0)
    lin = nn.Linear(256, 96, bias=bias)
    lin.weight.data = q4_1_weights(96, 256, seed=1)
    q = int4.Int4Linear(lin)
    x = torch.randn(3, 5, 256)  # [B, T, K]
    y = q(x)
    assert y.shape == (3, 5, 96) and y.dtype == torch.float32
    # the kernel's only rounding: bf16 activations and bf16 (scale, zero); both well under 1% of the output scale
    ref = lin(x)
    rel = (y - ref).abs().max() / ref.abs().max()
    assert rel < 1e-2
    wq = q.dequantized()
    assert torch.allclose(wq, lin.weight.data, atol=float(lin.weight.data.abs().max()) * 1e-2)


def test_quantize_model_swaps_fitting_linears_and_keeps_the_rest():
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10), nn.Linear(10, 16))
    quantized, total = int4.quantize_model(model)
    assert isinstance(model[0], int4.Int4Linear)
    assert isinstance(model[2], nn.Linear) and not isinstance(model[2], int4.Int4Linear)  # N=10: not a multiple of 16
    assert isinstance(model[3], nn.Linear)  # K=10: not a multiple of the group
    assert quantized == 64 * 32 and total == 64 * 32 + 32 * 10 + 10 * 16
    assert model(torch.randn(2, 64)).shape == (2, 16)


def test_int8_table_ties_lookup_and_projection():
    torch.manual_seed(0)
    emb = nn.Embedding(64, 32)
    head = nn.Linear(32, 64, bias=False)
    head.weight = emb.weight  # tied, as in the bundled model

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = emb, head

        def get_input_embeddings(self):
            return self.emb

        def get_output_embeddings(self):
            return self.head

        def set_input_embeddings(self, m):
            self.emb = m

        def set_output_embeddings(self, m):
            self.head = m

    model = Tiny()
    w = emb.weight.data.clone()
    assert int4.quantize_tied_table(model)
    assert model.emb.table is model.head.table
    ids = torch.tensor([[3, 17, 63]])
    step = w.abs().amax(1) / 127  # [V]
    assert ((model.emb(ids) - w[ids]).abs() <= step[ids][..., None] / 2 + 1e-6).all()
    x = torch.randn(2, 32)
    rel = (model.head(x) - x @ w.T).abs().max() / (x @ w.T).abs().max()
    assert rel < 2e-2


def test_untied_table_is_left_alone():
    class Untied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(64, 32), nn.Linear(32, 64, bias=False)

        def get_input_embeddings(self):
            return self.emb

        def get_output_embeddings(self):
            return self.head

    m = Untied()
    assert not int4.quantize_tied_table(m)
    assert isinstance(m.head, nn.Linear)
