"""`RecallMemory`: what the Engine calls at each eviction (`absorb`), before each model call (`prepare`) and after
it (`observe`).

The rule (tests hold the native step and prefill to transformers' forward in fp64 under it):
- evicted tokens queue up in eviction order; every B of them make a block, written to the store and indexed by
  `blocks.representatives` (per memory layer and KV head, r un-rotated keys);
- before a model call, each memory layer scores every indexed block with the queries of the last token of the
  previous call (rotated to the distance recalled keys will have: query position - `position`): per KV head the
  best representative against the sum of the head group's queries, summed over KV heads; the top-k blocks, in stream
  order, go into the layer's region after the queued tokens (always attended: they are not yet a block);
- every recalled key is rotated to one position, `position` (the first slot after the pinned prefix: InfLLM's "all
  memory at one distance"), and all of it is attended by every query of the call, before the sinks and the window.
Blocks the budget removes, or that fail to write or to read back, are reported (`ForgottenEvent`), never silent.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from sinkchat.config import MemoryConfig
from sinkchat.memory.blocks import Block, representatives, rotate, rotated_to
from sinkchat.memory.events import ForgottenEvent, RecallEvent
from sinkchat.memory.store import BlockStore, StoreError, Where
from sinkchat.model.spec import ModelSpec

log = logging.getLogger(__name__)

REPS = 4  # representative keys per block, layer and KV head (InfLLM: 4 per 128-token block)


class RecallMemory:
    """One session's recall memory over the cache layers `layers` (a hybrid model's global ones), each rotating
    with its `inv_freqs`; blocks stored under `root` within `cfg.budget_mb`."""

    def __init__(self, cfg: MemoryConfig, layers: list[int], inv_freqs: list[torch.Tensor], n_heads: int,
                 n_kv: int, head_dim: int, root: Path, reps: int = REPS) -> None:
        self.cfg, self.layers, self.inv_freqs = cfg, list(layers), [f.float() for f in inv_freqs]
        self.n_heads, self.n_kv, self.head_dim, self.reps = n_heads, n_kv, head_dim, reps
        self.B, self.topk = cfg.block, cfg.topk
        self.region = self.topk * self.B + self.B - 1  # the blocks plus a queue of fewer than B tokens
        self.store = BlockStore(root, cfg.budget_mb << 20)
        self.next_id = 0
        self.index_ids: list[int] = []  # block ids in the index, oldest first; `index` rows follow this order
        self.index = torch.empty(0)  # [NB, M, H_kv, r, D] fp32
        self.queue: list[tuple[torch.Tensor, torch.Tensor, list[int], list[int], list[int]]] = []  # k, v, ids, abs, slots
        self.queries: torch.Tensor | None = None  # [M, H, D] of the last token of the last call
        self.q_pos = 0
        self.lru: OrderedDict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.lru_bytes = 0
        self.placed: list[tuple[int, ...]] = []  # per layer: (position, *block ids) now in its region
        self.chosen: list[list[int]] = [[] for _ in self.layers]
        self.forgotten = 0  # tokens reported forgotten, all reasons
        self.distance: int | None = None
        self.positions = "one"  # "one": every recalled key at one position; "ordered": in stream order before it
        self.dtype: torch.dtype | None = None

    @classmethod
    def for_spec(cls, cfg: MemoryConfig, spec: ModelSpec, root: Path) -> "RecallMemory":
        """The memory of a model: over its global layers (all of a non-hybrid model's), each with its RoPE."""
        layers = list(spec.global_layers)
        return cls(cfg, layers, [spec.inv_freq(i) for i in layers], spec.n_heads, spec.n_kv, spec.head_dim, root)

    # ------------------------------------------------------------------------------------------ what it holds
    @property
    def queued(self) -> int:
        return sum(len(q[2]) for q in self.queue)

    @property
    def blocks(self) -> int:
        return len(self.index_ids)

    @property
    def tokens(self) -> int:
        """Tokens the memory holds: the indexed blocks' and the queue's."""
        return sum(self.store.where[b].n for b in self.index_ids) + self.queued

    @property
    def disk_bytes(self) -> int:
        return self.store.disk_bytes

    @property
    def index_bytes(self) -> int:
        return self.index.nbytes

    def attach(self, cache: object) -> None:
        """Reserve the region in a fresh cache's memory layers (before anything is written into it)."""
        for layer in self.layers:
            cache.layers[layer].reserve(self.region)  # type: ignore[attr-defined]
        self.placed = [() for _ in self.layers]

    # ------------------------------------------------------------------------------------------ eviction side
    def absorb(self, cache: object, start: int, count: int, ids: list[int], abs_index: list[int]
               ) -> list[ForgottenEvent]:
        """Slots [start, start + count) are about to be evicted: queue their keys / values (copies) and make
        blocks of every B queued tokens. Returns what the budget or a failed write forgot meanwhile."""
        layers = [cache.layers[i] for i in self.layers]  # type: ignore[attr-defined]
        if not layers[0].is_initialized or count <= 0:
            return []
        k = torch.stack([layer.live()[0][0, :, start : start + count] for layer in layers])  # [M, H_kv, n, D]
        v = torch.stack([layer.live()[1][0, :, start : start + count] for layer in layers])
        self.dtype = k.dtype
        self.queue.append((k, v, list(ids), list(abs_index), list(range(start, start + count))))
        events: list[ForgottenEvent] = []
        while self.queued >= self.B:
            events += self._commit(self._take(self.B))
        return events

    def _take(self, n: int) -> Block:
        """The first `n` queued tokens as a block."""
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
        block = Block(self.next_id, np.array(abs_, np.int64), np.array(ids, np.int32), np.array(slots, np.int32),
                      torch.cat(ks, 2).contiguous(), torch.cat(vs, 2).contiguous())
        self.next_id += 1
        return block

    def _commit(self, block: Block) -> list[ForgottenEvent]:
        """Store and index a block; a failed write forgets it (reported), the budget may forget older ones."""
        try:
            dropped = self.store.append(block)
        except OSError as e:
            log.warning("recall memory: block of tokens %d..%d not stored (%s)", block.first, block.last, e)
            return [self._forgot(block.n, block.first, block.last, "disk")]
        events = [self._unindex(w, bid) for bid, w in dropped]
        reps = representatives(block, self.inv_freqs, self.reps)[None]  # [1, M, H_kv, r, D]
        self.index = reps if not self.index_ids else torch.cat([self.index, reps])
        self.index_ids.append(block.id)
        return events

    def _unindex(self, w: Where, bid: int, reason: str = "budget") -> ForgottenEvent:
        if bid in self.index_ids:
            row = self.index_ids.index(bid)
            self.index = torch.cat([self.index[:row], self.index[row + 1 :]])
            self.index_ids.pop(row)
        for key in [key for key in self.lru if key[0] == bid]:
            self.lru_bytes -= sum(t.nbytes for t in self.lru.pop(key))
        return self._forgot(w.n, w.first, w.last, reason)

    def _forgot(self, n: int, first: int, last: int, reason: str) -> ForgottenEvent:
        self.forgotten += n
        return ForgottenEvent(n, first, last, reason)

    # ------------------------------------------------------------------------------------------ call side
    def position(self, pinned: int, length: int) -> int:
        """Where recalled keys sit for a call whose first token goes to slot `length`: the first slot after the
        pinned prefix (`distance` None), else `distance` slots before that token (never before the prefix)."""
        return pinned if self.distance is None else max(pinned, length - self.distance)

    def observe(self, queries: torch.Tensor, position: int) -> None:
        """The pre-RoPE queries [L, H*D] (every layer) of the last token of a call, at in-cache `position`."""
        q = queries[self.layers].reshape(len(self.layers), self.n_heads, self.head_dim)  # [M, H, D]
        self.queries, self.q_pos = q.detach().clone(), position

    def choose(self, position: int) -> list[list[int]]:
        """Per memory layer, the ids of its top-k blocks in stream order (all of them while there are <= k)."""
        nb = len(self.index_ids)
        if nb <= self.topk or self.queries is None:
            return [list(self.index_ids) for _ in self.layers]
        g = self.n_heads // self.n_kv
        shift = torch.tensor([self.q_pos - position])
        dt = torch.float64 if self.queries.dtype == torch.float64 else torch.float32
        rows = []
        for i, f in enumerate(self.inv_freqs):
            q = rotate(self.queries[i][:, None].to(dt), f, shift)[:, 0].to(dt)  # [H, D] at the recall distance
            rows.append(q.reshape(self.n_kv, g, self.head_dim).sum(1))  # [H_kv, D]: the group's queries summed
        q = torch.stack(rows)  # [M, H_kv, D]
        scores = torch.einsum("mkd,bmkrd->bmkr", q, self.index.to(dt)).amax(-1).sum(-1)  # [NB, M]
        top = scores.topk(self.topk, dim=0).indices.sort(dim=0).values  # [k, M] rows in stream order
        return [[self.index_ids[r] for r in top[:, i].tolist()] for i in range(len(self.layers))]

    def prepare(self, cache: object, position: int) -> tuple[int, list[ForgottenEvent]]:
        """Fill every memory layer's region for the next call, recalled keys at `position`; returns the slots
        attended (`used`, the same in every layer) and what a block that failed to read back forgot."""
        layers = [cache.layers[i] for i in self.layers]  # type: ignore[attr-defined]
        events: list[ForgottenEvent] = []
        if not layers[0].is_initialized or not (self.index_ids or self.queue):
            for layer in layers:
                layer.used = 0
            return 0, events
        while True:
            chosen = self.choose(position)
            try:
                used = self._fill(layers, chosen, position)
                break
            except StoreError as e:  # a damaged block: forgotten (reported), and the choice made again
                bid = int(e.args[1])
                events.append(self._unindex(self.store.where[bid], bid, "damaged"))
                self.store.forget(bid)
                self.placed = [() for _ in self.layers]
        self.chosen = chosen
        return used, events

    def _fill(self, layers: list, chosen: list[list[int]], position: int) -> int:
        """Write the queue and each layer's chosen blocks into its region (the blocks only where they changed);
        returns the slots attended. Positions: all at `position`, or ("ordered") in stream order ending there."""
        q, k = self.queued, len(chosen[0])
        used = q + k * self.B
        ordered = self.positions == "ordered"
        qk = self._queued_at(position - used if ordered else position, layers[0].keys.dtype) if q else None
        for i, layer in enumerate(layers):
            base = layer.base
            if qk is not None:
                layer.keys[0, :, base - used : base - used + q] = qk[0][i]
                layer.values[0, :, base - used : base - used + q] = qk[1][i]
            key = (position, *chosen[i])
            if self.placed[i] != key:
                for j, bid in enumerate(chosen[i]):
                    at = base - (k - j) * self.B
                    kr, vr = self._rotated(bid, position - (k - j) * self.B if ordered else position,
                                           layer.keys.dtype)
                    layer.keys[0, :, at : at + self.B] = kr[i]
                    layer.values[0, :, at : at + self.B] = vr[i]
                self.placed[i] = key
            layer.used = used
        return used

    def _queued_at(self, position: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The queued tokens' keys (rotated to `position`, or in order from it with "ordered" positions) and
        values [M, H_kv, q, D]."""
        k = torch.cat([e[0] for e in self.queue], 2)
        v = torch.cat([e[1] for e in self.queue], 2)
        slots = torch.tensor([s for e in self.queue for s in e[4]], dtype=torch.int64)
        target = position + (torch.arange(len(slots)) if self.positions == "ordered" else 0)
        keys = torch.stack([rotate(k[i], f, target - slots) for i, f in enumerate(self.inv_freqs)]).to(dtype)
        return keys, v

    def _rotated(self, bid: int, position: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Block `bid`'s keys rotated to `position` and its values [M, H_kv, B, D], from the LRU or the store."""
        hit = self.lru.get((bid, position))
        if hit is not None:
            self.lru.move_to_end((bid, position))
            return hit
        try:
            block = self.store.read(bid)
        except StoreError as e:
            raise StoreError(str(e), bid) from None
        step = 1 if self.positions == "ordered" else 0
        entry = (rotated_to(block, self.inv_freqs, position, dtype, step), block.values.to(dtype))
        self.lru[(bid, position)] = entry
        self.lru_bytes += sum(t.nbytes for t in entry)
        while self.lru_bytes > self.cfg.ram_mb << 20 and len(self.lru) > 1:
            _, old = self.lru.popitem(last=False)
            self.lru_bytes -= sum(t.nbytes for t in old)
        return entry

    def recall_event(self) -> RecallEvent | None:
        """The blocks the last `prepare` placed, over all layers (None: none)."""
        ids = sorted({b for c in self.chosen for b in c})
        if not ids:
            return None
        spans = tuple((self.store.where[b].first, self.store.where[b].last) for b in ids if b in self.store.where)
        return RecallEvent(len(ids), sum(self.store.where[b].n for b in ids if b in self.store.where), spans)

    def clear(self, cache: object | None = None) -> None:
        """Drop everything (a /clear): the store's files too; counted as cleared by the ledger, not forgotten."""
        self.store.close(remove=True)
        self.store = BlockStore(self.store.root, self.store.budget)
        self.index_ids, self.index, self.queue, self.queries = [], torch.empty(0), [], None
        self.lru.clear()
        self.lru_bytes = 0
        self.placed = [() for _ in self.layers]
        self.chosen = [[] for _ in self.layers]
        if cache is not None:
            for i in self.layers:
                cache.layers[i].used = 0  # type: ignore[attr-defined]

    def close(self) -> None:
        """The session is over: its memory goes (files included)."""
        self.store.close(remove=True)
