"""Hybrid attention on the sink cache (issue #15): Gemma 2 / 3 mix full-attention (global) and sliding-window (local)
layers. Global layers keep sinks + window; local layers keep the last W - 1 tokens of the stream (a ring), or share
the global slots when the window cannot bite inside the cache (`sinkchat/core/hybrid_cache.py`).

References, all through transformers' own forward on tiny random models with peaked attention (scores of std ~3,
see tests/README.md "Known traps"), streamed through the Engine (transformers' forward: no fast step runs these
models) across many evictions, in multi-token chunks and single tokens:
- literal: for models whose local layers all come before one global layer (Gemma 3's 5:1 block, Gemma 2's 1:1
  pair), one forward over the kept tokens at their in-cache positions plus the stream tokens their local windows
  reach back to (at the same relative distances), with explicit 4D masks: global layers see the kept slots, local
  layers what their window sees in the stream. Exact: no layer's input depends on an evicted token otherwise.
- shadow: for interleaved stacks, a cache that stores keys un-rotated and rotates them at use from scratch (fp64),
  per layer with that layer's RoPE (tests/shadow_cache.py, extended here with a local window layer).
The rings' memory and what a Ctrl-C rollback may take back from them: tests/test_core_rings.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
import transformers as tf
from transformers.cache_utils import Cache, CacheLayerMixin

from fakes import WordTokenizer
from shadow_cache import ShadowLayer, rotate_at
from sinkchat.config import CacheConfig, ConfigError, SamplingConfig
from sinkchat.core.engine import Engine
from sinkchat.core.hybrid_cache import HybridKVCache, make_cache
from sinkchat.core.kv_cache import SinkKVCache
from sinkchat.decode import select
from sinkchat.model.spec import ModelSpec, UnsupportedModel, check_config

TOL = 1e-4
SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=512)
S, F = "sliding_attention", "full_attention"
GEMMA3_ROPE = {F: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},  # as the 4B+ checkpoints
               S: {"rope_type": "default", "rope_theta": 1e4}}


def peaked(model, score_std: float = 3.0):
    """Attention far from uniform: q/k-normed models (Gemma 3) get q_norm's gain (1 + w) = score_std (unit-RMS q
    and k of dim D give q.k / sqrt(D) of std ~1); others q/k projections scaled as in fakes.tiny_model."""
    cfg = model.config
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if hasattr(attn, "q_norm"):
                attn.q_norm.weight.fill_(score_std - 1.0)
            else:
                g = (score_std / cfg.hidden_size) ** 0.5 / cfg.initializer_range
                attn.q_proj.weight.mul_(g)
                attn.k_proj.weight.mul_(g)
    return model.eval()


def gemma2(types, window=8, seed=0):
    torch.manual_seed(seed)
    cfg = tf.Gemma2Config(**SHAPE, num_hidden_layers=len(types), layer_types=list(types), sliding_window=window,
                          query_pre_attn_scalar=16)
    return peaked(tf.Gemma2ForCausalLM(cfg))


def gemma3(types, window=8, seed=0):
    torch.manual_seed(seed)
    cfg = tf.Gemma3TextConfig(**SHAPE, num_hidden_layers=len(types), layer_types=list(types), sliding_window=window,
                              query_pre_attn_scalar=16, rope_parameters={k: dict(v) for k, v in GEMMA3_ROPE.items()})
    return peaked(tf.Gemma3ForCausalLM(cfg))


def mistral(layers, window, seed=0):
    torch.manual_seed(seed)
    return peaked(tf.MistralForCausalLM(tf.MistralConfig(**SHAPE, num_hidden_layers=layers, sliding_window=window)))


def engine(model, cfg=CacheConfig("sink", 4, 40, 5), **kw):
    return Engine(model, WordTokenizer(), cfg, SamplingConfig(temperature=0), gauge_every=0, **kw)


def stream(eng, ids, chunk=7, singles=20, seen=None):
    """Prefill in chunks of `chunk`, then the last `singles` tokens one at a time; returns the eviction count.
    `seen`: a list that gets the logits after every chunk and token (an error that later evictions flush out of
    the cache still shows there)."""
    eng.prefill_chunk = chunk
    events = []
    for event in eng.feed_ids(ids[:-singles]):
        events.append(event)
        if seen is not None and type(event).__name__ == "PrefillEvent":
            seen.append(eng.last_logits.clone())
    for t in ids[-singles:]:
        events += list(eng.feed_ids([t]))
        if seen is not None:
            seen.append(eng.last_logits.clone())
    return sum(type(e).__name__ == "EvictionEvent" for e in events)


def random_ids(n, seed=1):
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---------------------------------------------------------------------------------------------- literal reference
def literal_logits(model, ids, eng, window, depth):
    """Logits of the last token from one transformers forward over the kept tokens at in-cache positions plus the
    `depth * (window - 1)` stream tokens before the window region (what the local windows of the kept tokens, and
    of the tokens those saw, reached). Only for `depth` local layers followed by one global layer."""
    idx, pinned = eng.ledger.abs_index, eng.pinned_slots()
    w0 = idx[pinned]
    assert idx[pinned:] == list(range(w0, w0 + len(idx) - pinned))  # the window region is one run of the stream
    offset = w0 - pinned  # stream token a >= w0 sits at slot a - offset
    lo = w0 - depth * (window - 1) if offset else pinned
    assert not offset or lo - pinned >= window - 1, "a local window reaches the sinks: no literal reference"
    stream_idx = idx[:pinned] + list(range(lo, idx[-1] + 1))
    pos = list(range(pinned)) + [a - offset for a in range(lo, idx[-1] + 1)]
    kept = set(idx)
    s = torch.tensor(stream_idx)
    causal = s[None, :] <= s[:, None]  # [T, T]: row i (query) may see column j (key)
    local = causal & (s[:, None] - s[None, :] < window)
    k = torch.tensor([a in kept for a in stream_idx])
    glob = (causal & k[:, None] & k[None, :]) | torch.eye(len(s), dtype=torch.bool)
    neg = torch.finfo(torch.float32).min

    def additive(m):
        return torch.where(m, 0.0, neg)[None, None]  # [1, 1, T, T]

    masks = {S: additive(local), F: additive(glob)}
    with torch.no_grad():
        out = model(torch.tensor([[ids[a] for a in stream_idx]]), position_ids=torch.tensor([pos]),
                    attention_mask=masks, use_cache=False)
    return out.logits[0, -1].float()


@pytest.mark.parametrize("build,depth", [(lambda: gemma3([S] * 5 + [F]), 5), (lambda: gemma2([S, F]), 1)],
                         ids=["gemma3-5:1", "gemma2-1:1"])
def test_local_then_global_matches_a_literal_forward_across_evictions(build, depth):
    model = build()
    eng = engine(model)
    assert isinstance(eng.cache, HybridKVCache) and eng.cache.rings
    ids = random_ids(3 * 40 + 37)
    assert stream(eng, ids) >= 10
    assert eng.ledger.abs_index[:4] == [0, 1, 2, 3]
    ref = literal_logits(model, ids, eng, 8, depth)
    diff = (ref - eng.last_logits).abs().max().item()
    assert diff <= TOL, diff


# ---------------------------------------------------------------------------------------------- shadow reference
class ShadowSliding(ShadowLayer):
    """A local layer sharing the global slots (window >= cache): rotated at use like ShadowLayer, with its RoPE."""

    is_sliding = True


class ShadowWindow(CacheLayerMixin):
    """A local layer, independently: every key fed is kept un-rotated (fp64 from the position it was computed at);
    each update returns the last `window - 1` stream tokens plus the new ones, rotated from scratch to the positions
    right before the current one."""

    is_compileable = False
    is_sliding = True

    def __init__(self, inv_freq, window):
        super().__init__()
        self.inv_freq, self.keep = inv_freq, window - 1
        self.raw_k = self.v = None
        self.length = 0  # the current position (the global cache's length)

    def lazy_initialization(self, key_states, value_states):
        self.raw_k, self.v = key_states[:, :, :0].clone(), value_states[:, :, :0].clone()
        self.is_initialized = True

    def visible(self):
        return 0 if self.raw_k is None else min(self.keep, self.raw_k.shape[-2])

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, q = self.visible(), key_states.shape[-2]
        raw = rotate_at(key_states, -torch.arange(self.length, self.length + q), self.inv_freq)
        self.raw_k, self.v = torch.cat([self.raw_k, raw], -2), torch.cat([self.v, value_states], -2)
        self.length += q
        keys = rotate_at(self.raw_k[:, :, -(n + q):], torch.arange(self.length - n - q, self.length), self.inv_freq)
        return keys, self.v[:, :, -(n + q):]

    def get_mask_sizes(self, query_length):
        n = self.visible()
        return n + query_length, self.length - n

    def get_seq_length(self):
        return self.length

    def get_max_length(self):
        return -1

    def evict(self, start, count):
        self.length -= count  # nothing leaves a window; positions move down

    def truncate(self, length):
        removed = self.length - length
        if removed > 0:
            self.raw_k, self.v = self.raw_k[:, :, :-removed], self.v[:, :, :-removed]
            self.length = length

    def rotated_keys(self):
        n = self.visible()
        return rotate_at(self.raw_k[:, :, self.raw_k.shape[-2] - n:], torch.arange(self.length - n, self.length),
                         self.inv_freq)


class ShadowHybrid(Cache):
    def __init__(self, spec: ModelSpec, capacity: int):
        window = spec.local_window
        layers = [ShadowLayer(spec.inv_freq(i)) if ls.attention == "full" else
                  ShadowSliding(spec.inv_freq(i)) if window >= capacity else ShadowWindow(spec.inv_freq(i), window)
                  for i, ls in enumerate(spec.layers)]
        super().__init__(layers=layers)
        self.capacity, self.g0 = capacity, spec.global_layers[0]

    @property
    def length(self):
        return self.layers[self.g0].length

    def evict(self, ev):
        for layer in self.layers:
            layer.evict(ev.start, ev.count)

    def truncate(self, length):
        for layer in self.layers:
            layer.truncate(length)

    def can_truncate(self, length):
        return True


@pytest.mark.parametrize("build,cap,chunk", [
    (lambda: gemma2([S, F, S, F]), 40, 7),
    (lambda: gemma3([S, S, F, S, S, F, S]), 40, 7),
    # chunks of 20 through a cache of 24: each evicts down to the sinks, so the rings reach below them (negative
    # positions), and the first chunk being 3 tokens, the rings grow their buffers once
    (lambda: gemma3([S, F, S]), 24, 20),
    (lambda: gemma3([S, F, S], window=48), 40, 7),  # window >= cache: local layers share the global slots
], ids=["gemma2-SFSF", "gemma3-SSFSSFS", "gemma3-small-cache", "gemma3-shared"])
def test_interleaved_stacks_match_the_rotate_at_use_reference(build, cap, chunk):
    model = build()
    cfg = CacheConfig("sink", 4, cap, 5)
    real, ref = engine(model, cfg), engine(model, cfg)
    ref.cache = ShadowHybrid(real.spec, real.cache_cfg.capacity)
    ids = random_ids(max(3 * cap, 150) + 37, seed=2)
    for eng in (real, ref):
        list(eng.feed_ids(ids[:3]))
    got, want = [], []
    assert stream(real, ids[3:], chunk, seen=got) >= 10
    stream(ref, ids[3:], chunk, seen=want)
    assert real.ledger.ids == ref.ledger.ids and real.cache.length == ref.cache.length
    diff = (torch.stack(got) - torch.stack(want)).abs().max().item()  # every chunk and token, the last included
    assert diff <= TOL, diff
    for i, (lr, lf) in enumerate(zip(real.cache.layers, ref.cache.layers)):
        k, v = lr.live()
        assert k.shape[-2] == lf.rotated_keys().shape[-2], i
        assert (k - lf.rotated_keys()).abs().max().item() <= TOL, i


def test_the_status_line_and_stats_show_both_kinds_of_layers():
    """What a user sees: the KV figure of a hybrid model names its global and local layers (the ledger's
    length alone would hide that 5 of the 6 layers hold 7 tokens)."""
    from sinkchat.apps.render import stats_table, toolbar_text
    from sinkchat.core.metrics import Metrics, read_stats, status_line

    eng = engine(gemma3([S] * 5 + [F]), CacheConfig("sink", 4, 64, 6))
    stream(eng, random_ids(120))
    s = read_stats(eng, Metrics())
    want = f"global 1 layer {eng.cache.length}/64, local 5 layers 7/7"
    assert s.kv_layout == want and want in status_line(s) and want in toolbar_text(s)
    assert want in "".join(str(c) for c in stats_table(s).columns[1]._cells)
    plain = read_stats(engine(mistral(2, None)), Metrics())
    assert plain.kv_layout == "" and f"{plain.cache_len}/{plain.capacity}" in status_line(plain)
    assert s.gauge_local is None and " local 0." not in status_line(s)  # nothing measured yet: no figure
    m = Metrics()
    m.fold(eng.measure_gauge() or _armed_gauge(eng))
    s = read_stats(eng, m)
    shown = f" local {s.gauge_local:.2f}"
    assert 0 < s.gauge_local < 1 and shown in status_line(s) and shown in toolbar_text(s)
    assert "on the first tokens of their window" in "".join(str(c) for c in stats_table(s).columns[1]._cells)


def _armed_gauge(eng):
    eng.gauge.armed = True
    list(eng.feed_ids([5]))
    eng.gauge.armed = False
    return eng.measure_gauge()


def test_a_cache_state_restores_the_rings():
    """state() / load_state() (snapshots, /cache) mid-stream: the restored cache continues exactly."""
    model = gemma3([S, S, F])
    ids = random_ids(150, seed=4)
    a, b = engine(model), engine(model)
    stream(a, ids[:100])
    stream(b, ids[:100])
    restored = make_cache(b.spec, 40, dtype=torch.float32)
    restored.load_state(b.cache.state())
    b.cache = restored
    assert b.cache.length == a.cache.length and b.cache.layers[0].dropped == 1
    assert [layer.get_seq_length() for layer in b.cache.layers] == [a.cache.length] * 3  # positions, not slots
    stream(a, ids[100:], singles=10)
    stream(b, ids[100:], singles=10)
    assert torch.equal(a.last_logits, b.last_logits)


def test_reconfigure_refuses_to_cross_the_local_window_mid_stream():
    eng = engine(gemma3([S, F], window=48))
    assert not eng.cache.rings
    stream(eng, random_ids(60))
    with pytest.raises(ConfigError, match="local layers"):
        eng.reconfigure(capacity=64)
    eng.clear()
    eng.reconfigure(capacity=64)
    assert eng.cache.rings


# ---------------------------------------------------------------------------------------------- all sliding
def test_all_sliding_model_caps_the_cache_and_is_exact():
    """Mistral style: every layer slides, so the cache is capped at the window and the window never bites: a
    1-layer model equals a fresh forward over the kept tokens at in-cache positions."""
    model = mistral(1, window=32)
    eng = engine(model, CacheConfig("sink", 4, 32, 4))
    assert type(eng.cache) is SinkKVCache and eng.max_positions == 32
    ids = random_ids(150, seed=6)
    assert stream(eng, ids) >= 10
    with torch.no_grad():
        ref = model(torch.tensor([eng.ledger.ids]), use_cache=False).logits[0, -1]
    assert (ref - eng.last_logits).abs().max().item() <= TOL
    with pytest.raises(ConfigError, match="trained context"):
        engine(model, CacheConfig("sink", 4, 33, 4))


# ---------------------------------------------------------------------------------------------- what runs
def test_fast_steps_decline_hybrid_models_and_say_why(caplog):
    """The torch step never runs Gemma; the native one does where the linears are packed for it
    (tests/test_native_gemma.py), so on these fp32 linears neither does."""
    model = gemma3([S, F])
    with caplog.at_level(logging.INFO):
        for mode in ("auto", "native", "compiled", "eager"):
            assert select(model, mode) is None
    assert "fast decode step off: model type 'gemma3_text'" in caplog.text
    assert "native decode step off: linears not all packed" in caplog.text
    eng = engine(model)
    assert eng.decoder_status == "hf, kv float32"


def test_what_the_cache_cannot_express_is_refused_in_one_line():
    spec = ModelSpec.from_model(gemma3([S, F]))
    assert spec.check() is spec and spec.hybrid and spec.global_layers == (1,) and spec.local_window == 8
    assert spec.context_limit == 512
    from dataclasses import replace

    two = replace(spec, layers=(spec.layers[0], spec.layers[1], replace(spec.layers[0], window=16)))
    chunked = replace(spec, layers=(replace(spec.layers[0], attention="chunked_attention"), spec.layers[1]))
    for bad, text in ((two, "different windows (8, 16)"), (chunked, "attention kind(s) chunked_attention")):
        with pytest.raises(UnsupportedModel, match=text.replace("(", r"\(").replace(")", r"\)")) as e:
            bad.check()
        assert "\n" not in str(e.value)
    with pytest.raises(UnsupportedModel, match="bidirectionally"):
        check_config(tf.Gemma3TextConfig(**SHAPE, num_hidden_layers=2, use_bidirectional_attention=True))


def _eager_streamed(build, seed):
    """The model on eager attention, 149 tokens streamed through a 40-slot sink cache, then one more with the gauge
    armed (its queries captured)."""
    model = build()
    model.set_attn_implementation("eager")
    eng = engine(model)
    ids = random_ids(150, seed=seed)
    stream(eng, ids[:-1], singles=5)
    eng.gauge.armed = True
    list(eng.feed_ids(ids[-1:]))
    eng.gauge.armed = False
    return model, eng, ids


@pytest.mark.parametrize("build", [lambda: gemma2([S, F]), lambda: gemma3([S, F])], ids=["gemma2", "gemma3"])
def test_gauge_measures_the_global_layers_as_attention_computed_them(build):
    """The gauge's probabilities for the global layer equal the attention weights transformers' eager attention
    returns for the same last query in the literal reference forward (Gemma 2: soft-capped scores; Gemma 3: q_norm
    and a RoPE of its own on the global layer)."""
    model, eng, ids = _eager_streamed(build, seed=7)
    probs = eng.gauge.probs(eng.cache, 0)[0].reshape(4, -1)  # [H, L]
    ev = eng.measure_gauge(4)
    assert len(ev.per_layer) == 1 and ev.per_layer[0] == pytest.approx(float(probs[:, :4].sum(-1).mean()))
    ref = literal_attention(model, ids, eng, 8, 1)  # [H, L] over the kept slots
    assert (probs - ref).abs().max().item() <= 1e-5


def literal_attention(model, ids, eng, window, depth):
    """The global layer's attention row of the last token in `literal_logits`' forward, on the kept slots."""
    captured = {}
    attn = model.model.layers[-1].self_attn

    def keep(module, args, out):
        captured["w"] = out[1]  # (output, weights): eager attention returns its softmax

    handle = attn.register_forward_hook(keep)
    try:
        with torch.no_grad():
            literal_logits(model, ids, eng, window, depth)
    finally:
        handle.remove()
    w = captured["w"][0, :, -1]  # [H, T]
    idx, pinned = eng.ledger.abs_index, eng.pinned_slots()
    w0 = idx[pinned]
    lo = w0 - depth * (window - 1)
    cols = list(range(pinned)) + [pinned + a - lo for a in idx[pinned:]]
    return w[:, cols]


@pytest.mark.parametrize("build", [lambda: gemma2([S, F]), lambda: gemma3([S, F])], ids=["gemma2", "gemma3"])
def test_gauge_measures_the_local_layers_over_their_own_window(build):
    """The local layer's figure (separately from the gauge proper): its attention over its ring, oldest first, is
    the attention weights transformers' eager attention returns for the same query. The reference is exact and
    simple because the local layer comes first: its input is the tokens alone, so a fresh forward over the last W
    tokens of the stream reproduces its window at the same relative distances. The event's `local` is that
    layer's share on the window's first 4 tokens, not on the cache's first slots (the sinks)."""
    model, eng, ids = _eager_streamed(build, seed=3)
    assert eng.gauge.measured == (1, 0) and eng.ledger.evicted > 40
    probs = eng.gauge.probs(eng.cache, 1)[0].reshape(4, -1)  # [H, W] the local layer over its window
    captured = {}
    handle = model.model.layers[0].self_attn.register_forward_hook(lambda m, a, out: captured.update(w=out[1]))
    try:
        with torch.no_grad():
            model(torch.tensor([ids[-8:]]))
    finally:
        handle.remove()
    ref = captured["w"][0, :, -1]  # [H, 8]: the last query over its window of 8
    assert probs.shape == (4, 8) and (probs - ref).abs().max().item() <= 1e-5
    glob = eng.gauge.probs(eng.cache, 0)[0].reshape(4, -1)  # the global layer over the kept slots: the sinks first
    ev = eng.measure_gauge(4)
    assert ev.local_per_layer == pytest.approx((float(ref[:, :4].sum(-1).mean()),), abs=1e-5)
    assert ev.local == ev.local_per_layer[0] and ev.local_uniform == 4 / 8
    assert glob.shape[-1] == eng.cache.length and ev.share == pytest.approx(float(glob[:, :4].sum(-1).mean()))
    assert abs(ev.local - ev.share) > 1e-3  # two different measurements, not one figure shown twice


def test_a_one_kind_model_has_no_local_figure():
    eng = engine(mistral(2, None))
    list(eng.feed_ids(random_ids(30)))
    ev = _armed_gauge(eng)
    assert ev.local is None and ev.local_per_layer == () and ev.local_uniform is None and len(ev.per_layer) == 2
