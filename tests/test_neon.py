"""The neon variant (csrc/matmul_neon.c, matmul_neon_k.c, rows_neon.h, attend_neon.c), cross-compiled for aarch64
and run under qemu-aarch64 against the x86 libraries in this process: slow (a minute of compiling and emulation),
and skipped only where the tools are absent (aarch64-linux-gnu-gcc with its libc headers, qemu-aarch64).

tests/neon_harness.c loads the neon library in the emulator and makes the very calls this test makes in-process on
the reference: the handshake (ABI, variant, every struct size and Model offset), the activation quantizer, the SiLU, every
matmul layout (one row, a few, past the prefill passes, with and without bias, the 8-bit extremes), the eviction,
and at 3 threads again. All bit-exact to ref.c; attention bit-exact to the avx512 variant (attend_neon.c does its
lanes and add tree in 128-bit registers) where this CPU has it, and within 4e-6 of ref.c in any case; the prefill's
attention tiles (hidden in the library: the harness links attend_neon.c itself) bit-identical to each query's own
attention.
"""

from __future__ import annotations

import ctypes
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from kernel_helpers import bits, k_case, k_pack, q4_case, q8g_case
from sinkchat.kernels import abi, native

pytestmark = pytest.mark.slow

GCC, SYSROOT = "aarch64-linux-gnu-gcc", Path("/usr/aarch64-linux-gnu")
QEMU = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")


def _tools() -> str | None:
    if not shutil.which(GCC):
        return f"no {GCC}"
    if not (SYSROOT / "include" / "stdio.h").is_file():
        return f"no aarch64 libc headers under {SYSROOT} (libc6-dev-arm64-cross)"
    if not QEMU:
        return "no qemu-aarch64 (qemu-user)"
    if native.unsupported("ref"):
        return f"the x86 reference: {native.unsupported('ref')}"
    return None


class Calls:
    """Calls to make on both sides: (name, args) with args ints, None or tensors (in/out buffers)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[Any]]] = []

    def add(self, name: str, *args: Any) -> int:
        self.calls.append((name, list(args)))
        return len(self.calls) - 1

    def encode(self) -> bytes:
        out = bytearray()
        for name, args in self.calls:
            out += struct.pack("<I", len(name)) + name.encode() + struct.pack("<I", len(args))
            for a in args:
                if a is None:
                    out += b"n"
                elif isinstance(a, (bytes, torch.Tensor)):
                    raw = a if isinstance(a, bytes) else a.contiguous().view(torch.uint8).numpy().tobytes()
                    out += b"b" + struct.pack("<Q", len(raw)) + raw
                else:
                    out += b"i" + struct.pack("<q", int(a))
        return bytes(out)

    def decode(self, raw: bytes) -> list[tuple[int, list[Any]]]:
        res, at = [], 0
        for name, args in self.calls:
            (rc,) = struct.unpack_from("<q", raw, at)
            at += 8
            if name in abi.API and abi.API[name][0] is abi.I or name in ("sc_abi", "sc_variant", "sc_threads"):
                rc = ctypes.c_int32(rc & 0xFFFFFFFF).value  # an int return: the low half of x0
            bufs = []
            for a in args:
                if isinstance(a, (bytes, torch.Tensor)):
                    n = len(a) if isinstance(a, bytes) else a.numel() * a.element_size()
                    chunk = raw[at : at + n]
                    at += n
                    bufs.append(chunk if isinstance(a, bytes) else
                                torch.frombuffer(bytearray(chunk), dtype=torch.uint8).view(a.dtype).view(a.shape))
            res.append((rc, bufs))
        assert at == len(raw)
        return res

    def local(self, variant: str) -> list[tuple[int, list[Any]]]:
        """The same calls on this process's `variant` library (buffers copied first)."""
        lib, res = native.library(variant), []
        for name, args in self.calls:
            copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            ptrs = [c.data_ptr() if isinstance(c, torch.Tensor) else c for c in copies]
            res.append((getattr(lib, name)(*ptrs), [c for c in copies if isinstance(c, torch.Tensor)]))
        return res


