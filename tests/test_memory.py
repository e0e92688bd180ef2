"""The recall memory (sinkchat/memory) against references of its rule.

- The rule itself, in fp64: a 1-layer model's logits with memory equal a fresh forward over exactly the tokens the
  last query attends (the sinks at slots 0..3, every recalled token at the memory's one position, the window at its
  in-cache positions), computed by transformers with explicit position ids. With one layer a token's K/V depend only
  on the token and its position, so that forward is the rule, computed another way.
- The choice of blocks: an independent fp64 scoring (un-rotate the stored keys, pick representatives, rotate the
  query to the recall distance) chooses the same blocks in every layer.
- The native step and prefill with memory against transformers' forward with memory (same packed weights), and with
  memory on but nothing recalled, bit-identical to memory off.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fakes import WordTokenizer, tiny_model
from sinkchat.config import CacheConfig, MemoryConfig, SamplingConfig
from sinkchat.core.engine import Engine
from sinkchat.core.events import ForgottenEvent
from sinkchat.decode import select
from sinkchat.kernels import native
from sinkchat.memory.blocks import representatives
from sinkchat.memory.recall import RecallMemory
from sinkchat.model.spec import ModelSpec

IDS = [(37 * i + 3) % 120 + 1 for i in range(150)]  # 150 tokens through a 40-slot cache: ~110 evicted


def memory(model: Any, root: Path, block: int = 8, topk: int = 2, budget_mb: int = 64, rule: str | None = None,
           reps: int | None = None) -> RecallMemory:
    return RecallMemory.for_spec(MemoryConfig("on", budget_mb, block, topk, 64), ModelSpec.from_model(model), root,
                                 rule, reps)


def engine(model: Any, mem: RecallMemory | None, chunk: int = 16, step: Any = None, kv: str = "auto") -> Engine:
    return Engine(model, WordTokenizer(), CacheConfig("sink", 4, 40, 5), SamplingConfig(temperature=0), step=step,
                  prefill_chunk=chunk, memory=mem, kv_dtype=kv)


def attended(eng: Engine) -> tuple[list[int], list[int]]:
    """(token ids, RoPE positions) of what the next query attends in layer 0, in the memory's own terms: the sinks
    and window at their slots, the queue and the chosen blocks at the memory's position."""
    mem = eng.memory
    pos = eng.pinned_slots()
    ids = [t for e in mem.queue for t in e[2]]
    for bid in mem.chosen[0]:
        ids += mem.store.read(bid).ids.tolist()
    return ids + eng.ledger.ids, [pos] * len(ids) + list(range(len(eng.ledger.ids)))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_one_layer_memory_equals_a_fresh_forward_over_what_it_attends(kind: str, tmp_path: Path) -> None:
    model = tiny_model(kind, layers=1, score_std=3.0).double()
    eng = engine(model, memory(model, tmp_path / "m"))
    plain = engine(model, None)
    worst, recalled, differs = 0.0, 0, 0.0
    for i, tok in enumerate(IDS):
        list(eng.feed_ids([tok]))
        list(plain.feed_ids([tok]))
        if eng.memory.blocks == 0:
            continue
        ids, pos = attended(eng)  # what the call that consumed `tok` attended: chosen before it, from the previous
        # call's queries; replay it: the last token at its slot attends everything before it (the explicit mask
        # stops transformers from reading the positions' drop back to 0 as a second packed sequence)
        with torch.no_grad():
            ref = model(torch.tensor([ids]), position_ids=torch.tensor([pos]), attention_mask=torch.ones(1, len(ids)),
                        use_cache=False).logits[0, -1]
        worst = max(worst, float((eng.last_logits.double() - ref).abs().max()))
        recalled += len(eng.memory.chosen[0])
        differs = max(differs, float((eng.last_logits - plain.last_logits).abs().max()))
    assert recalled > 100 and eng.memory.blocks >= 10
    assert differs > 0.05  # the recalled tokens matter: a memory that attends nothing would fail here
    assert worst < 1e-6  # transformers rotates an fp64 model's keys with fp32 cos / sin: ~1e-8 seen


