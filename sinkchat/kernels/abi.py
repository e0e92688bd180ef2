"""The C boundary of sinkchat's kernels: every ctypes declaration, the build of each variant's library, and the
handshake that checks them against the C side at load.

Why a handshake: ctypes trusts whatever it is told. A cached library from an older source, or a Python declaration
that drifted from the C prototype (an int where C now takes a size_t, a field added to the step's `Model`), would
otherwise run and read garbage. The library reports its ABI version (`sc_abi`), its variant, the size of each
struct and block layout it shares with Python (`sc_sizeof`), every `Model` field's offset (`sc_offsetof`), and
each exported function's signature (`sc_signature`, codes derived in C from the prototypes themselves); `open_library`
compares all of it with the declarations here and raises `NativeABIError` on the first difference. The caller
(`native.library`) logs that and falls back as for a library that does not build.

One library per variant (see `native`'s docstring for why): "avx512" (matmul.c, matmul_k.c, attend.c;
-march=native), "avxvnni" and "avx2" (matmul256.c, matmul256_k.c, attend256.c with explicit -m flags, so the build
runs on any CPU that has them), "neon" (matmul_neon.c, matmul_neon_k.c, attend_neon.c; -march=armv8.2-a+dotprod)
and "ref" (ref.c; no -march flag, any CPU), each linked with the shared linear.c, step.c, pool.c and api.c.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger(__name__)

ABI = 12  # csrc/kernels.h: SC_ABI_VERSION (3: q8g weights; per-linear types, q/k norms, partial rotary in Model;
#          4: the K-quant layouts q4k / q8k, lin_type 2 / 3; 5: the worker pool, sc_*_work(M, K, threads);
#          6: sc_layers and sc_step_layers: per-layer RoPE / scale / cache slice, Gemma's norms, GELU, soft-cap;
#          7: sc_silu, the MLP activation on its own exp; 8: Model.head / head_type, the head as any linear;
#          9: sc_prefill's off (recalled memory slots before the stream) and last-row queries;
#          10: the q40 layout (Q4_0 at its own 18 bytes: sc_q40_scales), lin_type 5, q40_matmul, sc_q40_work;
#          11: sc_step / sc_step_layers' gauge [L][3]: the share on the recalled memory slots third;
#          12: sc_q4k_scales' sc / mn at 6 bits (lo nibbles + hi 2-bit planes: Q4_K's own 144 bytes per 256); the
#              q80 layout (Q8_0 at its own 34 bytes: sc_q80_scales), lin_type 7, q80_matmul, sc_q80_work; the q5
#              blocks (sc_q5_block: Q5_0 / Q5_1 / Q5_K at 5 bits), lin_type 8 / 9 / 10, q50 / q51 / q5k_matmul)
KEY_VERSION = 4  # part of the cached library's name: bump to rebuild every cached copy (4: one per ISA variant)
CSRC = Path(__file__).parent / "csrc"
SHARED = ("linear.c", "step.c", "prefill.c", "pool.c", "api.c")  # every build: jobs, step, prefill, pool, entry points
_V256 = ("matmul256.c", "matmul256_k.c", "attend256.c", *SHARED)
SOURCES = {"avx512": ("matmul.c", "matmul_k.c", "attend.c", *SHARED), "avxvnni": _V256, "avx2": _V256,
           "neon": ("matmul_neon.c", "matmul_neon_k.c", "attend_neon.c", *SHARED), "ref": ("ref.c", *SHARED)}
_H256 = ("kernels.h", "layouts.h", "simd256.h", "rows256.h", "attend_v16.h")
HEADERS = {"avx512": ("kernels.h", "layouts.h", "simd512.h", "rows512.h", "attend_v16.h"), "avxvnni": _H256,
           "avx2": _H256, "neon": ("kernels.h", "layouts.h", "simd_neon.h", "rows_neon.h", "attend_v16.h"),
           "ref": ("kernels.h", "layouts.h")}
VARIANT_ID = {"ref": 0, "avx512": 1, "avx2": 2, "avxvnni": 3, "neon": 4}  # csrc/kernels.h: SC_VARIANT_*
# -ffp-contract=off: the compiler fuses no multiply-add on its own, so the scalar reference and the vector code
# round at the same places (ref.c) and the tests can hold them bit-exact. -fvisibility=hidden: only SC_API exports.
_COMMON = ("-shared", "-fPIC", "-pthread", "-fno-math-errno", "-ffp-contract=off", "-fvisibility=hidden", "-std=gnu11")
# avx512 keeps -march=native (its build is named by the CPU); the 256-bit ones name exactly the extensions their
# CPU check asks for (native.CPU_FLAGS), so the same file runs on any such CPU and this one, which has AVX-512 too,
# cannot pick an AVX-512 instruction into them.
_AVX2 = ("-mavx2", "-mfma", "-mf16c")
CFLAGS = {"avx512": ("-O3", "-march=native", *_COMMON), "avxvnni": ("-O3", *_AVX2, "-mavxvnni", *_COMMON),
          "avx2": ("-O3", *_AVX2, *_COMMON), "neon": ("-O3", "-march=armv8.2-a+dotprod", *_COMMON),
          "ref": ("-O2", *_COMMON)}
ARCH = {"avx512": "x86_64", "avxvnni": "x86_64", "avx2": "x86_64", "neon": "aarch64"}  # platform.machine()
# Tests only (never chosen by the product): the avxvnni sources with vpdpbusd in its AVX-512 VL encoding
# (csrc/simd256.h: SC_VNNI_EVEX), so a CPU with AVX-512 VNNI but without AVX-VNNI runs the avxvnni code.
TEST_VARIANTS = {"avxvnni_evex": ("avx512vl", "avx512_vnni")}  # -> the CPU flags it needs
SOURCES["avxvnni_evex"], HEADERS["avxvnni_evex"] = _V256, HEADERS["avxvnni"]
CFLAGS["avxvnni_evex"] = ("-O3", *_AVX2, "-mavx512vl", "-mavx512vnni", "-DSC_VNNI_EVEX", *_COMMON)
VARIANT_ID["avxvnni_evex"] = VARIANT_ID["avxvnni"]
RG = 16  # output rows per register (the layouts' row interleave)
QB = 32  # weights per quant block
QK = 256  # weights per K-quant super-block (csrc/kernels.h: SC_QK)
Q4K_SCALES = 2 * RG * 2 + 12 * RG  # sc_q4k_scales: fp16 d, dmin [16]; lo [8][16] (sc | mn << 4), hi [4][16] (2-bit)
Q8K_SCALES = 2 * RG * 2 + 2 * 16 * RG  # sc_q8k_scales: fp16 d, dmin [16]; int8 sc, uint8 mn [16][16]
Q40_SCALES = RG * 2  # sc_q40_scales: fp16 d [16] (Q4_0: no m)
Q6K_BLOCK = QB * RG // 2 + QB * RG // 4  # sc_q6k_block: the q4 nibble tile, then 2 bit-planes of the high 2 bits
Q6K_SCALES = RG * 2 + 16 * RG  # sc_q6k_scales: fp16 d [16]; int8 sc [16][16] (Q6_K: no dmin, mn)
Q80_SCALES = RG * 2  # sc_q80_scales: fp16 d [16] (Q8_0: no m)
Q5_BLOCK = QB * RG // 2 + QB * RG // 8  # sc_q5_block: the q4 nibble tile, then the bit-plane of the fifth bit

P, I, Z, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_long


class NativeABIError(RuntimeError):
    """A library whose ABI, layouts or signatures differ from this binding's declarations."""


