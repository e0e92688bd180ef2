"""A lexical prior for the recall memory's choice of blocks: the block that shares the most rare tokens with the
prefill chunk being fed (the question) takes one of the top-k slots in every memory layer.

Why: the attention rule ("mass", recall.py) scores blocks with the queries of the token *before* the call, which
single out a passkey among filler (its block chosen in 25-30 of 30 layers) but not a fact among facts like it: a
soak's planted facts ("Remember this: the code word for the copper canyon is 2042.") were chosen in a median of 3 of
30 layers and recalled 2/55 beyond the window, facts given mid-chat 1/40 against a dense cache's 8/40. With the prior
the soak's fact block is chosen in all 30 layers in 46 of 49 probes, recalled 13/49 against 1/30 (6-minute soaks;
docs/memory.md, "A lexical prior"). The question names what it asks for ("the code word for the copper canyon");
the block that holds the fact is the only one with those words together, and no query needs to know that.

The score of a block for a query is the sum, over the query's distinct terms present in the block, of the term's
inverse document frequency over the indexed blocks, log(N / df): a term in every block ("the", the chat template,
punctuation) weighs 0, one in a single block of 1,500 weighs 7.3. Terms are token ids and, with `BIGRAMS`, pairs
of adjacent token ids (a block holding "copper lantern" and another "misty canyon" shares both words with
"the copper canyon" but not the pair). Terms in more than `MAX_DF` of the blocks are skipped: their weight is
under log(1 / MAX_DF) and their posting lists are the long ones (scoring cost). A block is picked only when it is
clearly first: its score at least `RATIO` times the runner-up's and at least `MIN_SCORE` (measured in
docs/memory.md: where the question's block stood out and where a prose chunk's best block did not).

Held in RAM, bounded by the memory's disk budget (each indexed block's distinct terms, ~100 a block, and their
postings); rebuilt from the stored token ids when a saved session loads (persist.py).
"""

from __future__ import annotations

import logging
import math
from typing import Iterable, Sequence

log = logging.getLogger(__name__)

# Measured offline on the token ids of the benchmarks' streams (bundled tokenizer, blocks of 64, window 1,020: 10
# passkey-in-prose trials at 4k, 40 mid-chat facts of recall_chat.py --plant-after 4 at 1,000 tokens, 60 soak-like
# probes over ~90 blocks; docs/memory.md "A lexical prior"): right / wrong / no block picked.
BIGRAMS = True  # pairs of adjacent tokens are terms too: passkey in prose 7/0/3 against 1/0/9 without (the 3: the
#                 needle still in the window), soak 46/0/14 against 44/0/16, chat facts 20/4/16 against 18/4/18
MAX_DF = 0.1  # terms in more than this share of the blocks are not scored (weight < log 10 = 2.3): at 0.25 the
#               chat facts 19/4/17, and the passkey's question picked a prose block in the 3 trials it is in the window
RATIO = 1.2  # the best block's score over the runner-up's for it to be picked (1.5: soak 43/0/17; 2.0: soak 34/0/26,
#              chat 17/3/20, passkey 1/0/9); the runner-up of a fact asked is most often a block sharing one topic word
MIN_SCORE = 6.0  # and its least score: two rare terms in common (one term in 1 of 64 blocks weighs 4.2)
MIN_BLOCKS = 8  # fewer blocks: document frequencies mean little, and the top-k holds a good share of them anyway
QUERY_TOKENS = 48  # the chunk's last tokens that are matched: a question ends the prompt, and a whole chunk of 256
#                    prose tokens shares some words with every prose block (passkey in prose: 0/6/4 scoring the
#                    whole chunk, where the last 48 tokens pick the needle's block in 7 of its 7 trials)


def terms(ids: Sequence[int], bigrams: bool = BIGRAMS) -> frozenset[int]:
    """The distinct terms of a token sequence: its token ids, and with `bigrams` each adjacent pair (a, b) as
    -(a * 2**32 + b) - 1 (negative: never a token id)."""
    out = set(int(t) for t in ids)
    if bigrams:
        out.update(-(int(a) << 32) - int(b) - 1 for a, b in zip(ids[:-1], ids[1:]))
    return frozenset(out)


class Lexicon:
    """Per indexed block its distinct terms, and per term the blocks holding it (their count is its document
    frequency); kept beside the index: `add` / `remove` / `clear` with it."""

    def __init__(self, bigrams: bool = BIGRAMS) -> None:
        self.bigrams = bigrams
        # block id -> its terms; term -> the blocks holding it, in the order added. Tuples and lists, not sets: 1,500
        # blocks of prose (96k tokens, 52k distinct terms) took 28.5 MiB as sets, ~300 B a token
        self.blocks: dict[int, tuple[int, ...]] = {}
        self.postings: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.blocks)

    def add(self, bid: int, ids: Sequence[int]) -> None:
        """Index block `bid`'s token ids (a block already held is replaced)."""
        self.remove(bid)
        ts = tuple(terms(list(ids), self.bigrams))
        self.blocks[bid] = ts
        for t in ts:
            self.postings.setdefault(t, []).append(bid)

    def remove(self, bid: int) -> None:
        ts = self.blocks.pop(bid, None)
        for t in ts or ():
            held = self.postings[t]
            held.remove(bid)
            if not held:
                del self.postings[t]

    def clear(self) -> None:
        self.blocks, self.postings = {}, {}

    def idf(self, term: int) -> float:
        """log(N / df) over the blocks held; 0 for a term no block holds."""
        df = len(self.postings.get(term, ()))
        return math.log(len(self.blocks) / df) if df else 0.0

    def scores(self, ids: Sequence[int], least: float = 1.0) -> dict[int, float]:
        """Per block holding any scored term of `ids`, the sum of those terms' IDF (terms in order, so the sums are
        the same however the lexicon was built: a loaded session scores as the saved one did). A term in more than
        MAX_DF of the blocks is not scored, unless it is in at most `least` blocks (a term of one block always
        counts)."""
        n, most = len(self.blocks), max(least, MAX_DF * len(self.blocks))
        out: dict[int, float] = {}
        for t in sorted(terms(list(ids), self.bigrams)):
            held = self.postings.get(t)
            if not held or len(held) > most:
                continue
            w = math.log(n / len(held))
            for bid in held:
                out[bid] = out.get(bid, 0.0) + w
        return out

    def pick(self, ids: Sequence[int], least: float = 1.0) -> int | None:
        """The block that stands out for the last QUERY_TOKENS of `ids` (see the module's rule; `least`: `scores`),
        or None."""
        if len(self.blocks) < MIN_BLOCKS or not ids:
            return None
        return standout(self.scores(list(ids)[-QUERY_TOKENS:], least))


def standout(scores: dict[int, float]) -> int | None:
    """The best-scored block if it is clearly first (>= MIN_SCORE and >= RATIO x the runner-up), else None; ties
    go to the newer block (the larger id)."""
    if not scores:
        return None
    ranked = sorted(scores.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)
    return ranked[0][0] if clearly_first(ranked[0][1], ranked[1][1] if len(ranked) > 1 else 0.0) else None


def clearly_first(best: float, second: float) -> bool:
    """A block's score stands out: at least MIN_SCORE and at least RATIO times the runner-up's."""
    return best >= MIN_SCORE and best >= RATIO * second


def rebuild(lexicon: Lexicon, blocks: Iterable[tuple[int, Sequence[int]]]) -> Lexicon:
    """`lexicon` filled from (block id, token ids) pairs (a loaded session's stored blocks)."""
    lexicon.clear()
    for bid, ids in blocks:
        lexicon.add(bid, ids)
    return lexicon
