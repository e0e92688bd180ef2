"""The recall memory's own small C library (csrc/memk.c): the bf16 index's dots and the rotation of block keys, each
giving the bits of the torch code it replaces, built once with the system's C compiler into the cache dir and
loaded with ctypes; where it cannot be (no compiler, SINKCHAT_KERNELS=torch, an odd shape) the torch code runs.

Why: a choice of blocks scores every block in every layer, twice per 256-token chunk (the chunk, then the feed's
last token), and torch's bf16 matmul on a CPU without AVX-512 BF16 is a dot loop: with 100k tokens in memory
(1,550 blocks) `Index.scores` took 112-124 ms of CPU time a choice, 35 ms with the C dots (236 blocks, 16k tokens:
22 against 6.8 ms), 15 ms since they take eight rows at once (sums reduced, rounded and maxed per block in vectors:
the dots alone 20.4 -> 10.5 ms, the same bits); a block's keys are rotated twice (its slots -> the recall
position, back for its index rows) and the queue's at every call, 2.1-2.5 ms of CPU a call in torch against
0.5-0.6 in C (30 layers x 3 heads x 64 tokens; 1 thread, a 2-core AMD EPYC at load 4-5, `time.thread_time`). In
a cProfile of 10 chunks at 16k tokens the memory's own Python went from ~340 to ~240 ms a chunk (choosing 83 -> 33,
rotating 91 -> 31) at a higher load.
Why its own library and not the step's (sinkchat/kernels): these are no part of the step's ABI, and a memory
without them still works (the torch code is the reference the tests hold them to: tests/test_memory_native.py).

The dots follow torch 2.x's reduced-precision dot (ATen `dot_with_fp32_arith`, which its bf16 matmul [G, W] x
[W, N] runs per output on AVX2): 64 fp32 partial sums then a halving tree (csrc/memk.c). That order is torch's
choice, not a promise (an AVX-512 BF16 CPU runs oneDNN instead), so the C dots run only where this process's torch
gives their bits on a probe whose dots other orders change (`agrees`: ~7,000 dots, once per width; about a third
of them differ between torch's own two bf16 kernels), and the tests hold them to it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "memk.c"
_COMMON = ("-shared", "-fPIC", "-fno-math-errno", "-ffp-contract=off", "-fvisibility=hidden", "-std=gnu11")
FLAGS = {"avx2": ("-O3", "-mavx2", "-mfma", *_COMMON), "ref": ("-O2", *_COMMON)}
_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_API = {"mk_avx2": (_I, []), "mk_dots": (_I, [_P, _L, _I, _I, _I, _P, _I, _I, _P, _P, _I]),
        "mk_rotate": (_I, [_P, _I, _L, _I, _I, _I, _P, _P, _P, _I])}

_enabled = True  # use(): tests switch the C paths off to get the torch ones


def use(on: bool) -> bool:
    """Run the memory's C paths (True) or its torch code (False) in this process; returns the previous setting."""
    global _enabled
    prev, _enabled = _enabled, on
    return prev


def _flavour() -> str:
    from sinkchat.kernels.variants import cpu, machine

    flags = cpu()[0]
    return "avx2" if machine() == "x86_64" and {"avx2", "fma"} <= flags else "ref"


@functools.lru_cache(maxsize=None)
def library(flavour: str | None = None) -> Any | None:
    """The compiled library (`flavour`: "avx2" or "ref", default the best this CPU runs), or None where it cannot
    be built or loaded (logged once)."""
    from sinkchat.config import cache_dir
    from sinkchat.kernels.variants import compiler

    flavour = flavour or _flavour()
    cc = compiler()
    try:
        source = SOURCE.read_bytes()
    except OSError:  # an install without the source (pyproject's package-data must name memory/csrc/*.c)
        return None
    if cc is None:
        return None
    h = hashlib.sha256(" ".join(FLAGS[flavour]).encode() + source).hexdigest()[:16]
    out = cache_dir() / "native" / f"sinkchat-memk-{flavour}-{h}.so"
    if not out.exists():
        err = _build(cc, FLAGS[flavour], out)
        if err:
            log.warning("recall memory kernels did not compile (torch code instead): %s", err)
            return None
    try:
        lib = ctypes.CDLL(str(out))
        for name, (res, args) in _API.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
    except (OSError, AttributeError) as e:
        log.warning("recall memory kernels not loaded from %s (%s)", out, e)
        return None
    return lib


def _build(cc: str, flags: tuple[str, ...], out: Path) -> str | None:
    """Compile csrc/memk.c into `out`, atomically; None, or why not (the compiler's last line)."""
    from sinkchat.kernels.abi import compile_shared

    return compile_shared(cc, flags, [SOURCE], out, tail=1)


def _lib(flavour: str | None = None) -> Any | None:
    """The library, unless use(False) or SINKCHAT_KERNELS=torch (no native code at all) says otherwise."""
    from sinkchat.config import env

    if not _enabled or env("SINKCHAT_KERNELS") == "torch":
        return None
    return library(flavour)


