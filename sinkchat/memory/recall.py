"""`RecallMemory`: what the Engine calls at each eviction (`absorb`), before each model call (`prepare`) and after
it (`observe`).

The rule (tests hold the native step and prefill to transformers' forward, and that to an fp64 fresh forward):
- evicted tokens queue up in eviction order; every B of them make a block, its keys rotated to the recall position,
  written to the store and indexed by `blocks.representatives` (per memory layer and KV head, r un-rotated keys);
- before a model call, each memory layer scores every indexed block with the queries of the last token of the
  previous call (rotated to the distance recalled keys will have: query position - recall position): per query
  head the best representative's dot, times the layer's softmax scale, through a softmax over the blocks (the
  block's share of that head's attention among the blocks), summed over the heads (`RULE` "mass"); the top-k blocks, in
  stream order, go into the layer's region after the queued tokens (always attended: they are not yet a block).
  A block whose rare tokens the last chunk shares, clearly more than any other's (lexical.py: the question names
  what it asks for), takes one of the k in every layer: soak facts beyond the window chosen in a median of 3 of 30
  layers without it (docs/memory.md, "A lexical prior").
  Chunks choose again every call; single tokens (decoding) every `every` calls, and always right after a chunk;
- every recalled key sits at one position, the first slot after the pinned prefix (InfLLM's "all memory at one
  distance"; measured against keeping each block's order before the window, and against a closer distance, in
  docs/memory.md), and all of it is attended by every query of the call, before the sinks and the window.
Blocks the budget removes, or that fail to write or to read back, are reported (`ForgottenEvent`), never silent.
"""

from __future__ import annotations

import logging
import secrets
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sinkchat.config import MemoryConfig
from sinkchat.memory.blocks import Block, bound_queries, bounds, representatives, rotate
from sinkchat.memory.events import ForgottenEvent
from sinkchat.memory.fedclock import FedClock
from sinkchat.memory.heap import trim_heap
from sinkchat.memory.index import Index
from sinkchat.memory.lexical import Lexicon
from sinkchat.memory.slices import SliceCache
from sinkchat.memory.store import BlockStore, StoreError, Where
from sinkchat.model.spec import ModelSpec

log = logging.getLogger(__name__)

REPS = 4  # representative keys per block, layer and KV head (InfLLM: 4 per 128-token block)
RULE = "mass"  # how a block is indexed and scored (measured in docs/memory.md "Choosing blocks"): "mass" (the REPS
#                keys farthest from the mean; per query head its best key's dot, through a softmax over the blocks at
#                the layer's attention scale, summed over heads), "far" (the same keys, the head group's queries
#                summed, best dots summed over KV heads: the rule before), "attn" (the REPS keys the last call's
#                queries attend most, InfLLM-like), "bound" (Quest's elementwise max / min of the keys, an upper
#                bound of q . k). 4k tokens, 10 trials: Retrieve.Number 8/10 with "mass" against 6/10 with "far"
#                (dense 8/10); passkey in filler 4/10 both, in prose 2/10 both (its block chosen in a median of
#                4.5 layers against 4: the question's own queries pick it in 6.5-7.5 with every key, `passkey.py
#                --oracle`). "bound" also answered 8/10 numbers but chose the prose needle in 1.5 layers.
RULES = ("far", "attn", "bound", "mass")
TRIM_EVERY = 1  # blocks between two returns of freed heap pages to the system (`heap.trim_heap`: 3-6 ms a call at 8k
#                 tokens, 1 thread; 1.2% of memory-on time in a py-spy at 55k tokens. Every 8 blocks: 14,080 tokens
#                 streamed ended at 683 MB RSS against 568 every block, for ~1% of speed: kept at 1)
EVERY = 8  # decode steps between two choices of blocks (a choice scores every block in every layer)


