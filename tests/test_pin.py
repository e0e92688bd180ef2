"""`--pin system`: the sink policy keeps the system prompt forever right behind the sinks, so instructions survive
any length of conversation (ollama's `num_keep` of 4 lost them; ollama/ollama#13641 pins system + tools)."""

from __future__ import annotations

import pytest
import torch

from fakes import FakeTokenizer, tiny_model
from sinkchat.config import CacheConfig, ConfigError, SamplingConfig
from sinkchat.core.engine import Engine
from sinkchat.core.metrics import Metrics, read_stats, status_line

SYSTEM = "Always end every answer with three hash marks."
GREEDY = SamplingConfig(temperature=0, max_tokens=6, repetition_penalty=1.0)


def engine(pin: str = "system", capacity: int = 160, n_sink: int = 4, system: str | None = SYSTEM) -> Engine:
    cfg = CacheConfig(policy="sink", n_sink=n_sink, capacity=capacity, evict_chunk=8, pin=pin)
    return Engine(tiny_model(max_pos=512), FakeTokenizer("chars"), cfg, GREEDY, system=system, gauge_every=0)


def chat(eng: Engine, turns: int) -> None:
    for i in range(turns):
        list(eng.chat(f"turn {i}: tell me something about the number {i * 7}"))


def test_the_system_prompt_stays_in_the_cache_after_many_evictions():
    eng = engine()
    block = eng.encode(eng.conv.system_block())
    chat(eng, 12)
    p = eng.ledger.pinned
    assert eng.ledger.evicted > 4 * eng.cache_cfg.capacity  # the conversation went round the cache many times
    assert p == len(block) > eng.cache_cfg.n_sink
    assert eng.ledger.ids[:p] == block and eng.ledger.abs_index[:p] == list(range(p))  # never evicted, never moved


def test_without_the_pin_the_system_prompt_is_evicted():
    eng = engine(pin="none")
    chat(eng, 12)
    p = len(eng.encode(eng.conv.system_block()))
    assert eng.ledger.pinned == 0 and eng.ledger.abs_index[:4] == [0, 1, 2, 3]
    assert eng.ledger.abs_index[4] > p  # only the 4 sinks survived of the system prompt


def test_pinning_is_the_sink_mechanism_with_more_sinks():
    """A pinned prefix of P tokens must behave exactly like P sinks (whose exactness the cache tests establish):
    same evictions, same re-rotations, the same logits (up to fp32 summation order: the pinned engine feeds the
    system block as a chunk of its own)."""
    pinned = engine()
    chat(pinned, 8)
    p = pinned.ledger.pinned
    as_sinks = engine(pin="none", n_sink=p)
    chat(as_sinks, 8)
    assert pinned.ledger.ids == as_sinks.ledger.ids and pinned.ledger.evicted == as_sinks.ledger.evicted
    torch.testing.assert_close(pinned.last_logits, as_sinks.last_logits, rtol=0, atol=1e-5)


def test_a_system_prompt_too_large_to_pin_is_refused_in_one_line_before_anything_is_fed():
    with pytest.raises(ConfigError, match=r"the system prompt takes \d+ tokens.*--pin none") as e:
        engine(capacity=64, system="x" * 60)
    assert "\n" not in str(e.value)
    eng = engine(capacity=64, system=None)
    eng.conv.system = "y" * 60  # changed later, e.g. by /system
    with pytest.raises(ConfigError):
        list(eng.add_message("user", "hi"))
    assert eng.cache.length == 0 and eng.conv.messages == []


def test_clear_unpins_and_the_next_message_pins_again():
    eng = engine()
    chat(eng, 2)
    p = eng.ledger.pinned
    eng.clear()
    assert eng.ledger.pinned == 0
    chat(eng, 1)
    assert eng.ledger.pinned == p and eng.ledger.abs_index[0] == eng.ledger.start


def test_an_interrupted_first_message_leaves_nothing_pinned():
    eng = engine()
    gen = eng.add_message("user", "a message long enough to be fed in several chunks " * 3)
    eng.prefill_chunk = 8
    next(gen)  # the first chunk of the system block is in
    gen.close()  # Ctrl-C: the message is taken back whole
    assert eng.cache.length == 0 and eng.ledger.pinned == 0 and eng.message_taken_back


def test_the_status_line_shows_pinned_and_window():
    eng = engine()
    chat(eng, 1)
    line = status_line(read_stats(eng, Metrics(), model_nbytes=0))
    p = eng.ledger.pinned
    assert f"sink(4) pinned {p} + window {160 - p}" in line


def test_switching_the_pin_off_makes_the_prompt_evictable():
    eng = engine()
    chat(eng, 1)
    eng.reconfigure(pin="none")
    assert eng.pinned_slots() == 4


def test_the_toolbar_and_stats_show_the_pin():
    from sinkchat.apps.render import stats_table, toolbar_text

    eng = engine()
    chat(eng, 1)
    s = read_stats(eng, Metrics(), model_nbytes=0)
    p = eng.ledger.pinned
    assert f"sink(4) pinned {p} + window {160 - p}" in toolbar_text(s, 200)
    assert f"sink(4)+{p}" in toolbar_text(s, 80)
    from rich.console import Console

    con = Console(record=True, width=120)
    con.print(stats_table(s))
    assert f"pinned {p} + window {160 - p}" in con.export_text()
