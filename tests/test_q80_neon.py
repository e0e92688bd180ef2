"""The q80 layout on the neon variant (csrc/matmul_neon.c: q80_scales on rows_neon.h's q8 loop), cross-compiled and
run under qemu-aarch64 as tests/test_neon.py runs the other layouts (its `neon` fixture; slow, skipped without the
tools): every q80 matmul bit for bit the x86 reference's, and bit for bit q8g's on the same tensor, on 1 and 3
threads. (q4k's 6-bit scales on neon: tests/test_neon.py, over k_case's extremes.)
"""

from __future__ import annotations

import pytest
import torch

from sinkchat.kernels import native
from test_neon import Calls, check_pairs, neon  # noqa: F401  (the fixture)
from test_q80 import _as_q8g, q80_case

pytestmark = pytest.mark.slow


def _q80_calls(calls: Calls) -> list[tuple[int, int]]:
    """Each case as q80 then q8g: (index of the q80 call, of the q8g call)."""
    g, pairs = torch.Generator().manual_seed(4), []
    for n, k, m in [(16, 32, 1), (48, 512, 1), (208, 768, 1), (48, 512, 5), (80, 256, 130)]:
        x = torch.randn(m, k, generator=g)
        x[:, 5] = 30.0
        values = q80_case(n, k, seed=n + m)
        for bias in (None, torch.randn(n, generator=g)):
            a = calls.add("q80_matmul", x, m, k, n, *native.pack_q80(*values), bias, torch.empty(m, n), None, 0)
            b = calls.add("q8g_matmul", x, m, k, n, *_as_q8g(*values), bias, torch.empty(m, n), None, 0)
            pairs.append((a, b))
    return pairs


def test_q80_is_the_references_bits_and_q8gs(neon):
    check_pairs(neon, _q80_calls)
