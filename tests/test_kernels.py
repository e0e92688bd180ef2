"""The kernels' C boundary, their work buffers, the choice of variant, and each SIMD variant held to the scalar
reference.

- Each library builds wherever it can run: a failed build is a failure here, not a skip (only a missing compiler,
  or a CPU without the variant's instructions, skips). It passes the handshake; a library with another ABI,
  a drifted signature or a drifted Model struct is refused, and the product then falls back to torch.
- The variant: "auto" takes the best one the CPU has (avx2 on a CPU without AVX-512 or AVX-VNNI); SINKCHAT_KERNELS
  naming one the CPU lacks is one ConfigError line, and its library is never loaded (no SIGILL).
- Work buffers are the caller's: the C side refuses one below its stated size, at any alignment accepts one of that
  size, and allocates its own only when given none; the binding keeps one per thread and reuses it.
- Every SIMD variant (avx512, avxvnni, avx2; where the CPU lacks AVX-VNNI but has AVX-512 VNNI, the avxvnni code
  through avxvnni_evex, the same sources with vpdpbusd's EVEX encoding) against reference (csrc/ref.c), on the same
  inputs: bit-exact for the activation quantizer, the 4-bit
  matmul (one-row and prefill paths), the 8-bit table and the eviction (re-rotation, bf16 rounding), where both do
  the same integer and float operations in the same order. Attention and the whole decode step agree to float
  rounding only (the SIMD attention sums in another order and uses its own exp; see the tolerances below).
"""

from __future__ import annotations

import ctypes
import re
import threading
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from kernel_helpers import SIMD, bits, check_work_buffer, lib as _lib, on, simd  # noqa: F401  (simd: the fixture)
from kernel_helpers import q4_case as _q4_case, q40_case
from test_neon import neon  # noqa: F401  (the fixture: the neon library under qemu-aarch64, or a skip)
from sinkchat.kernels import abi, native, variants

I, P = ctypes.c_int, ctypes.c_void_p


@pytest.fixture
def both(simd: str) -> tuple[Any, Any]:
    return _lib(simd), _lib("ref")


# ---- build and handshake ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", [*native.VARIANTS, *abi.TEST_VARIANTS])
def test_each_library_builds_where_it_can_run_and_passes_the_handshake(variant):
    lib = _lib(variant)
    assert lib.sc_abi() == abi.ABI and lib.sc_variant() == abi.VARIANT_ID[variant]
    assert set(lib.sc_signature(None).decode().split()) == set(abi.API)
    with on(variant):
        assert native.available(), native.why_unavailable()


def test_the_256_bit_builds_compile_here_and_hold_no_avx512():
    """Where the CPU lacks a variant its tests skip, but its library must still compile (avxvnni on this Zen 5: the
    real -mavxvnni build, whose code runs in the tests as avxvnni_evex). The 256-bit libraries must carry no AVX-512
    instruction (no zmm register, no EVEX-only opmask): they are what runs where AVX-512 is missing."""
    import shutil
    import subprocess

    from sinkchat.config import cache_dir

    if variants.machine() != "x86_64" or variants.compiler() is None:
        pytest.skip("x86-64 builds, with a C compiler")
    for v in ("avxvnni", "avx2"):
        if not variants._accepts(v):
            continue
        so = abi.library_path(cache_dir(), v, variants.cpu())  # where native builds it: compiled once, kept
        assert so.exists() or abi.build(variants.compiler(), v, so) is None
        if shutil.which("objdump"):
            dis = subprocess.run(["objdump", "-d", str(so)], capture_output=True, text=True, check=True).stdout
            assert "vpmaddubsw" in dis or "vpdpbusd" in dis
            assert not re.search(r"%zmm|%k[1-7]\b|\{evex\}", dis), v


