"""One model call of the Engine, by the path that computes it: the injected decode step for one token, the step's
chunk path (native prefill) for several, else transformers' forward; with the recall memory, its region filled
before the call and the call's last queries handed back after it (`RecallMemory.prepare` / `observe`).

Functions over the Engine (gpt-fast's decode_one / prefill split), kept apart so engine.py stays the stream's
bookkeeping: what is fed, evicted and recorded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sinkchat.core.engine import Engine


def run(eng: Engine, ids: list[int], L: int, all_logits: bool) -> torch.Tensor:
    """Logits [q or 1, V] of `ids` at in-cache slots [L, L + q); the cache has room (the caller made it)."""
    base, used = recall(eng, ids)
    step = eng.step if not base or getattr(eng.step, "memory_region", False) else None
    if step is not None and len(ids) == 1:
        keys, values = eng.cache.buffers(step.n_kv, step.head_dim, eng.device, eng.kv_store)
        eng.cache.advance(1)  # checks the room first; an interrupted step is truncated back to L by the caller
        extra = {"base": base, "used": used} if base else {}
        logits, queries, shares = step(ids[0], L, keys, values, eng.gauge_n, **extra)  # [1, V], [L, H*D], [L, 3]
        eng.gauge.record(queries, eng.gauge_n, shares)  # C measures the stream's first slots, after any recalled
        observe(eng, queries, L)
        return logits
    eng.gauge.discard_shares()  # shares of an earlier fast step must not stand for this forward's attention
    prefill = getattr(step, "prefill", None)  # the step's chunk path (native: one C call), if it has one
    if prefill is not None and not eng.gauge.armed:  # armed: the gauge hooks want transformers' queries
        keys, values = eng.cache.buffers(step.n_kv, step.head_dim, eng.device, eng.kv_store)
        eng.cache.advance(len(ids))  # as for the step: an interrupted chunk is truncated back to L by the caller
        if not base:
            return prefill(ids, L, keys, values, all_logits)  # [q or 1, V]
        queries = torch.empty(eng.n_layers, eng.spec.n_heads * eng.spec.head_dim)  # [L, H*D]
        logits = prefill(ids, L, keys, values, all_logits, base=base, used=used, queries=queries)
        observe(eng, queries, L + len(ids) - 1)
        return logits
    x = torch.tensor([ids], dtype=torch.long, device=eng.device)  # [1, q]
    pos = torch.arange(L, L + len(ids), device=eng.device)[None]  # [1, q]
    out = eng.model(input_ids=x, position_ids=pos, cache=eng.cache, use_cache=True,
                    logits_to_keep=0 if all_logits else 1)
    if eng.memory is not None:
        observe(eng, eng.gauge.captured_queries(), L + len(ids) - 1)
    return out.logits[0]


def recall(eng: Engine, ids: list[int]) -> tuple[int, int]:
    """Fill the recall memory's region for the call that feeds `ids`: (slots reserved in front of the stream, slots
    of them attended); recalled keys sit right after the pinned prefix. A chunk's ids choose the block of the
    memory's lexical prior (`RecallMemory.prepare`). Blocks that failed to read back are reported after the call
    (`Engine._forgotten`)."""
    if eng.memory is None:
        return 0, 0
    eng.memory.fed.note(int(eng.ledger.seen))  # the stream index of this call's first token (its text's age)
    used, lost = eng.memory.prepare(eng.cache, eng.pinned_slots(), len(ids) == 1, ids=ids)
    eng._forgotten += lost
    return eng.memory.region, used


def observe(eng: Engine, queries: torch.Tensor | None, position: int) -> None:
    """Hand the memory the queries [L, H*D] of the call's last token (at in-cache `position`)."""
    if eng.memory is not None and queries is not None:
        eng.memory.observe(queries, position)
