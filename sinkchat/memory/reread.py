"""Reading recalled blocks again as text: before a message, the stored block its words single out (the lexical
prior, lexical.py) and its neighbours are fed again, token for token, just before the message.

Why: the recall memory finds the block (the passkey's in all 30 layers), but attending its stored keys and values at
one recalled position is not enough for a small model to answer from it. Passkey at 4,096 tokens through cache
1,024, bundled 135M model, 20 trials (`python benchmarks/passkey.py --lengths 4096 --trials 20 --modes on --reread
N`, the question fed after the document as a message is): attending alone (N = 0) 9/20; the named block read again
(N = 1) 17/20; with its neighbours (N = 3, the default) 19/20, the needle's block read again in every trial where it
had left the window; a dense cache holding the whole document 5/20 (docs/memory.md "Reading a block again"). Only a
block the message names is read again (the lexical prior's pick: its rare words or word pairs, clearly ahead of
every other block's), so a message that names nothing in the memory costs nothing and changes nothing.

The neighbours: a fact cut by a block boundary (a needle of ~25 tokens in blocks of 64 is cut in ~1 of 3 trials)
is whole again with the block after and the one before, when those hold the stream right next to it.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from sinkchat.memory import lexical
from sinkchat.memory.store import StoreError

log = logging.getLogger(__name__)

LEAST_DF = 2  # a term in this many blocks is scored however few blocks there are (lexical.MAX_DF: 10% of them)


def neighbours(where: dict[int, Any], ids: list[int], pick: int, n: int) -> list[int]:
    """Up to `n` block ids around `pick` (itself first in the count, then alternately the next and the previous
    block), each holding the stream right next to the last one taken (no gap); in stream order. `ids`: the indexed
    blocks in stream order."""
    if n <= 0 or pick not in where:
        return []
    at = ids.index(pick)
    out, lo, hi = [pick], at, at
    while len(out) < n:
        grew = False
        if hi + 1 < len(ids) and where[ids[hi + 1]].first == where[ids[hi]].last:
            hi += 1
            out.append(ids[hi])
            grew = True
        if len(out) < n and lo > 0 and where[ids[lo - 1]].last == where[ids[lo]].first:
            lo -= 1
            out.append(ids[lo])
            grew = True
        if not grew:
            break
    return sorted(out, key=lambda b: where[b].first)


def named(memory: Any, query: Sequence[int]) -> int | None:
    """The block `query` names: the lexical prior's scores (lexical.py: IDF of the rare tokens and token pairs the
    query's last QUERY_TOKENS share with a block), with two changes for a copy that brings its neighbours along: a
    term in two blocks still counts (`LEAST_DF`: a fact and the reply that repeats its words, "my locker code" in
    both, would otherwise score nothing at 14 blocks), and the runner-up it must clearly beat is the best block that
    is not right next to it in the stream (that one comes along as a neighbour)."""
    if len(memory.lexicon) < lexical.MIN_BLOCKS or not query:
        return None
    scores = memory.lexicon.scores(list(query)[-lexical.QUERY_TOKENS :], LEAST_DF)
    if not scores:
        return None
    where = memory.store.where
    best = max(scores, key=lambda b: (scores[b], -b))  # a tie: the older block (the fact, before its reply)
    if best not in where:
        return None
    w = where[best]
    rest = [v for b, v in scores.items() if b != best and (b not in where or not (where[b].first == w.last
                                                                                   or where[b].last == w.first))]
    return best if lexical.clearly_first(scores[best], max(rest, default=0.0)) else None


def to_reread(memory: Any, query: Sequence[int], n: int, room: int) -> list[tuple[int, list[int]]]:
    """(block id, its token ids) of the blocks to read again before `query` (the token ids about to be fed): the
    block the lexical prior singles out for them and its neighbours, `n` blocks at most and `room` tokens at most
    (the neighbours farthest from it go first; nothing when it alone is more), in stream order; [] when it singles
    out none. `room`: what the copies may take of the window beside the query, so that they are still in the window
    when the query's last token reads them (half the window less the query, `Engine.feed_query`): a long paste
    reads nothing again. A block that cannot be read back is left out (the next model call reports it forgotten
    when it fails there too)."""
    if n <= 0 or not query:
        return []
    pick = named(memory, query)
    if pick is None:
        return []
    where = memory.store.where
    chosen = neighbours(where, memory.index.ids, pick, n)
    while chosen and sum(where[b].n for b in chosen) > room:  # the farthest from the pick first, the pick last
        chosen.remove(max(chosen, key=lambda b: (abs(where[b].first - where[pick].first), b == pick)))
    out = []
    for bid in chosen:
        try:
            out.append((bid, [int(t) for t in memory.store.token_ids(bid)]))
        except StoreError:
            log.warning("recall memory: block %d could not be read back to read again", bid)
    return out