def test_the_default_is_the_best_variant_the_cpu_has(monkeypatch):
    lib = _lib(native.best())
    with on(None):
        monkeypatch.delenv("SINKCHAT_KERNELS", raising=False)
        assert native.library() is lib
        flags, model = variants.cpu()
        avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
        expect = "avx512" if avx512 <= flags else "avxvnni" if "avx_vnni" in flags else "avx2"
        assert native.best() == expect
        base = flags - avx512 - {"avx_vnni"} | {"avx2", "fma", "f16c"}
        vnni = base | {"avx_vnni"}
        for cpu, picked in [(vnni | avx512, "avx512"), (vnni, "avxvnni"), (base, "avx2"),
                            (base | {"avx512f", "avx512_vnni"}, "avx2"), (base - {"fma"}, "avx2")]:
            monkeypatch.setattr(variants, "cpu", lambda cpu=cpu: (frozenset(cpu), model))
            assert native.best() == native.variant() == picked, cpu - base
        assert native.unsupported("avx2") == "the CPU lacks fma"  # the last case: no SIMD variant runs
        monkeypatch.setattr(variants, "cpu", lambda: (frozenset(vnni), model))
        monkeypatch.setattr(variants, "_accepts", lambda v: v != "avxvnni")  # an older gcc: no -mavxvnni
        assert native.best() == "avx2"
        assert "does not take -mavx2 -mfma -mf16c -mavxvnni" in native.unsupported("avxvnni")


def test_a_cpu_without_avx512_runs_the_avx2_library(monkeypatch):
    """The product on a CPU without AVX-512 or AVX-VNNI (simulated: its flags taken out of /proc/cpuinfo's): auto
    picks avx2 and the kernels run on the avx2 library; asking for avx512 there is one ConfigError line, and its
    library is never loaded."""
    from sinkchat.config import ConfigError

    _lib("avx2")
    flags, model = variants.cpu()
    no512 = frozenset(f for f in flags if not f.startswith("avx512") and f != "avx_vnni")
    monkeypatch.setattr(variants, "cpu", lambda: (no512, model))
    loads: list[str] = []
    real_load = native._load
    monkeypatch.setattr(native, "_load", lambda which: (loads.append(which), real_load(which))[1])
    monkeypatch.delenv("SINKCHAT_KERNELS", raising=False)
    with on(None):
        assert native.variant() == "avx2" and native.available()
        assert native.library().sc_variant() == abi.VARIANT_ID["avx2"]
        qw, sw = _q4_case(32, 64)
        native.q4_matmul(torch.randn(1, 64), qw, sw, None)
        assert set(loads) == {"avx2"}
        for name in ("avx512", "avxvnni"):
            monkeypatch.setenv("SINKCHAT_KERNELS", name)
            with pytest.raises(ConfigError) as e:
                native.available()
            msg = str(e.value)
            assert msg.startswith(f"SINKCHAT_KERNELS={name}: the CPU lacks ") and "\n" not in msg
            assert "this machine runs: avx2, ref" in msg
        assert set(loads) == {"avx2"}
        monkeypatch.setenv("SINKCHAT_KERNELS", "avx2")
        assert native.available() and native.variant() == "avx2"
        monkeypatch.setenv("SINKCHAT_KERNELS", "sse2")
        with pytest.raises(ConfigError, match="must be auto, torch, avx512, avxvnni, avx2, neon, ref"):
            native.variant()


def _refusal(path: Path) -> str:
    with pytest.raises(abi.NativeABIError) as e:
        abi.open_library(path, "ref")
    return str(e.value)


def test_a_mismatched_library_is_refused(monkeypatch):
    _lib("ref")
    from sinkchat.config import cache_dir

    path = abi.library_path(cache_dir(), "ref", variants.cpu())
    real = abi.ABI
    with monkeypatch.context() as m:
        m.setattr(abi, "ABI", real + 1)
        assert f"speaks ABI {real}, this binding {real + 1}" in _refusal(path)
    with monkeypatch.context() as m:  # an int where C takes a size_t
        m.setitem(abi.API, "q4_matmul", (I, [P, I, I, I, P, P, P, P, P, I]))
        assert "q4_matmul is i(piiipppppz) in C, declared i(piiipppppi) here" in _refusal(path)
    with monkeypatch.context() as m:  # a field gone from the Python struct
        m.setattr(abi, "StepModel", type("Short", (ctypes.Structure,), {"_fields_": abi.StepModel._fields_[:-1]}))
        assert "sizeof(Model)" in _refusal(path)
    with monkeypatch.context() as m:  # two fields swapped: same size, other offsets
        f = list(abi.StepModel._fields_)
        f[8], f[9] = f[9], f[8]
        m.setattr(abi, "StepModel", type("Swapped", (ctypes.Structure,), {"_fields_": f}))
        assert "Model.scaling at offset 36 in C, 32 here" in _refusal(path)
    with monkeypatch.context() as m:  # a function C exports that the binding does not declare
        m.delitem(abi.API, "sc_attend")
        assert "exports" in _refusal(path)


