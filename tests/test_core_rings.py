"""A hybrid model's local rings (`core/hybrid_cache.WindowLayer`): what a Ctrl-C rollback may take back, and what the
rings hold in memory over a long stream.

The rollback rule (issue 32, item 9): a cut message is taken back only where the rings still hold every token the
next query's window must see; once a ring has given one of them up, the message stays (like one that evicted).
Judged by the outcome, not by the rings' counters: a taken-back message must leave a state whose next turn equals,
to fp32 noise, the next turn of an engine that never saw the message.
"""

from __future__ import annotations

import torch

from fakes import CharTokenizer
from test_hybrid import S, F, engine, gemma3, random_ids, stream
from sinkchat.config import CacheConfig, SamplingConfig
from sinkchat.core.engine import Engine
from sinkchat.core.hybrid_cache import WindowLayer
from sinkchat.core.kv_cache import SinkLayer

HISTORY = random_ids(30)
MESSAGE = "abcdefghij" * 4
FOLLOW_UP = "what comes next?"


def _chat_engine(model) -> Engine:
    """Window 8 (rings of 7, compacted every 16 appended slots), chunks of 4, a cache that never evicts."""
    eng = Engine(model, CharTokenizer(), CacheConfig("sink", 4, 200, 5), SamplingConfig(temperature=0),
                 gauge_every=0, prefill_chunk=4)
    list(eng.feed_ids(HISTORY))
    return eng


def _cut_after(eng: Engine, chunks: int) -> None:
    gen = eng.add_message("user", MESSAGE)
    for _ in range(chunks):
        next(gen)
    gen.close()  # what Ctrl-C between two chunks does to the generator


def _next_turn(eng: Engine) -> torch.Tensor:
    list(eng.add_message("user", FOLLOW_UP))
    assert eng.last_logits is not None
    return eng.last_logits.clone()


def test_a_cut_message_is_taken_back_exactly_or_not_at_all():
    """Cut after 1, 2, ... chunks: while taken back, the next turn's logits equal those of an engine that never got
    the message (a rollback that accepts a ring missing tokens differs by ~0.4 here); once refused, never again
    accepted for a later cut, and the message stays in the cache."""
    model = gemma3([S, F])
    ref = _chat_engine(model)
    want = _next_turn(ref)
    taken = []
    for chunks in range(1, 13):
        eng = _chat_engine(model)
        _cut_after(eng, chunks)
        taken.append(eng.message_taken_back)
        if eng.message_taken_back:
            assert eng.cache.length == len(HISTORY) and eng.ledger.ids == HISTORY
            diff = (_next_turn(eng) - want).abs().max().item()
            assert diff <= 1e-5, (chunks, diff)
        else:
            assert eng.cache.length > len(HISTORY) and eng.ledger.ids[: len(HISTORY)] == HISTORY
    assert taken[0] and not taken[-1], taken
    first_refused = taken.index(False)
    assert not any(taken[first_refused:]), taken  # once a ring gave a needed token up, it cannot come back


def test_a_ring_that_dropped_a_token_the_window_needs_refuses_the_rollback():
    """The layer's own answer, at the boundary: after a compaction that keeps exactly the window, rolling back
    even one token would need the token before the window, which is gone."""
    ring = _chat_engine(gemma3([S, F])).cache.layers[0]
    assert isinstance(ring, WindowLayer) and ring.dropped > 0 and ring.visible == ring.keep
    held = ring.end - ring.floor  # slots still in the buffer: the window plus what the last compaction spared
    assert ring.can_truncate(ring.length - (held - ring.keep))  # the window at that point is all still held
    assert not ring.can_truncate(ring.length - (held - ring.keep) - 1)


def test_ring_layers_hold_the_window_not_the_cache():
    """What a leak or an oversized ring would move, not what nbytes computes: each ring's buffers are the same
    allocations from its first compaction to the end of a long stream (no growth, no re-allocation), they are
    smaller than half the global layer's, the cache's nbytes is what its tensors really occupy, and the rings
    show exactly their window."""
    eng = engine(gemma3([S] * 5 + [F]), CacheConfig("sink", 4, 64, 6))
    stream(eng, random_ids(200))
    layers = eng.cache.layers
    assert [type(layer) for layer in layers] == [WindowLayer] * 5 + [SinkLayer]
    ring, glob = layers[0], layers[5]
    ptrs = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in layers]
    storage = [layer.keys.untyped_storage().nbytes() + layer.values.untyped_storage().nbytes() for layer in layers]
    stream(eng, random_ids(1000, seed=5))  # many more compactions and evictions
    assert [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in layers] == ptrs
    now = [layer.keys.untyped_storage().nbytes() + layer.values.untyped_storage().nbytes() for layer in layers]
    assert now == storage and eng.cache.nbytes == sum(now)
    assert storage[0] * 2 < storage[5]  # a ring allocated at the cache's size (64 slots) fails this
    assert ring.visible == 7 and glob.length == eng.cache.length == len(eng.ledger) <= 64
    k, _ = ring.live()
    assert k.shape[-2] == 7 and ring.end - ring.floor <= ring.keys.shape[-2]
    assert eng.cache.layout() == f"global 1 layer {eng.cache.length}/64, local 5 layers 7/7"
    assert [layer.is_sliding for layer in layers] == [True] * 5 + [False]
