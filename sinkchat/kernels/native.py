"""sinkchat's own CPU kernels (`csrc/`): 4-bit and 8-bit weight matmuls on int8 activations, and the whole
one-token decode step built on them, for x86-64 CPUs with AVX2 and up and aarch64 ones with the dot-product
extension (and a scalar reference anywhere).

Why our own: torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`) converts every weight to float before its
multiply-adds, so at one token it is bound by arithmetic, not memory: ~7.5 ms for the bundled model's linears, when a
core here streams their 66 MB in ~2.4 ms. llama.cpp instead quantizes the activations to int8 per 32 values and
multiplies bytes with `vpdpbusd` (64 multiply-adds an instruction); these kernels do the same, on a layout that puts
16 output rows in one 512-bit register (no horizontal sums in the inner loop). Measured on the bundled model's
shapes: 1.4 ms instead of 7.5 ms per token when the weights are in cache, and 2.7x faster at a 256-token prefill.

The activation rounding is llama.cpp's (int8, one scale per 32 values, exact block sums for the zero points). The
library is compiled once per source (and, for avx512, per CPU) with the system's C compiler into the cache dir
(~0.5 s) and loaded with ctypes: no build step at install time. Where no variant runs `available()` is False.

Variants, one library each, chosen at run time (`variant()`): SINKCHAT_KERNELS=avx512|avxvnni|avx2|neon|ref names one
(a CPU without it is a one-line ConfigError, never a SIGILL: its library is not even loaded), `use()` switches this
process (tests), and "auto" takes `best()`, the first of these the CPU has:
- "avx512" (csrc/matmul.c, matmul_k.c, attend.c; -march=native): AVX-512 VNNI, 16 rows a register.
- "avxvnni" (matmul256.c, matmul256_k.c, attend256.c with -mavxvnni): the same `vpdpbusd` on 256 bits, 8 rows a
  register, for CPUs with AVX-VNNI but no AVX-512 (Alder Lake and later client parts).
- "avx2" (the same sources without -mavxvnni): `vpmaddubsw` + `vpmaddwd` in place of `vpdpbusd`, exact for every
  byte the layouts hold (csrc/simd256.h says how the int16 saturation is kept out).
- "neon" (matmul_neon.c, matmul_neon_k.c, attend_neon.c; -march=armv8.2-a+dotprod): `sdot` on 128 bits, 4 rows a
  register, for aarch64 CPUs with the dot-product extension. Tested bit for bit under qemu-aarch64 (tests/
  test_neon.py, slow); not tuned (prefill runs its one-row code row by row) nor timed: no ARM machine here.
- "ref" (ref.c): plain scalar C built with no -march flag, so it compiles and runs on any CPU; slow, for checking.
Each links the same layer loop, pool and entry points (linear.c, step.c, pool.c, api.c). Separate libraries rather
than per-function target attributes: each build keeps its flags for all its code (the step's scalar loops too), and
cannot pick up another ISA's instruction by accident; the cost is a ~0.5 s compile per variant a process uses.
Tests hold every SIMD variant to the reference: bit-exact for the matmuls, the quantizer, the rotation and the
eviction; to float rounding for attention (tests/test_kernels.py).

Scratch memory is the caller's (ggml's work buffers): each C kernel takes a work buffer of the size its
`sc_*_work` function gives, and this binding keeps one per thread (`threading.local`: concurrent callers never
share one), grown to the next power of two when a call needs more and then reused, so no call allocates.

Threads: each library keeps a pool of worker threads (csrc/pool.c) that `set_threads(n)` sizes in every variant
(the loader calls it with `--threads`); the matmuls (decode and prefill), the decode step's attention and the
eviction split across it, and give the same bits at any thread count (tests/test_threads.py). The work sizes count
one piece of scratch per thread. 1 -> 2 threads, the other core idle (`sinkchat bench --policies sink --caches 512
--decode 128 --gauge-tokens 0`): the ~1B Q4_0 model decodes 31-33 -> 39-42 tok/s, prefills 103-108 -> 177-178;
with the other core running a busy loop, 2 threads are as fast as 1 (1B: 28.2 / 29.7 tok/s), not slower.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from typing import Any

import torch

from sinkchat.kernels.abi import (  # noqa: F401  (StepModel, StepLayers, ACT_*, RG, QK: the API)
    ACT_GELU_TANH, ACT_SILU, QB, QK, RG, NativeABIError, StepLayers, StepModel)
from sinkchat.kernels import abi
from sinkchat.kernels.layouts import (  # noqa: F401  (the binding's API: native.pack_q4, native.pack_q8g, ...)
    pack_q4, pack_q4_dm, pack_q4k, pack_q40, pack_q8, pack_q8g, pack_q8k, q4_unpack, q4k_unpack, q40_gguf_bytes,
    q40_unpack, q8_rows, q8g_unpack, q8k_unpack)
from sinkchat.kernels.layouts import pack_q6k, q6k_gguf_bytes, q6k_unpack  # noqa: F401  (the binding's API: q6k)
from sinkchat.kernels.layouts import pack_q80, q80_gguf_bytes, q80_unpack  # noqa: F401  (the binding's API: q80)
from sinkchat.kernels.variants import (  # noqa: F401  (the binding's API: native.unsupported, native.best, ...)
    CPU_FLAGS, SIMD, VARIANTS, best, lacks, unsupported)
from sinkchat.kernels import variants as _variants

log = logging.getLogger(__name__)

_override: str | None = None  # use()


def use(variant: str | None) -> str | None:
    """Run this process's kernels on `variant` (one of VARIANTS; None: as SINKCHAT_KERNELS says); returns the
    previous choice. For tests and checks: packed weights work with any."""
    global _override
    if variant not in (None, *VARIANTS, *abi.TEST_VARIANTS):
        raise ValueError(f"kernel variant {variant!r}: {', '.join(VARIANTS)} or None")
    prev, _override = _override, variant
    return prev


def _choice() -> str:
    """SINKCHAT_KERNELS, checked: auto, torch or a variant (a ConfigError, one line, for anything else)."""
    from sinkchat.config import ConfigError, env

    choice = env("SINKCHAT_KERNELS")
    if choice not in ("auto", "torch", *VARIANTS):
        raise ConfigError(f"SINKCHAT_KERNELS must be auto, torch, {', '.join(VARIANTS)}, not {choice!r}")
    return choice


def variant() -> str:
    """The variant `library()` gives: use()'s choice, else the one SINKCHAT_KERNELS names, else `best()`."""
    if _override is not None:
        return _override
    choice = _choice()
    return choice if choice in VARIANTS else best()


