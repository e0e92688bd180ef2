"""The recall memory's lexical prior (sinkchat/memory/lexical.py): the block that shares the rare tokens of the chunk
being fed takes one of the top-k slots in every memory layer.

- The lexicon's document frequencies, kept as blocks come and go, equal the ones counted afresh; its scores equal the
  plain sum of IDF over the shared terms; a block is picked only when it stands out.
- A store of many blocks of alike text where one block alone holds the question's rare words: that block is chosen
  in every layer while the question is fed and answered, where the attention rule alone misses it in some layer.
- The choice survives a saved and loaded session (the lexicon rebuilt from the stored token ids).
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from fakes import tiny_model
from sinkchat.memory import lexical
from sinkchat.memory.lexical import Lexicon, standout, terms
from test_memory import engine, memory

RARE = [100, 101, 102]  # the one block that holds these; every other block is drawn from COMMON
COMMON = list(range(1, 13))


def _plain_scores(blocks: dict[int, list[int]], query: list[int]) -> dict[int, float]:
    """Sum of log(N / df) over the query's distinct terms present in each block, terms in more than MAX_DF of the
    blocks (and in more than one) left out: written from the blocks' token ids alone."""
    sets = {b: terms(ids) for b, ids in blocks.items()}
    n, out = len(sets), {}
    for t in terms(query[-lexical.QUERY_TOKENS :]):
        df = sum(t in s for s in sets.values())
        if df == 0 or df > max(1.0, lexical.MAX_DF * n):
            continue
        for b, s in sets.items():
            if t in s:
                out[b] = out.get(b, 0.0) + math.log(n / df)
    return out


def test_document_frequencies_follow_adds_and_removes_and_scores_are_the_plain_sum() -> None:
    rng = random.Random(0)
    blocks = {b: [rng.randrange(1, 400) for _ in range(16)] + [500] * (b % 5 == 1) for b in range(60)}
    lex = Lexicon()
    for b, ids in blocks.items():
        lex.add(b, ids)
    for b in range(0, 60, 3):  # the budget takes some, others come
        lex.remove(b)
        del blocks[b]
    for b in range(60, 70):
        blocks[b] = [rng.randrange(1, 400) for _ in range(16)]
        lex.add(b, blocks[b])
    fresh = Lexicon()
    for b, ids in blocks.items():
        fresh.add(b, ids)
    assert {t: sorted(v) for t, v in lex.postings.items()} == {t: sorted(v) for t, v in fresh.postings.items()}
    query = blocks[61][3:9] + [5, 6, 7, 500]  # 500: in a fifth of the blocks, past MAX_DF, so not scored
    got, want = lex.scores(query[-lexical.QUERY_TOKENS :]), _plain_scores(blocks, query)
    assert got.keys() == want.keys() and all(abs(got[b] - want[b]) < 1e-12 for b in want)
    assert lexical.MAX_DF < len(lex.postings[500]) / len(lex.blocks) < 0.5
    assert lex.pick(query) == standout(want) == 61
    assert lex.idf(query[0]) == pytest.approx(math.log(len(blocks) / len(lex.postings[query[0]])))
    lex.clear()
    assert not lex.blocks and not lex.postings and lex.pick(query) is None


def test_a_block_is_picked_only_when_it_stands_out() -> None:
    assert standout({1: 10.0, 2: 8.0}) == 1  # 1.25x the runner-up
    assert standout({1: 10.0, 2: 9.0}) is None  # too close: the attention rule alone decides
    assert standout({1: lexical.MIN_SCORE - 0.1}) is None  # too few rare terms in common
    assert standout({3: 9.0, 7: 9.0, 1: 1.0}) is None and standout({}) is None
    lex = Lexicon()
    for b in range(lexical.MIN_BLOCKS - 1):
        lex.add(b, [b * 10 + i for i in range(8)])
    assert lex.pick([15, 16, 17]) is None  # too few blocks for document frequencies to mean anything
    lex.add(99, [1000, 1001])
    assert lex.pick([15, 16, 17]) == 1
    assert lex.pick(list(range(500, 600)) + [15, 16, 17]) == 1  # only the chunk's end (the question) is matched
    assert lex.pick([15, 16, 17] + list(range(500, 600))) is None


def _stream(seed: int = 0, blocks: int = 30, at: int = 12) -> list[int]:
    """Blocks of 8 alike tokens (COMMON, drawn at random) from stream index 4 (after the sinks: blocks are made in
    eviction order), block `at` holding the RARE tokens among them."""
    rng = random.Random(seed)
    ids = [rng.choice(COMMON) for _ in range(4 + 8 * blocks)]
    ids[4 + 8 * at + 2 : 4 + 8 * at + 5] = RARE
    return ids


