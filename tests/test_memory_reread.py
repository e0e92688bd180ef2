"""Blocks read again as text before a message (`Engine.feed_query`, `memory/reread.py`): exactly the stored tokens of
the block the message names and its neighbours, fed once before the message; copies the memory lets go (reported
"re-read", counted apart from what was lost); nothing at all when the memory is off, `reread` is 0, the message
names no block, or the message is scaffolding the memory does not keep.

A tiny random llama and a one-character-a-token tokenizer: a block of 8 tokens is 8 characters, so a message can
name one block's words exactly.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fakes import CharTokenizer, tiny_model
from sinkchat.config import CacheConfig, MemoryConfig, SamplingConfig
from sinkchat.core.engine import Engine
from sinkchat.memory import report
from sinkchat.memory.recall import RecallMemory
from sinkchat.memory.reread import named, neighbours, to_reread
from sinkchat.memory.store import Where
from sinkchat.model.spec import ModelSpec

torch.set_num_threads(1)


def w(first: int, last: int) -> Where:
    return Where(0, 0, 0, first, last, last - first)


def test_neighbours_take_the_pick_then_next_then_previous_and_stop_at_gaps():
    where = {1: w(0, 8), 2: w(8, 16), 3: w(16, 24), 4: w(40, 48), 5: w(48, 56)}
    ids = [1, 2, 3, 4, 5]
    assert neighbours(where, ids, 2, 1) == [2]
    assert neighbours(where, ids, 2, 2) == [2, 3]  # the next block first: a fact cut at the pick's end
    assert neighbours(where, ids, 2, 3) == [1, 2, 3]
    assert neighbours(where, ids, 2, 9) == [1, 2, 3]  # no block past a gap in the stream
    assert neighbours(where, ids, 3, 3) == [1, 2, 3]  # 4 holds [40, 48): not next to 3
    assert neighbours(where, ids, 4, 3) == [4, 5]
    assert neighbours(where, ids, 4, 0) == [] and neighbours(where, ids, 9, 3) == []


WORDS = ["apple", "brick", "cloud", "delta", "ember", "frost", "grove", "haven", "ivory", "jolly", "kite", "lemon"]


def engine(root: Path | None, reread: int = 1) -> Engine:
    model = tiny_model("llama", layers=2, max_pos=2048)
    mem = None
    if root is not None:
        cfg = MemoryConfig("on", 64, 8, 2, 64, reread=reread)
        mem = RecallMemory.for_spec(cfg, ModelSpec.from_model(model), root)
    return Engine(model, CharTokenizer(), CacheConfig(policy="sink", n_sink=4, capacity=96),
                  SamplingConfig(temperature=0, max_tokens=4, repetition_penalty=1.0), memory=mem)


def stream(seed: int = 0) -> str:
    """~600 characters of lower-case words, with one block-sized fact only it holds ("zq7x!") in the middle."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(50)]
    return " ".join(words[:25]) + " zq7x! " + " ".join(words[25:]) + " "


def fed_after(eng: Engine, since: int) -> list[int]:
    return [t for t, a in zip(eng.ledger.ids, eng.ledger.abs_index) if a >= since]


def copy_taken_back(eng: Engine) -> Engine:
    """`eng` after the stream, then a query that reads a block again, then all of that query taken back (as
    `soak.recall.take_back` does): the copy's stream indices are free again."""
    for _ in eng.feed(stream()):
        pass
    seen = eng.ledger.seen
    for _ in eng.feed_query(eng.encode("zq7x!")):
        pass
    assert eng.ledger.seen > seen + 5 and eng.copies
    k = eng.ledger.abs_index.index(seen)
    eng.cache.truncate(k)
    eng.ledger.truncate(k)
    assert eng.ledger.seen == seen
    return eng