def why_unavailable() -> str | None:
    """Why the native kernels cannot run here (None: they can). SINKCHAT_KERNELS naming a variant this machine
    cannot run is a ConfigError (one line: the CLI's exit 2) rather than a quiet fall back to torch: it was asked
    for."""
    from sinkchat.config import ConfigError

    choice = _choice()
    if choice == "torch":
        return "SINKCHAT_KERNELS=torch"
    v = variant()
    reason = unsupported(v)
    if reason and _override is None and choice == v:
        runs = [x for x in VARIANTS if unsupported(x) is None]
        raise ConfigError(f"SINKCHAT_KERNELS={v}: {reason} (this machine runs: {', '.join(runs) or 'none'})")
    if reason:
        return reason
    return None if library(v) is not None else f"the {v} kernels did not load: {load_error(v)}"


def available() -> bool:
    return why_unavailable() is None


def resolve(kernels: str) -> str:
    """"auto" -> "native" where the CPU and a compiler allow, else "torch"."""
    if kernels == "auto":
        return "native" if available() else "torch"
    return kernels


def library(which: str | None = None) -> Any | None:
    """The compiled kernels of variant `which` (default: `variant()`), built on first use into the cache dir and
    checked against the binding (abi.open_library); None if they cannot be built or loaded (`load_error` says why)."""
    return _load(which or variant())[0]


def load_error(which: str | None = None) -> str | None:
    """Why `library(which)` is None (the compiler's message, the handshake's mismatch), or None."""
    return _load(which or variant())[1]


_threads = 1  # set_threads(): the pool size of every loaded variant
_LOADED: dict[str, Any] = {}  # variant -> its library, once loaded


def set_threads(n: int) -> int:
    """Run the kernels on `n` threads, the caller included (0 or 1: no pool), in every variant loaded now and any
    loaded later (csrc/pool.c: sc_set_threads). Returns the count the pool has (fewer if threads could not start)."""
    global _threads
    _threads = max(1, int(n))
    got = [int(lib.sc_set_threads(_threads)) for lib in list(_LOADED.values())]
    return min(got, default=_threads)


def threads() -> int:
    """The thread count `set_threads` last asked for (1 until then)."""
    return _threads


