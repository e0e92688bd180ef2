"""sinkchat's own CPU kernels (`csrc/`: matmul.c, step.c): 4-bit and 8-bit weight matmuls on int8 activations with AVX-512 VNNI,
and the whole one-token decode step built on them.

Why our own: torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`) converts every weight to float before its
multiply-adds, so at one token it is bound by arithmetic, not memory: ~7.5 ms for the bundled model's linears, when a
core here streams their 66 MB in ~2.4 ms. llama.cpp instead quantizes the activations to int8 per 32 values and
multiplies bytes with `vpdpbusd` (64 multiply-adds an instruction); these kernels do the same, on a layout that puts
16 output rows in one 512-bit register (no horizontal sums in the inner loop). Measured on the bundled model's
shapes: 1.4 ms instead of 7.5 ms per token when the weights are in cache, and 2.7x faster at a 256-token prefill.

The activation rounding is llama.cpp's (int8, one scale per 32 values, exact block sums for the zero points); its
cost in perplexity is in the README. The library is compiled once per source and CPU with the system's C compiler
into sinkchat's cache dir (~0.3 s) and loaded with ctypes: no torch headers, no build step at install time. Where
the CPU lacks AVX-512 VNNI or no compiler is found, `available()` is False and torch's kernels run instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("matmul.c", "step.c")  # and simd.h
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
CFLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-fno-math-errno")
RG = 16  # output rows per register (the layouts' row interleave)
QB = 32  # weights per quant block
P = ctypes.c_void_p


@functools.lru_cache(maxsize=1)
def _cpu() -> tuple[frozenset[str], str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset(), ""
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "")
    return frozenset(flags), model


def why_unavailable() -> str | None:
    """Why the native kernels cannot run here (None: they can)."""
    from sinkchat.config import ConfigError, env

    choice = env("SINKCHAT_KERNELS")
    if choice not in ("auto", "torch"):
        raise ConfigError(f"SINKCHAT_KERNELS must be auto or torch, not {choice!r}")
    if choice == "torch":
        return "SINKCHAT_KERNELS=torch"
    flags, _ = _cpu()
    missing = [f for f in CPU_FLAGS if f not in flags]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    if _compiler() is None:
        return "no C compiler found (CC, gcc or cc)"
    return None if library() is not None else "the kernels did not compile"


def available() -> bool:
    return why_unavailable() is None


def resolve(kernels: str) -> str:
    """"auto" -> "native" where the CPU and a compiler allow, else "torch"."""
    if kernels == "auto":
        return "native" if available() else "torch"
    return kernels


@functools.lru_cache(maxsize=1)
def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "gcc", "cc"):
        if name and shutil.which(name):
            return name
    return None


@functools.lru_cache(maxsize=1)
def library() -> Any | None:
    """The compiled kernels (ctypes), built on first use into the cache dir; None if they cannot be built."""
    from sinkchat.config import cache_dir

    cc = _compiler()
    if cc is None:
        return None
    src = b"".join((CSRC / f).read_bytes() for f in (*SOURCES, "simd.h"))
    key = hashlib.sha256(src + " ".join(CFLAGS).encode() + repr(sorted(_cpu()[0])).encode() + _cpu()[1].encode())
    out = cache_dir() / "native" / f"q4-{key.hexdigest()[:16]}.so"
    if not out.exists() and not _build(cc, out):
        return None
    try:
        lib = ctypes.CDLL(str(out))
        i = ctypes.c_int
        for name, args in (("q4_matmul", [P, i, i, i, P, P, P, P]), ("q8_matmul", [P, i, i, i, P, P, P]),
                           ("sc_step", [P, P, i, i, P, P, i, P, P, P]),
                           ("kv_evict", [P, P, i, i, i, i, i, i, P, P, i, i])):
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = i  # 0, or -1 when out of memory
    except (OSError, AttributeError) as e:  # a foreign or broken file, a noexec cache dir
        log.warning("native kernels not loaded from %s (%s)", out, e)
        return None
    return lib


def _build(cc: str, out: Path) -> bool:
    """Compile the kernels into `out`, atomically: a concurrent session sees no file or the whole library."""
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
        os.close(fd)
        res = subprocess.run([cc, *CFLAGS, "-o", tmp, *[str(CSRC / f) for f in SOURCES], "-lm"],
                             capture_output=True, text=True, check=False)
        if res.returncode != 0:
            log.warning("native kernels did not compile: %s", (res.stderr.strip().splitlines() or ["?"])[-1])
            return False
        os.replace(tmp, out)
        tmp = None
        return True
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("native kernels not built (%s)", e)
        return False
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def pack_q4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q int [N, K] in 0..15, scale / zero [N, K/32] in torch's convention (w = (q - 8)·scale + zero) -> the
    kernel's layout: qw uint8 [N/16, K/32, 4, 16, 4] (sub-block s, row r, byte t: q[r, 8s+t] low nibble,
    q[r, 8s+4+t] high nibble) and sw fp16 [N/16, K/32, 2, 16] (d = scale, m = zero - 8·scale: w = d·q + m).

    fp16, as ggml's Q4_1 stores d and m, so a Q4_1 GGUF is held exactly. Not bf16 (torch's kernel's choice): m is a
    block's minimum, ~8 steps from zero, and bf16's 8-bit mantissa shifted every weight of a block by up to 1.5%
    of a step, the same way (+0.8% perplexity on the bundled model, measured)."""
    n, k = q.shape
    qq = q.to(torch.uint8).reshape(n // RG, RG, k // QB, 4, 2, 4)  # [g, r, b, s, half, t]: k = 32b + 8s + 4half + t
    qw = (qq[..., 0, :] | (qq[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).contiguous()  # [g, b, s, r, t]
    d, m = scale.to(torch.float16), (zero.double() - 8 * scale.double()).to(torch.float16)
    sw = torch.stack([d, m], -1).reshape(n // RG, RG, k // QB, 2).permute(0, 2, 3, 1).contiguous()  # [g, b, 2, r]
    return qw, sw


def pack_q8(q: torch.Tensor) -> torch.Tensor:
    """int8 [V, K] -> uint8 (q + 128) [V/16, K/4, 16, 4], padded to a multiple of 16 rows with q = 0 (stored 128;
    their scale is 0, so they project to 0 and are cut off)."""
    v, k = q.shape
    pad = (-v) % RG
    u = q.view(torch.uint8) ^ 128  # two's complement: q + 128 as a byte
    if pad:
        u = torch.cat([u, torch.full((pad, k), 128, dtype=torch.uint8)])
    return u.reshape(-1, RG, k // 4, 4).permute(0, 2, 1, 3).contiguous()


def q8_rows(hw: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [...] of a `pack_q8` table as int16 [..., K] (embedding lookups read the head's one copy)."""
    rows = hw[ids // RG, :, ids % RG, :]  # [..., K/4, 4]
    return rows.reshape(*ids.shape, -1).to(torch.int16) - 128


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def kv_evict(keys: torch.Tensor, values: torch.Tensor, start: int, count: int, n: int,
             cos_sin: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
    """Drop slots [start, start+count) of one layer's keys / values [1, H_kv, cap, D] (fp32 or bf16, contiguous, on
    the CPU) and move the next n slots down, re-rotating the keys by cos/sin [rot] (None: move only). False (nothing
    done) where these kernels cannot: the caller then runs the torch path."""
    if (keys.device.type != "cpu" or keys.dtype not in (torch.float32, torch.bfloat16)
            or values.dtype != keys.dtype or not keys.is_contiguous() or not values.is_contiguous()
            or keys.shape != values.shape or keys.shape[0] != 1 or keys.shape[-1] > 1024):
        return False
    _, h, cap, d = keys.shape
    if start < 0 or count < 0 or n < 0 or start + count + n > cap:
        raise ValueError(f"eviction [{start}, {start + count}) + {n} outside a cache of {cap}")
    cs, sn = cos_sin if cos_sin is not None else (None, None)
    if cs is not None and (cs.numel() > d or cs.numel() % 2 or cs.shape != sn.shape  # type: ignore[union-attr]
                           or cs.dtype != torch.float32 or sn.dtype != torch.float32):  # type: ignore[union-attr]
        return False
    if not available():
        return False
    return library().kv_evict(keys.data_ptr(), values.data_ptr(), h, cap, d, start, count, n, _ptr(cs), _ptr(sn),
                              0 if cs is None else cs.numel(), int(keys.dtype == torch.bfloat16)) == 0


def q4_matmul(x: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] fp32 -> [M, N] fp32 through `pack_q4` weights."""
    x = x.float().contiguous()
    m, k = x.shape
    n = qw.shape[0] * RG
    if qw.shape[1:] != (k // QB, 4, RG, 4) or k % QB or qw.dtype != torch.uint8 or not qw.is_contiguous():
        raise ValueError(f"q4 weights {tuple(qw.shape)} do not fit x {tuple(x.shape)}")
    if sw.shape != (n // RG, k // QB, 2, RG) or sw.dtype != torch.float16 or not sw.is_contiguous():
        raise ValueError(f"q4 scales {tuple(sw.shape)} {sw.dtype} do not fit the weights")
    if bias is not None:
        bias = bias.float().contiguous()  # the kernel reads n fp32 values
        if bias.numel() != n:
            raise ValueError(f"bias of {bias.numel()} for {n} outputs")
    y = torch.empty(m, n)
    if library().q4_matmul(x.data_ptr(), m, k, n, qw.data_ptr(), sw.data_ptr(), _ptr(bias), y.data_ptr()):
        raise MemoryError("q4_matmul: out of memory")
    return y


def q8_matmul(x: torch.Tensor, hw: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 -> [M, Vpadded] fp32 through a `pack_q8` table with per-row scales `scale` [Vpadded]."""
    x = x.float().contiguous()
    m, k = x.shape
    n = hw.shape[0] * RG
    if hw.shape[1:] != (k // 4, RG, 4) or k % QB or hw.dtype != torch.uint8 or not hw.is_contiguous():
        raise ValueError(f"q8 table {tuple(hw.shape)} does not fit x {tuple(x.shape)}")
    if scale.shape != (n,) or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError(f"q8 scales {tuple(scale.shape)} do not fit the table")
    y = torch.empty(m, n)
    if library().q8_matmul(x.data_ptr(), m, k, n, hw.data_ptr(), scale.data_ptr(), y.data_ptr()):
        raise MemoryError("q8_matmul: out of memory")
    return y
