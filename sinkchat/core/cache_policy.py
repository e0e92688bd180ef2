"""Pure integer bookkeeping of what the KV cache holds: which tokens, at which slots, and what to evict next.

No torch here. The tensor cache (`kv_cache.py`) does what this module decides; keeping the decision pure makes it
exhaustively testable and lets snapshots, previews and the recompute baseline share one truth.

Positions are *in-cache*: the token in slot i is always at RoPE position i (StreamingLLM, sec. 3.2). Evicting a block
therefore shifts every later slot (and its RoPE position) down by the block's size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sinkchat.errors import UserError

if TYPE_CHECKING:
    from sinkchat.config import CacheConfig


class ContextFull(UserError, RuntimeError):
    """The `dense` policy cannot take more tokens: the model's context is full."""


@dataclass(frozen=True)
class Eviction:
    """Remove `count` slots starting at slot `start`; the slots after them move down by `count`."""

    start: int
    count: int


def plan_eviction(
    policy: str, n_sink: int, capacity: int, evict_chunk: int, cache_len: int, incoming: int
) -> Eviction | None:
    """What to evict so that `incoming` new tokens fit into a cache of `capacity` holding `cache_len`.

    - sink: keep slots [0, n_sink) forever, evict the oldest of the rest, at least `evict_chunk` at a time
      (amortises the re-rotation; one big shift per chunk instead of a tiny one per token).
    - window: the naive sliding window: the same, but nothing is pinned, so the first tokens go first.
    - dense: never evicts; raises ContextFull instead.
    """
    if incoming < 0 or cache_len < 0:
        raise ValueError("negative lengths")
    need = cache_len + incoming - capacity
    if need <= 0:
        return None
    if policy == "dense":
        raise ContextFull(
            f"the context is full ({capacity} tokens) and policy 'dense' never evicts; "
            "use --policy sink to keep going"
        )
    pinned = n_sink if policy == "sink" else 0
    evictable = cache_len - pinned
    if need > evictable:
        raise ValueError(f"{incoming} incoming tokens cannot fit a cache of {capacity} with {pinned} pinned")
    count = min(max(need, evict_chunk), evictable)
    return Eviction(start=pinned, count=count)


def pinned_slots(cfg: CacheConfig, pinned_prefix: int) -> int:
    """Leading slots that `cfg` never evicts: the sinks, or a pinned prefix of `pinned_prefix` slots (the system
    prompt, which starts with the sinks) where it is longer and `cfg` pins it. Only the sink policy pins anything.
    The one rule behind eviction, the prefill chunk and a live shrink: were one of them to count only the sinks, it
    would evict the prompt (or feed a chunk that fits only by evicting it) while the ledger still says it is pinned."""
    if cfg.policy != "sink":
        return 0
    return max(cfg.n_sink, pinned_prefix if cfg.pin == "system" else 0)


def eviction_runs(abs_index: list[int], ev: Eviction) -> list[Eviction]:
    """`ev` split into runs of consecutive stream positions, each starting where the previous one was (the slots
    move down as each run goes): a block spanning a gap (the old sinks plus the oldest window tokens, right after
    switching sink -> window) must never show as one range claiming everything in between."""
    idx = abs_index[ev.start : ev.start + ev.count]
    runs, n = [], 1
    for a, b in zip(idx, idx[1:]):
        if b != a + 1:
            runs.append(Eviction(ev.start, n))
            n = 0
        n += 1
    return runs + [Eviction(ev.start, n)]


def kept_parts(abs_index: list[int], ev: Eviction, unkept: list[tuple[int, int]]
               ) -> list[tuple[Eviction, bool]]:
    """`ev`'s slots split into runs that the recall memory keeps (True) or lets go (False: their stream index lies in
    one of the `unkept` [first, last) ranges, an agent's example turns). Slots do not move between the parts: every
    part is taken from the cache before the eviction itself."""
    lo, hi = abs_index[ev.start], abs_index[ev.start + ev.count - 1]
    if not any(first <= hi and lo < last for first, last in unkept):  # the usual case: no range reaches the run
        return [(ev, True)]
    parts: list[tuple[Eviction, bool]] = []
    for slot in range(ev.start, ev.start + ev.count):
        a = abs_index[slot]
        keep = not any(first <= a < last for first, last in unkept)
        if parts and parts[-1][1] == keep:
            parts[-1] = (Eviction(parts[-1][0].start, parts[-1][0].count + 1), keep)
        else:
            parts.append((Eviction(slot, 1), keep))
    return parts