def _rope(x: torch.Tensor, inv: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """x [..., n, D] rotated by shift [n] (rotate-half, the first 2 * len(inv) dims), in fp64."""
    a = shift.double()[:, None] * inv[None]  # [n, R/2]
    c, s = torch.cat([a.cos(), a.cos()], -1), torch.cat([a.sin(), a.sin()], -1)
    half, r = inv.numel(), 2 * inv.numel()
    out = x.clone()
    out[..., :half] = x[..., :half] * c[:, :half] - x[..., half:r] * s[:, :half]
    out[..., half:r] = x[..., half:r] * c[:, half:] + x[..., :half] * s[:, half:]
    return out


def _block_score(mem: RecallMemory, rule: str, q: torch.Tensor, un: torch.Tensor) -> torch.Tensor:
    """One block's score per query head [H] (rule far: per KV head, in column 0) from the rotated queries q [H, D]
    and the block's un-rotated keys un [H_kv, n, D], written out plainly."""
    g = mem.n_heads // mem.n_kv
    if rule == "bound":  # Quest: sum_d max(q_d * min_d, q_d * max_d) per query head
        hi, lo = un.amax(1), un.amin(1)  # [H_kv, D]
        return torch.stack([torch.maximum(q[h] * lo[h // g], q[h] * hi[h // g]).sum() for h in range(mem.n_heads)])
    spread = (un - un.mean(1, keepdim=True)).norm(dim=-1)  # [H_kv, n]
    reps = torch.gather(un, 1, spread.topk(mem.reps, -1).indices[..., None].expand(-1, -1, un.shape[-1]))
    if rule == "far":
        qg = q.reshape(mem.n_kv, g, -1).sum(1)  # [H_kv, D]
        return torch.einsum("kd,krd->kr", qg, reps).amax(-1)
    return torch.stack([(reps[h // g] @ q[h]).max() for h in range(mem.n_heads)])  # mass: best key per head


def reference_pick(mem: RecallMemory, ids: list[int]) -> int | None:
    """The block the lexical prior singles out for a chunk's `ids`, from the stored blocks' token ids: per block the
    sum of log(N / df) over the distinct tokens and adjacent pairs of the chunk's last QUERY_TOKENS that it holds
    (terms in more than MAX_DF of the blocks, and in more than one, left out); the best block if it scores at least
    MIN_SCORE and RATIO x the runner-up."""
    from sinkchat.memory import lexical as lx

    def grams(t: list[int]) -> set[tuple[int, ...]]:
        return {(a,) for a in t} | set(zip(t[:-1], t[1:]))

    held = {bid: grams(mem.store.read(bid).ids.tolist()) for bid in mem.index_ids}
    if len(held) < lx.MIN_BLOCKS:
        return None
    scores = dict.fromkeys(held, 0.0)
    for g in grams(list(ids)[-lx.QUERY_TOKENS :]):
        df = sum(g in h for h in held.values())
        if 0 < df <= max(1, lx.MAX_DF * len(held)):
            for bid, h in held.items():
                scores[bid] += math.log(len(held) / df) if g in h else 0.0
    ranked = sorted(scores.values(), reverse=True) + [0.0]
    best = max(held, key=lambda b: (scores[b], b))
    return best if ranked[0] >= lx.MIN_SCORE and ranked[0] >= lx.RATIO * ranked[1] else None


def reference_choice(mem: RecallMemory, position: int, pick: int | None = None) -> list[list[int]]:
    """The blocks each layer should recall, computed from the stored blocks in fp64 (not from the index); `pick`:
    the lexical prior's block, which takes one of the top-k in every layer."""
    q = mem.queries.double()  # [M, H, D]
    out = []
    for i, f in enumerate(mem.inv_freqs):
        inv = f.double()
        rot = _rope(q[i][:, None], inv, torch.tensor([mem.q_pos - position]))[:, 0]  # [H, D]
        per = []
        for bid in mem.index_ids:
            b = mem.store.read(bid)
            un = _rope(b.keys[i].double(), inv, -torch.from_numpy(b.slots.astype(np.int64)))  # [H_kv, n, D]
            per.append(_block_score(mem, mem.rule, rot, un))
        s = torch.stack(per)  # [NB, H or H_kv]
        if mem.rule == "mass":  # each head's share among the blocks
            s = torch.softmax(s * float(mem.scaling[i]), dim=0)
        scores = s.sum(1).tolist()
        ranked = [j for j in np.argsort(scores)[::-1].tolist() if mem.index_ids[j] != pick]
        top = ranked[: mem.topk - (pick is not None)]
        if pick is not None and pick in mem.index_ids:
            top.append(mem.index_ids.index(pick))
        out.append([mem.index_ids[j] for j in sorted(top)])
    return out


@pytest.mark.parametrize("rule", ["far", "mass", "bound"])
def test_every_layer_recalls_the_blocks_an_fp64_scoring_picks(rule: str, tmp_path: Path) -> None:
    """Fed in pieces of 1-7 tokens (each piece's chunk chooses a lexical prior, kept by the single tokens after it),
    the stream coming round again so that chunks share tokens with stored blocks: each layer's choice is the fp64
    scoring's, with the block an independent lexical scoring picks at the chunk in every layer."""
    model = tiny_model("llama", layers=3, score_std=3.0).double()
    eng = engine(model, memory(model, tmp_path / "m", topk=3, rule=rule))
    mem = eng.memory
    real, ref = mem.prepare, {"pick": None}

    def spy(cache: Any, position: int, single: bool = False, ids: list[int] | None = None) -> Any:
        if not single:  # the blocks as this chunk sees them (after the evictions that made room for it)
            ref["pick"] = reference_pick(mem, (ids if ids is not None else mem.feeding) or [])
        return real(cache, position, single, ids=ids)

    mem.prepare = spy  # type: ignore[method-assign]
    stream, at, checked, picked, distinct = IDS + IDS[10:90], 0, 0, 0, set()
    for n in [1, 3, 1, 5, 1, 1, 7, 2] * 40:
        if at >= len(stream):
            break
        list(eng.feed_ids(stream[at : at + n]))
        at += n
        if ref["pick"] not in mem.index_ids:
            ref["pick"] = None  # gone with its block
        assert mem.lexical == ref["pick"]
        if mem.blocks > mem.topk and n > 1:
            pos = eng.pinned_slots()
            got = mem.choose(pos)
            assert got == reference_choice(mem, pos, ref["pick"])
            distinct.add(tuple(map(tuple, got)))
            checked += 1
            picked += ref["pick"] is not None
    assert checked >= 8 and picked >= 3
    assert any(len({tuple(c) for c in choice}) > 1 for choice in distinct)  # layers do choose differently


def _packed(layers: int = 2) -> Any:
    from sinkchat.model import int4

    model = tiny_model("llama", layers=layers, score_std=3.0)
    int4.quantize_model(model.model.layers, kernels="native")
    return model


needs_native = pytest.mark.skipif(native.unsupported("ref") is not None,
                                  reason=f"native kernels: {native.unsupported('ref')}")


@needs_native
@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
def test_native_step_and_prefill_with_memory_match_the_transformers_forward(kv: str, tmp_path: Path) -> None:
    """Chunks through the C prefill and tokens through the C step, each attending the recall region, against the
    same calls through transformers' forward (same packed weights, same memory rule): the same blocks chosen in
    every layer at every call, and the same logits."""
    model = _packed()
    ref = engine(model, memory(model, tmp_path / "r"), chunk=12, kv=kv)
    fast = engine(model, memory(model, tmp_path / "f"), chunk=12, step=select(model, "native"), kv=kv)
    assert fast.step.prefill is not None and fast.step.memory_region
    worst, calls, lexical = 0.0, 0, 0
    for at in range(0, len(IDS), 15):  # 15 tokens a feed: a chunk of 11, then 1 (the memory's split), ...
        for eng in (ref, fast):
            list(eng.feed_ids(IDS[at : at + 15]))
        out = [list(eng.generate(max_tokens=2)) for eng in (ref, fast)]  # two decode steps each
        assert ref.memory.chosen == fast.memory.chosen and ref.memory.lexical == fast.memory.lexical
        lexical += fast.memory.lexical is not None  # IDS comes round at 120: its chunks single out stored blocks
        assert ref.last_reply_ids == fast.last_reply_ids
        worst = max(worst, float((ref.last_logits - fast.last_logits).abs().max()))
        calls += bool(fast.memory.chosen[0])
        assert out[0][-1].tokens == out[1][-1].tokens == 2
    assert calls >= 5 and fast.memory.blocks >= 8 and fast.cache.layers[0].used > 0 and lexical >= 1
    assert worst < (2e-2 if kv == "bfloat16" else 5e-3)


@needs_native
def test_memory_on_with_nothing_recalled_is_bit_identical_to_off(tmp_path: Path) -> None:
    """The region path (sc_step_layers with every buffer `base` slots in, sc_prefill with `off`) computes what
    the plain path computes when nothing is recalled: bit for bit."""
    model = _packed()
    a = engine(model, memory(model, tmp_path / "m"), step=select(model, "native"))
    b = engine(model, None, step=select(model, "native"))
    for tok in IDS[:30]:
        list(a.feed_ids([tok]))
        list(b.feed_ids([tok]))
        assert torch.equal(a.last_logits, b.last_logits)
    assert a.memory.blocks == 0 and not a.memory.queue and a.cache.layers[0].base > 0
    for eng in (a, b):
        eng.cache.truncate(20)
        eng.ledger.truncate(20)
        ids = IDS[20:30]
        keys, values = eng.cache.buffers(eng.step.n_kv, eng.step.head_dim, eng.device, eng.kv_store)
        eng.cache.advance(len(ids))
        extra = {"base": eng.memory.region, "used": 0} if eng.memory else {}
        eng.last_logits = eng.step.prefill(ids, 20, keys, values, True, **extra)
    assert torch.equal(a.last_logits, b.last_logits)
    for la, lb in zip(a.cache.layers, b.cache.layers):
        assert torch.equal(la.live()[0], lb.live()[0]) and torch.equal(la.live()[1], lb.live()[1])


def _blocks(n: int, start: int = 0) -> list[Any]:
    from sinkchat.memory.blocks import Block

    g = torch.Generator().manual_seed(start)
    return [Block(start + i, np.arange(8 * i, 8 * i + 8), np.arange(8, dtype=np.int32), np.arange(4, 12, dtype=np.int32),
                  torch.randn(2, 2, 8, 16, generator=g).bfloat16(), torch.randn(2, 2, 8, 16, generator=g).bfloat16())
            for i in range(n)]


def test_store_round_trip_cut_tail_and_bad_checksum_are_reported(tmp_path: Path) -> None:
    from sinkchat.memory.store import BlockStore, StoreError, scan

    store = BlockStore(tmp_path / "s", 1 << 20)
    blocks = _blocks(5)
    for b in blocks:
        store.append(b)
    assert oct((tmp_path / "s").stat().st_mode & 0o777) == "0o700"
    seg = next((tmp_path / "s").glob("seg-*.mem"))
    assert oct(seg.stat().st_mode & 0o777) == "0o600"
    back = store.read(3)
    assert torch.equal(back.keys, blocks[3].keys) and (back.abs_index == blocks[3].abs_index).all()
    got, note = scan(tmp_path / "s")
    assert [b.id for b in got] == [0, 1, 2, 3, 4] and note is None
    data = seg.read_bytes()
    seg.write_bytes(data[:-100])  # killed in the middle of the last record
    got, note = scan(tmp_path / "s")
    assert [b.id for b in got] == [0, 1, 2, 3] and "cut short" in note and "\n" not in note
    with pytest.raises(StoreError, match="short"):
        store.read(4)
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF  # one bit flipped inside a record
    seg.write_bytes(bytes(flipped))
    got, note = scan(tmp_path / "s")
    assert len(got) < 5 and "checksum" in note
    store.close()
    assert not (tmp_path / "s").exists()  # the session's memory goes with it


def test_a_store_killed_mid_write_loses_at_most_its_last_block(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    from sinkchat.memory.store import scan

    code = ("import sys, torch, numpy as np\nsys.path.insert(0, 'tests')\nfrom test_memory import _blocks\n"
            "from sinkchat.memory.store import BlockStore\n"
            f"s = BlockStore(__import__('pathlib').Path({str(tmp_path / 's')!r}), 1 << 40)\n"
            "i = 0\nwhile True:\n    [s.append(b) for b in _blocks(50, i)]\n    i += 50\n    print(i, flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parent.parent)
    written = int(proc.stdout.readline())  # at least 50 blocks are out
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    got, note = scan(tmp_path / "s")
    ids = [b.id for b in got]
    assert len(ids) >= written and ids == list(range(len(ids)))  # every block before the cut, in order
    assert note is None or "\n" not in note  # a cut record, if the kill landed in one: one line


def test_a_block_that_fails_its_checksum_is_reported_forgotten(tmp_path: Path) -> None:
    model = tiny_model("llama", layers=1, score_std=3.0)
    eng = engine(model, memory(model, tmp_path / "m", topk=2))
    list(eng.feed_ids(IDS[:70]))
    mem = eng.memory
    assert mem.blocks >= 3
    mem.slices.clear()
    mem.placed = [() for _ in mem.layers]
    for seg in (tmp_path / "m").glob("seg-*.mem"):  # damage every record's payload
        data = bytearray(seg.read_bytes())
        for w in mem.store.where.values():
            data[w.offset + 60] ^= 0xFF
        seg.write_bytes(bytes(data))
    events = [e for e in eng.feed_ids(IDS[70:72]) if isinstance(e, ForgottenEvent)]
    assert events and all(e.reason == "damaged" for e in events)
    assert eng.ledger.evicted == mem.tokens + mem.forgotten


@needs_native
def test_the_sink_gauge_measures_the_stream_first_slots_past_the_recalled_ones(tmp_path: Path) -> None:
    """The C step's gauge share (first slots from the stream's start on, after the recalled slots) equals the
    share recomputed in torch from the captured queries over [recalled | stream] (gauge.probs)."""
    model = _packed()
    eng = engine(model, memory(model, tmp_path / "m"), step=select(model, "native"))
    list(eng.feed_ids(IDS[:100]))
    assert eng.cache.layers[0].used > 0
    eng.gauge.armed = True
    list(eng.feed_ids([IDS[100]]))
    eng.gauge.armed = False
    c_shares = eng.gauge.shares[1][:, 0].clone()
    used = eng.cache.layers[0].used
    torch_shares = torch.stack([eng.gauge.probs(eng.cache, i)[..., used : used + 4].sum(-1).mean()
                                for i in range(len(eng.gauge.layers))])
    torch.testing.assert_close(c_shares, torch_shares.float(), rtol=0, atol=2e-3)
    assert float((eng.gauge.probs(eng.cache, 0)[..., :used].sum(-1)).mean()) > 0.01  # recalled slots do get some


def test_a_hybrid_model_recalls_on_its_global_layers_only(tmp_path: Path) -> None:
    """Gemma 3 (local, global, local): the memory holds and recalls the global layer's keys; the local rings keep
    their windows as before; the fast steps decline (they say why) and transformers' forward attends the region."""
    import transformers as tf

    torch.manual_seed(0)
    shape = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, max_position_embeddings=512)
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**shape, num_hidden_layers=3, layer_types=types,
                                                     sliding_window=8, query_pre_attn_scalar=16)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.fill_(2.0)  # peaked attention: recalled keys must matter
    mem = memory(model, tmp_path / "m")
    assert mem.layers == [1]
    a, b = engine(model, mem), engine(model, None)
    for eng in (a, b):
        list(eng.feed_ids(IDS[:120]))
    assert a.cache.layers[1].used > 0 and not hasattr(a.cache.layers[0], "used")
    assert a.ledger.evicted == mem.tokens + mem.forgotten and mem.blocks >= 8
    assert float((a.last_logits - b.last_logits).abs().max()) > 1e-3
    out = list(a.generate(max_tokens=4))
    assert out[-1].tokens == 4


def test_a_loaded_snapshot_recalls_its_own_conversation_and_never_the_one_it_replaced(tmp_path: Path) -> None:
    from sinkchat.store.snapshot import load_snapshot, save_snapshot

    model = tiny_model("llama", layers=1, score_std=3.0)
    eng = engine(model, memory(model, tmp_path / "m"))
    list(eng.feed_ids(IDS[:60]))
    saved_blocks = list(eng.memory.index_ids)
    assert saved_blocks
    snap = save_snapshot(eng, tmp_path / "s.safetensors")
    kept = {int(a) for bid in saved_blocks for a in eng.memory.store.read(bid).abs_index} | {
        a for e in eng.memory.queue for a in e[3]}
    other = [(t + 7) % 120 + 1 for t in IDS[60:140]]
    list(eng.feed_ids(other))  # another conversation fills the memory (appending to the linked segment too)
    assert eng.memory.blocks > len(saved_blocks)
    load_snapshot(eng, snap)
    assert eng.memory.index_ids == saved_blocks and eng.cache.layers[0].used == 0
    assert eng.ledger.evicted == eng.memory.tokens + eng.memory.forgotten
    list(eng.feed_ids(IDS[140:145]))
    recalled = {int(a) for bid in eng.memory.chosen[0] for a in eng.memory.store.read(bid).abs_index}
    assert recalled and recalled <= kept  # only the loaded session's own tokens come back


def test_the_index_keeps_its_rows_in_block_order_through_growth_and_removals() -> None:
    """Appends past the capacity (doubling, compacting), the oldest removed (the front moves), one from the
    middle: the scores stay those of a plain list of the same blocks, in the same order."""
    from sinkchat.memory.index import Index

    g = torch.Generator().manual_seed(0)
    idx, kept = Index(), {}
    for bid in range(40):
        kept[bid] = torch.randn(3, 2, 4, 8, generator=g)
        idx.add(bid, kept[bid])
        if bid % 5 == 4:
            oldest = min(kept)
            idx.remove(oldest)
            del kept[oldest]
    idx.remove(sorted(kept)[len(kept) // 2])
    del kept[sorted(kept)[len(kept) // 2]]
    q = torch.randn(3, 2, 8, generator=g)
    want = torch.stack([torch.einsum("mkd,mkrd->mkr", q, kept[b]).amax(-1).sum(-1) for b in sorted(kept)])  # [NB, M]
    assert idx.ids == sorted(kept)
    torch.testing.assert_close(idx.scores(q), want)


def test_the_index_scores_each_heads_share_and_quests_bound_as_written() -> None:
    """Rule "mass": per block and layer, each query head's best row dot, times the layer's scale, through a softmax
    over the blocks, summed over heads (through growth and a removal). Rule "bound": the row [max | min] of a
    block's keys against the query's positive / negative parts is sum_d max(q_d min_d, q_d max_d), never below
    any key's dot, and equal to the best one for a block of one key."""
    from sinkchat.memory.blocks import bound_queries, bounds
    from sinkchat.memory.index import Index

    g = torch.Generator().manual_seed(1)
    m, h, grp, r, d = 3, 2, 3, 4, 8
    idx, kept = Index(), {}
    for bid in range(40):
        kept[bid] = torch.randn(m, h, r, d, generator=g, dtype=torch.float64)
        idx.add(bid, kept[bid])
    idx.remove(0)
    del kept[0]
    q = torch.randn(m, h, d, grp, generator=g, dtype=torch.float64)
    scale = torch.tensor([0.3, 0.5, 0.7], dtype=torch.float64)
    best = torch.stack([torch.einsum("mkrd,mkdg->mkgr", kept[b], q).amax(-1) for b in sorted(kept)])  # [NB,M,H,G]
    want = torch.softmax(best * scale[None, :, None, None], dim=0).sum((2, 3))
    torch.testing.assert_close(idx.scores(q, scale), want, rtol=1e-12, atol=1e-12)
    keys = torch.randn(m, h, 16, d, generator=g, dtype=torch.float64)
    qb = torch.randn(m, h, grp, d, generator=g, dtype=torch.float64)
    ib = Index()
    ib.add(0, bounds(keys))
    hi, lo = keys.amax(2), keys.amin(2)  # [M, H, D]
    plain = torch.maximum(qb * lo[:, :, None], qb * hi[:, :, None]).sum(-1)  # [M, H, G]
    torch.testing.assert_close(ib.scores(bound_queries(qb).transpose(2, 3))[0], plain.sum((1, 2)))
    assert bool((plain[..., None] >= torch.einsum("mkgd,mknd->mkgn", qb, keys) - 1e-12).all())
    one = Index()
    one.add(0, bounds(keys[:, :, :1]))
    torch.testing.assert_close(one.scores(bound_queries(qb).transpose(2, 3))[0],
                               torch.einsum("mkgd,mkd->m", qb, keys[:, :, 0]))
    with pytest.raises(ValueError, match="added to an index"):
        idx.add(99, bounds(keys))  # another rule's rows in the same index: refused, not scored as these


def test_the_attn_rule_keeps_the_keys_the_last_queries_attend_most(tmp_path: Path) -> None:
    """Rule "attn" (InfLLM-like, measured in docs/memory.md): a block's rows are, per layer and KV head, the r keys
    with the largest dot against the head group's queries rotated to the recall distance, in token order; with no
    queries yet, the "far" keys."""
    model = tiny_model("llama", layers=2, score_std=3.0).double()
    mem = memory(model, tmp_path / "m", rule="attn")
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(2, mem.n_kv, 8, mem.head_dim, generator=g, dtype=torch.float64)  # [M, H_kv, n, D]
    assert torch.equal(mem._rows(keys, 4), representatives(keys, mem.reps))
    mem.queries, mem.q_pos = torch.randn(2, mem.n_heads, mem.head_dim, generator=g, dtype=torch.float64), 30
    q = mem._group_queries(4)  # [M, H_kv, D]
    for i in range(2):
        for k in range(mem.n_kv):
            pick = sorted((keys[i, k] @ q[i, k]).topk(mem.reps).indices.tolist())
            assert torch.equal(mem._rows(keys, 4)[i, k], keys[i, k, pick])
    mem.close()


def test_the_slice_cache_stays_within_its_bytes_and_reads_each_block_once_a_call() -> None:
    from sinkchat.memory.slices import SliceCache

    reads: list[tuple[int, list[int]]] = []

    def read(bid: int, layers: list[int]) -> tuple[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
        reads.append((bid, sorted(layers)))
        return 5, {i: (torch.full((2, 8, 4), float(bid)), torch.full((2, 8, 4), -float(bid))) for i in layers}

    cache = SliceCache(10 * 2 * 2 * 8 * 4 * 4, [torch.ones(2)] * 3)  # room for 10 slices
    got = cache.get_many([(1, 0), (1, 2), (2, 0), (1, 0)], 5, torch.float32, read)
    assert reads == [(1, [0, 2]), (2, [0])] and float(got[(2, 0)][0][0, 0, 0]) == 2.0
    for b in range(3, 30):
        cache.get_many([(b, 0), (b, 1)], 5, torch.float32, read)
        assert cache.nbytes <= cache.limit
    reads.clear()
    cache.get_many([(29, 0), (29, 1)], 5, torch.float32, read)
    assert reads == []  # the most recent ones are still there
    k, _ = cache.get_many([(29, 0)], 6, torch.float32, read)[(29, 0)]  # the recall position moved by one
    assert not torch.equal(k, torch.full((2, 8, 4), 29.0))


@needs_native
def test_a_hybrid_native_step_with_memory_matches_the_transformers_forward(tmp_path: Path) -> None:
    """Gemma 3 (local, local, global, local, global), packed: the C step attends the global layers' recall regions
    and the local rings as before; transformers' forward with the same memory rule chooses the same blocks and gives
    the same greedy tokens."""
    from test_native_gemma import F, S, gemma

    model = gemma("gemma3", [S, S, F, S, F])
    ref = engine(model, memory(model, tmp_path / "r"), chunk=12, kv="float32")
    fast = engine(model, memory(model, tmp_path / "f"), chunk=12, step=select(model, "native"), kv="float32")
    assert fast.step.memory_region and ref.memory.layers == [2, 4]
    worst = 0.0
    for at in range(0, len(IDS), 15):  # in lockstep (the same tokens fed to both: Gemma's sums differ enough in
        for eng in (ref, fast):  # order that a free-running greedy reply can take another near-tied token)
            list(eng.feed_ids(IDS[at : at + 13]))
            for tok in IDS[at + 13 : at + 15]:  # two single-token calls: the decode step
                list(eng.feed_ids([tok]))
        assert ref.memory.chosen == fast.memory.chosen
        worst = max(worst, float((ref.last_logits - fast.last_logits).abs().max()))
    assert fast.cache.layers[2].used > 0 and fast.memory.blocks >= 8
    assert worst < 2e-2


def test_chunks_choose_every_call_and_decoding_every_few_and_right_after_a_chunk(tmp_path: Path) -> None:
    """The feed's last token goes on its own and chooses with the queries of the chunk before it (so the question's
    last token recalls by the question, not by what came before it); decoding keeps a choice for `every` tokens."""
    model = tiny_model("llama", layers=1, score_std=3.0)
    eng = engine(model, memory(model, tmp_path / "m"), chunk=16)
    list(eng.feed_ids(IDS[:100]))
    mem = eng.memory
    assert mem.blocks > mem.topk
    calls: list[int] = []
    real = mem.choose
    mem.choose = lambda position: calls.append(eng.ledger.seen) or real(position)  # type: ignore[method-assign]
    list(eng.feed_ids(IDS[100:113]))  # 13 tokens: a chunk of 12, then the last one on its own
    assert len(calls) == 2
    calls.clear()
    for tok in IDS[113:130]:
        list(eng.feed_ids([tok]))
    assert len(calls) == 2  # 17 single tokens after a choice: chosen again at the 8th and the 16th (every 8)


def test_event_lines_say_where_evicted_tokens_went_and_why_forgotten_ones_left() -> None:
    from sinkchat.core.events import EvictionEvent
    from sinkchat.core.metrics import eviction_line

    assert eviction_line(EvictionEvent(63, 4, 67, "old", "sink", 961, 0.0, True)).startswith(
        "⟂ evicted 63 tokens [4,67) to memory (sink, 961 left)")
    assert " to memory" not in eviction_line(EvictionEvent(63, 4, 67, "old", "sink", 961))
    assert eviction_line(ForgottenEvent(64, 4, 68, "budget")) == \
        "⟂ forgotten 64 tokens [4,68) (over the memory budget)"
    assert "could not write" in eviction_line(ForgottenEvent(64, 4, 68, "disk"))
    assert "checksum" in eviction_line(ForgottenEvent(64, 4, 68, "damaged"))


def test_clear_counts_what_the_memory_held_and_a_cleared_memory_recalls_at_most_k(tmp_path: Path) -> None:
    """A /clear drops the memory's tokens as forgotten (the ledger counted them evicted), and a memory with no
    queries yet over a cache that then evicts many blocks at once recalls its k newest, never more (the region
    holds k blocks: more once crashed the fill)."""
    model = tiny_model("llama", layers=1, score_std=3.0)
    eng = engine(model, memory(model, tmp_path / "m"), chunk=36)
    list(eng.feed_ids(IDS[:100]))
    held = eng.memory.tokens
    assert held > 0
    eng.clear()
    assert eng.memory.tokens == 0 and eng.memory.forgotten == held
    assert eng.ledger.evicted == eng.memory.tokens + eng.memory.forgotten
    list(eng.feed_ids(IDS[:36]))
    eng.memory.queries = None  # as after a clear over a cache that holds tokens (/forget, /memory on)
    list(eng.feed_ids(IDS[36:72]))  # one chunk that evicts 4 blocks before the call
    assert eng.memory.blocks > 2 and all(len(c) == 2 for c in eng.memory.chosen)
    assert eng.ledger.evicted == eng.memory.tokens + eng.memory.forgotten


def test_eight_bit_records_halve_the_disk_and_read_back_within_half_a_step(tmp_path: Path) -> None:
    """--memory-bits 8: a record's keys and values as int8 with an fp32 scale per token and head (absmax / 127):
    ~half the bytes of bf16, each value back within half a quantization step, checked by the same CRCs; an engine
    with it recalls (its logits differ from 16-bit storage, slightly) and keeps every token accounted for."""
    from sinkchat.memory.blocks import HEADER, Block, Shape, layer_of, tokens_of

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(3, 2, 16, 8, generator=g).bfloat16(), torch.randn(3, 2, 16, 8, generator=g).bfloat16()
    blk = Block(7, np.arange(16, dtype=np.int64), np.arange(16, dtype=np.int32), np.full(16, 4, np.int32), k, v)
    rec8, rec16 = blk.encode(8), blk.encode(16)
    assert len(rec8) < 0.8 * len(rec16)
    back = Block.decode(rec8[: HEADER.size], rec8[HEADER.size :])
    for orig, got in ((k, back.keys), (v, back.values)):
        step = orig.float().abs().amax(-1, keepdim=True) / 127
        assert float(((got - orig.float()).abs() - step / 2).max()) <= 1e-6
    sh = Shape.of(rec8[: HEADER.size])
    _, _, _, crcs = tokens_of(sh, rec8[HEADER.size : HEADER.size + sh.meta])
    chunk = bytearray(rec8[sh.layer_at(1) : sh.layer_at(1) + sh.chunk])
    chunk[3] ^= 1
    with pytest.raises(ValueError, match="checksum"):
        layer_of(sh, bytes(chunk), crcs[1], 1)
    model = tiny_model("llama", layers=1, score_std=3.0)
    runs = {}
    for bits in (16, 8):
        mem = RecallMemory.for_spec(MemoryConfig("on", 64, 8, 2, 64, bits), ModelSpec.from_model(model),
                                    tmp_path / f"m{bits}")
        eng = engine(model, mem)
        list(eng.feed_ids(IDS))
        assert eng.ledger.evicted == mem.tokens + mem.forgotten
        runs[bits] = (eng.last_logits.clone(), mem.disk_bytes)
    diff = float((runs[8][0] - runs[16][0]).abs().max())
    assert 0 < diff < 0.05 and runs[8][1] < 0.8 * runs[16][1]
