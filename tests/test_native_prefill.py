"""The native prefill (csrc/prefill.c through decode/native_prefill.py) against transformers' forward, the path it
replaces for chunks of more than one token.

Both engines hold the same packed weights and the same native decode step; the reference's step has its chunk path
switched off (`step.prefill = None`), so its chunks go through transformers' forward on the same GEMM kernels. A
stream of 90 tokens goes through a 40-slot sink cache in chunks (evictions between them), every chunk's logits asked
for (as `ppl` asks), and the logits of every row and the cache's keys and values must agree: tiny Llama / Qwen2
models (test_native's shapes), Qwen3, Mistral, Phi-3 (full and partial rotary), q4, q8g and all four layouts mixed,
fp32 and bf16 caches, several chunk sizes; and the C prefill is bit-identical at 1 and 2 threads.

The sharp check is the other reference: the native decode step fed the same chunks one token at a time (evicting
where the chunked engine evicts). Same GEMMs (one row or many: bit-identical per row), the same RMSNorm, RoPE,
attention and SiLU code: the caches must be equal bit for bit, and so must the logits (to 1e-6 where the output head
runs in torch, whose matmul rounds differently at 1 and T rows: seen 6e-7).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fakes import WordTokenizer
from sinkchat.config import CacheConfig, SamplingConfig
from sinkchat.core.cache_policy import chunk_sizes
from sinkchat.core.engine import Engine
from sinkchat.decode import select
from kernel_helpers import NATIVE, SIMD, best_kernels, bits, on  # noqa: F401  (best_kernels: the fixture)
from sinkchat.kernels import native

pytestmark = [NATIVE, pytest.mark.usefixtures("best_kernels")]

IDS = [(37 * i + 3) % 120 + 1 for i in range(90)]  # 90 tokens through a 40-slot cache: evictions between chunks


def engines(model: Any, kv: str, chunk: int, **kw: Any) -> tuple[Engine, Engine]:
    """(reference, native): the native decode step in both; the reference's chunks through transformers."""
    ref, fast = (Engine(model, WordTokenizer(), CacheConfig("sink", 4, 40, 5), SamplingConfig(temperature=0),
                        step=select(model, "native"), kv_dtype=kv, prefill_chunk=chunk, **kw) for _ in range(2))
    assert type(fast.step).__name__ == "NativeStep" and fast.step.prefill is not None
    ref.step.prefill = None
    return ref, fast


def stream(eng: Engine, ids: list[int]) -> torch.Tensor:
    """Every row's logits [len(ids), V], fed in the engine's chunks."""
    out = [item for item in eng.feed_ids(ids, all_logits=True) if isinstance(item, torch.Tensor)]
    return torch.cat(out)


def compare(model: Any, kv: str, chunk: int, logits_atol: float, k_atol: float, v_atol: float) -> float:
    """Stream IDS through both engines; assert the logits and caches agree; return the largest logit difference."""
    ref, fast = engines(model, kv, chunk)
    a, b = stream(ref, IDS), stream(fast, IDS)
    assert a.shape == b.shape and a.shape[0] == len(IDS) and a.abs().max() > 0.1
    assert fast.ledger.evicted >= 50 and fast.cache.length == ref.cache.length == len(fast.ledger.ids)
    torch.testing.assert_close(b, a, rtol=0, atol=logits_atol)
    rtol = 2**-7 if kv == "bfloat16" else 0  # an int8 tie flipped upstream can move a cached value by one bf16 step
    for la, lb in zip(ref.cache.layers, fast.cache.layers):
        n = la.length
        assert lb.keys.dtype == la.keys.dtype == {"float32": torch.float32, "bfloat16": torch.bfloat16}[kv]
        torch.testing.assert_close(lb.keys[:, :, :n].float(), la.keys[:, :, :n].float(), rtol=rtol, atol=k_atol)
        torch.testing.assert_close(lb.values[:, :, :n].float(), la.values[:, :, :n].float(), rtol=rtol, atol=v_atol)
    return float((b - a).abs().max())