def dots(rows: torch.Tensor, qt: torch.Tensor, r: int = 0, flavour: str | None = None) -> torch.Tensor | None:
    """Per batch the dots of bf16 rows [B, N, W] (each batch contiguous, batches any stride apart) with bf16 queries
    qt [B, G, W], G >= 2, in the order of torch's per-batch `torch.matmul(qt[b], rows[b].T)` (`index._batched`;
    one column is a matrix-vector product there, another kernel), rounded to bf16: [B, N, G] bf16 (r = 0), or with
    r > 0 their max over each r consecutive rows (a block's), [B, N / r, G] in fp32. None where the C path does not
    run or take the shape."""
    lib = _lib(flavour)
    b, n, w = rows.shape
    g = qt.shape[1]
    ok = rows.dtype == qt.dtype == torch.bfloat16 and rows.stride()[1:] == (w, 1) and qt.is_contiguous()
    ok = ok and rows.device.type == qt.device.type == "cpu"  # a CUDA pointer read on the host would crash
    if lib is None or not ok or qt.shape != (b, g, w) or (r and n % r) or g < 2 or not agrees(w, g, flavour):
        return None
    return _dots(lib, rows, qt, r, flavour)


def _dots(lib: Any, rows: torch.Tensor, qt: torch.Tensor, r: int, flavour: str | None) -> torch.Tensor | None:
    b, n, w = rows.shape
    g = qt.shape[1]
    out = torch.empty(b, n // r, g) if r else torch.empty(b, n, g, dtype=torch.bfloat16)  # [B, N / r, G] / [B, N, G]
    rc = lib.mk_dots(rows.data_ptr(), rows.stride(0), b, n, w, qt.data_ptr(), g, r, None if r else out.data_ptr(),
                     out.data_ptr() if r else None, int(flavour == "ref"))
    return out if rc == 0 else None


def rotate(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype,
           flavour: str | None = None) -> torch.Tensor | None:
    """Keys k [..., n, D] (bf16 or fp32) rotated by fp32 cos / sin [n, R] as `blocks.rotate` does, in `out_dtype`
    (fp32, or bf16 rounded to nearest even as `.to(torch.bfloat16)` rounds); None where the C path does not run."""
    lib = _lib(flavour)
    ok = k.dtype in (torch.bfloat16, torch.float32) and out_dtype in (torch.bfloat16, torch.float32)
    ok = ok and k.device.type == cos.device.type == sin.device.type == "cpu"
    if lib is None or not ok or k.dim() < 2 or cos.dtype != torch.float32 or k.numel() == 0:
        return None
    k = k.contiguous()
    n, d = k.shape[-2:]
    cos, sin = cos.contiguous(), sin.contiguous()  # [n, R]
    if cos.shape[0] != n or cos.shape != sin.shape:
        return None
    out = torch.empty(k.shape, dtype=out_dtype)
    rc = lib.mk_rotate(k.data_ptr(), int(k.dtype == torch.bfloat16), k.numel() // (n * d), n, d, cos.shape[1],
                       cos.data_ptr(), sin.data_ptr(), out.data_ptr(), int(out_dtype == torch.bfloat16))
    return out if rc == 0 else None


def probe(g: torch.Generator, b: int, n: int, w: int, cols: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 rows [b, n, w] and queries [b, w, cols] whose dots depend on the order of the sum: +-2^22..2^26 at two
    random places of a row among small values, and query columns of ones, powers of two and random values in turn
    (a small value is kept or lost by where the large pair meets in the sum)."""
    x = (torch.randn(b, n, w, generator=g) * 4).bfloat16().float()
    pos = torch.rand(b, n, w, generator=g).argsort(-1)[..., :2]
    big = torch.pow(2.0, torch.randint(22, 27, (b, n, 1), generator=g).float())
    x.scatter_(-1, pos[..., :1], big)
    x.scatter_(-1, pos[..., 1:], -big)
    q = torch.ones(b, w, cols)
    for c in range(1, cols):
        kind = torch.pow(2.0, torch.randint(-2, 3, (b, w), generator=g).float()) if c % 3 == 1 else \
            (torch.randn(b, w, generator=g).abs() + 0.5 if c % 3 == 2 else torch.ones(b, w))
        q[:, :, c] = kind
    return x.bfloat16(), q.bfloat16()


@functools.lru_cache(maxsize=None)
def agrees(w: int, cols: int, flavour: str | None = None) -> bool:
    """Whether the C dots of width `w` with `cols` query columns give this process's torch bits (`index._batched`'s
    per-batch matmul) on a `probe` of 3 x 800 rows: checked once per shape, ~2 ms."""
    lib = _lib(flavour)
    if lib is None or w % 64:
        return False
    rows, qs = probe(torch.Generator().manual_seed(w), 3, 800, w, cols)
    qt = qs.transpose(1, 2).contiguous()  # [B, G, W]
    want = torch.stack([torch.matmul(qt[i], rows[i].T) for i in range(rows.shape[0])]).transpose(1, 2)  # [B, N, G]
    got = _dots(lib, rows, qt, 0, flavour)
    ok = got is not None and torch.equal(got.view(torch.int16), want.contiguous().view(torch.int16))
    if not ok:
        log.info("recall memory: torch's bf16 dots are not the C kernel's here; the index is scored by torch")
    return ok