@dataclass
class Ledger:
    """Token ids and absolute stream indices of the tokens in the cache, slot by slot.

    `seen` counts every token ever fed; `evicted` every token a policy dropped; `cleared` every token a `clear`
    (/clear, /load) dropped, which is not an eviction. `start` is the stream index of the first token fed since the
    last clear: the stream's start as the model sees it. `pinned`: how many leading slots hold a pinned prefix (the
    system prompt under `--pin system`), which the sink policy keeps like its sinks. Invariant: len(ids) == len(abs_index)
    == seen - evicted - cleared (the counters keep running across clears so totals stay truthful).
    """

    ids: list[int] = field(default_factory=list)
    abs_index: list[int] = field(default_factory=list)
    seen: int = 0
    evicted: int = 0
    cleared: int = 0
    start: int = 0
    pinned: int = 0
    # transient, not state: the lowest `seen` a truncate left since `take_low_water` (stream indices from it on were
    # taken back, and the next tokens fed reuse them)
    low_water: int | None = field(default=None, compare=False)

    def __len__(self) -> int:
        return len(self.ids)

    def take_low_water(self) -> int | None:
        """Where the stream was taken back to since the last call (None: nowhere); starts over."""
        low, self.low_water = self.low_water, None
        return low

    def append(self, token_ids: list[int]) -> None:
        self.ids.extend(token_ids)
        self.abs_index.extend(range(self.seen, self.seen + len(token_ids)))
        self.seen += len(token_ids)

    def evict(self, ev: Eviction) -> tuple[list[int], int, int]:
        """Drop the slots of `ev`; return (dropped ids, first absolute index, last absolute index + 1). An eviction
        that reaches into the pinned prefix (the window policy starts at slot 0) leaves only the part before it
        pinned: the count must never claim slots that now hold other tokens."""
        end = ev.start + ev.count
        if ev.count <= 0 or end > len(self.ids):
            raise ValueError(f"bad eviction {ev} for {len(self.ids)} slots")
        dropped = self.ids[ev.start : end]
        first, last = self.abs_index[ev.start], self.abs_index[end - 1] + 1
        del self.ids[ev.start : end]
        del self.abs_index[ev.start : end]
        self.evicted += ev.count
        self.pinned = min(self.pinned, ev.start)
        return dropped, first, last

    def truncate(self, length: int) -> None:
        """Forget slots >= length (rolls back a half-done step; the tokens were never really seen)."""
        removed = len(self.ids) - length
        if removed < 0:
            raise ValueError("truncate cannot grow the ledger")
        del self.ids[length:]
        del self.abs_index[length:]
        self.seen -= removed
        if removed:
            self.low_water = self.seen if self.low_water is None else min(self.low_water, self.seen)
        self.pinned = min(self.pinned, length)

    def clear(self) -> None:
        """Drop everything (counted as cleared, not evicted); the next token fed starts a new stream."""
        self.cleared += len(self.ids)
        self.ids.clear()
        self.abs_index.clear()
        self.start = self.seen
        self.pinned = 0

    def holds_stream_start(self) -> bool:
        """True while the first token of the current stream (since the last clear) is still in slot 0: what
        `window` loses at its first eviction and `sink` keeps."""
        return bool(self.abs_index) and self.abs_index[0] == self.start

    def state(self) -> dict[str, object]:
        return {"ids": list(self.ids), "abs_index": list(self.abs_index), "seen": self.seen, "evicted": self.evicted,
                "cleared": self.cleared, "start": self.start, "pinned": self.pinned}

    @classmethod
    def from_state(cls, st: dict[str, object]) -> "Ledger":
        """Inverse of `state`; snapshots from before `cleared` / `start` existed read as 0 / the first index."""
        ids, idx = list(st["ids"]), list(st["abs_index"])  # type: ignore[call-overload]
        start = int(st.get("start", idx[0] if idx else 0))  # type: ignore[arg-type]
        led = cls(ids, idx, int(st["seen"]), int(st["evicted"]), int(st.get("cleared", 0)), start,  # type: ignore[arg-type]
                  int(st.get("pinned", 0)))  # type: ignore[arg-type]
        if len(led.ids) != len(led.abs_index):
            raise ValueError("ledger ids and indices differ in length")
        return led


def chunk_sizes(total: int, max_chunk: int) -> list[int]:
    """Split a prefill of `total` tokens into chunks no larger than `max_chunk`."""
    if max_chunk < 1:
        raise ValueError("max_chunk must be >= 1")
    return [min(max_chunk, total - i) for i in range(0, total, max_chunk)]
