"""The q6k layout on the neon variant (csrc/rows_neon.h: q6k_bytes, matmul_neon_k.c: q6k_scales), cross-compiled and
run under qemu-aarch64 as tests/test_neon.py runs the other layouts (its `neon` fixture; slow, skipped without the
tools): every q6k matmul bit for bit the x86 reference's, and bit for bit q8k's on the same tensor, on 1 and 3 threads.
"""

from __future__ import annotations

import pytest
import torch

from sinkchat.kernels import native
from test_neon import Calls, check_pairs, neon  # noqa: F401  (the fixture)
from test_q6k import q6k_case

pytestmark = pytest.mark.slow


def _q6k_calls(calls: Calls) -> list[tuple[int, int]]:
    """Each case as q6k then q8k: (index of the q6k call, of the q8k call)."""
    g, pairs = torch.Generator().manual_seed(4), []
    for n, k, m in [(16, 256, 1), (48, 512, 1), (208, 768, 1), (48, 512, 5), (80, 256, 130)]:
        x = torch.randn(m, k, generator=g)
        x[:, 5] = 30.0
        values = q6k_case(n, k, seed=n + m)
        for bias in (None, torch.randn(n, generator=g)):
            a = calls.add("q6k_matmul", x, m, k, n, *native.pack_q6k(*values), bias, torch.empty(m, n), None, 0)
            b = calls.add("q8k_matmul", x, m, k, n, *native.pack_q8k(*values), bias, torch.empty(m, n), None, 0)
            pairs.append((a, b))
    return pairs


def test_q6k_is_the_references_bits_and_q8ks(neon):
    check_pairs(neon, _q6k_calls)
