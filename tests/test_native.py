"""The native VNNI kernels and the C decode step against their references.

- The matmuls against an fp64 model of the integer arithmetic they claim to do (int8 activations per 32 values,
  4-bit weights as d·q + m): agreement to float rounding, so any wrong nibble, lane, block or scale shows.
- The C decode step against the transformers forward on the same packed weights, across many evictions: same
  logits, same cache contents, same sink gauge.
- The C eviction (move + re-rotate) against the torch path.
"""

from __future__ import annotations

import pytest
import torch

from fakes import WordTokenizer, stream_logits as _stream, tiny_model
from sinkchat.decode import select
from sinkchat.model.spec import ModelSpec
from sinkchat.model import int4
from kernel_helpers import NATIVE, best_kernels  # noqa: F401  (the fixture: every test on the best variant)
from sinkchat.kernels import native
from sinkchat.config import CacheConfig, SamplingConfig
from sinkchat.core.engine import Engine
from sinkchat.core.events import GaugeEvent

# Skip only where no kernels can exist (no C compiler): a library that fails to build fails these tests. They run on
# the best variant the CPU has (`native.best()`), or on the scalar reference where it has none (no AVX2); tests/
# test_kernels.py holds every SIMD variant to the reference.
pytestmark = [NATIVE, pytest.mark.usefixtures("best_kernels")]


def _linear(n: int, k: int, bias: bool = False, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias)
    lin.weight.data = torch.randn(n, k) * 0.05 + 0.01
    return lin