def same_as_the_decode_step(model: Any, kv: str, chunk: int, logits_atol: float) -> None:
    """The chunks through the C prefill against the same chunks one token at a time through the C decode step."""
    ref, fast = engines(model, kv, chunk)
    rows, pos = [], 0
    for n in chunk_sizes(len(IDS), fast.max_chunk):
        list(ref._make_room(n))  # evict where the chunked engine does, then feed the chunk token by token
        for tok in IDS[pos : pos + n]:
            rows.append(stream(ref, [tok])[-1])
        pos += n
    a, b = torch.stack(rows), stream(fast, IDS)
    assert fast.ledger.evicted >= 50 and ref.ledger.evicted == fast.ledger.evicted
    torch.testing.assert_close(b, a, rtol=0, atol=logits_atol)
    for la, lb in zip(ref.cache.layers, fast.cache.layers):
        assert la.length == lb.length
        assert torch.equal(lb.keys[:, :, : la.length], la.keys[:, :, : la.length])
        assert torch.equal(lb.values[:, :, : la.length], la.values[:, :, : la.length])


# Against transformers: the same GEMMs (the same int8 rows give bit-identical q/k/v), but RMSNorm, RoPE's cos/sin,
# SiLU and the softmax round differently (C in order vs torch's vectorized sums, sdpa's blocked softmax): <= 3e-7 on
# logits where nothing flips. Where an activation sits on an int8 rounding tie one ulp flips it, in one row of one
# layer, and the changed k/v stays in the cache for the later rows: common here (up to 66 of 90 rows off by > 1e-4),
# seen up to 1.3e-2 on logits, 4.7e-2 on keys, 7.8e-3 on values (test_native's models), 1.5e-2 / 6.4e-2 / 4.4e-2
# (test_native_archs'); tolerances ~3x that (the decode step's tests see the same flips). The decode-step check
# above is the exact one. What they must catch, measured with scratch edits of prefill.c (tests/README.md): a query
# seeing one slot past its own: 0.53-1.2 on logits; k and v stored swapped: 0.84-1.5; RoPE at slot pos + t + 1 moves
# no logit of the chunk (RoPE is relative) but every cached key (the cache checks); SiLU x 1.0001: only the exact
# check (each failed 14-35 of this file's tests).
@pytest.mark.parametrize("kind,tied,shape", [("llama", False, {}), ("llama", True, {}), ("qwen2", True, "WIDE"),
                                             ("qwen2", False, "D128"), ("llama", False, "D64")])
@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
@pytest.mark.parametrize("chunk", [36, 7])
def test_native_prefill_matches_the_transformers_forward_across_evictions(kind, tied, shape, kv, chunk):
    import test_native

    model = test_native._native_model(kind, tied, **(getattr(test_native, shape) if shape else {}))
    compare(model, kv, chunk, 4e-2, 0.15, 2e-2)


@pytest.mark.parametrize("kind,kw,weights", [("qwen3", {}, "q4"), ("mistral", {}, "q8g"), ("phi3", {}, "q4"),
                                             ("phi3", {"partial_rotary_factor": 0.5}, "mixed"),
                                             ("qwen2", {}, "mixed"), ("llama", "K_SHAPE", "four")])
@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
def test_native_prefill_on_every_architecture_and_layout(kind, kw, weights, kv):
    """test_native_archs' models (3 layers, vocab 512): exact against the decode step, close to transformers."""
    import test_native_archs as archs
    import test_qk

    choose = {"q4": archs.q4, "q8g": archs.q8g, "mixed": archs.mixed, "four": test_qk._four}[weights]
    model = archs.pack(archs.build(kind, **(test_qk.K_SHAPE if kw == "K_SHAPE" else kw)), choose)
    same_as_the_decode_step(model, kv, 16, 2e-6)  # the lm_head is untied, in torch
    compare(model, kv, 16, 4e-2, 0.2, 0.1)