@pytest.fixture(scope="module")
def neon(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Runs a Calls on the neon library under qemu: (calls) -> decoded results."""
    reason = _tools()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("neon")
    lib = tmp / "sinkchat-neon.so"
    err = abi.build(GCC, "neon", lib)
    assert err is None, err
    harness = tmp / "harness"  # with attend_neon.c in it, built as the library builds it (its tiles are hidden there)
    flags = [f for f in abi.CFLAGS["neon"] if f != "-shared"]
    subprocess.run([GCC, *flags, "-I", str(abi.CSRC), "-o", str(harness), str(Path(__file__).parent / "neon_harness.c"),
                    str(abi.CSRC / "attend_neon.c"), "-ldl", "-lm"], check=True)

    def run(calls: Calls) -> list[tuple[int, list[Any]]]:
        (tmp / "in.bin").write_bytes(calls.encode())
        cmd = [QEMU, "-L", str(SYSROOT), str(harness), str(lib), str(tmp / "in.bin"), str(tmp / "out.bin")]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
        return calls.decode((tmp / "out.bin").read_bytes())

    return run


def _same(a: list[tuple[int, list[Any]]], b: list[tuple[int, list[Any]]], calls: Calls) -> None:
    for (name, _), (rc_a, bufs_a), (rc_b, bufs_b) in zip(calls.calls, a, b):
        assert rc_a == rc_b, name
        for x, y in zip(bufs_a, bufs_b):
            assert torch.equal(bits(x), bits(y)), name


def test_the_handshake(neon):
    calls = Calls()
    calls.add("sc_abi")
    calls.add("sc_variant")
    for name in abi.layouts():
        calls.add("sc_sizeof", name.encode() + b"\0")
    for field, _ in abi.StepModel._fields_:
        calls.add("sc_offsetof", field.encode() + b"\0")
    got = [rc for rc, _ in neon(calls)]
    offsets = [getattr(abi.StepModel, f).offset for f, _ in abi.StepModel._fields_]
    assert got == [abi.ABI, abi.VARIANT_ID["neon"], *abi.layouts().values(), *offsets]


def _matmul_calls(calls: Calls) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 128, generator=g)
    x[0, 3], x[1, :32], x[2, :32], x[4] = 40.0, 0.0, torch.arange(32) - 15.5, x[4] * 1e-30
    calls.add("sc_quant", x, 7, 128, torch.empty(7, 128, dtype=torch.int8), torch.empty(7, 4), torch.empty(7, 4))
    from test_silu import _gates

    gates = _gates()
    calls.add("sc_silu", gates, torch.linspace(-3, 3, gates.numel()), gates.numel())
    for n, k, m in [(16, 32, 1), (48, 96, 1), (192, 576, 1), (48, 96, 5), (32, 64, 300)]:
        x = torch.randn(m, k, generator=g)
        x[:, 5] = 30.0
        for bias in (None, torch.randn(n, generator=g)):
            qw, sw = q4_case(n, k, seed=n + k)
            calls.add("q4_matmul", x, m, k, n, qw, sw, bias, torch.empty(m, n), None, 0)
            hw, hs = native.pack_q8g(*q8g_case(n, k, seed=n + k + m))
            calls.add("q8g_matmul", x, m, k, n, hw, hs, bias, torch.empty(m, n), None, 0)
    for n, k, m in [(16, 256, 1), (48, 512, 1), (48, 512, 5), (80, 256, 300)]:
        x = torch.randn(m, k, generator=g)
        x[:, 5] = 30.0
        for layout in ("q4k", "q8k"):
            w, sw = k_pack(layout, *k_case(layout, n, k, seed=n + k + m))
            calls.add(f"{layout}_matmul", x, m, k, n, w, sw, torch.randn(n, generator=g), torch.empty(m, n), None, 0)
    hw = native.pack_q8(torch.randint(-128, 128, (1000, 96), generator=g, dtype=torch.int8))
    for m in (1, 3):
        calls.add("q8_matmul", torch.randn(m, 96, generator=g), m, 96, 1008, hw, torch.rand(1008, generator=g),
                  torch.empty(m, 1008), None, 0)
    q = torch.full((64, 256), 127, dtype=torch.int8)  # the 8-bit extremes (test_kernels)
    q[16:32], q[32:48, ::2] = -128, -128
    xe = torch.ones(4, 256)
    xe[0, 32:64], xe[-1, ::3] = -1.0, -2.0
    calls.add("q8_matmul", xe, 4, 256, 64, native.pack_q8(q), torch.rand(64, generator=g) + 0.5, torch.empty(4, 64),
              None, 0)
    ones = torch.ones(64, 16)
    calls.add("q8g_matmul", xe, 4, 256, 64, *native.pack_q8g(q, ones * 0.5, ones * 0.25), None, torch.empty(4, 64),
              None, 0)


def _evict_calls(calls: Calls) -> None:
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        for rot, d in [(64, 64), (32, 48), (16, 16), (24, 32)]:
            keys = torch.randn(1, 3, 64, d, generator=g).to(dtype)
            values = torch.randn(1, 3, 64, d, generator=g).to(dtype)
            ang = 9 * (1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot)))
            cs, sn = torch.cat([torch.cos(ang)] * 2), torch.cat([-torch.sin(ang)] * 2)
            calls.add("kv_evict", keys, values, 3, 64, d, 4, 9, 40, cs, sn, rot, int(dtype == torch.bfloat16))


def test_matmuls_quantizer_and_eviction_are_the_references_bits(neon):
    calls = Calls()
    _matmul_calls(calls)
    _evict_calls(calls)
    n = len(calls.calls)
    calls.add("sc_set_threads", 3)
    calls.add("sc_set_grain", 0)
    _matmul_calls(calls)  # again on 3 threads, every job split
    got = neon(calls)
    assert got[n][0] == 3  # the pool started under qemu
    expect = calls.local("ref")
    _same(got[:n], expect[:n], _sub(calls, 0, n))
    _same(got[n + 2 :], got[: len(got) - n - 2], _sub(calls, n + 2, len(got)))
    assert any(b[0].abs().max() > 0 for rc, b in got[:n] if b and b[0].dtype == torch.float32)


def _sub(calls: Calls, lo: int, hi: int) -> Calls:
    c = Calls()
    c.calls = calls.calls[lo:hi]
    return c


def check_pairs(neon: Any, build: Any) -> None:
    """The layout tests' one check (q6k, q80, q5): `build(calls)` adds matmul pairs (the layout's call, then the
    layout holding the same values it replaces) and returns their indices; they run on 1 thread, then again on 3
    with every job split. Every result is the x86 reference's bits, the 3-thread run the 1-thread run's, and each
    pair's outputs bit for bit equal (and not all zero)."""
    calls = Calls()
    pairs = build(calls)
    n = len(calls.calls)
    calls.add("sc_set_threads", 3)
    calls.add("sc_set_grain", 0)
    build(calls)
    got = neon(calls)
    assert got[n][0] == 3
    _same(got[:n], calls.local("ref")[:n], _sub(calls, 0, n))
    _same(got[n + 2 :], got[:n], _sub(calls, n + 2, len(got)))
    for a, b in pairs:
        assert got[a][0] == got[b][0] == 0
        assert torch.equal(got[a][1][-1].view(torch.int32), got[b][1][-1].view(torch.int32))
        assert got[a][1][-1].abs().max() > 0


