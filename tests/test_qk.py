"""The K-quant layouts q4k (Q4_K) and q8k (Q5_K, Q6_K), their kernels, and `Int4KLinear` / `Int8KLinear`; and Q4_0's
own layout q40 (`Int4Q0Linear`), held to gguf-py's weights and to the bits the q4 layout gave for Q4_0 before.

- SIMD against the scalar reference (csrc/ref.c): bit-exact, one-row (decode) and many-row (prefill, across its
  passes) paths, with and without bias, N not a multiple of 64.
- Against an fp64 model of the integer arithmetic on the very int8 activations the kernel made: only float rounding
  separates them, so a wrong nibble, sub-block, super-block, scale, min or sign shows.
- The weights are the file's: `rows` / `dequantized` equal gguf-py's dequantize of random real blocks bit for bit,
  taken apart by `gguf_blocks.unpack_k` (and the kernel computes with exactly those weights).
- The native decode step on q4k / q8k linears (alone and mixed with q4 / q8g) against transformers' forward.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
from torch import nn

from kernel_helpers import NATIVE, SIMD, best_kernels, bits, check_work_buffer, on, simd  # noqa: F401  (fixtures)
# (also tests/test_threads.py's, from here)
from kernel_helpers import k_case as _case, k_matmul as _matmul, k_pack as _pack  # noqa: F401
from sinkchat.kernels import native
from kernel_helpers import q40_case
from sinkchat.model import gguf_blocks, gguf_packed, int4
from sinkchat.model.int4q0 import Int4Q0Linear
from sinkchat.model.int8g import Int8GLinear
from sinkchat.model.intk import Int4KLinear, Int8KLinear
from test_gguf_blocks import random_blocks

pytestmark = NATIVE

LAYOUTS = ("q4k", "q8k")
CLASS = {"q4k": Int4KLinear, "q8k": Int8KLinear}


def _exact_weights(q: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor
                   ) -> torch.Tensor:
    """(d·sc)·q − dmin·mn per sub-block, in fp64: [N, K]."""
    n, k = q.shape
    per = sc.shape[1] // d.shape[1]
    ds = d.double().repeat_interleave(per, 1) * sc.double()
    dm = dmin.double().repeat_interleave(per, 1) * mn.double()
    return (q.double().reshape(n, sc.shape[1], -1) * ds[..., None] - dm[..., None]).reshape(n, k)


def _integer_model(x: torch.Tensor, *values: torch.Tensor) -> torch.Tensor:
    """What the kernels compute, in fp64, on the kernel's own int8 activations: per 32-block b, dx_b · Σ w·xq with
    the exact weights (the min term on the rounded activations' sums, as ggml's Q8_K / Q8_1 sums)."""
    q, d, dmin, sc, mn = values
    n, k = q.shape
    xq, dx, _ = native.quantize_activations(x)  # [M, K] int8, [M, K/32]
    w = _exact_weights(*values).reshape(n, k // 32, 32)  # [N, B, 32]
    return torch.einsum("mbi,nbi,mb->mn", xq.double().reshape(-1, k // 32, 32), w, dx.double())


# (N, K, M): one row, a few rows, and past the prefill's 128 / 256-row passes; N = 48, 208: not multiples of 64
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n,k,m", [(16, 256, 1), (48, 512, 1), (208, 768, 1), (48, 512, 5), (80, 256, 300)])
@pytest.mark.parametrize("bias", [False, True])
def test_k_matmuls_are_bit_exact_against_the_reference(simd, layout, n, k, m, bias):
    values = _case(layout, n, k, seed=n + k + m)
    w, sw = _pack(layout, *values)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[:, 5] = 30.0  # an outlier block
    b = torch.randn(n) if bias else None
    with on(simd):
        y_simd = _matmul(layout, x, w, sw, b)
    with on("ref"):
        y_ref = _matmul(layout, x, w, sw, b)
    assert torch.isfinite(y_ref).all() and y_ref.abs().max() > 0
    assert torch.equal(bits(y_simd), bits(y_ref))


@pytest.mark.parametrize("m", [1, 5, 300])
def test_q8k_without_mins_keeps_the_reference_bits(simd, m):
    """Q6_K's q8k has dmin 0: there the AVX-512 prefill leaves the m terms out (rows512.h: q8_half0), which must give
    the reference's bits. Row groups of dmin +0 and -0 between ones with mins, so both paths run in one call."""
    q, d, dmin, sc, mn = _case("q8k", 80, 512, seed=m)
    dmin[:16], dmin[32:48] = 0.0, -0.0
    w, sw = _pack("q8k", q, d, dmin, sc, mn)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
    with on(simd):
        y_simd = _matmul("q8k", x, w, sw, None)
    with on("ref"):
        y_ref = _matmul("q8k", x, w, sw, None)
    assert torch.equal(bits(y_simd), bits(y_ref))