def _integer_model(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """What the q4 kernel computes, in fp64: x rounded to int8 per 32 values (scale = block max / 127), the weight
    block as d·q + m, and the zero-point term on the *rounded* x (ggml's Q8_1 sum)."""
    n, k = q.shape
    xb = x.double().reshape(-1, k // 32, 32)  # [M, B, 32]
    dx = (xb.float().abs().amax(-1, keepdim=True) / 127).double()  # [M, B, 1]
    xq = torch.where(dx > 0, torch.round(xb / dx), 0)
    isum = torch.einsum("mbk,nbk->mnb", xq, q.double().reshape(n, k // 32, 32))  # [M, N, B]
    dxb = dx[..., 0][:, None, :]  # [M, 1, B]
    return (isum * d.double()[None] * dxb).sum(-1) + (m.double()[None] * dxb * xq.sum(-1)[:, None, :]).sum(-1)


@pytest.mark.parametrize("shape", [(64, 32), (48, 96), (192, 576)])
def test_q4_kernel_does_exactly_its_integer_arithmetic(shape):
    n, k = shape
    lin = _linear(n, k, bias=True)
    layer = int4.Int4Linear(lin, kernels="native")
    q, scale, zero = int4.quantize(lin.weight.data)
    d, m = scale.to(torch.float16), (zero.double() - 8 * scale.double()).to(torch.float16)
    x = torch.randn(5, k)
    x[:, 3] = 40.0  # an outlier: its block rounds coarsely, the others must not be affected
    y = layer(x).double()
    ref = _integer_model(x, q, d, m) + lin.bias.double()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
    # and it is a good matmul: within int8 activation rounding of the exact product
    exact = x.double() @ int4.dequantize(q, scale, zero).T + lin.bias.double()
    assert (y - exact).abs().max() < 0.02 * exact.abs().max()
    # row m of a batch equals that row alone (no state leaks between rows)
    torch.testing.assert_close(layer(x[2:3]), layer(x)[2:3], rtol=0, atol=0)


def test_q4_native_layout_holds_q4_1_blocks_exactly():
    """A GGUF Q4_1 block is d·q + m with fp16 d and m: the native layout stores those fp16 values, so the weights
    the kernel uses are the file's, bit for bit (torch's layout rounds them to bf16)."""
    torch.manual_seed(1)
    n, k = 32, 64
    q = torch.randint(0, 16, (n, k))
    q[:, ::32] = 0  # every block spans the full 0..15 range, as ggml's min/max quantizer makes it
    q[:, 1::32] = 15
    d = (torch.rand(n, k // 32) * 0.1 + 0.01).half().float()
    m = (-torch.rand(n, k // 32)).half().float()
    w = (q.reshape(n, -1, 32) * d[..., None] + m[..., None]).reshape(n, k)
    lin = torch.nn.Linear(k, n, bias=False)
    lin.weight.data = w
    native_w = int4.Int4Linear(lin, kernels="native").dequantized()
    torch_w = int4.Int4Linear(lin, kernels="torch").dequantized()
    assert (native_w - w).abs().max() < 1e-6
    assert (torch_w - w).abs().max() > (native_w - w).abs().max()


@pytest.mark.parametrize("vocab", [1000, 1024])
def test_q8_table_lookups_are_exact_and_projection_is_close(vocab):
    torch.manual_seed(2)
    w = torch.randn(vocab, 96) * 0.05
    a, b = int4.Int8Table(w, kernels="native"), int4.Int8Table(w, kernels="torch")
    ids = torch.tensor([[0, 5, 17, vocab - 1], [3, 3, 2, 1]])
    torch.testing.assert_close(a.lookup(ids), b.lookup(ids), rtol=0, atol=0)  # same int8 rows, same scales
    x = torch.randn(3, 96)
    y = a.project(x)
    assert y.shape == (3, vocab)  # padding rows cut off
    exact = x.double() @ (b.q.double() * b.scale.double()[:, None]).T
    assert (y.double() - exact).abs().max() < 0.01 * exact.abs().max()


# Peaked attention (scores of std 3: a few slots carry most of each row), so that a query at the wrong position, a
# wrong mask or a wrong scale moves the logits by O(0.1) instead of the ~1e-3 of transformers' near-uniform init.
SCORE_STD = 3.0


def _native_model(kind: str, tied: bool = False, **kw):
    model = tiny_model(kind, tie_word_embeddings=tied, score_std=kw.pop("score_std", SCORE_STD), **kw)
    int4.quantize_model(model.model.layers, kernels="native")
    if tied:
        assert int4.quantize_tied_table(model, "native")
    return model


WIDE = dict(vocab_size=1000, hidden_size=96, num_attention_heads=6, num_key_value_heads=2, intermediate_size=192)
D64 = dict(hidden_size=192, num_attention_heads=3, num_key_value_heads=1, intermediate_size=128)
D128 = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128)


# head dims 16 (the generic attention loops), 64 and 128 (the unrolled ones); WIDE: 3 query heads per kv head and
# a vocab that pads to 1008
@pytest.mark.parametrize("kind,tied,shape", [("llama", False, {}), ("llama", True, {}), ("qwen2", False, {}),
                                             ("qwen2", True, WIDE), ("llama", True, D64), ("qwen2", False, D128)])
@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
def test_native_step_matches_the_transformers_forward_across_evictions(kind, tied, shape, kv):
    model = _native_model(kind, tied, **shape)
    cfg = CacheConfig("sink", 4, 40, 5)
    ref, fast = (Engine(model, WordTokenizer(), cfg, SamplingConfig(temperature=0), step=select(model, d), kv_dtype=kv)
                 for d in ("hf", "native"))
    assert ref.step is None and type(fast.step).__name__ == "NativeStep"
    fast.step.prefill = None  # the decode step alone: both prefills through transformers (the native one rounds its
    #                           norms differently, and an int8 flip there would stay in the cache: test_native_prefill)
    ids = [(7 * i + 3) % 120 + 1 for i in range(90)]  # 90 tokens through a 40-slot cache: many evictions
    a, b = _stream(ref, ids), _stream(fast, ids)
    assert fast.ledger.evicted > 40 and fast.cache.length == ref.cache.length
    # Same kernels on both sides, but attention and RMSNorm sum in another order (fp32 rounding: ~3e-7 on logits of
    # ~1). Where an activation sits on an int8 rounding tie one ulp flips it and the changed k/v stays in the cache:
    # rare untied (seen up to 1.4e-3, head dim 128), common with a tied int8 table, whose embeddings are exact
    # multiples of a row scale (seen up to 1.6e-2 on logits, 5.5e-2 on keys of |k| ~5, 9e-3 on values). Tolerances:
    # ~3x the worst seen. What they must catch, measured with scratch edits of step.c on these models (README of
    # tests/): RoPE angle at pos + 1 >= 0.28 on logits, attending one slot too few >= 0.24 or too many >= 0.14,
    # scores scaled x1.25 >= 0.11; each moves keys by >= 0.5 and values by >= 0.045 (test below: no re-rotation).
    torch.testing.assert_close(b, a, rtol=0, atol=4e-2 if tied else 5e-3)
    rtol = 2**-7 if kv == "bfloat16" else 0  # a flip there can also move a cached value by one bf16 step
    k_atol, v_atol = (0.1, 2e-2) if tied else (1e-3, 1e-3)
    for la, lb in zip(ref.cache.layers, fast.cache.layers):
        n = la.length
        assert lb.keys.dtype == la.keys.dtype
        torch.testing.assert_close(lb.keys[:, :, :n].float(), la.keys[:, :, :n].float(), rtol=rtol, atol=k_atol)
        torch.testing.assert_close(lb.values[:, :, :n].float(), la.values[:, :, :n].float(), rtol=rtol, atol=v_atol)


@pytest.mark.parametrize("decoder", ["native", "hf"])
def test_keys_left_unrotated_on_eviction_are_caught_by_the_exactness_check(decoder):
    """The mutation the check above exists for, kept as a test: a cache that moves keys down without re-rotating
    them (`rerotate=False`, absolute positions) must miss the reference by far more than its tolerance (5e-3)."""
    model = _native_model("llama")
    cfg, ids = CacheConfig("sink", 4, 40, 5), [(7 * i + 3) % 120 + 1 for i in range(90)]
    ref = Engine(model, WordTokenizer(), cfg, SamplingConfig(temperature=0), step=select(model, "hf"),
                 kv_dtype="float32")
    bad = Engine(model, WordTokenizer(), cfg, SamplingConfig(temperature=0), step=select(model, decoder),
                 kv_dtype="float32", rerotate=False)
    a, b = _stream(ref, ids), _stream(bad, ids)
    assert (b - a).abs().max() > 0.1  # measured 0.54 (native); the tolerance it must beat is 5e-3


def test_native_generation_and_gauge_agree_with_the_reference():
    model = _native_model("llama", tied=True)
    ref, fast = (Engine(model, WordTokenizer(), CacheConfig("sink", 4, 40, 5), SamplingConfig(temperature=0),
                        step=select(model, d), kv_dtype="float32", gauge_every=1) for d in ("hf", "native"))
    for eng in (ref, fast):
        eng.stop_ids = set()
        list(eng.feed_ids(list(range(1, 30))))
    evs = [list(eng.generate(max_tokens=25)) for eng in (ref, fast)]
    assert ref.last_reply_ids == fast.last_reply_ids and len(ref.last_reply_ids) == 25
    g_ref, g_fast = ([e for e in ev if isinstance(e, GaugeEvent)] for ev in evs)
    assert len(g_ref) == len(g_fast) == 25
    for x, y in zip(g_ref, g_fast):
        assert x.per_layer == pytest.approx(y.per_layer, abs=1e-4)
        assert (x.recent, x.uniform, x.n) == pytest.approx((y.recent, y.uniform, y.n), abs=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rerotate", [True, False])
@pytest.mark.parametrize("rot,head_dim", [(32, 48), (16, 16)])  # vector path + partial rotary; scalar path
def test_native_eviction_equals_the_torch_path(monkeypatch, dtype, rerotate, rot, head_dim):
    from sinkchat.core.cache_policy import Eviction
    from sinkchat.core.kv_cache import Rope, SinkKVCache

    rope = Rope(inv_freq=1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot)), head_dim=head_dim)
    caches = []
    for use_native in (True, False):
        if not use_native:
            monkeypatch.setattr(native, "kv_evict", lambda *a, **k: False)
        torch.manual_seed(3)
        c = SinkKVCache(2, 64, rope, rerotate, dtype)
        keys, values = c.buffers(3, head_dim, torch.device("cpu"), dtype)
        for t in keys + values:
            t.copy_(torch.randn(t.shape))
        c.advance(64)
        for start, count in [(4, 9), (4, 1), (10, 20)]:
            c.evict(Eviction(start, count))
            c.advance(count)
        caches.append(c)
    for la, lb in zip(caches[0].layers, caches[1].layers):
        # fp32: fused multiply-adds round once where torch rounds twice (<= 1 ulp); bf16 then rounds the same
        torch.testing.assert_close(la.keys.float(), lb.keys.float(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(la.values, lb.values, rtol=0, atol=0)


def test_q4_load_keeps_native_biases_fp32_under_a_bf16_model(tmp_path):
    """The native kernel adds an fp32 bias: a bf16 model read straight into q4 must still hand it fp32 (a bf16 bias
    read as fp32 was garbage, and read past the end of the buffer)."""
    from sinkchat.model.q4load import load_q4

    src = tiny_model("qwen2")
    for layer in src.model.layers:
        layer.self_attn.q_proj.bias.data.uniform_(-1, 1)
    src.save_pretrained(tmp_path)
    outs, x = [], torch.randn(3, 64, dtype=torch.bfloat16)
    for kernels in ("native", "torch"):
        model, _ = load_q4(str(tmp_path), src.config, torch.bfloat16, kernels)
        q = model.model.layers[0].self_attn.q_proj
        if kernels == "native":
            assert q.bias.dtype == torch.float32
        outs.append(q(x).float())
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0.1)  # bf16 activations on the torch side


def test_native_step_follows_a_new_cache_even_where_addresses_repeat():
    """The step caches its pointer arrays; a cache rebuilt with some buffers at the old addresses must not leave the
    others pointing at freed memory."""
    from sinkchat.decode.native_step import NativeStep

    model = _native_model("llama", layers=3)
    step = NativeStep(model, ModelSpec.from_model(model))
    keys = [torch.zeros(1, 2, 8, 16) for _ in range(3)]
    values = [torch.zeros(1, 2, 8, 16) for _ in range(3)]
    step(5, 0, keys, values)
    new_k1, new_v1 = torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16)
    keys2, values2 = [keys[0], new_k1, keys[2]], [values[0], new_v1, values[2]]
    step(6, 1, keys2, values2)
    assert new_k1[0, :, 1].abs().sum() > 0 and keys[1][0, :, 1].abs().sum() == 0  # written where it now lives
    with pytest.raises(ValueError, match="KV buffer"):
        step(7, 2, keys2, [values[0], new_v1, values[2].to(torch.bfloat16)])


def test_decoder_choice_follows_the_packed_weights(monkeypatch):
    from sinkchat.decode import select as decode_step
    from sinkchat.decode.native_step import NativeStep
    from sinkchat.decode.torch_step import TorchStep
    from sinkchat.model.loader import q4_kernels

    assert isinstance(decode_step(_native_model("llama"), "native"), NativeStep)
    assert isinstance(decode_step(_native_model("llama"), "auto"), NativeStep)
    torch_packed = tiny_model("llama")
    int4.quantize_model(torch_packed.model.layers, kernels="torch")
    step = decode_step(torch_packed, "native")  # weights packed for torch's kernel: the torch step, eager
    assert isinstance(step, TorchStep) and step.mode == "eager"
    assert q4_kernels("compiled") == q4_kernels("eager") == "torch"
    assert q4_kernels("auto") == q4_kernels("native") == "native"
    narrow = tiny_model("llama", hidden_size=64, num_attention_heads=8).config  # head dim 8: only the torch step
    assert q4_kernels("auto", narrow) == "torch" and q4_kernels("native", narrow) == "native"
    monkeypatch.setenv("SINKCHAT_KERNELS", "torch")
    assert q4_kernels("auto") == "torch" and not native.available()