def test_attention_is_the_avx512_variants_bits(neon):
    calls, cases = Calls(), []
    for dtype in (torch.float32, torch.bfloat16):
        for d in (16, 48, 64, 128):
            m = abi.StepModel(n_heads=6, n_kv=2, head_dim=d, kv_bf16=int(dtype == torch.bfloat16), scaling=d**-0.5)
            torch.manual_seed(d)
            q = torch.randn(6 * d) * 3
            keys, values = torch.randn(1, 2, 80, d).to(dtype), torch.randn(1, 2, 80, d).to(dtype)
            for pos in (0, 15, 16, 39, 79):
                calls.add("sc_attend", bytes(m), q, keys, values, 80, pos, 4, torch.empty(6 * d), torch.empty(2),
                          torch.empty(6 * (pos + 1)))
                cases.append((m, q, keys, values, pos))
    got = neon(calls)
    from test_kernels import _attend

    for (rc, bufs), (m, q, keys, values, pos) in zip(got, cases):
        assert rc == 0
        out, gauge, scores = bufs[-3:]
        ref = _attend(native.library("ref"), m, q, keys, values, pos)
        for x, y in zip((out, scores, gauge), ref):
            torch.testing.assert_close(x, y, rtol=0, atol=4e-6)
        if native.unsupported("avx512") is None:
            wide = _attend(native.library("avx512"), m, q, keys, values, pos)
            for x, y in zip((out, scores, gauge), wide):
                assert torch.equal(bits(x), bits(y)), (m.head_dim, pos)