def _question() -> list[int]:
    return [3, 5, *RARE, 7, 9]


def _rare_block(mem: Any) -> int:
    held = [b for b in mem.index_ids if set(RARE) <= set(mem.store.read(b).ids.tolist())]
    assert len(held) == 1
    return held[0]


@pytest.mark.parametrize("seed", [0, 1])
def test_the_block_that_shares_the_questions_rare_words_is_chosen_in_every_layer(seed: int, tmp_path: Path) -> None:
    """Thirty alike blocks; the question shares its rare words with one: chosen in all 3 layers for the question's
    chunk, its last token and the reply's decode steps. The attention rule alone (the same memory, the same queries,
    the prior taken away) leaves it out of some layer, so the prior is what chose it."""
    model = tiny_model("llama", layers=3, score_std=3.0)
    eng = engine(model, memory(model, tmp_path / "m", topk=2), chunk=16)
    mem = eng.memory
    seen: list[list[list[int]]] = []
    real = mem.prepare

    def spy(cache: Any, position: int, single: bool = False, ids: list[int] | None = None) -> Any:
        out = real(cache, position, single, ids=ids)
        seen.append([list(c) for c in mem.chosen])
        return out

    mem.prepare = spy  # type: ignore[method-assign]
    list(eng.feed_ids(_stream(seed)))
    rare = _rare_block(mem)
    assert mem.blocks >= 25 and mem.lexical is None  # the stream's own chunks single nothing out
    seen.clear()
    list(eng.feed_ids(_question()))  # a chunk, then its last token on its own
    list(eng.generate(max_tokens=10))  # decoding keeps the chunk's choice (and chooses again at the 8th)
    assert mem.lexical == rare and len(seen) >= 10
    assert all(rare in c for call in seen for c in call)
    kept = mem.lexical
    mem.lexical = None  # the attention rule alone, same queries
    alone = mem.choose(eng.pinned_slots())
    mem.lexical = kept
    assert not all(rare in c for c in alone)
    assert mem.choose(eng.pinned_slots()) != alone


def test_the_prior_goes_with_its_block_and_with_a_clear(tmp_path: Path) -> None:
    model = tiny_model("llama", layers=1, score_std=3.0)
    eng = engine(model, memory(model, tmp_path / "m", topk=2), chunk=16)
    mem = eng.memory
    list(eng.feed_ids(_stream()))
    list(eng.feed_ids(_question()))
    rare = _rare_block(mem)
    assert mem.lexical == rare and rare in mem.lexicon.blocks
    mem._unindex(mem.store.where[rare], rare)  # as the budget does
    assert mem.lexical is None and rare not in mem.lexicon.blocks
    assert all(rare not in ps for ps in mem.lexicon.postings.values())
    list(eng.feed_ids([3, 5, 7]))
    mem.clear(eng.cache)
    assert not mem.lexicon.blocks and mem.lexical is None


def test_a_loaded_session_keeps_the_prior_and_rebuilds_the_lexicon(tmp_path: Path) -> None:
    """Saved right after the question (the decode steps to come keep its block), loaded into another session: the
    same lexicon from the stored token ids, the same block singled out, the same logits token for token."""
    from sinkchat.store.snapshot import load_snapshot, save_snapshot

    model = tiny_model("llama", layers=2, score_std=3.0)
    eng = engine(model, memory(model, tmp_path / "a", topk=2), chunk=16)
    list(eng.feed_ids(_stream()))
    list(eng.feed_ids(_question()))
    assert eng.memory.lexical is not None
    snap = save_snapshot(eng, tmp_path / "s.safetensors")
    other = engine(model, memory(model, tmp_path / "b", topk=2), chunk=16)
    list(other.feed_ids(_stream(seed=3)))  # a memory of its own, replaced by the load
    load_snapshot(other, snap)
    assert other.memory.lexical == eng.memory.lexical
    assert {b: sorted(t) for b, t in other.memory.lexicon.blocks.items()} == {
        b: sorted(t) for b, t in eng.memory.lexicon.blocks.items()}
    for tok in [3, 9, 5, 7, 11, 2, 4, 6, 8, 10]:  # single tokens: past the 8-call cycle, which chooses again
        for e in (eng, other):
            list(e.feed_ids([tok]))
        assert torch.equal(eng.last_logits, other.last_logits)
        assert eng.memory.chosen == other.memory.chosen