class RecallMemory:
    """One session's recall memory over the cache layers `layers` (a hybrid model's global ones), each rotating
    with its `inv_freqs`; blocks stored under `root` within `cfg.budget_mb`, recalled slices cached in
    `cfg.ram_mb`."""

    def __init__(self, cfg: MemoryConfig, layers: list[int], inv_freqs: list[torch.Tensor], n_heads: int,
                 n_kv: int, head_dim: int, root: Path, reps: int | None = None, every: int = EVERY,
                 rule: str | None = None, scaling: list[float] | None = None) -> None:
        self.cfg, self.layers, self.inv_freqs = cfg, list(layers), [f.float() for f in inv_freqs]
        # the one RoPE every memory layer rotates with (None: one per layer, Gemma 3's global layers may differ)
        self.rope = self.inv_freqs[0] if all(torch.equal(f, self.inv_freqs[0]) for f in self.inv_freqs) else None
        self.n_heads, self.n_kv, self.head_dim, self.every = n_heads, n_kv, head_dim, every
        self.reps, self.rule = REPS if reps is None else reps, RULE if rule is None else rule
        if self.rule not in RULES:
            raise ValueError(f"unknown recall rule {self.rule!r}")
        self.scaling = torch.tensor(scaling if scaling is not None else [head_dim**-0.5] * len(self.layers))  # [M]
        self.B, self.topk = cfg.block, cfg.topk
        self.region = self.topk * self.B + self.B - 1  # the blocks plus a queue of fewer than B tokens
        self.store = BlockStore(root, cfg.budget_mb << 20, cfg.bits)
        self.index = Index()
        self.lexicon = Lexicon()  # the indexed blocks' token ids, for the lexical prior (lexical.py)
        self.lexical: int | None = None  # the block the last chunk's tokens single out: in every layer's top-k
        self.slices = SliceCache(cfg.ram_mb << 20, self.inv_freqs, least=len(self.layers) * self.topk)
        self.next_id = 0
        self.queue: list[tuple[torch.Tensor, torch.Tensor, list[int], list[int], list[int]]] = []  # k v ids abs slots
        self.queries: torch.Tensor | None = None  # [M, H, D] of the last token of the last call
        self.q_pos = 0
        self.placed: list[tuple[int, ...]] = []  # per layer: (position, k, *block ids) in its region now
        self.queue_placed: tuple[int, ...] = ()
        self.chosen: list[list[int]] = [[] for _ in self.layers]
        self.since = 0  # single-token calls since the last choice
        self.after_chunk = False  # the last call was a chunk: the next single token chooses with its queries
        self.forgotten = 0  # tokens reported forgotten, all reasons
        self.copies = 0  # of them: copies of stored blocks read again (`Engine.feed_query`) let go, nothing lost
        self.held = 0  # queued tokens at the queue's front not attended: set aside (`hold_queue`), not the window's
        self.born: dict[int, float] = {}  # block id -> wall time its first token was fed (its text's age)
        self.fed = FedClock()  # when each call's tokens were fed (`note_fed`): the age `born` is
        self.recalled: dict[int, int] = {}  # block id -> most layers it was in at one call, since `take_recalled`
        self.reread: set[int] = set()  # blocks read again as text since `take_recalled` (`Engine.feed_query`)

    @classmethod
    def for_spec(cls, cfg: MemoryConfig, spec: ModelSpec, root: Path, rule: str | None = None,
                 reps: int | None = None) -> "RecallMemory":
        """The memory of a model: over its global layers (all of a non-hybrid model's), each with its RoPE and
        softmax scale; `rule` / `reps`: RULE / REPS unless given."""
        layers = list(spec.global_layers)
        return cls(cfg, layers, [spec.inv_freq(i) for i in layers], spec.n_heads, spec.n_kv, spec.head_dim, root,
                   reps, rule=rule, scaling=[spec.layers[i].scaling for i in layers])

    def sibling(self) -> "RecallMemory":
        """An empty memory like this one (settings, layers, RoPE) in a store folder of its own beside this one's:
        another conversation's (a `serve` session) on the same model."""
        root = self.store.root.with_name(f"{self.store.root.name}-{secrets.token_hex(4)}")
        return type(self)(self.cfg, self.layers, self.inv_freqs, self.n_heads, self.n_kv, self.head_dim, root,
                          self.reps, self.every, self.rule, self.scaling.tolist())

    # ------------------------------------------------------------------------------------------ what it holds
    @property
    def index_ids(self) -> list[int]:
        return self.index.ids

    @property
    def queued(self) -> int:
        return sum(len(q[2]) for q in self.queue)

    @property
    def blocks(self) -> int:
        return len(self.index)

    @property
    def tokens(self) -> int:
        """Tokens the memory holds: the indexed blocks' and the queue's."""
        return sum(self.store.where[b].n for b in self.index.ids) + self.queued

    @property
    def disk_bytes(self) -> int:
        return self.store.disk_bytes

    @property
    def index_bytes(self) -> int:
        return self.index.nbytes

    @property
    def lru_bytes(self) -> int:
        return self.slices.nbytes

    def attach(self, cache: Any) -> None:
        """Reserve the region in a fresh cache's memory layers (before anything is written into it)."""
        for layer in self.layers:
            cache.layers[layer].reserve(self.region)
        self.placed = [() for _ in self.layers]
        self.queue_placed = ()

    # ------------------------------------------------------------------------------------------ eviction side
    def absorb(self, cache: Any, start: int, count: int, ids: list[int], abs_index: list[int], position: int
               ) -> list[ForgottenEvent]:
        """Slots [start, start + count) are about to be evicted: queue their keys / values (copies) and make
        blocks of every B queued tokens, stored with their keys at `position`. Returns what the budget or a
        failed write forgot meanwhile."""
        layers = [cache.layers[i] for i in self.layers]
        if not layers[0].is_initialized or count <= 0:
            return []
        live = [layer.live() for layer in layers]
        k = torch.stack([lk[0, :, start : start + count] for lk, _ in live])  # [M, H_kv, n, D]
        v = torch.stack([lv[0, :, start : start + count] for _, lv in live])
        self.queue.append((k, v, list(ids), list(abs_index), list(range(start, start + count))))
        events: list[ForgottenEvent] = []
        while self.queued >= self.B:
            events += self._commit(self._take(self.B, position))
            if self.next_id % TRIM_EVERY == 0:
                trim_heap()
        return events

    def _take(self, n: int, position: int) -> Block:
        """The first `n` queued tokens as a block, keys rotated from their slots to `position`."""
        ks, vs, ids, abs_, slots, need = [], [], [], [], [], n
        while need:
            k, v, i, a, s = self.queue[0]
            m = min(need, len(i))
            ks.append(k[:, :, :m])
            vs.append(v[:, :, :m])
            ids, abs_, slots = ids + i[:m], abs_ + a[:m], slots + s[:m]
            if m == len(i):
                self.queue.pop(0)
            else:
                self.queue[0] = (k[:, :, m:], v[:, :, m:], i[m:], a[m:], s[m:])
            need -= m
        self.held = max(0, self.held - n)
        keys = torch.cat(ks, 2)
        keys = self._rotate(keys, position - torch.tensor(slots, dtype=torch.int64), keys.dtype)
        block = Block(self.next_id, np.array(abs_, np.int64), np.array(ids, np.int32),
                      np.full(n, position, np.int32), keys.contiguous(), torch.cat(vs, 2).contiguous())
        self.next_id += 1
        return block

    def _rotate(self, k: torch.Tensor, shifts: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Keys [M, H_kv, n, D] of every memory layer rotated by shifts [n] (fp32, or fp64 keys in fp64; `dtype`)."""
        if self.rope is not None:
            return rotate(k, self.rope, shifts, dtype)
        return torch.stack([rotate(k[i], f, shifts, dtype) for i, f in enumerate(self.inv_freqs)])

    def _commit(self, block: Block) -> list[ForgottenEvent]:
        """Store and index a block; a failed write forgets it (reported), the budget may forget older ones."""
        try:
            dropped = self.store.append(block)
        except OSError as e:
            log.warning("recall memory: block of tokens %d..%d not stored (%s)", block.first, block.last, e)
            return [self._forgot(block.n, block.first, block.last, "disk")]
        events = [self._unindex(w, bid) for bid, w in dropped]
        self.born[block.id] = self.fed.time_of(block.first, block.last)
        self.index.add(block.id, self.index_rows(block))
        self.lexicon.add(block.id, block.ids.tolist())
        return events

    def index_rows(self, block: Block) -> torch.Tensor:
        """A block's index rows [M, H_kv, r, W] in its keys' dtype, from its un-rotated keys (`RULE`)."""
        unrotated = self._rotate(block.keys, torch.from_numpy(-block.slots.astype(np.int64)))  # [M, H_kv, n, D]
        return self._rows(unrotated, int(block.slots[0])).to(block.keys.dtype)

    def _rows(self, keys: torch.Tensor, position: int) -> torch.Tensor:
        """A block's index rows [M, H_kv, r, W] from its un-rotated keys [M, H_kv, n, D] (`RULE`)."""
        if self.rule == "bound":
            return bounds(keys)
        if self.rule == "attn" and self.queries is not None:
            q = self._group_queries(position)  # [M, H_kv, D]
            logits = torch.einsum("mkd,mknd->mkn", q.to(keys.dtype), keys)  # [M, H_kv, n]
            pick = logits.topk(min(self.reps, keys.shape[2]), dim=-1).indices.sort(dim=-1).values  # [M, H_kv, r]
            return torch.gather(keys, 2, pick[..., None].expand(*pick.shape, keys.shape[-1]))
        return representatives(keys, self.reps)

    def _unindex(self, w: Where, bid: int, reason: str = "budget") -> ForgottenEvent:
        self.index.remove(bid)
        self.lexicon.remove(bid)
        if self.lexical == bid:
            self.lexical = None
        self.born.pop(bid, None)
        self.recalled.pop(bid, None)
        self.slices.drop(bid)
        if any(bid in c for c in self.chosen):
            self.since = self.every  # a block in use is gone: choose again at the next call
        return self._forgot(w.n, w.first, w.last, reason)

    def _forgot(self, n: int, first: int, last: int, reason: str) -> ForgottenEvent:
        self.forgotten += n
        return ForgottenEvent(n, first, last, reason)

    def hold_queue(self) -> None:
        """The queued tokens were set aside, not slid out of the window (an agent's finished task): they stop being
        attended as the window's continuation and wait to be recalled as part of a block like any other. Why: the
        queue is attended because it is what slid out just before the window; a set-aside tail is not (the next
        task starts from the checkpoint). Measured on agent_tasks 43-48 (bundled model): the same answers either
        way, so this is for the rule's sake, not a measured gain."""
        self.held = self.queued

    # ------------------------------------------------------------------------------------------ call side
    def observe(self, queries: torch.Tensor, position: int) -> None:
        """The pre-RoPE queries [L, H*D] (every layer) of the last token of a call, at in-cache `position`."""
        q = queries[self.layers].reshape(len(self.layers), self.n_heads, self.head_dim)  # [M, H, D]
        self.queries, self.q_pos = q.detach().clone(), position

    def choose(self, position: int) -> list[list[int]]:
        """Per memory layer, the ids of its top-k blocks in stream order (all of them while there are <= k): by the
        attention rule, except that the block the last chunk's tokens single out (`lexical`, lexical.py) takes one
        of the k in every layer (the rule's best k-1 of the others beside it, or its k if they hold it already)."""
        ids = self.index.ids
        pick = self.lexical if self.lexical in self.lexicon.blocks else None
        if len(ids) <= self.topk:
            return [list(ids) for _ in self.layers]
        if self.queries is None:  # no queries yet (a memory opened or cleared over a cache that holds tokens): the
            newest = list(ids[-self.topk :])  # newest k blocks
            if pick is not None and pick not in newest:
                newest = sorted([pick] + newest[1:], key=ids.index)
            return [list(newest) for _ in self.layers]
        scale = self.scaling if self.rule == "mass" else None
        scores = self.index.scores(self._index_queries(position), scale)  # [NB, M]
        if pick is not None:
            scores[ids.index(pick)] = float("inf")
        top = scores.topk(self.topk, dim=0).indices.sort(dim=0).values  # [k, M]: rows in stream order
        return [[ids[r] for r in top[:, i].tolist()] for i in range(len(self.layers))]

    def _rotated_queries(self, position: int) -> torch.Tensor:
        """The last call's queries [M, H_kv, G, D] rotated to the distance keys recalled at `position` will have
        (fp32, or fp64 queries in fp64)."""
        assert self.queries is not None
        dt = torch.float64 if self.queries.dtype == torch.float64 else torch.float32
        q = self._rotate(self.queries.to(dt)[:, :, None], torch.tensor([self.q_pos - position]))[:, :, 0]  # [M, H, D]
        return q.reshape(len(self.layers), self.n_kv, self.n_heads // self.n_kv, self.head_dim)

    def _group_queries(self, position: int) -> torch.Tensor:
        """[M, H_kv, D]: each head group's rotated queries summed (what rule "far" scores representatives with)."""
        return self._rotated_queries(position).sum(2)

    def _index_queries(self, position: int) -> torch.Tensor:
        """What `Index.scores` takes for this rule: the group sums [M, H_kv, D], or for "bound" one column per
        query head [M, H_kv, 2D, G] (each head's upper bound, summed: a group sum would bound the sum, looser)."""
        if self.rule == "bound":
            return bound_queries(self._rotated_queries(position)).transpose(2, 3)
        if self.rule == "mass":
            return self._rotated_queries(position).transpose(2, 3)  # [M, H_kv, D, G]
        return self._group_queries(position)

    def prepare(self, cache: Any, position: int, single: bool = False, ids: list[int] | None = None
                ) -> tuple[int, list[ForgottenEvent]]:
        """Fill every memory layer's region for the next call, recalled keys at `position`; returns the slots
        attended (`used`, the same in every layer) and what a block that failed to read back forgot. `single`: a
        one-token call, which keeps the last choice for `every` calls. `ids`: the call's token ids; a chunk's pick the
        block of the lexical prior (`lexical`), which single tokens (decoding) keep."""
        if not single:
            self.lexical = self.lexicon.pick(ids) if ids else None
            if self.lexical is not None:
                log.debug("recall memory: block %d singled out by the chunk's tokens", self.lexical)
        layers = [cache.layers[i] for i in self.layers]
        events: list[ForgottenEvent] = []
        if not layers[0].is_initialized or not (self.index.ids or self.queue):
            for layer in layers:
                layer.used = 0
            return 0, events
        fresh = (not single or self.after_chunk or self.since >= self.every - 1
                 or any(p and p[0] != position for p in self.placed))
        self.since = 0 if fresh else self.since + 1
        self.after_chunk = not single
        chosen = self.choose(position) if fresh else self.chosen
        while True:
            try:
                used = self._fill(layers, chosen, position)
                break
            except StoreError as e:  # a damaged block: forgotten (reported), and the choice made again
                bid = int(e.args[1])
                events.append(self._unindex(self.store.where[bid], bid, "damaged"))
                self.store.forget(bid)
                self.placed = [() for _ in self.layers]
                chosen = self.choose(position)
        self.chosen = chosen
        if fresh:
            self._note(chosen)
        return used, events

    def _note(self, chosen: list[list[int]]) -> None:
        """Count what this call recalls, for the reply's report (`take_recalled`)."""
        layers: dict[int, int] = {}
        for c in chosen:
            for bid in c:
                layers[bid] = layers.get(bid, 0) + 1
        for bid, n in layers.items():
            self.recalled[bid] = max(self.recalled.get(bid, 0), n)

    def _fill(self, layers: list[Any], chosen: list[list[int]], position: int) -> int:
        """Write the queue and each layer's chosen blocks into its region (each part only where it changed);
        returns the slots attended. The queue first, then the blocks in stream order, ending at the stream."""
        q, k, h = self.queued - self.held, len(chosen[0]), self.held
        used = q + k * self.B
        qkey = (position, used, self.next_id, q)
        if q and self.queue_placed != qkey:
            keys = torch.cat([e[0] for e in self.queue], 2)[:, :, h:]  # [M, H_kv, q, D] at their slots
            slots = torch.tensor([s for e in self.queue for s in e[4]][h:], dtype=torch.int64)
            keys = self._rotate(keys, position - slots, keys.dtype)
            values = torch.cat([e[1] for e in self.queue], 2)[:, :, h:]
            for i, layer in enumerate(layers):
                layer.keys[0, :, layer.base - used : layer.base - used + q] = keys[i]
                layer.values[0, :, layer.base - used : layer.base - used + q] = values[i]
        self.queue_placed = qkey
        keys = [(position, k, *c) for c in chosen]
        todo = [i for i in range(len(layers)) if self.placed[i] != keys[i]]
        got = self.slices.get_many([(bid, i) for i in todo for bid in chosen[i]], position, layers[0].keys.dtype,
                                   self._read) if todo else {}
        for i in todo:
            layer, was = layers[i], self.placed[i]
            same = was[:2] == keys[i][:2]  # same position and count: a slot still holding its block stays
            for j, bid in enumerate(chosen[i]):
                if same and was[2 + j] == bid:
                    continue
                at = layer.base - (k - j) * self.B
                layer.keys[0, :, at : at + self.B], layer.values[0, :, at : at + self.B] = got[(bid, i)]
            self.placed[i] = keys[i]
        for layer in layers:
            layer.used = used
        return used

    def _read(self, bid: int, layers: list[int]) -> tuple[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
        try:
            return self.store.read_layers(bid, layers)
        except StoreError as e:
            raise StoreError(str(e), bid) from None

    def clear(self, cache: Any | None = None) -> int:
        """Drop everything (a /clear, /forget): the store's files too. What it held is counted forgotten (the
        ledger counted it evicted: `ledger.evicted == tokens + forgotten` still holds); returns how many tokens."""
        dropped = self.tokens
        self.forgotten += dropped
        self.store.close(remove=True)
        self.store = BlockStore(self.store.root, self.store.budget, self.store.bits)
        self.index.clear()
        self.lexicon.clear()
        self.lexical = None
        self.slices.clear()
        self.queue, self.queries = [], None
        self.born, self.recalled, self.reread, self.held = {}, {}, set(), 0
        self.placed = [() for _ in self.layers]
        self.queue_placed = ()
        self.chosen = [[] for _ in self.layers]
        if cache is not None:
            for i in self.layers:
                cache.layers[i].used = 0
        return dropped

    def close(self) -> None:
        """The session is over: its memory goes (files included)."""
        self.store.close(remove=True)