def _f32_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


def _torch_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, n: int, scale: float, cap: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    s = (keys[:n].double() @ q.double()) * scale
    if cap > 0:
        s = torch.tanh(s / cap) * cap
    p = torch.softmax(s, 0)
    return p, p @ values[:n].double()


def test_the_prefill_tiles_give_each_query_its_own_attention(neon):
    """The prefill's attention tiles (attend_v16.h: sc_heads_attend on attend_neon.c's registers) under qemu: each
    query of a tile bit-identical to sc_head_attend_cap on that query alone (the decode step's attention, which
    test_attention_is_the_avx512_variants_bits holds to the avx512 bits), and within float rounding of torch. Head
    dims 64 and 128 (the tiled ones; 48 goes a query at a time), fp32 and bf16 rows, with and without a soft-cap,
    query lengths across one, two and three 32-slot blocks (odd and even, a 16-slot group split by none)."""
    calls, cases = Calls(), []
    ns = torch.tensor([1, 15, 16, 17, 32, 33, 64, 79, 80], dtype=torch.int32)
    nq, cap = len(ns), 80
    for dtype in (torch.float32, torch.bfloat16):
        for d in (48, 64, 128):
            for softcap in (0.0, 30.0):
                torch.manual_seed(d + int(softcap))
                q = torch.randn(nq, d) * 3
                keys, values = torch.randn(cap, d).to(dtype), torch.randn(cap, d).to(dtype)
                bf, scale = int(dtype == torch.bfloat16), d**-0.5
                kv = torch.empty(32 * d + 2 * nq * d)  # kernels.h: sc_tile_floats(D, nq)
                tile = calls.add("tiles", q, ns, nq, keys, values, bf, _f32_bits(scale), _f32_bits(softcap),
                                 torch.zeros(nq, cap), cap, torch.empty(nq, d), d, kv)
                heads = [calls.add("head", q[i], keys, values, int(n), bf, _f32_bits(scale), _f32_bits(softcap),
                                   torch.empty(int(n)), torch.empty(d), d) for i, n in enumerate(ns)]
                cases.append((tile, heads, q, keys.float(), values.float(), scale, softcap))
    got = neon(calls)
    for tile, heads, q, keys, values, scale, softcap in cases:
        sc, out = got[tile][1][-3:-1]
        for i, h in enumerate(heads):
            n = int(ns[i])
            h_sc, h_out = got[h][1][-2:]
            assert torch.equal(bits(sc[i, :n]), bits(h_sc)) and torch.equal(bits(out[i]), bits(h_out)), (i, n)
            p, o = _torch_attention(q[i], keys, values, n, scale, softcap)
            torch.testing.assert_close(h_sc.double(), p, rtol=0, atol=4e-6)
            torch.testing.assert_close(h_out.double(), o, rtol=0, atol=2e-5)