def with_copy(eng: Engine) -> Engine:
    """`eng` after the stream and a query that names the fact's block (so a copy of it is in the window)."""
    for _ in eng.feed(stream()):
        pass
    for _ in eng.feed_query(eng.encode("zq7x!")):
        pass
    return eng


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_named_block_and_its_neighbours_are_fed_again_exactly(tmp_path, n):
    eng = engine(tmp_path / "m", reread=n)
    for _ in eng.feed(stream()):
        pass
    mem = eng.memory
    assert mem.blocks >= 8
    query = eng.encode("what was zq7x! about")
    pick = named(mem, query)
    assert pick is not None and "zq7x" in "".join(eng.tokenizer.decode(mem.store.token_ids(pick).tolist()))
    ids = mem.index.ids
    want = neighbours(mem.store.where, ids, pick, n)
    assert len(want) == n and pick in want
    since = eng.ledger.seen
    for _ in eng.feed_query(query):
        pass
    again = [t for b in want for t in mem.store.token_ids(b).tolist()]
    assert fed_after(eng, since) == again + query  # the blocks' own tokens in stream order, then the query
    assert sorted(mem.reread) == sorted(want)
    got = report.take_recalled(mem)
    assert {r.bid for r in got if r.reread} == set(want)
    # the copies leave the window as the stream goes on: let go as "re-read", never stored a second time
    events = [e for e in eng.feed(stream(1)) if type(e).__name__ == "ForgottenEvent"]
    copies = [e for e in events if e.reason == "re-read"]
    assert sum(e.count for e in copies) == len(again) == mem.copies
    assert all(since <= e.first and e.last <= since + len(again) for e in copies)
    assert eng.ledger.evicted == mem.tokens + mem.forgotten
    stored = {int(a) for b in mem.index.ids for a in mem.store.read(b).abs_index}
    assert not stored & set(range(since, since + len(again)))  # no copy stored (a block may span them: a gap)
    mem.close()


def test_nothing_is_read_again_when_off_zero_unnamed_or_scaffolding(tmp_path):
    for eng in (engine(None), engine(tmp_path / "z", reread=0), engine(tmp_path / "u")):
        for _ in eng.feed(stream()):
            pass
        seen = eng.ledger.seen
        named = eng.encode("what was about" if eng.memory is not None and eng.memory.cfg.reread else "zq7x!")
        for _ in eng.feed_query(named):
            pass
        assert fed_after(eng, seen) == named  # the query alone
    eng = engine(tmp_path / "s")
    for _ in eng.feed(stream()):
        pass
    seen = eng.ledger.seen
    q = eng.encode("zq7x!")
    with eng.not_kept():  # an agent's example turns: no recall fed into them
        for _ in eng.feed_query(q):
            pass
    assert fed_after(eng, seen) == q
    for _ in eng.feed_query(q):
        pass
    assert eng.ledger.seen > seen + 2 * len(q)


def test_a_chat_message_reads_again_before_itself_and_off_is_bit_identical(tmp_path):
    a, b = engine(tmp_path / "a"), engine(tmp_path / "b", reread=0)
    for eng in (a, b):
        for _ in eng.feed(stream()):
            pass
    for eng in (a, b):
        since = eng.ledger.seen
        for _ in eng.add_message("user", "zq7x!", recall=True):
            pass
        eng.fed = fed_after(eng, since)
    msg = b.fed  # with reread 0, the templated message alone
    assert a.fed[-len(msg):] == msg and len(a.fed) > len(msg)
    assert a.fed[: -len(msg)] == [t for bid in sorted(a.memory.reread) for t in a.memory.store.token_ids(bid).tolist()]
    # a message that names no block: the same cache, bit for bit, as with reread 0
    c, d = engine(tmp_path / "c"), engine(tmp_path / "d", reread=0)
    for eng in (c, d):
        for _ in eng.feed(stream()):
            pass
        for _ in eng.add_message("user", "tell me more", recall=True):
            pass
    assert not c.memory.reread and c.ledger.ids == d.ledger.ids
    sc, sd = c.cache.state(), d.cache.state()
    assert all(torch.equal(sc[k], sd[k]) for k in sc)
    for e in (a, b, c, d):
        e.memory.close()


def test_a_copy_taken_back_does_not_mark_the_tokens_fed_after_it(tmp_path):
    """A soak probe (or an interrupted message) takes back what it fed, its copy included; the next tokens reuse
    those stream indices and must be kept like any others, not let go as copies."""
    eng = copy_taken_back(engine(tmp_path / "m"))
    events = [e for e in eng.feed(stream(2) + stream(3)) if type(e).__name__ == "ForgottenEvent"]
    assert not events and eng.memory.copies == 0
    assert eng.ledger.evicted == eng.memory.tokens + eng.memory.forgotten
    eng.memory.close()


