"""Which kernel variants this machine can run, and the best of them: its architecture, its CPU's flags
(/proc/cpuinfo), and whether the C compiler takes each variant's flags. No state but caches: `native` picks and loads.
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
from pathlib import Path

from sinkchat.kernels import abi

# The variants, best first: what each needs of the CPU (/proc/cpuinfo flags, or an ARM CPU's features) and why it
# ranks there. Each runs only on its own architecture (abi.ARCH).
CPU_FLAGS = {
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"),  # 16 rows a register, vpdpbusd
    "avxvnni": ("avx2", "fma", "f16c", "avx_vnni"),  # 8 rows a register, vpdpbusd (Alder Lake and later)
    "avx2": ("avx2", "fma", "f16c"),  # 8 rows a register, vpmaddubsw + vpmaddwd (Haswell / Zen 1 and later)
    "neon": ("asimd", "asimddp"),  # 4 rows a register, sdot (the ARMv8.2 dot product: Neoverse N1+, Apple M1+)
}
VARIANTS = ("avx512", "avxvnni", "avx2", "neon", "ref")
SIMD = VARIANTS[:-1]


@functools.lru_cache(maxsize=1)
def cpu() -> tuple[frozenset[str], str]:
    """The CPU's flags (x86 "flags", ARM "Features") and model name, from /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset(), ""
    lines = text.splitlines()
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith(("flags", "Features"))), [])
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    return frozenset(flags), model


def machine() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


@functools.lru_cache(maxsize=1)
def compiler() -> str | None:
    for name in (os.environ.get("CC"), "gcc", "cc"):
        if name and shutil.which(name):
            return name
    return None


def lacks(variant: str) -> str | None:
    """What the CPU lacks for `variant` ("the CPU lacks avx512_vnni", "not an x86-64 CPU"), or None."""
    if variant == "ref":
        return None
    arch = abi.ARCH[variant.split("_")[0]]  # avxvnni_evex: avxvnni's
    if machine() != arch:
        return f"{variant} is {arch} code and this is {machine() or 'an unknown machine'}"
    missing = [f for f in {**CPU_FLAGS, **abi.TEST_VARIANTS}[variant] if f not in cpu()[0]]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


@functools.lru_cache(maxsize=None)
def _accepts(variant: str) -> bool:
    return abi.accepts(compiler(), variant)  # type: ignore[arg-type]


def unsupported(variant: str) -> str | None:
    """Why `variant` cannot be built here at all (no compiler; a CPU without its instructions; a compiler without
    its flags), or None: then the library must build and load, and a failure is a bug (tests fail on it rather
    than skip)."""
    if compiler() is None:
        return "no C compiler found (CC, gcc or cc)"
    reason = lacks(variant)
    if reason is None and not _accepts(variant):
        reason = f"{compiler()} does not take {' '.join(f for f in abi.CFLAGS[variant] if f.startswith('-m'))}"
    return reason


def best() -> str:
    """The fastest SIMD variant this machine runs and its compiler builds (avx512, avxvnni, avx2 on x86-64; neon on
    aarch64), else the last of its architecture's (whose `unsupported` then says why no native kernels run here)."""
    mine = [v for v in SIMD if abi.ARCH[v] == machine()] or [SIMD[0]]
    return next((v for v in mine if unsupported(v) is None), mine[-1])