class StepModel(ctypes.Structure):
    """csrc/kernels.h's `Model`: the decode step's shapes and weight pointers (size and offsets checked at load)."""

    _fields_ = [(n, ctypes.c_int) for n in ("n_layers", "dim", "n_heads", "n_kv", "head_dim", "inter", "vocab",
                                             "kv_bf16")]
    _fields_ += [(n, ctypes.c_float) for n in ("eps", "scaling", "rope_scale")]
    _fields_ += [(n, ctypes.c_void_p) for n in ("inv_freq", "norm_in", "norm_post", "norm_final", "lin", "table",
                                                 "table_scale", "q_norm", "k_norm", "lin_type")]
    _fields_ += [("rot", ctypes.c_int), ("head_type", ctypes.c_int), ("head", ctypes.c_void_p)]


ACT_SILU, ACT_GELU_TANH = 0, 1  # csrc/kernels.h: SC_ACT_* (sc_layers.act)


class StepLayers(ctypes.Structure):
    """csrc/kernels.h's `sc_layers`: what `sc_step_layers` adds to a `Model` (per-layer RoPE, scale; Gemma's output
    norms, GELU, soft-cap). Checked at load as `StepModel` is (offsets named "sc_layers.<field>")."""

    _fields_ = [(n, ctypes.c_void_p) for n in ("inv_freq", "rope_scale", "scaling", "norm_attn_out", "norm_mlp_out")]
    _fields_ += [("softcap", ctypes.c_float), ("act", ctypes.c_int)]