@pytest.mark.parametrize("variant", [*SIMD, "ref"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n,k,m", [(48, 512, 1), (208, 768, 7), (64, 256, 260)])
def test_k_matmuls_do_exactly_their_integer_arithmetic(variant, layout, n, k, m):
    values = _case(layout, n, k, seed=k + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    x[:, 3] = -40.0
    b = torch.randn(n)
    with on(variant):
        y = _matmul(layout, x, *_pack(layout, *values), b).double()
        ref = _integer_model(x, *values) + b.double()
    # fp32 accumulation of K/32 (q4k) or K/16 (q8k) terms ~|y| each, and each term's products: ~1e-6 relative
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    exact = x.double() @ _exact_weights(*values).T + b.double()  # and a good matmul: within activation rounding
    assert (y - exact).norm() < 0.03 * exact.norm()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_k_rows_do_not_leak_into_each_other(layout):
    w, sw = _pack(layout, *_case(layout, 64, 512))
    x = torch.randn(9, 512)
    with on("ref" if native.unsupported(native.best()) else native.best()):
        full = _matmul(layout, x, w, sw, None)
        for i in (0, 4, 8):
            assert torch.equal(_matmul(layout, x[i : i + 1], w, sw, None), full[i : i + 1])
        assert _matmul(layout, torch.empty(0, 512), w, sw, None).shape == (0, 64)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("variant", [*SIMD, "ref"])
def test_k_work_buffers_are_checked(layout, variant):
    with on(variant):
        library = native.library()
    n, k, m = 32, 256, 3
    w, sw = _pack(layout, *_case(layout, n, k))
    check_work_buffer(library, layout, torch.randn(m, k), n, w, sw, least=m * k + 4 * m * k // 32)  # xq, dx at least


def test_packing_refuses_what_the_kernels_cannot_take():
    q, d, dmin, sc, mn = _case("q4k", 32, 512)
    with pytest.raises(ValueError, match="K % 256"):
        native.pack_q4k(q[:, :256 + 32], d, dmin, sc[:, :9], mn[:, :9])
    with pytest.raises(ValueError, match="N % 16"):
        native.pack_q4k(q[:24], d[:24], dmin[:24], sc[:24], mn[:24])
    with pytest.raises(ValueError, match="outside 0..15"):
        native.pack_q4k(q + 1, d, dmin, sc, mn)
    with pytest.raises(ValueError, match="outside torch.uint8"):
        native.pack_q4k(q, d, dmin, sc.int() + 256, mn)
    with pytest.raises(ValueError, match="outside 0..63"):
        native.pack_q4k(q, d, dmin, sc, mn.int() + 1)  # mn[0, 1] is 63: Q4_K's 6 bits hold no 64
    with pytest.raises(ValueError, match="do not fit"):
        native.q4k_matmul(torch.randn(1, 256), *native.pack_q4k(q, d, dmin, sc, mn), None)
    q8, d, dmin, sc8, mn8 = _case("q8k", 32, 512)
    with pytest.raises(ValueError, match="outside torch.int8"):
        native.pack_q8k(q8, d, dmin, sc8.int() * 2, mn8)
    with pytest.raises(ValueError, match="want int8"):
        native.pack_q8k(q8.int(), d, dmin, sc8, mn8)
    with pytest.raises(ValueError, match="scales"):
        native.q8k_matmul(torch.randn(1, 512), native.pack_q8k(q8, d, dmin, sc8, mn8)[0],
                          native.pack_q4k(q, d, dmin, sc, mn)[1], None)


# ---- the file's weights, bit for bit -----------------------------------------------------------------------------
K_TYPES = [T.Q4_K, T.Q5_K, T.Q6_K]


def _file_blocks(qtype: int, rows: int, k: int, seed: int) -> np.ndarray:
    """Random valid blocks (random bytes, finite random fp16 scales), with an fp16 subnormal d and a negative one."""
    raw = random_blocks(qtype, rows=rows, k=k, seed=seed)
    at = 208 if qtype == T.Q6_K else 0
    raw[0, at : at + 2] = np.array([3e-6], dtype=np.float16).view(np.uint8)
    raw[1, at : at + 2] = np.array([-0.02], dtype=np.float16).view(np.uint8)
    return raw


def _linear(p: gguf_blocks.KParts, bias: torch.Tensor | None = None, kernels: str = "native") -> nn.Module:
    values = [torch.from_numpy(np.ascontiguousarray(a)) for a in (p.q, p.d, p.dmin, p.sc, p.mn)]
    return CLASS[p.layout].from_values(*values, bias=bias, kernels=kernels)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: T(t).name)
def test_rows_and_dequantized_are_gguf_dequantize_bit_for_bit(qtype):
    raw = _file_blocks(qtype, rows=48, k=768, seed=int(qtype))
    want = torch.from_numpy(dequantize(raw, qtype))  # [48, 768] fp32
    p = gguf_blocks.unpack_k(qtype, raw)
    assert p.layout == ("q4k" if qtype == T.Q4_K else "q8k") and p.q.shape == (48, 768)
    assert p.d.shape == p.dmin.shape == (48, 3) and p.sc.shape == p.mn.shape == (48, 768 // p.sub)
    np.testing.assert_array_equal(p.dequantize(), want.numpy())
    lin = _linear(p)
    assert lin.layout == p.layout
    _weights_and_rows_are(lin, want)
    np.testing.assert_array_equal(gguf_blocks.to_float(qtype, raw), want.numpy())  # the old path still works


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: T(t).name)
def test_the_kernels_compute_with_the_files_weights(qtype):
    """From real blocks: the kernel is its integer model over gguf-py's weights (fp64), SIMD and reference alike."""
    raw = _file_blocks(qtype, rows=32, k=512, seed=7)
    p = gguf_blocks.unpack_k(qtype, raw)
    lin = _linear(p)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(3))
    xq, dx, _ = native.quantize_activations(x)
    w = torch.from_numpy(dequantize(raw, qtype)).double().reshape(32, 16, 32)  # exact: fp32 holds each weight
    ref = torch.einsum("mbi,nbi,mb->mn", xq.double().reshape(3, 16, 32), w, dx.double())
    outs = []
    for variant in [v for v in (*SIMD, "ref") if not native.unsupported(v)]:
        with on(variant):
            outs.append(lin(x))
        torch.testing.assert_close(outs[-1].double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    assert all(torch.equal(bits(o), bits(outs[-1])) for o in outs)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_k_linears_are_linears(layout, kernels):
    values = _case(layout, 64, 512, seed=5)
    bias = torch.randn(64)
    lin = CLASS[layout].from_values(*values, bias=bias, kernels=kernels)
    assert lin.layout == layout and lin.bias.dtype == torch.float32 and not lin.bias.requires_grad
    assert lin.sw.shape[:2] == (4, 2) and lin.weights.shape[:2] == (4, 16)  # row groups first
    x = torch.randn(2, 3, 512)
    y = lin(x)
    assert y.shape == (2, 3, 64) and y.dtype == torch.float32
    exact = x.double() @ _exact_weights(*values).T + bias.double()
    assert (y.double() - exact).abs().max() < (0.03 if kernels == "native" else 1e-5) * exact.abs().max()
    assert lin(x.to(torch.bfloat16)).dtype == torch.bfloat16
    state = CLASS[layout](512, 64, bias=True, kernels=kernels)
    state.load_state_dict(lin.state_dict())  # the buffers are the whole weight
    assert torch.equal(state(x), y)
    with pytest.raises(ValueError, match="% 256"):
        CLASS[layout](384, 64)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bias", [False, True])
def test_the_packed_cache_can_rebuild_them(layout, bias):
    """gguf_packed saves a module as class name + plain attributes + tensors, and rebuilds it without __init__."""
    lin = CLASS[layout].from_values(*_case(layout, 32, 256, seed=2), bias=torch.randn(32) if bias else None)
    _rebuilt_by_the_packed_cache(lin, bias)


def _rebuilt_by_the_packed_cache(lin: nn.Module, bias: bool) -> None:
    assert gguf_packed.CLASSES[type(lin).__name__] is type(lin)
    spec = {"class": type(lin).__name__, "attrs": gguf_packed._attrs(lin),
            "params": [k for k, p in lin.named_parameters(recurse=False) if p is not None]}
    assert spec["attrs"] == {"in_features": 256, "out_features": 32, "kernels": "native",
                             **({} if bias else {"bias": None})}
    shell = gguf_packed._shell(spec)
    for name, t in lin.state_dict().items():
        if name in spec["params"]:
            setattr(shell, name, nn.Parameter(t.clone(), requires_grad=False))
        else:
            shell.register_buffer(name, t.clone())
    x = torch.randn(2, 256)
    assert torch.equal(shell(x), lin(x)) and torch.equal(shell.rows(torch.tensor([3])), lin.rows(torch.tensor([3])))


# ---- the decode step ---------------------------------------------------------------------------------------------
K_SHAPE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512)


def _minmax_k(w: torch.Tensor, levels: int) -> tuple[torch.Tensor, ...]:
    """Q4_K / Q5_K-style min/max quantization of a float weight [N, K]: per 32 a scale and a min, each 6 bits of its
    super-block's fp16 d / dmin; q in 0..levels. Returns q uint8 [N, K], d, dmin [N, K/256], sc, mn uint8 [N, K/32]."""
    n, k = w.shape
    wg = w.detach().double().reshape(n, k // 256, 8, 32)
    lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)  # [N, S, 8]
    scale, low = (hi - lo) / levels, -lo
    d = (scale.amax(-1) / 63).clamp(min=1e-6).half().double()  # [N, S]
    dmin = (low.amax(-1) / 63).clamp(min=1e-6).half().double()
    sc = torch.round(scale / d[..., None]).clamp(1, 63)
    mn = torch.round(low / dmin[..., None]).clamp(0, 63)
    q = torch.round((wg + (dmin[..., None] * mn)[..., None]) / (d[..., None] * sc)[..., None]).clamp(0, levels)
    return (q.to(torch.uint8).reshape(n, k), d.float(), dmin.float(), sc.to(torch.uint8).reshape(n, -1),
            mn.to(torch.uint8).reshape(n, -1))


def q4k_values(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return _minmax_k(w, 15)


def q8k_values(w: torch.Tensor, asym: bool) -> tuple[torch.Tensor, ...]:
    """Q6_K-style (symmetric 6-bit, an int8 scale per 16) or, `asym`, Q5_K-style (5-bit min/max per 32, its scale
    and min on both 16-halves) values of a float weight [N, K], as `pack_q8k` takes them."""
    n, k = w.shape
    if asym:
        q, d, dmin, sc, mn = _minmax_k(w, 31)
        return (q.to(torch.int8), d, dmin, sc.repeat_interleave(2, 1).to(torch.int8), mn.repeat_interleave(2, 1))
    wg = w.detach().double().reshape(n, k // 256, 16, 16)
    scale = wg.abs().amax(-1) / 31  # [N, S, 16]
    d = (scale.amax(-1) / 127).clamp(min=1e-6).half().double()
    sc = torch.round(scale / d[..., None]).clamp(1, 127)
    q = torch.round(wg / (d[..., None] * sc)[..., None]).clamp(-32, 31)
    return (q.to(torch.int8).reshape(n, k), d.float(), torch.zeros_like(d).float(), sc.to(torch.int8).reshape(n, -1),
            torch.zeros(n, k // 16, dtype=torch.uint8))


def to_q4k(lin: nn.Linear) -> Int4KLinear:
    return Int4KLinear.from_values(*q4k_values(lin.weight), bias=lin.bias)


def to_q8k(lin: nn.Linear, asym: bool = False) -> Int8KLinear:
    return Int8KLinear.from_values(*q8k_values(lin.weight, asym), bias=lin.bias)


def _four(i: int, name: str, lin: nn.Linear) -> nn.Module:
    """q4, q4k, q8g, q8k (Q6_K- and Q5_K-style) in turn across each layer's linears, shifted per layer."""
    from test_native_archs import to_q8g

    names = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj")
    at = (next(j for j, s in enumerate(names) if name.endswith(s)) + i) % 5
    return [lambda: int4.Int4Linear(lin, kernels="native"), lambda: to_q4k(lin), lambda: to_q8g(lin),
            lambda: to_q8k(lin), lambda: to_q8k(lin, asym=True)][at]()


@pytest.mark.usefixtures("best_kernels")
@pytest.mark.parametrize("weights", ["q4k", "q8k", "q5k"])
def test_native_step_on_k_quants_matches_the_transformers_forward(weights):
    from test_native_archs import build, compare, pack

    choose = {"q4k": lambda i, n, lin: to_q4k(lin), "q8k": lambda i, n, lin: to_q8k(lin),
              "q5k": lambda i, n, lin: to_q8k(lin, asym=True)}[weights]
    model = pack(build("llama", **K_SHAPE), choose)
    assert {m.layout for m in model.modules() if hasattr(m, "layout")} == {"q4k" if weights == "q4k" else "q8k"}
    compare(model)


@pytest.mark.usefixtures("best_kernels")
@pytest.mark.parametrize("kind,kw", [("qwen3", {}), ("phi3", {"partial_rotary_factor": 0.5}), ("qwen2", {})])
def test_q4_q4k_q8g_q8k_linears_mix_in_one_model(kind, kw):
    """Every layout in one model; Phi-3's fused projections as row-group views of q4k / q8k buffers too."""
    from test_native_archs import build, compare, pack

    model = pack(build(kind, **K_SHAPE, **kw), _four)
    layouts = {m.layout for m in model.modules() if isinstance(m, (int4.Int4Linear, Int8GLinear, Int4KLinear,
                                                                     Int8KLinear))}
    assert layouts == {"q4", "q4k", "q8g", "q8k"}
    compare(model, kv="bfloat16" if kind == "qwen2" else "float32")


@pytest.mark.usefixtures("best_kernels")
def test_k_quant_model_is_close_to_the_float_model_of_its_dequantized_weights():
    """The q4k / q8k weights are the file's; what separates the packed model from a float one holding the same
    weights (transformers' forward on `dequantized()`) is the kernels' int8 activations: small next to the logits."""
    from test_native_archs import build, pack

    packed = pack(build("llama", **K_SHAPE), _four)
    plain = pack(build("llama", **K_SHAPE), lambda i, n, lin: _float_copy(packed.model.layers[i].get_submodule(n)))
    ids = torch.tensor([[(37 * i + 3) % 500 + 1 for i in range(30)]])
    with torch.no_grad():
        a, b = packed(ids).logits, plain(ids).logits
    assert (a - b).abs().max() < 0.05 * b.abs().max()


def _float_copy(lin: Any) -> nn.Linear:
    out = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None)
    out.weight.data = lin.dequantized()
    if lin.bias is not None:
        out.bias.data = lin.bias.data.clone()
    return out


# ---- Q4_0 at its own bits: q40 (`Int4Q0Linear`) ------------------------------------------------------------------
def _q40_file(rows: int, k: int, seed: int) -> tuple[np.ndarray, Int4Q0Linear]:
    raw = _file_blocks(T.Q4_0, rows=rows, k=k, seed=seed)
    p = gguf_blocks.unpack(T.Q4_0, raw)
    return raw, Int4Q0Linear.from_values(torch.from_numpy(p.q), torch.from_numpy(p.d))


def _weights_and_rows_are(lin: nn.Module, want: torch.Tensor) -> None:
    """A [48, 768] linear's weight and its rows (any shape of ids, one id, none, one out of range) are `want`'s bits."""
    assert torch.equal(bits(lin.dequantized()), bits(want))
    ids = torch.tensor([[0, 47, 5], [16, 16, 31]])
    assert torch.equal(bits(lin.rows(ids)), bits(want[ids]))
    assert lin.rows(torch.tensor(7)).shape == (768,) and lin.rows(torch.tensor([], dtype=torch.long)).shape == (0, 768)
    with pytest.raises(IndexError):
        lin.rows(torch.tensor([48]))


def test_q40_rows_and_dequantized_are_gguf_dequantize_bit_for_bit():
    raw, lin = _q40_file(48, 768, seed=11)
    want = torch.from_numpy(dequantize(raw, T.Q4_0))
    assert lin.layout == "q40" and lin.qw.shape == (3, 24, 4, 16, 4) and lin.sw.shape == (3, 24, 16)
    assert lin.qw.nbytes + lin.sw.nbytes == raw.nbytes  # the file's size: 18 bytes a block
    np.testing.assert_array_equal(native.q40_gguf_bytes(lin.qw, lin.sw), raw)  # and its very bits
    _weights_and_rows_are(lin, want)


def test_q40_kernels_compute_with_the_files_weights_and_give_q4s_bits():
    """From real blocks: the kernel is its integer model over gguf-py's weights (fp64), SIMD and reference alike, and
    bit for bit what the q4 layout (m = -8·d stored) computed for the same tensor."""
    raw, lin = _q40_file(32, 512, seed=7)
    p = gguf_blocks.unpack(T.Q4_0, raw)
    old = int4.Int4Linear.from_values(torch.from_numpy(p.q), torch.from_numpy(p.d), torch.from_numpy(p.m),
                                      kernels="native")
    assert (old.qw.nbytes + old.sw.nbytes) * 18 == (lin.qw.nbytes + lin.sw.nbytes) * 20
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(3))
    xq, dx, _ = native.quantize_activations(x)
    w = torch.from_numpy(dequantize(raw, T.Q4_0)).double().reshape(32, 16, 32)
    ref = torch.einsum("mbi,nbi,mb->mn", xq.double().reshape(3, 16, 32), w, dx.double())
    outs = []
    for variant in [v for v in (*SIMD, "ref") if not native.unsupported(v)]:
        with on(variant):
            outs.append(lin(x))
            assert torch.equal(bits(outs[-1]), bits(old(x))) and torch.equal(bits(lin(x[:1])), bits(old(x[:1])))
        torch.testing.assert_close(outs[-1].double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    assert all(torch.equal(bits(o), bits(outs[-1])) for o in outs)


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_q40_linears_are_linears(kernels):
    q, d = q40_case(64, 96, seed=5)
    bias = torch.randn(64)
    lin = Int4Q0Linear.from_values(q, d, bias=bias, kernels=kernels)
    assert lin.bias.dtype == torch.float32 and not lin.bias.requires_grad
    x = torch.randn(2, 3, 96)
    y = lin(x)
    exact = x.double() @ (d.double().repeat_interleave(32, 1) * (q.double() - 8)).T + bias.double()
    assert y.shape == (2, 3, 64) and (y.double() - exact).abs().max() < (0.03 if kernels == "native" else 1e-5) * \
        exact.abs().max()
    assert lin(x.to(torch.bfloat16)).dtype == torch.bfloat16
    state = Int4Q0Linear(96, 64, bias=True, kernels=kernels)
    state.load_state_dict(lin.state_dict())  # the buffers are the whole weight
    assert torch.equal(state(x), y)
    with pytest.raises(ValueError, match="% 32"):
        Int4Q0Linear(80, 64)


@pytest.mark.parametrize("bias", [False, True])
def test_the_packed_cache_can_rebuild_q40(bias):
    lin = Int4Q0Linear.from_values(*q40_case(32, 256, seed=2), bias=torch.randn(32) if bias else None)
    assert gguf_packed.VERSION >= 2  # v1 held Q4_0 as q4
    _rebuilt_by_the_packed_cache(lin, bias)


def q40_values(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's Q4_0 of a float weight [N, K]: per 32, d = (the value of largest magnitude) / -8 (fp16), q = round(w/d
    + 8) in 0..15. Returns q uint8 [N, K], d [N, K/32]."""
    n, k = w.shape
    wg = w.detach().float().reshape(n, k // 32, 32)
    at = wg.abs().argmax(-1, keepdim=True)
    d = (wg.gather(-1, at) / -8).squeeze(-1).half().float()  # [N, K/32]
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.clamp(torch.floor(wg * inv[..., None] + 8.5), 0, 15)
    return q.to(torch.uint8).reshape(n, k), d


def to_q40(lin: nn.Linear) -> Int4Q0Linear:
    return Int4Q0Linear.from_values(*q40_values(lin.weight), bias=lin.bias)


def _as_q4(lin: nn.Linear) -> int4.Int4Linear:
    """The same Q4_0 values as the q4 layout held them before q40 (m = -8·d)."""
    q, d = q40_values(lin.weight)
    return int4.Int4Linear.from_values(q, d, -8 * d, lin.bias, kernels="native")


@pytest.mark.usefixtures("best_kernels")
@pytest.mark.parametrize("kind,kw", [("llama", {}), ("phi3", {"partial_rotary_factor": 0.5}), ("qwen2", {})])
def test_a_q4_0_model_on_q40_gives_the_bits_it_gave_on_q4(kind, kw):
    """The native decode step and prefill (lin_type SC_LIN_Q40; Phi-3's fused projections as row-group views of
    q40 buffers; Qwen2's biases) on q40 linears: logits and caches bit for bit those of the same model with its Q4_0
    linears held as q4, as every Q4_0 file loaded before; and within the usual bounds of transformers' forward."""
    from test_native_archs import build, compare, engines, pack

    new = pack(build(kind, **K_SHAPE, **kw), lambda i, n, lin: to_q40(lin))
    old = pack(build(kind, **K_SHAPE, **kw), lambda i, n, lin: _as_q4(lin))
    assert {m.layout for m in new.modules() if hasattr(m, "layout")} == {"q40"}
    assert {m.layout for m in old.modules() if hasattr(m, "layout")} == {"q4"}
    ids = [(37 * i + 3) % 500 + 1 for i in range(60)]
    runs = []
    for model in (new, old):
        _, fast = engines(model, "float32")
        assert fast.step.prefill is not None  # the chunk goes through C's prefill
        list(fast.feed_ids(ids[:40]))  # a prefill of 40 rows
        logits = [fast.last_logits.clone()]
        for t in ids[40:]:  # then decode steps
            list(fast.feed_ids([t]))
            logits.append(fast.last_logits.clone())
        runs.append((torch.stack(logits), [(la.keys.clone(), la.values.clone()) for la in fast.cache.layers]))
    assert torch.equal(bits(runs[0][0]), bits(runs[1][0])) and runs[0][0].abs().max() > 0.1
    assert all(torch.equal(bits(a[0]), bits(b[0])) and torch.equal(bits(a[1]), bits(b[1]))
               for a, b in zip(runs[0][1], runs[1][1]))
    compare(new)