@functools.lru_cache(maxsize=None)
def _load(which: str) -> tuple[Any | None, str | None]:
    from sinkchat.config import cache_dir

    reason = unsupported(which)
    if reason:
        return None, reason
    out = abi.library_path(cache_dir(), which, _variants.cpu())
    if not out.exists():
        err = abi.build(_variants.compiler(), which, out)  # type: ignore[arg-type]
        if err:
            log.warning("native %s kernels did not compile: %s", which, err.splitlines()[-1])
            return None, f"compile failed: {err}"
    try:
        lib = abi.open_library(out, which)
        lib.sc_set_threads(_threads)
        _LOADED[which] = lib
        return lib, None
    except NativeABIError as e:
        log.warning("native %s kernels refused: %s", which, e)
        return None, f"refused: {e}"
    except (OSError, AttributeError) as e:  # a foreign or broken file, a noexec cache dir
        log.warning("native %s kernels not loaded from %s (%s)", which, out, e)
        return None, f"not loaded from {out}: {e}"


_FAST: tuple[tuple[Any, ...], Any] | None = None  # what chooses the variant -> its library


def _lib() -> Any:
    """`library()`, memoized on what chooses the variant (use(), SINKCHAT_KERNELS, the CPU probe and loader, which
    tests replace): a lookup costs ~35 us, four a decode step (~2% of a bundled-model token)."""
    global _FAST
    key = (_override, os.environ.get("SINKCHAT_KERNELS"), _load, _variants.cpu)
    if _FAST is not None and _FAST[0] == key:
        return _FAST[1]
    lib = library()
    if lib is None:
        raise RuntimeError(f"native kernels unavailable: {load_error()}")
    _FAST = (key, lib)
    return lib


# ---- caller-owned scratch ----------------------------------------------------------------------------------------
class _Work(threading.local):
    buf: torch.Tensor | None = None


_WORK = _Work()
_MIN_WORK = 1 << 16


def work_buffer(nbytes: int) -> tuple[int, int]:
    """This thread's scratch buffer, at least `nbytes`: (address, size). Grown to the next power of two (at least
    64 KiB) when short, never shrunk: a thread's largest prefill sets it, and every later call reuses it."""
    buf = _WORK.buf
    if buf is None or buf.numel() < nbytes:
        size = max(_MIN_WORK, 1 << max(nbytes - 1, 0).bit_length())
        try:
            buf = torch.empty(size, dtype=torch.uint8)
        except RuntimeError as e:  # torch's allocator reports exhaustion as a RuntimeError
            raise MemoryError(f"native kernels: no {size} bytes for a work buffer ({e})") from e
        _WORK.buf = buf
    return buf.data_ptr(), buf.numel()


def _work_size(lib: Any, fn: str, m: int, k: int) -> int:
    """Bytes of scratch kernel `fn` needs for m x k inputs on the current thread count."""
    return _sized(lib, fn, m, k, _threads)


@functools.lru_cache(maxsize=4096)
def _sized(lib: Any, fn: str, m: int, k: int, threads: int) -> int:
    return int(getattr(lib, fn)(m, k, threads))


def _check_rc(rc: int, what: str) -> None:
    if rc == -1:
        raise MemoryError(f"{what}: out of memory")
    if rc:
        raise RuntimeError(f"{what} failed ({rc}: a work buffer under its sc_*_work size is a binding bug)")


# ---- kernels -------------------------------------------------------------------------------------------------------
def sc_step(m: StepModel, x: int, pos: int, n_gauge: int, keys: Any, values: Any, cap: int, out: int, queries: int,
            gauge: int) -> int:
    """One decode step through csrc/step.c (see `sinkchat.decode.native_step`), in this thread's work buffer;
    0, or nonzero (-1: out of memory). `gauge`: the address of fp32 [L, 3] (first / newest / recalled shares)."""
    lib = _lib()
    ptr, size = work_buffer(lib.sc_step_work(ctypes.byref(m), cap))
    return lib.sc_step(ctypes.byref(m), x, pos, n_gauge, keys, values, cap, out, queries, gauge, ptr, size)


def sc_step_layers(m: StepModel, layers: StepLayers | None, x: int, pos: int, n_gauge: int, keys: Any, values: Any,
                   caps: Any, ns: Any, most: int, out: int, queries: int, gauge: int) -> int:
    """`sc_step` with per-layer extras (None: the model's own, as sc_step) and cache slices (caps / ns: int arrays
    [L]; most = max ns); 0, or nonzero (-1: out of memory, -3: a slice outside its buffer)."""
    lib = _lib()
    ptr, size = work_buffer(lib.sc_step_work(ctypes.byref(m), most))
    return lib.sc_step_layers(ctypes.byref(m), None if layers is None else ctypes.byref(layers), x, pos, n_gauge, keys, values, caps, ns, out,
                              queries, gauge, ptr, size)