# Every function in csrc/kernels.h's SC_EXPORTS: name -> (restype, argtypes). Returns: 0, or SC_ENOMEM (-1) /
# SC_EWORK (-2); the sc_*_work functions return bytes.
API: dict[str, tuple[Any, list[Any]]] = {
    "sc_q4_work": (Z, [I, I, I]),  # (M, K, threads: <= 0 the pool's size)
    "sc_q8_work": (Z, [I, I, I]),
    "sc_q8g_work": (Z, [I, I, I]),
    "sc_q4k_work": (Z, [I, I, I]),
    "sc_q8k_work": (Z, [I, I, I]),
    "sc_q40_work": (Z, [I, I, I]),
    "sc_q6k_work": (Z, [I, I, I]),
    "sc_q80_work": (Z, [I, I, I]),
    "sc_q50_work": (Z, [I, I, I]),
    "sc_q51_work": (Z, [I, I, I]),
    "sc_q5k_work": (Z, [I, I, I]),
    "sc_set_threads": (I, [I]),  # (n: 0 / 1 no pool) -> the pool's size now
    "sc_set_grain": (L, [L]),  # (bytes: a job under it runs on the caller alone; < 0 only asks) -> the previous
    "sc_set_deal": (I, [I]),  # (1: deal each job's chunks to every thread, 0: claimed; < 0 only asks) -> previous
    "sc_step_work": (Z, [P, I]),  # (model, cap)
    "sc_quant": (I, [P, I, I, P, P, P]),  # (x, M, K, xq, dx, sx)
    "q4_matmul": (I, [P, I, I, I, P, P, P, P, P, Z]),  # (x, M, K, N, qw, sw, bias, y, work, work_size)
    "q8_matmul": (I, [P, I, I, I, P, P, P, P, Z]),  # (x, M, K, N, hw, ws, y, work, work_size)
    "q8g_matmul": (I, [P, I, I, I, P, P, P, P, P, Z]),  # (x, M, K, N, hw, sw, bias, y, work, work_size)
    "q4k_matmul": (I, [P, I, I, I, P, P, P, P, P, Z]),  # (x, M, K, N, qw, sw, bias, y, work, work_size)
    "q8k_matmul": (I, [P, I, I, I, P, P, P, P, P, Z]),  # (x, M, K, N, hw, sw, bias, y, work, work_size)
    "q40_matmul": (I, [P, I, I, I, P, P, P, P, P, Z]),  # (x, M, K, N, qw, sw, bias, y, work, work_size)
    "q6k_matmul": (I, [P, I, I, I, P, P, P, P, P, Z]),  # (x, M, K, N, qw, sw, bias, y, work, work_size)
    "q80_matmul": (I, [P, I, I, I, P, P, P, P, P, Z]),  # (x, M, K, N, hw, sw, bias, y, work, work_size)
    "q50_matmul": (I, [P, I, I, I, P, P, P, P, P, Z]),  # (x, M, K, N, qw, sw, bias, y, work, work_size)
    "q51_matmul": (I, [P, I, I, I, P, P, P, P, P, Z]),
    "q5k_matmul": (I, [P, I, I, I, P, P, P, P, P, Z]),
    "sc_attend": (I, [P, P, P, P, I, I, I, P, P, P]),  # (model, q, K, V, cap, pos, n_gauge, out, gauge, scores)
    "sc_step": (I, [P, P, I, I, P, P, I, P, P, P, P, Z]),  # (model, x, pos, n_gauge, keys, values, cap, out,
    #                                                        queries, gauge [L][3], work, work_size)
    "kv_evict": (I, [P, P, I, I, I, I, I, I, P, P, I, I]),
    "sc_step_layers": (I, [P, P, P, I, I, P, P, P, P, P, P, P, P, Z]),  # (model, layers, x, pos, n_gauge, keys,
    #                                                  values, caps, ns, out, queries, gauge [L][3], work, work_size)
    "sc_silu": (I, [P, P, Z]),  # (g, u, n): g = silu(g) * u
    "sc_prefill_work": (Z, [P, I, I]),  # (model, T, cap)
    "sc_prefill": (I, [P, P, I, I, I, I, P, P, I, P, P, P, Z]),  # (model, x, T, pos, off, n_out, keys, values,
    #                                                               cap, out, queries, work, work_size)
}
# The handshake's own declarations (what SC_ABI_VERSION promises about them).
_HANDSHAKE: dict[str, tuple[Any, list[Any]]] = {
    "sc_abi": (I, []),
    "sc_variant": (I, []),
    "sc_sizeof": (ctypes.c_long, [ctypes.c_char_p]),
    "sc_offsetof": (ctypes.c_long, [ctypes.c_char_p]),
    "sc_signature": (ctypes.c_char_p, [ctypes.c_char_p]),
    "sc_threads": (I, []),  # the pool's size: no arguments, so outside sc_signature's table
}
_CODES = {I: "i", L: "l", Z: "z", ctypes.c_float: "f", P: "p", ctypes.c_char_p: "p"}