def test_a_copy_cut_short_marks_only_what_it_fed(tmp_path):
    eng = engine(tmp_path / "m", reread=2)
    for _ in eng.feed(stream()):
        pass
    eng.prefill_chunk = 4
    seen = eng.ledger.seen
    gen = eng.feed_query(eng.encode("zq7x!"))
    for ev in gen:
        if type(ev).__name__ == "PrefillEvent":
            break
    gen.close()  # Ctrl-C after the first 4 tokens of a 16-token copy
    assert eng.ledger.seen == seen + 4 and eng.copies == [(seen, seen + 4)]
    assert eng.unkept == [(seen, seen + 4)]
    eng.prefill_chunk = 256
    events = [e for e in eng.feed(stream(2) + stream(3)) if type(e).__name__ == "ForgottenEvent"]
    assert [(e.first, e.last, e.reason) for e in events] == [(seen, seen + 4, "re-read")]
    assert eng.ledger.evicted == eng.memory.tokens + eng.memory.forgotten
    eng.memory.close()


def test_only_a_persons_message_reads_again(tmp_path):
    """Log chunks, an agent's tasks and tool results, history fed again: `add_message` without `recall`."""
    a, b = engine(tmp_path / "a", reread=3), engine(tmp_path / "b", reread=0)
    for eng in (a, b):
        for _ in eng.feed(stream()):
            pass
        since = eng.ledger.seen
        for _ in eng.add_message("user", "zq7x!"):
            pass
        eng.fed = fed_after(eng, since)
    assert not a.memory.reread and a.fed == b.fed
    for _ in a.add_message("user", "zq7x!", recall=True):
        pass
    assert a.memory.reread
    for e in (a, b):
        e.memory.close()


def test_the_copies_fit_half_the_window_beside_the_query(tmp_path):
    """Copies evicted in the same feed would be read by nothing and push the recent context out: the neighbours
    farthest from the pick go first, then the pick; a long paste reads nothing again."""
    eng = engine(tmp_path / "m")
    for _ in eng.feed(stream()):
        pass
    mem, q = eng.memory, eng.encode("zq7x!")
    pick, where = named(mem, q), mem.store.where
    three = [b for b, _ in to_reread(mem, q, 3, 10_000)]
    assert len(three) == 3 and pick in three
    two = [b for b, _ in to_reread(mem, q, 3, sum(where[b].n for b in three) - 1)]
    assert len(two) == 2 and pick in two and set(two) < set(three)
    assert [b for b, _ in to_reread(mem, q, 3, where[pick].n)] == [pick]
    assert to_reread(mem, q, 3, where[pick].n - 1) == []
    long = eng.encode("zq7x! " * 10)  # 60 tokens: more than half the 92-token window
    since = eng.ledger.seen
    for _ in eng.feed_query(long):
        pass
    assert fed_after(eng, since) == long and not mem.reread
    mem.close()


def test_a_served_conversation_keeps_its_own_ranges(tmp_path):
    """Serve swaps conversations on one engine: a copy range of one must not mark another's tokens."""
    from sinkchat.api import capture, fresh_state, install

    eng = with_copy(engine(tmp_path / "m"))
    a = capture(eng)
    assert a.copies and a.unkept
    install(eng, fresh_state(eng, None))
    assert eng.copies == [] and eng.unkept == []
    events = [e for e in eng.feed(stream(2) + stream(3)) if type(e).__name__ == "ForgottenEvent"]
    assert not events and eng.memory.copies == 0
    b_mem = eng.memory
    install(eng, a)
    assert eng.copies == a.copies
    events = [e for e in eng.feed(stream(4)) if type(e).__name__ == "ForgottenEvent"]
    assert events and all(e.reason == "re-read" for e in events)
    for m in (eng.memory, b_mem):
        m.close()