def sc_prefill(m: StepModel, x: int, t: int, pos: int, n_out: int, keys: Any, values: Any, cap: int, out: int,
               off: int = 0, queries: int | None = None) -> int:
    """T tokens at positions pos..pos+T-1 (slots off+pos..: `off` recalled-memory slots come first) through
    csrc/prefill.c (see `sinkchat.decode.native_prefill`), in this thread's work buffer; `queries` (an address, or
    None) gets the last row's pre-RoPE queries [L, H*D]. 0, or nonzero (-1: out of memory, -3: rows outside the
    cache)."""
    lib = _lib()
    ptr, size = work_buffer(lib.sc_prefill_work(ctypes.byref(m), t, cap))
    return lib.sc_prefill(ctypes.byref(m), x, t, pos, off, n_out, keys, values, cap, out, queries, ptr, size)


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
    return _lib().kv_evict(keys.data_ptr(), values.data_ptr(), h, cap, d, start, count, n, _ptr(cs), _ptr(sn),
                           0 if cs is None else cs.numel(), int(keys.dtype == torch.bfloat16)) == 0


def q4_matmul(x: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] fp32 -> [M, N] fp32 through `pack_q4` weights."""
    return _packed_matmul("q4", x, qw, sw, bias, (4, RG, 4), (2, RG))


def q40_matmul(x: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] fp32 -> [M, N] fp32 through `pack_q40` weights (Q4_0: w = d·(q − 8) per 32), plus bias [N] if given:
    the same bits as `q4_matmul` on the same tensor packed as q4 (m = −8·d)."""
    return _packed_matmul("q40", x, qw, sw, bias, (4, RG, 4), (RG,))