def test_a_refused_library_makes_the_product_fall_back_to_torch(monkeypatch):
    _lib("ref")
    try:
        with monkeypatch.context() as m, on("ref"):
            m.setattr(abi, "ABI", abi.ABI + 1)
            native._load.cache_clear()
            assert not native.available()
            assert "refused" in native.why_unavailable() and "stale or foreign" in native.why_unavailable()
            assert native.resolve("auto") == "torch"
    finally:
        native._load.cache_clear()
    with on("ref"):
        assert native.available()


def test_a_file_without_the_handshake_is_not_loaded(tmp_path):
    _lib("ref")
    import subprocess

    src = tmp_path / "old.c"
    src.write_text("int q4_matmul(void) { return 0; }\n")  # a pre-handshake build: kernels, no sc_abi
    so = tmp_path / "old.so"
    subprocess.run([variants.compiler(), "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    with pytest.raises(AttributeError, match="sc_abi"):
        abi.open_library(so, "ref")


# ---- work buffers ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", native.VARIANTS)
@pytest.mark.parametrize("m", [1, 5])
def test_the_c_side_checks_the_work_buffer_and_allocates_only_without_one(variant, m):
    library = _lib(variant)
    n, k = 48, 96
    x = torch.randn(m, k)
    check_work_buffer(library, "q4", x, n, *_q4_case(n, k), least=m * k)  # the int8 activations at least
    hw, ws, y = native.pack_q8(torch.randint(-127, 128, (32, k), dtype=torch.int8)), torch.rand(32), torch.empty(m, 32)
    buf = torch.empty(library.sc_q8_work(m, k, 1), dtype=torch.uint8)
    assert library.q8_matmul(x.data_ptr(), m, k, 32, hw.data_ptr(), ws.data_ptr(), y.data_ptr(), buf.data_ptr(),
                             buf.numel() - 1) == -2


def test_no_kernel_allocates_but_where_it_was_given_no_buffer():
    """Only kernels.h's sc_work_open (work NULL: a C caller without a buffer) calls malloc."""
    src = {p.name: p.read_text() for p in abi.CSRC.iterdir() if p.suffix in (".c", ".h")}
    calls = {name: len(re.findall(r"\b(?:malloc|calloc|realloc|aligned_alloc)\(", text)) for name, text in src.items()}
    assert calls == {name: int(name == "kernels.h") for name in src}


def test_the_binding_reuses_one_work_buffer_per_thread():
    _lib("ref")
    qw, sw = _q4_case(16, 64)
    with on("ref"):
        native.q4_matmul(torch.randn(1, 64), qw, sw, None)
        first = native._WORK.buf
        native.q4_matmul(torch.randn(3, 64), qw, sw, None)
        assert native._WORK.buf is first  # reused, not reallocated
        big = native.work_buffer(first.numel() + 1)
        assert native._WORK.buf.numel() == 2 * first.numel() and big[1] == 2 * first.numel()  # grown: next power of 2
        theirs: list[int] = []
        t = threading.Thread(target=lambda: theirs.append(native.work_buffer(16)[0]))
        t.start()
        t.join()
        assert theirs and theirs[0] != native.work_buffer(16)[0]  # another thread, another buffer


# ---- SIMD against reference, bit-exact -------------------------------------------------------------------------
def test_the_activation_quantizer_is_bit_exact(simd):
    torch.manual_seed(0)
    x = torch.randn(7, 128)
    x[0, 3] = 40.0  # an outlier block
    x[1, :32] = 0.0  # an all-zero block: scale 0
    x[2, :32] = torch.arange(32) - 15.5  # amax 16.5: many values land on .5 after scaling (ties to even)
    x[3, 32:64] = torch.tensor([127.0] + [k + 0.5 for k in range(-16, 15)])  # scale exactly 1: exact ties
    x[4] *= 1e-30  # tiny scales
    a = native.quantize_activations(x, simd)
    b = native.quantize_activations(x, "ref")
    for u, v in zip(a, b):
        assert torch.equal(bits(u), bits(v))
    assert a[0][3, 33:63].tolist() == [round(k + 0.5) for k in range(-16, 14)]  # Python's round: to even too


# (N, K, M): one row (decode) and the prefill path, M > 256 crossing its row passes
@pytest.mark.parametrize("n,k,m", [(16, 32, 1), (48, 96, 1), (192, 576, 1), (48, 96, 5), (32, 64, 300)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout", ["q4", "q40"])
def test_q4_matmul_is_bit_exact(simd, layout, n, k, m, bias):
    """q4, and Q4_0 at its own bits (q40: d alone, m = -8·d formed in the kernel): SIMD == reference, both paths."""
    if layout == "q4":
        qw, sw = _q4_case(n, k, seed=n + k)
    else:
        qw, sw = native.pack_q40(*q40_case(n, k, seed=n + k))
    matmul = getattr(native, f"{layout}_matmul")
    x = torch.randn(m, k)
    x[:, 5] = 30.0
    b = torch.randn(n) if bias else None
    with on(simd):
        y_simd = matmul(x, qw, sw, b)
    with on("ref"):
        y_ref = matmul(x, qw, sw, b)
    assert torch.isfinite(y_ref).all() and y_ref.abs().max() > 0
    assert torch.equal(bits(y_simd), bits(y_ref))


@pytest.mark.parametrize("variant", native.VARIANTS)
@pytest.mark.parametrize("m", [1, 5, 300])
def test_q40_gives_the_bits_q4_gave_for_the_same_tensor(variant, m):
    """A Q4_0 tensor was held as q4 with m = -8·d (fp16, exact); q40 holds d alone and forms -8·d in fp32: every
    output the same bits as before, on every variant, decode and prefill. The nibble blocks are the same bytes."""
    _lib(variant)
    q, d = q40_case(64, 256, seed=m)
    qw, sw = native.pack_q40(q, d)
    qw4, sw4 = native.pack_q4_dm(q, d, -8 * d)
    assert torch.equal(qw, qw4) and torch.equal(sw4[:, :, 1], (-8 * sw4[:, :, 0].float()).half())
    assert qw.numel() + sw.numel() * 2 == 64 * 256 // 32 * 18  # Q4_0's 18 bytes a block (q4: 20)
    assert qw4.numel() + sw4.numel() * 2 == 64 * 256 // 32 * 20
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
    b = torch.randn(64)
    with on(variant):
        assert torch.equal(bits(native.q40_matmul(x, qw, sw, b)), bits(native.q4_matmul(x, qw4, sw4, b)))
        assert torch.equal(bits(native.q40_matmul(x, qw, sw, None)), bits(native.q4_matmul(x, qw4, sw4, None)))


@pytest.mark.parametrize("variant", native.VARIANTS)
@pytest.mark.parametrize("m", [1, 5])
def test_q40_work_buffers_are_checked(variant, m):
    library = _lib(variant)
    x = torch.randn(m, 96)
    check_work_buffer(library, "q40", x, 48, *native.pack_q40(*q40_case(48, 96)), least=m * 96)


def test_q40_packing_refuses_what_the_kernels_cannot_take():
    q, d = q40_case(32, 64)
    with pytest.raises(ValueError, match="outside 0..15"):
        native.pack_q40(q.int() + 1, d)
    with pytest.raises(ValueError):
        native.pack_q40(q[:20], d[:20])
    qw, sw = native.pack_q40(q, d)
    with pytest.raises(ValueError, match="q40 scales"):
        native.q40_matmul(torch.randn(1, 64), qw, sw.float(), None)


@pytest.mark.parametrize("variant", native.VARIANTS)
def test_no_rows_in_no_rows_out(variant):
    _lib(variant)
    qw, sw = _q4_case(16, 64)
    with on(variant):
        assert native.q4_matmul(torch.empty(0, 64), qw, sw, torch.zeros(16)).shape == (0, 16)
        assert native.q8_matmul(torch.empty(0, 64), native.pack_q8(torch.zeros(16, 64, dtype=torch.int8)),
                                torch.ones(16)).shape == (0, 16)


@pytest.mark.parametrize("m", [1, 3])
def test_q8_matmul_is_bit_exact(simd, m):
    torch.manual_seed(1)
    hw = native.pack_q8(torch.randint(-127, 128, (1000, 96), dtype=torch.int8))  # pads to 1008 rows
    scale = torch.rand(hw.shape[0] * native.RG)
    x = torch.randn(m, 96)
    with on(simd):
        y_simd = native.q8_matmul(x, hw, scale)
    with on("ref"):
        y_ref = native.q8_matmul(x, hw, scale)
    assert torch.equal(bits(y_simd), bits(y_ref))


@pytest.mark.parametrize("layout", ["table", "q8g", "q8k"])
@pytest.mark.parametrize("m", [1, 4])
def test_8bit_weights_at_the_extremes_are_exact(simd, layout, m):
    """The avx2 variant's trap: vpmaddubsw adds two byte products into an int16 with saturation, and 8-bit weights
    stored q + 128 (0..255) times int8 activations of +-127 reach 2 x 255 x 127 = 64770. Here every block is
    at the extremes (q = 127 / -128 rows, activations whole blocks of +-127, alternating and not), where a
    saturating dot is off by thousands; the reference's plain integer sums are the truth."""
    from test_qk import _matmul as k_matmul

    n, k = 64, 256
    q = torch.full((n, k), 127, dtype=torch.int8)
    q[16:32] = -128
    q[32:48, ::2] = -128  # alternating -128, 127 along K
    q[48:] = torch.randint(-128, 128, (16, k), generator=torch.Generator().manual_seed(5), dtype=torch.int8)
    x = torch.ones(m, k)
    x[0, 32:64] = -1.0
    x[0, 64:128:2] = -1.0
    x[-1, ::3] = -2.0  # all -127 where 2, -64 where 1 (scale 2/127)
    ones = torch.ones(n, k // 16)
    if layout == "table":
        run = partial(native.q8_matmul, x, native.pack_q8(q), torch.rand(n) + 0.5)
    elif layout == "q8g":
        run = partial(native.q8g_matmul, x, *native.pack_q8g(q, ones * 0.5, ones * 0.25), None)
    else:
        d = torch.full((n, k // 256), 0.5)
        sc = torch.full((n, k // 16), 127, dtype=torch.int8)
        run = partial(k_matmul, "q8k", x, *native.pack_q8k(q, d, d, sc, sc.view(torch.uint8)), None)
    with on(simd):
        y = run()
    with on("ref"):
        y_ref = run()
    assert torch.isfinite(y_ref).all() and y_ref.abs().max() > 1000
    assert torch.equal(bits(y), bits(y_ref))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot,head_dim", [(64, 64), (32, 48), (16, 16), (24, 32)])  # SIMD loop; partial; scalar tails
@pytest.mark.parametrize("rerotate", [True, False])
def test_the_eviction_is_bit_exact(simd, dtype, rot, head_dim, rerotate):
    torch.manual_seed(2)
    keys = torch.randn(1, 3, 64, head_dim).to(dtype)
    values = torch.randn(1, 3, 64, head_dim).to(dtype)
    keys[0, 1, 30, 0] = float("nan")  # NaN stays NaN, quietly, in both
    ang = 9 * (1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot)))
    cs = torch.cat([torch.cos(ang), torch.cos(ang)]) if rerotate else None
    sn = torch.cat([-torch.sin(ang), -torch.sin(ang)]) if rerotate else None
    out = []
    for variant in (simd, "ref"):
        k, v = keys.clone(), values.clone()
        with on(variant):
            assert native.kv_evict(k, v, 4, 9, 40, None if cs is None else (cs, sn))
        out.append((k, v))
    for a, b in zip(out[0], out[1]):
        assert torch.equal(bits(a), bits(b))
    assert not torch.equal(out[0][0], keys)


# ---- SIMD against reference, to float rounding -------------------------------------------------------------------
def _attend(lib: Any, m: abi.StepModel, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out, gauge = torch.empty(m.n_heads * m.head_dim), torch.empty(2)
    scores = torch.empty(m.n_heads * (pos + 1))
    assert lib.sc_attend(ctypes.byref(m), q.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.shape[2], pos, 4,
                         out.data_ptr(), gauge.data_ptr(), scores.data_ptr()) == 0
    return out, scores, gauge


@pytest.mark.parametrize("head_dim", [16, 48, 64, 128])  # generic loops (16, 48), unrolled (64, 128)
@pytest.mark.parametrize("pos", [0, 14, 15, 16, 39, 299])  # 1..300 slots: the 16-slot blocks and their tails
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_agrees_to_float_rounding(both, head_dim, pos, dtype):
    """Scores are D-term dot products summed in another order (SIMD: 16 lanes, then a transposing add tree;
    reference: in order), the exponential is a polynomial against expf (~1 ulp), and the outputs sum n products:
    each an error of a few ulp of the terms' magnitudes. With values ~N(0, 1) and scores ~N(0, 1), 4e-6 absolute
    (~32 ulp at 1) holds them with margin (seen: <= 8e-7, up to 1000 slots); a wrong lane, slot, head or mask is
    O(0.1)."""
    lib, ref = both
    torch.manual_seed(pos + head_dim)
    m = abi.StepModel(n_heads=6, n_kv=2, head_dim=head_dim, kv_bf16=int(dtype == torch.bfloat16),
                      scaling=head_dim**-0.5)
    cap = 320
    q = torch.randn(6 * head_dim)
    keys, values = torch.randn(1, 2, cap, head_dim).to(dtype), torch.randn(1, 2, cap, head_dim).to(dtype)
    keys[..., pos + 1 :, :] = float("nan")  # slots past pos must not be read
    a, b = _attend(lib, m, q, keys, values, pos), _attend(ref, m, q, keys, values, pos)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=4e-6)
    k, v = (t[0, :, : pos + 1].float().repeat_interleave(3, 0) for t in (keys, values))  # [H, n, D]
    ref_out = torch.softmax((q.view(6, 1, head_dim) * k).sum(-1) * head_dim**-0.5, -1)[:, None] @ v
    torch.testing.assert_close(b[0].view(6, head_dim), ref_out.squeeze(1), rtol=0, atol=2e-5)  # and it is attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_simd_attention_has_the_avx512_bits(simd, dtype):
    """The 256-bit variants do the avx512 variant's attention lane for lane (csrc/attend256.c: each 16-lane
    register a pair, its add tree included), so scores, probabilities, outputs and gauge are bit-identical: at the
    generic head dims (16, 48) and the unrolled ones (64, 128), over 16-slot blocks and their tails."""
    if simd == "avx512":
        pytest.skip("the reference point")
    wide = _lib("avx512")
    for head_dim in (16, 48, 64, 128):
        m = abi.StepModel(n_heads=4, n_kv=2, head_dim=head_dim, kv_bf16=int(dtype == torch.bfloat16),
                          scaling=head_dim**-0.5)
        torch.manual_seed(head_dim)
        q = torch.randn(4 * head_dim) * 3
        keys, values = torch.randn(1, 2, 80, head_dim).to(dtype), torch.randn(1, 2, 80, head_dim).to(dtype)
        for pos in (0, 15, 16, 37, 79):
            a, b = _attend(_lib(simd), m, q, keys, values, pos), _attend(wide, m, q, keys, values, pos)
            for x, y in zip(a, b):
                assert torch.equal(bits(x), bits(y)), (head_dim, pos)


def test_every_simd_decode_step_has_the_avx512_bits(simd):
    """With the matmuls bit-exact to ref.c and the attention to avx512's, the whole step is bit-identical across the
    SIMD variants: 40 free-running tokens of a model with all four layouts, Qwen3's q/k norms, a bf16 cache."""
    from sinkchat.decode import select
    from test_native_archs import build, pack
    from test_qk import K_SHAPE, _four

    if simd == "avx512":
        pytest.skip("the reference point")
    _lib("avx512")
    model = pack(build("qwen3", **K_SHAPE), _four)
    runs = []
    for variant in (simd, "avx512"):
        with on(variant):
            step = select(model, "native")
            keys = [torch.zeros(1, 2, 48, 64, dtype=torch.bfloat16) for _ in range(3)]
            values = [torch.zeros(1, 2, 48, 64, dtype=torch.bfloat16) for _ in range(3)]
            runs.append(([step((37 * t + 3) % 500 + 1, t, keys, values) for t in range(40)], keys + values))
    (a, ca), (b, cb) = runs
    for t, (oa, ob) in enumerate(zip(a, b)):
        for name, x, y in zip(("logits", "queries", "gauge"), oa, ob):
            assert torch.equal(bits(x), bits(y)), (t, name)
    assert all(torch.equal(bits(x), bits(y)) for x, y in zip(ca, cb))


@pytest.mark.parametrize("kind,tied", [("llama", True), ("qwen2", False)])
@pytest.mark.parametrize("kv", [torch.float32, torch.bfloat16])
def test_the_decode_step_agrees_to_float_rounding(simd, kind, tied, kv):
    """The step's matmuls, rotations and stores are bit-exact (above); only attention differs, by float rounding.
    That difference reaches the next layer's int8 rounding, where a value on a tie can round the other way (one
    step, ~1/127 of its block's largest value) and stay in the cache. Seen: <= 4e-7 on logits, queries, gauge and
    cache, but for one flip of 1.2e-3 on the untied qwen2's fp32 logits; 5e-3 leaves room for such flips. A wrong
    slot, position or mask is O(0.1)."""
    from fakes import tiny_model
    from sinkchat.decode import select
    from sinkchat.model import int4

    model = tiny_model(kind, tie_word_embeddings=tied, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                       intermediate_size=160)  # head dim 64: the unrolled attention
    int4.quantize_model(model.model.layers, kernels="native")
    if tied:
        assert int4.quantize_tied_table(model, "native")
    runs = []
    for variant in (simd, "ref"):
        with on(variant):
            step = select(model, "native")
            assert type(step).__name__ == "NativeStep"
            keys = [torch.zeros(1, 1, 48, 64, dtype=kv) for _ in range(2)]
            values = [torch.zeros(1, 1, 48, 64, dtype=kv) for _ in range(2)]
            outs = [step((7 * t + 3) % 120 + 1, t, keys, values) for t in range(40)]
        runs.append((outs, keys, values))
    (a, ka, va), (b, kb, vb) = runs
    for oa, ob in zip(a, b):
        for x, y in zip(oa, ob):  # logits, queries, gauge
            torch.testing.assert_close(x, y, rtol=0, atol=5e-3)
    for x, y in zip(ka + va, kb + vb):
        torch.testing.assert_close(x.float(), y.float(), rtol=2**-7 if kv == torch.bfloat16 else 0, atol=5e-3)


@pytest.mark.parametrize("kind,kw", [("qwen3", {}), ("phi3", {"partial_rotary_factor": 0.5})])
def test_the_decode_step_with_q8g_qk_norms_and_partial_rotary_agrees_to_float_rounding(simd, kind, kw):
    """The same for what ABI 3 added to the step: q4 and q8g linears mixed in a layer, Qwen3's q/k norms, Phi-3's
    fused projections (row-group views) and partial rotary. Same bounds as above (the q8g matmul is bit-exact too)."""
    from sinkchat.decode import select
    from test_native_archs import build, mixed, pack

    model = pack(build(kind, **kw), mixed)
    runs = []
    for variant in (simd, "ref"):
        with on(variant):
            step = select(model, "native")
            assert type(step).__name__ == "NativeStep"
            keys = [torch.zeros(1, 2, 48, 32) for _ in range(3)]
            values = [torch.zeros(1, 2, 48, 32) for _ in range(3)]
            outs = [step((37 * t + 3) % 500 + 1, t, keys, values) for t in range(40)]
        runs.append((outs, keys, values))
    (a, ka, va), (b, kb, vb) = runs
    for oa, ob in zip(a, b):
        for x, y in zip(oa, ob):  # logits, queries, gauge
            torch.testing.assert_close(x, y, rtol=0, atol=5e-3)
    for x, y in zip(ka + va, kb + vb):
        torch.testing.assert_close(x, y, rtol=0, atol=5e-3)


@pytest.mark.parametrize("kind,kw", [("llama", {}), ("phi3", {"partial_rotary_factor": 0.5})])
def test_the_decode_step_with_k_quant_linears_agrees_to_float_rounding(simd, kind, kw):
    """The same for ABI 4's lin_types: q4, q4k, q8g and q8k linears (Q6_K- and Q5_K-style) in one model, Phi-3's fused
    ones as row-group views of q4k / q8k buffers (the q4k / q8k matmuls are bit-exact: tests/test_qk.py). At hidden
    256 (K % 256 == 0) and head dim 64 the int8 rounding flips that attention's float rounding can cause are more
    frequent and larger than above (free-running, seen on Phi-3: a flip every ~5 steps after step 15, up to 2.3e-2 on
    queries and cached keys, 4e-3 on logits). So the two variants run in lockstep (the reference's cache reset to the
    SIMD one's before each token, as test_native_archs.compare does): every older slot stays bit-identical, each step
    is within compare()'s flip bounds (seen: <= 6e-2, on queries), and nearly every step agrees to float rounding
    (seen: all but 2 of 40 within 2.2e-6 on llama, all but 1 on Phi-3)."""
    from sinkchat.decode import select
    from test_native_archs import build, pack
    from test_qk import K_SHAPE, _four

    model = pack(build(kind, **K_SHAPE, **kw), _four)
    with on(simd):
        step = select(model, "native")
    assert type(step).__name__ == "NativeStep" and sorted(set(step._types)) == [0, 1, 2, 3]
    caches = {v: ([torch.zeros(1, 2, 48, 64) for _ in range(3)], [torch.zeros(1, 2, 48, 64) for _ in range(3)])
              for v in (simd, "ref")}
    close = 0
    for t in range(40):
        for a, b in zip(caches[simd][0] + caches[simd][1], caches["ref"][0] + caches["ref"][1]):
            b.copy_(a)
        outs = {}
        for variant in (simd, "ref"):
            with on(variant):
                outs[variant] = step((37 * t + 3) % 500 + 1, t, *caches[variant])
        diffs = [float((x - y).abs().max()) for x, y in zip(outs[simd], outs["ref"])]  # logits, queries, gauge
        assert diffs[0] < 4e-2 and diffs[1] < 0.2 and diffs[2] < 1e-2, (t, diffs)
        for x, y in zip(caches[simd][0] + caches[simd][1], caches["ref"][0] + caches["ref"][1]):
            assert torch.equal(x[:, :, :t], y[:, :, :t])
            torch.testing.assert_close(x[:, :, t], y[:, :, t], rtol=0, atol=0.2)
        close += max(diffs) < 1e-5
    assert close >= 0.9 * 40, close


@pytest.mark.slow
def test_q40_on_neon_is_the_references_bits(neon):
    """The neon q40 step (matmul_neon.c: q40_scales) under qemu-aarch64 (tests/test_neon.py's harness, which makes
    any exported call): the reference's bits and q4's, one row, a few, past the prefill passes, with and without
    bias, on 1 thread and 3."""
    from test_neon import Calls, _same

    calls = Calls()
    g = torch.Generator().manual_seed(4)
    for threads in (1, 3):
        calls.add("sc_set_threads", threads)
        calls.add("sc_set_grain", 0)
        for n, k, m in [(16, 32, 1), (48, 96, 1), (192, 576, 1), (48, 96, 5), (32, 64, 300)]:
            x = torch.randn(m, k, generator=g)
            x[:, 5] = 30.0
            q, d = q40_case(n, k, seed=n + k)
            for bias in (None, torch.randn(n, generator=g)):
                calls.add("q40_matmul", x, m, k, n, *native.pack_q40(q, d), bias, torch.empty(m, n), None, 0)
                calls.add("q4_matmul", x, m, k, n, *native.pack_q4_dm(q, d, -8 * d), bias, torch.empty(m, n), None, 0)
    got, want = neon(calls), calls.local("ref")
    is_mm = [i for i, (name, _) in enumerate(calls.calls) if name.endswith("matmul")]
    _same([got[i] for i in is_mm], [want[i] for i in is_mm], _sub(calls, is_mm))
    assert all(torch.equal(bits(got[i][1][-1]), bits(got[i + 1][1][-1])) for i in is_mm[::2])  # q40 == q4


def _sub(calls: Any, at: list[int]) -> Any:
    from test_neon import Calls

    c = Calls()
    c.calls = [calls.calls[i] for i in at]
    return c