def layouts() -> dict[str, int]:
    """The sizes Python assumes for the structs and blocks it shares with C (`sc_sizeof` must agree)."""
    return {"Model": ctypes.sizeof(StepModel), "sc_q4_block": QB * RG // 2, "sc_q4_scales": 2 * RG * 2,
            "sc_q8_block": QB * RG, "sc_q8g_scales": 4 * RG * 2, "sc_q4k_scales": Q4K_SCALES,
            "sc_q8k_scales": Q8K_SCALES, "sc_q40_scales": Q40_SCALES,
            "sc_q6k_block": Q6K_BLOCK, "sc_q6k_scales": Q6K_SCALES, "sc_q80_scales": Q80_SCALES,
            "sc_q5_block": Q5_BLOCK, "sc_layers": ctypes.sizeof(StepLayers)}


def signature(restype: Any, argtypes: list[Any]) -> str:
    """The code `sc_signature` gives for a C function of these ctypes types, e.g. "i(pii)"."""
    return _CODES[restype] + "(" + "".join(_CODES[a] for a in argtypes) + ")"


def open_library(path: Path, variant: str) -> Any:
    """Load `path`, declare every function, and check it against this binding; NativeABIError on a mismatch,
    OSError / AttributeError for a file that is no library or lacks the handshake."""
    lib = ctypes.CDLL(str(path))
    for name, (res, args) in _HANDSHAKE.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    if lib.sc_abi() != ABI:
        raise NativeABIError(f"{path.name} speaks ABI {lib.sc_abi()}, this binding {ABI} (a stale or foreign build)")
    if lib.sc_variant() != VARIANT_ID[variant]:
        raise NativeABIError(f"{path.name} is variant {lib.sc_variant()}, not {variant!r}")
    for name, size in layouts().items():
        if lib.sc_sizeof(name.encode()) != size:
            raise NativeABIError(f"{path.name}: sizeof({name}) is {lib.sc_sizeof(name.encode())} in C, {size} here")
    for struct, prefix in ((StepModel, ""), (StepLayers, "sc_layers.")):
        for field, _ in struct._fields_:
            at, want = lib.sc_offsetof(f"{prefix}{field}".encode()), getattr(struct, field).offset
            if at != want:
                raise NativeABIError(f"{path.name}: {prefix or 'Model.'}{field} at offset {at} in C, {want} here")
    exported = set(lib.sc_signature(None).decode().split())
    if exported != set(API):
        raise NativeABIError(f"{path.name} exports {sorted(exported)}, this binding declares {sorted(API)}")
    for name, (res, args) in API.items():
        c_sig, py_sig = lib.sc_signature(name.encode()).decode(), signature(res, args)
        if c_sig != py_sig:
            raise NativeABIError(f"{path.name}: {name} is {c_sig} in C, declared {py_sig} here")
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


def library_path(cache: Path, variant: str, cpu: tuple[frozenset[str], str]) -> Path:
    """Where `variant`'s library is cached: named by the ABI, the sources, the flags and (avx512) the CPU, so an
    edited source, a new flag or another CPU builds a new file and a stale one is never loaded."""
    h = hashlib.sha256(f"{KEY_VERSION} {ABI} {variant} {' '.join(CFLAGS[variant])} {platform.machine()}".encode())
    for f in (*SOURCES[variant], *HEADERS[variant]):
        h.update((CSRC / f).read_bytes())
    if "-march=native" in CFLAGS[variant]:  # the build is only good for this CPU
        h.update(repr(sorted(cpu[0])).encode() + cpu[1].encode())
    return cache / "native" / f"sinkchat-{variant}-abi{ABI}-{h.hexdigest()[:16]}.so"


def accepts(cc: str, variant: str) -> bool:
    """Whether `cc` takes `variant`'s flags (an older gcc has no -mavxvnni): one empty compile, ~20 ms."""
    try:
        res = subprocess.run([cc, *CFLAGS[variant], "-x", "c", "-c", "-o", os.devnull, "-"], input="int sc_x;\n",
                             capture_output=True, text=True, check=False, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return res.returncode == 0


def build(cc: str, variant: str, out: Path) -> str | None:
    """Compile `variant` into `out`, atomically (`compile_shared`). None, or why not (the compiler's last lines)."""
    return compile_shared(cc, CFLAGS[variant], [CSRC / f for f in SOURCES[variant]], out, ["-lm"])


def compile_shared(cc: str, flags: Sequence[str], sources: Sequence[Path], out: Path, libs: Sequence[str] = (),
                   tail: int = 6) -> str | None:
    """Compile `sources` into the shared library `out`, atomically (a concurrent session sees no file or the whole
    library): the kernels' and the recall memory's own (memory/native.py). None, or why not (the compiler's last
    `tail` lines)."""
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
        os.close(fd)
        cmd = [cc, *flags, "-o", tmp, *[str(f) for f in sources], *libs]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            return "\n".join(res.stderr.strip().splitlines()[-tail:]) or f"{cc} exited with {res.returncode}"
        os.replace(tmp, out)
        tmp = None
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return str(e)
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