def q8g_matmul(x: torch.Tensor, hw: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] fp32 -> [M, N] fp32 through `pack_q8g` weights (w = d·q + m per 16 along K), plus bias [N] if given."""
    return _packed_matmul("q8g", x, hw, sw, bias, (QB // 4, RG, 4), (2, 2, RG))


def q80_matmul(x: torch.Tensor, hw: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] fp32 -> [M, N] fp32 through `pack_q80` weights (Q8_0: w = d·q per 32), plus bias [N] if given: the
    same bits as `q8g_matmul` on the same tensor packed as q8g (d per 16, m = 0)."""
    return _packed_matmul("q80", x, hw, sw, bias, (QB // 4, RG, 4), (RG,))


def q50_matmul(x: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] fp32 -> [M, N] through `int5.pack_q50` weights (Q5_0: w = d·(u − 16) per 32), + bias: q8g's bits."""
    return _packed_matmul("q50", x, qw, sw, bias, (5, RG, 4), (RG,))


def q51_matmul(x: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] fp32 -> [M, N] through `int5.pack_q51` weights (Q5_1: w = d·u + m per 32), + bias: q8g's bits."""
    return _packed_matmul("q51", x, qw, sw, bias, (5, RG, 4), (2, RG))


def q5k_matmul(x: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] fp32 -> [M, N] through `int5.pack_q5k` weights (Q5_K: w = (d·sc_j)·u − dmin·mn_j per 32), + bias:
    q8k's bits."""
    return _k_matmul("q5k_matmul", x, qw, sw, bias, (5, RG, 4), abi.Q4K_SCALES)


def _packed_matmul(name: str, x: torch.Tensor, w: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None,
                   wtail: tuple[int, ...], stail: tuple[int, ...]) -> torch.Tensor:
    """x [M, K] fp32 -> [M, N] through the `name` layout's kernel (`<name>_matmul`, work from `sc_<name>_work`):
    weights [N/16, K/32, *wtail] uint8, scales [N/16, K/32, *stail] fp16, both contiguous, checked first."""
    n = w.shape[0] * RG
    return _matmul(name, x, w, sw, bias, wtail, QB, lambda k: (n // RG, k // QB, *stail), torch.float16)


def _k_matmul(fn: str, x: torch.Tensor, w: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None,
              block: tuple[int, ...], scales: int) -> torch.Tensor:
    """q4k / q8k / q6k / q5k: x [M, K] fp32 -> [M, N] fp32 through weight blocks `w` [N/16, K/32, *block] and K-quant
    scales `sw` uint8 [N/16, K/256, scales] (layouts.pack_q4k / pack_q8k), plus bias [N] if given."""
    n = w.shape[0] * RG
    return _matmul(fn[:3], x, w, sw, bias, block, QK, lambda k: (n // RG, k // QK, scales), torch.uint8)


def _matmul(name: str, x: torch.Tensor, w: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None,
            wtail: tuple[int, ...], kmul: int, sshape: Any, sdtype: torch.dtype) -> torch.Tensor:
    """The one binding of a layout's matmul `<name>_matmul`: shapes checked (K a multiple of `kmul`, scales of
    `sshape(K)` in `sdtype`), the thread's work buffer, the call, its return code."""
    x = x.float().contiguous()
    m, k = x.shape
    n = w.shape[0] * RG
    if w.shape[1:] != (k // QB, *wtail) or k % kmul or w.dtype != torch.uint8 or not w.is_contiguous():
        more = f" (K % {kmul} == 0)" if kmul != QB else ""
        raise ValueError(f"{name} weights {tuple(w.shape)} do not fit x {tuple(x.shape)}{more}")
    if sw.shape != sshape(k) or sw.dtype != sdtype or not sw.is_contiguous():
        raise ValueError(f"{name} scales {tuple(sw.shape)} {sw.dtype} do not fit the weights")
    if bias is not None:
        bias = bias.float().contiguous()
        if bias.numel() != n:
            raise ValueError(f"bias of {bias.numel()} for {n} outputs")
    lib = _lib()
    ptr, size = work_buffer(_work_size(lib, f"sc_{name}_work", m, k))
    y = torch.empty(m, n)
    _check_rc(getattr(lib, f"{name}_matmul")(x.data_ptr(), m, k, n, w.data_ptr(), sw.data_ptr(), _ptr(bias),
                                             y.data_ptr(), ptr, size), f"{name}_matmul")
    return y


def q4k_matmul(x: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] fp32 -> [M, N] fp32 through `pack_q4k` weights (Q4_K: w = (d·sc_j)·q − dmin·mn_j per 32), + bias."""
    return _k_matmul("q4k_matmul", x, qw, sw, bias, (4, RG, 4), abi.Q4K_SCALES)


def q8k_matmul(x: torch.Tensor, hw: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] fp32 -> [M, N] fp32 through `pack_q8k` weights (Q5_K / Q6_K: w = (d·sc_j)·q − dmin·mn_j per 16)."""
    return _k_matmul("q8k_matmul", x, hw, sw, bias, (QB // 4, RG, 4), abi.Q8K_SCALES)


def q6k_matmul(x: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] fp32 -> [M, N] fp32 through `pack_q6k` weights (Q6_K at its own bits: w = (d·sc_j)·q per 16), + bias:
    the same bits as `q8k_matmul` on the same tensor packed as q8k (csrc/rows512.h: q6k_bytes)."""
    return _k_matmul("q6k_matmul", x, qw, sw, bias, (6, RG, 4), abi.Q6K_SCALES)


def q8_matmul(x: torch.Tensor, hw: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 -> [M, Vpadded] fp32 through a `pack_q8` table with per-row scales `scale` [Vpadded]."""
    x = x.float().contiguous()
    m, k = x.shape
    n = hw.shape[0] * RG
    if hw.shape[1:] != (k // 4, RG, 4) or k % QB or hw.dtype != torch.uint8 or not hw.is_contiguous():
        raise ValueError(f"q8 table {tuple(hw.shape)} does not fit x {tuple(x.shape)}")
    if scale.shape != (n,) or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError(f"q8 scales {tuple(scale.shape)} do not fit the table")
    lib = _lib()
    ptr, size = work_buffer(_work_size(lib, "sc_q8_work", m, k))
    y = torch.empty(m, n)
    _check_rc(lib.q8_matmul(x.data_ptr(), m, k, n, hw.data_ptr(), scale.data_ptr(), y.data_ptr(), ptr, size),
              "q8_matmul")
    return y


def quantize_activations(x: torch.Tensor, which: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The matmuls' activation quantizer alone, on `which` variant: x [M, K] fp32 -> (xq int8 [M, K], dx [M, K/32],
    sx [M, K/32]): per 32 values, the int8 values, their scale and scale x their sum."""
    x = x.float().contiguous()
    m, k = x.shape
    if k % QB:
        raise ValueError(f"K = {k} is not a multiple of {QB}")
    xq, dx, sx = torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // QB), torch.empty(m, k // QB)
    lib = library(which)
    if lib is None:
        raise RuntimeError(f"native kernels unavailable: {load_error(which)}")
    lib.sc_quant(x.data_ptr(), m, k, xq.data_ptr(), dx.data_ptr(), sx.data_ptr())
    return xq, dx, sx
