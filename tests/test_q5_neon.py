"""The q5 blocks on the neon variant (csrc/rows_neon.h: q5_bytes; matmul_neon.c: q51_scales; matmul_neon_k.c:
q5k_scales), cross-compiled and run under qemu-aarch64 as tests/test_neon.py runs the other layouts (its `neon`
fixture; slow, skipped without the tools): every q50 / q51 / q5k matmul bit for bit the x86 reference's, and bit for
bit q8g's / q8k's on the same tensor, on 1 and 3 threads.
"""

from __future__ import annotations

import pytest
import torch

from test_neon import Calls, check_pairs, neon  # noqa: F401  (the fixture)
from test_q5 import _old, _pack, q5_case

pytestmark = pytest.mark.slow


def _q5_calls(calls: Calls) -> list[tuple[int, int]]:
    """Each case as q5 then as the 8-bit layout: (index of the q5 call, of the 8-bit one)."""
    g, pairs = torch.Generator().manual_seed(4), []
    for layout in ("q50", "q51", "q5k"):
        for n, k, m in [(16, 256, 1), (208, 768, 1), (48, 512, 5), (80, 256, 130)]:
            x = torch.randn(m, k, generator=g)
            x[:, 5] = 30.0
            values = q5_case(layout, n, k, seed=n + m)
            old = "q8k_matmul" if layout == "q5k" else "q8g_matmul"
            for bias in (None, torch.randn(n, generator=g)):
                a = calls.add(f"{layout}_matmul", x, m, k, n, *_pack(layout, values), bias, torch.empty(m, n), None, 0)
                b = calls.add(old, x, m, k, n, *_old(layout, values), bias, torch.empty(m, n), None, 0)
                pairs.append((a, b))
    return pairs


def test_q5_is_the_references_bits_and_the_8_bit_layouts(neon):
    check_pairs(neon, _q5_calls)