def test_a_saved_session_keeps_its_ranges(tmp_path):
    """/save then --resume: copies still in the window leave it as copies, not stored a second time."""
    from sinkchat.store.snapshot import load_snapshot, save_snapshot

    eng = with_copy(engine(tmp_path / "m"))
    path = save_snapshot(eng, tmp_path / "s.safetensors")
    other = engine(tmp_path / "o")
    load_snapshot(other, path)
    assert other.copies == eng.copies and other.unkept == eng.unkept
    for e in (eng, other):
        e.got = [(x.first, x.last, x.reason) for x in e.feed(stream(2)) if type(x).__name__ == "ForgottenEvent"]
    assert eng.got and other.got == eng.got
    assert other.memory.tokens == eng.memory.tokens
    for e in (eng, other):
        e.memory.close()


class _Mem:
    """What `named` reads of a memory: a lexicon over blocks and where each block sits in the stream."""

    def __init__(self, blocks: dict[int, list[int]], where: dict[int, Where]) -> None:
        from sinkchat.memory.lexical import Lexicon

        self.lexicon, self.store = Lexicon(), type("S", (), {"where": where})()
        for bid, ids in blocks.items():
            self.lexicon.add(bid, ids)


def test_a_block_is_named_past_its_neighbour_but_not_past_a_block_elsewhere():
    """A fact and the reply that repeats its words, in two adjacent blocks: named (the neighbour comes along);
    the same words in a block elsewhere in the stream: nothing stands out, nothing is read again."""
    filler = {b: [1000 + 10 * b + i for i in range(8)] for b in range(12)}  # words of their own
    fact, reply = [7, 8, 9, 5, 6], [7, 8, 9, 4]  # "my locker code is 4417" / "your locker code"
    where = {b: w(8 * b, 8 * b + 8) for b in range(12)}
    near = dict(filler) | {3: filler[3] + fact, 4: filler[4] + reply}
    assert named(_Mem(near, where), [7, 8, 9]) == 3  # a tie: the older (the fact); the reply comes along after it
    far = dict(filler) | {3: filler[3] + fact, 9: filler[9] + reply}
    assert named(_Mem(far, where), [7, 8, 9]) is None
    one = dict(filler) | {3: filler[3] + fact}
    assert named(_Mem(one, where), [7, 8, 9]) == 3


def test_a_copy_taken_back_before_a_save_is_not_saved(tmp_path):
    """Taken back, then saved and loaded: the loaded session keeps the next tokens like the live one does."""
    from sinkchat.store.snapshot import load_snapshot, save_snapshot

    eng = copy_taken_back(engine(tmp_path / "m"))
    path = save_snapshot(eng, tmp_path / "s.safetensors")
    other = engine(tmp_path / "o")
    load_snapshot(other, path)
    for e in (eng, other):
        e.got = [(x.first, x.last, x.reason) for x in e.feed(stream(2) + stream(3))
                 if type(x).__name__ == "ForgottenEvent"]
    assert eng.got == [] and other.got == []
    for e in (eng, other):
        e.memory.close()


def test_after_forget_the_copies_in_the_window_go_to_the_memory_as_they_leave(tmp_path):
    """/forget (and /memory off) drop the blocks the window holds copies of: those copies are then the text's only
    copy, so they leave the window into the memory like the rest of it, not let go as "re-read" (they were, and
    the text was gone with nothing said but a label that named originals no longer there)."""
    eng = with_copy(engine(tmp_path / "m", reread=1))
    mem = eng.memory
    window = set(eng.ledger.abs_index)
    live = {i for a, b in eng.copies for i in range(a, b) if i in window}
    assert live
    held, copies = mem.tokens, mem.copies
    gone = eng.forget_memory()
    assert sum(e.count for e in gone) == held and mem.tokens == 0
    events = [e for e in eng.feed(stream(1)) if type(e).__name__ == "ForgottenEvent"]
    assert not [e for e in events if e.reason == "re-read"] and mem.copies == copies
    stored = {int(a) for b in mem.index.ids for a in mem.store.read(b).abs_index}
    assert live - set(eng.ledger.abs_index) and live - set(eng.ledger.abs_index) <= stored
    assert eng.ledger.evicted == mem.tokens + mem.forgotten
    mem.close()