def test_only_the_last_row_unless_all_are_asked_and_the_cache_length_follows():
    import test_native

    model = test_native._native_model("llama")
    ref, fast = engines(model, "float32", 36)
    full = stream(ref, IDS[:30])
    out = [x for x in fast.feed_ids(IDS[:30]) if isinstance(x, torch.Tensor)]
    assert out == [] and fast.cache.length == ref.cache.length == 30 and fast.ledger.ids == IDS[:30]
    assert fast.last_logits.shape == full[-1].shape
    torch.testing.assert_close(fast.last_logits, full[-1], rtol=0, atol=5e-3)
    # then decoding continues from the prefilled cache as the reference's does
    for e in (ref, fast):
        e.stop_ids = set()
        list(e.generate(max_tokens=10))
    assert fast.last_reply_ids == ref.last_reply_ids


def test_an_interrupted_chunk_leaves_cache_and_ledger_as_before(monkeypatch):
    import test_native

    model = test_native._native_model("llama")
    _, fast = engines(model, "float32", 36)
    list(fast.feed_ids(IDS[:20]))
    before = (fast.cache.length, list(fast.ledger.ids))

    def interrupted(*args: Any) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(native, "sc_prefill", interrupted)
    with pytest.raises(KeyboardInterrupt):
        list(fast.feed_ids(IDS[20:30]))
    assert (fast.cache.length, list(fast.ledger.ids)) == before


def test_models_the_c_prefill_does_not_compute_keep_transformers(monkeypatch):
    import dataclasses

    import test_native
    from sinkchat.decode.native_prefill import NativePrefill, refusal
    from sinkchat.model.spec import ModelSpec

    model = test_native._native_model("llama")
    spec = ModelSpec.from_model(model)
    assert refusal(spec) is None
    for change in (dict(model_type="gemma2"), dict(attn_softcap=50.0), dict(embed_scale=8.0),
                   dict(norm=dataclasses.replace(spec.norm, sandwich=True))):
        assert NativePrefill.for_step(None, dataclasses.replace(spec, **change)) is None, change
    monkeypatch.setenv("SINKCHAT_PREFILL", "hf")
    assert select(model, "native").prefill is None


def _threaded_runs(model: Any, kv: str) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    from test_threads import pool

    runs = []
    for t, deal in [(1, False), (2, False), (2, True)]:  # dealt: every thread computes its share
        with pool(t, deal):
            _, fast = engines(model, kv, 36)
            logits = stream(fast, IDS)
            runs.append((logits, [x.clone() for layer in fast.cache.layers for x in (layer.keys, layer.values)]))
    return runs


@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
def test_the_prefill_is_bit_identical_at_any_thread_count(kv):
    import test_native

    model = test_native._native_model("qwen2", True, **test_native.WIDE)  # 6 heads on 2 kv heads, a tied table
    same_as_the_decode_step(model, kv, 36, 0)  # the tied int8 table in C: logits bit for bit too
    runs = _threaded_runs(model, kv)
    for logits, cache in runs[1:]:
        assert torch.equal(bits(logits), bits(runs[0][0]))
        for x, y in zip(cache, runs[0][1]):
            assert torch.equal(bits(x), bits(y))


MQA = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=1, intermediate_size=128)  # G >= SC_TILE


@pytest.mark.parametrize("variant", SIMD)
@pytest.mark.parametrize("shape", ["D64", "D128", "MQA"])
@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
def test_every_simd_prefill_attends_in_tiles_with_the_decode_steps_bits(variant, shape, kv):
    """The prefill attends in tiles (csrc/attend_v16.h: sc_heads_attend: a kv head's query heads for a few rows,
    the K / V rows converted once per 32 slots), each query summed as the decode step sums it alone: so every SIMD
    build's prefill gives its own decode step's caches bit for bit. Head dims 64 and 128 (the tiled ones), 3 and 2
    query heads on one kv head (and 32 on one: a tile a row), chunks of up to 36 rows (tiles of up to 9 and 12 rows)
    over a 40-slot cache (two slot blocks, the second partial; odd and even slot counts)."""
    import test_native

    model = test_native._native_model("llama", True, **(MQA if shape == "MQA" else getattr(test_native, shape)))
    with on(variant):
        same_as_the_decode_step(model, kv, 36, 0)  # the tied int8 table in C: logits bit for bit too
