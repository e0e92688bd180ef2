"""`--pin system`: the sink policy keeps the system prompt forever right behind the sinks, so instructions survive
any length of conversation (ollama's `num_keep` of 4 lost them; ollama/ollama#13641 pins system + tools)."""

from __future__ import annotations

import re

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
    assert "\n" not in str(e.value) and not re.search(r"leave -\d", str(e.value))  # no negative "leave -6"
    need = int(re.search(r"--cache (\d+) or more", str(e.value)).group(1))  # the cache it names is enough
    engine(capacity=need, system="x" * 60)
    with pytest.raises(ConfigError):
        engine(capacity=need - 1, system="x" * 60)
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


def _pinned_keys(eng: Engine, p: int) -> list[torch.Tensor]:
    return [layer.live()[0][:, :, :p].clone() for layer in eng.cache.layers]


@pytest.mark.parametrize("command", ["/window 60", "/sinks 1", "reconfigure"])
def test_shrinking_the_cache_live_keeps_the_pinned_prompt(command):
    """/window, /sinks and `reconfigure` evict what no longer fits from behind the pinned prompt, never the prompt:
    its ids, stream indices and keys (never moved, never re-rotated) stay, the ledger's count of pinned slots
    stays true, and the engine goes on exactly as one that held the prompt as sinks and shrank the same way."""
    from sinkchat.apps.chat.repl import lines_reader
    from test_repl import make_loop

    eng = engine()
    chat(eng, 3)
    p, block = eng.ledger.pinned, eng.encode(eng.conv.system_block())
    assert p == len(block) == 56 and eng.cache.length > 140
    keys, evicted = _pinned_keys(eng, p), eng.ledger.evicted
    if command == "reconfigure":
        eng.reconfigure(capacity=72)
    else:
        loop, _, err = make_loop(eng)
        loop.run(lines_reader([command]))
        assert "rror" not in err.getvalue(), err.getvalue()
    cap = eng.cache_cfg.capacity
    assert cap < 160 and eng.cache.length <= cap and eng.ledger.evicted > evicted
    assert eng.ledger.pinned == p and eng.pinned_slots() == p
    assert eng.ledger.ids[:p] == block and eng.ledger.abs_index[:p] == list(range(p))
    assert all(torch.equal(a, b) for a, b in zip(keys, _pinned_keys(eng, p)))
    as_sinks = engine(pin="none", n_sink=p)
    chat(as_sinks, 3)
    as_sinks.reconfigure(capacity=cap, evict_chunk=eng.cache_cfg.evict_chunk)  # derived from the sinks alone
    chat(eng, 2)
    chat(as_sinks, 2)
    assert eng.ledger.ids == as_sinks.ledger.ids and eng.ledger.ids[:p] == block
    torch.testing.assert_close(eng.last_logits, as_sinks.last_logits, rtol=0, atol=1e-5)


def test_shrinking_below_the_pinned_prompt_plus_a_window_is_refused_and_changes_nothing():
    eng = engine()
    chat(eng, 2)
    before = (eng.cache_cfg, eng.cache.length, list(eng.ledger.ids))
    with pytest.raises(ConfigError, match="56 pinned tokens") as e:
        eng.reconfigure(capacity=60)
    assert "\n" not in str(e.value) and (eng.cache_cfg, eng.cache.length, eng.ledger.ids) == before


def test_a_long_message_after_a_large_pinned_prompt_is_fed_in_chunks_that_fit():
    """97 pinned slots of a 160-token cache leave 63 for the conversation: a 156-token message (shorter than the
    prefill chunk of 256) must go in chunks of at most 63, not as one chunk that could only fit by evicting the
    pinned prompt ("156 incoming tokens cannot fit a cache of 160 with 97 pinned")."""
    eng = engine(system="x" * 87)
    assert eng.prefill_chunk >= 156
    block = eng.encode(eng.conv.system_block())
    events = list(eng.add_message("user", "y" * 137))
    p = eng.ledger.pinned
    assert p == len(block) == 97 and eng.ledger.seen == 97 + 156
    assert eng.ledger.ids[:p] == block and eng.ledger.abs_index[:p] == list(range(p))
    fed = [e.tokens for e in events if type(e).__name__ == "PrefillEvent"]
    assert fed[0] == 97 and max(fed[1:]) <= 160 - 97 and sum(fed) == 97 + 156  # the prompt, then the message
    assert eng.cache.length <= 160 and eng.ledger.evicted == 156 + 97 - eng.cache.length
    list(eng.generate())  # and the reply goes on from there
    assert eng.ledger.ids[:p] == block


def test_a_window_policy_that_evicts_the_prompt_unpins_it():
    """`/policy window` evicts from slot 0, the prompt first: the ledger must stop counting it as pinned, or a
    switch back to sink would freeze whatever conversation tokens then sit in those 56 slots (and the status line
    would show a pinned prompt that is gone)."""
    eng = engine()
    chat(eng, 2)
    eng.reconfigure(policy="window")
    assert eng.ledger.pinned == 56  # nothing evicted yet: the prompt still sits at the front
    chat(eng, 2)
    assert eng.ledger.abs_index[0] > 0 and eng.ledger.pinned == 0
    eng.reconfigure(policy="sink")
    assert eng.pinned_slots() == 4
    front = eng.ledger.abs_index[4]
    chat(eng, 2)
    assert eng.ledger.abs_index[4] > front  # slot 4 on is an ordinary window again
    line = status_line(read_stats(eng, Metrics(), model_nbytes=0))
    assert "pinned" not in line
