"""The prefill's attention tiles over long caches and a recall region: the avx512 build scores a tile's queries two
at a time (csrc/attend_v16.h: block_scores2, V16_PAIRS; head dim 64), each K vector loaded once for both. That may not change a
bit: each query is summed as sc_head_attend_cap sums it alone (the decode step's attention). The 256-bit builds
score one query at a time, so avx512 == avx2 bit for bit checks the pairs, and so does the prefill against the
decode step row by row. Caches of 300+ slots (nine 32-slot blocks, the last partial; odd and even lengths), a region
of recalled slots in front (as the recall memory passes it), head dims 64 (3 query heads on a kv head), 128 (2)
and 16 (a query at a time in every build), fp32 and bf16, random K/V of std 3 (peaked scores).

What they catch, measured with scratch edits of attend_v16.h: block_scores2 storing q1's scores as q0's (14 of the
44 failed); the pair path taken where a query's last block is partial (3 of 44).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernel_helpers import NATIVE, bits, on
from sinkchat.decode import select

pytestmark = NATIVE

SHAPES = {"D64": dict(hidden_size=192, num_attention_heads=3, num_key_value_heads=1, intermediate_size=128),
          "WIDE": dict(vocab_size=1000, hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                       intermediate_size=192),  # head dim 16: a query at a time in every build
          "D128": dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128),
          "WIDE64": dict(vocab_size=1000, hidden_size=384, num_attention_heads=6, num_key_value_heads=2,
                         intermediate_size=192)}  # head dim 64, 3 query heads on each of 2 kv heads


def _model(shape: str) -> Any:
    import test_native

    return test_native._native_model("llama", True, **SHAPES[shape])


def _buffers(step: Any, cap: int, kv: str, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[kv]
    shape = (1, step.n_kv, cap, step.head_dim)
    keys = [(torch.randn(shape, generator=g) * 3).to(dtype) for _ in range(step.n_layers)]
    values = [torch.randn(shape, generator=g).to(dtype) for _ in range(step.n_layers)]
    return keys, values


def _decode(variant: str, threads: int, shape: str, kv: str, pos: int, base: int, used: int) -> list[torch.Tensor]:
    """One decode step at stream slot `pos` over random buffers (a region of `base` slots in front, `used` of them
    attended): logits, queries, gauge and every buffer."""
    from test_threads import pool

    with on(variant), pool(threads, deal=True):
        step = select(_model(shape), "native")
        keys, values = _buffers(step, base + pos + 8, kv, pos)
        extra = {"base": base, "used": used} if base else {}
        out = list(step(17, pos, keys, values, 4, **extra))
    return out + keys + values


def _prefill(variant: str, threads: int, shape: str, kv: str, pos: int, rows: int, base: int, used: int
             ) -> list[torch.Tensor]:
    """A chunk of `rows` tokens at stream slots pos.. over random buffers with a region: every row's logits, the last
    row's queries, every buffer."""
    from test_threads import pool

    with on(variant), pool(threads, deal=True):
        step = select(_model(shape), "native")
        keys, values = _buffers(step, base + pos + rows + 8, kv, pos)
        queries = torch.empty(step.n_layers, step.n_heads * step.head_dim)
        ids = [(37 * i + 3) % 120 + 1 for i in range(rows)]
        logits = step.prefill(ids, pos, keys, values, True, base=base, used=used, queries=queries)
    return [logits, queries] + keys + values


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(bits(x), bits(y)), i


@pytest.mark.parametrize("shape", ["D64", "D128", "WIDE64", "WIDE"])
@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
@pytest.mark.parametrize("pos,base,used", [(299, 0, 0), (290, 40, 33), (200, 64, 64)])
def test_the_decode_step_over_a_region_has_the_same_bits_in_every_build_and_at_any_thread_count(shape, kv, pos, base, used):
    ref = _decode("avx512", 1, shape, kv, pos, base, used)
    for variant, threads in [("avx512", 2), ("avx512", 3), ("avx2", 1), ("avx2", 2)]:
        _same(_decode(variant, threads, shape, kv, pos, base, used), ref)


@pytest.mark.parametrize("shape", ["D64", "D128", "WIDE64"])
@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
@pytest.mark.parametrize("pos,rows,base,used", [(250, 37, 64, 57), (0, 36, 96, 96), (100, 1, 32, 31)])
def test_the_prefills_paired_scores_have_the_same_bits_in_every_build(shape, kv, pos, rows, base, used):
    ref = _prefill("avx512", 1, shape, kv, pos, rows, base, used)
    for variant, threads in [("avx512", 2), ("avx2", 1)]:
        _same(_prefill(variant, threads, shape, kv, pos, rows, base, used), ref)


@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
def test_the_prefill_over_a_region_is_the_decode_step_row_by_row(kv):
    """The chunk's rows through the C prefill (paired scores) and one at a time through the C decode step (a query at
    a time) over the same region: the same caches bit for bit, logits to the torch head's rounding."""
    with on("avx512"):
        step = select(_model("D64"), "native")
        base, used, pos, rows = 64, 50, 120, 20
        ids = [(37 * i + 3) % 120 + 1 for i in range(rows)]
        (k1, v1), (k2, v2) = _buffers(step, base + pos + rows, kv, 5), _buffers(step, base + pos + rows, kv, 5)
        chunk = step.prefill(ids, pos, k1, v1, True, base=base, used=used)
        one = torch.cat([step(t, pos + i, k2, v2, 4, base=base, used=used)[0] for i, t in enumerate(ids)])
    torch.testing.assert_close(chunk, one, rtol=0, atol=1e-6)
    _same(k1 + v1, k2 + v2)
