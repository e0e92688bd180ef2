"""Pure bookkeeping: what gets evicted, and the ledger of what the cache holds."""

import pytest

from sinkchat.core.cache_policy import (ContextFull, Eviction, Ledger, chunk_sizes, eviction_runs, pinned_slots,
                                        plan_eviction)
from sinkchat.config import CacheConfig, ConfigError


def test_no_eviction_while_it_fits():
    assert plan_eviction("sink", 4, 100, 10, 90, 10) is None
    assert plan_eviction("window", 4, 100, 10, 0, 100) is None


def test_sink_evicts_a_chunk_after_the_sinks():
    assert plan_eviction("sink", 4, 100, 10, 100, 1) == Eviction(start=4, count=10)
    # a big incoming block evicts at least what it needs
    assert plan_eviction("sink", 4, 100, 10, 100, 37) == Eviction(start=4, count=37)


def test_window_evicts_from_slot_zero():
    assert plan_eviction("window", 4, 100, 10, 100, 1) == Eviction(start=0, count=10)


def test_eviction_never_exceeds_what_is_evictable():
    ev = plan_eviction("sink", 4, 20, 50, 20, 1)
    assert ev == Eviction(start=4, count=16)


def test_dense_raises_when_full():
    with pytest.raises(ContextFull):
        plan_eviction("dense", 4, 100, 10, 95, 10)


def test_incoming_larger_than_cache_is_rejected():
    with pytest.raises(ValueError):
        plan_eviction("sink", 4, 20, 5, 10, 30)


def test_ledger_tracks_absolute_indices_through_evictions():
    led = Ledger()
    led.append(list(range(100, 120)))  # 20 tokens, abs 0..19
    dropped, first, last = led.evict(Eviction(4, 6))
    assert dropped == list(range(104, 110)) and (first, last) == (4, 10)
    assert led.abs_index == [0, 1, 2, 3] + list(range(10, 20))
    led.append([7, 8])
    assert led.abs_index[-2:] == [20, 21] and led.seen == 22 and led.evicted == 6
    assert len(led) == led.seen - led.evicted
    assert led.holds_stream_start()
    led.evict(Eviction(0, 3))
    assert not led.holds_stream_start()


def test_ledger_truncate_and_state_roundtrip():
    led = Ledger()
    led.append([1, 2, 3, 4, 5])
    led.truncate(3)
    assert led.ids == [1, 2, 3] and led.seen == 3
    again = Ledger.from_state(led.state())
    assert again == led
    with pytest.raises(ValueError):
        led.truncate(10)


def test_chunk_sizes_cover_everything():
    assert chunk_sizes(10, 4) == [4, 4, 2]
    assert sum(chunk_sizes(1001, 256)) == 1001
    assert chunk_sizes(0, 4) == []


def test_cache_config_resolution_and_validation():
    c = CacheConfig().resolved(8192)
    assert c.capacity == 2048 and c.evict_chunk == (2048 - 4) // 16
    assert CacheConfig(capacity=64).resolved(8192).window == 60
    with pytest.raises(ConfigError):
        CacheConfig(capacity=10000).resolved(8192)
    with pytest.raises(ConfigError):
        CacheConfig(policy="lru")
    with pytest.raises(ConfigError):
        CacheConfig(capacity=5, n_sink=4)


def test_clear_is_not_eviction_and_the_new_stream_starts_at_the_next_token():
    """After /clear (or /load) the sinks hold the new stream's first tokens: "(start gone)" must not show, and the
    cleared tokens must not count as evicted."""
    led = Ledger()
    led.append(list(range(10)))
    led.evict(Eviction(4, 3))
    led.clear()
    assert (led.evicted, led.cleared, len(led)) == (3, 7, 0)
    assert not led.holds_stream_start()  # empty
    led.append([5, 6, 7])
    assert led.holds_stream_start() and led.abs_index == [10, 11, 12]
    assert len(led) == led.seen - led.evicted - led.cleared
    led.evict(Eviction(0, 1))  # the naive window drops the new stream's first token
    assert not led.holds_stream_start()
    again = Ledger.from_state(led.state())
    assert again == led


def test_a_ledger_saved_before_cleared_and_start_existed_still_loads():
    old = {"ids": [1, 2], "abs_index": [40, 41], "seen": 42, "evicted": 40}
    led = Ledger.from_state(old)
    assert (led.cleared, led.start) == (0, 40) and led.holds_stream_start()


@pytest.mark.parametrize("cfg,prefix,want", [
    (CacheConfig("sink", 4, 160, 8, "system"), 56, 56),  # the pinned prompt, longer than the sinks
    (CacheConfig("sink", 4, 160, 8, "system"), 0, 4),  # nothing pinned yet: the sinks
    (CacheConfig("sink", 8, 160, 8, "system"), 6, 8),  # a prompt shorter than the sinks sits inside them
    (CacheConfig("sink", 4, 160, 8, "none"), 56, 4),  # --pin none: the prompt is evictable
    (CacheConfig("window", 4, 160, 8, "system"), 56, 0),  # only the sink policy keeps anything
    (CacheConfig("dense", 4, 160, 8, "system"), 56, 0),
])
def test_pinned_slots_is_the_sinks_or_the_pinned_prompt(cfg, prefix, want):
    assert pinned_slots(cfg, prefix) == want


def test_an_eviction_into_the_pinned_prefix_unpins_what_it_took():
    led = Ledger()
    led.append(list(range(100)))
    led.pinned = 56
    led.evict(Eviction(56, 10))  # the sink policy: behind the prefix
    assert led.pinned == 56
    led.evict(Eviction(0, 10))  # the window policy: from slot 0, into the prompt
    assert led.pinned == 0 and led.abs_index[0] == 10


def test_eviction_runs_split_at_gaps_in_the_stream():
    idx = [0, 1, 2, 3, 40, 41, 42, 90]
    assert eviction_runs(idx, Eviction(0, 6)) == [Eviction(0, 4), Eviction(0, 2)]
    assert eviction_runs(idx, Eviction(4, 4)) == [Eviction(4, 3), Eviction(4, 1)]
    assert eviction_runs(idx, Eviction(1, 2)) == [Eviction(1, 2)]


def test_kept_parts_split_an_eviction_where_the_unkept_ranges_start_and_end() -> None:
    """The recall memory's part of an eviction: slots whose stream index lies in an unkept range (an agent's example
    turns) come out as parts of their own, so they can be let go while the rest is stored."""
    from sinkchat.core.cache_policy import kept_parts

    abs_index = [0, 1, 2, 3, 10, 11, 12, 13, 14, 15, 16, 17]
    ev = Eviction(4, 8)  # stream 10..17
    assert kept_parts(abs_index, ev, []) == [(Eviction(4, 8), True)]
    assert kept_parts(abs_index, ev, [(12, 15)]) == [(Eviction(4, 2), True), (Eviction(6, 3), False),
                                                     (Eviction(9, 3), True)]
    assert kept_parts(abs_index, ev, [(0, 11), (16, 99)]) == [(Eviction(4, 1), False), (Eviction(5, 5), True),
                                                              (Eviction(10, 2), False)]
    assert kept_parts(abs_index, ev, [(10, 18)]) == [(Eviction(4, 8), False)]
