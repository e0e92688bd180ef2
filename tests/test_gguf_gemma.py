"""Gemma 2 / Gemma 3 GGUF files read by sinkchat's own GGUF reader: a tiny random model of each written as llama.cpp's
converter writes it (tests/gguf_gemma.py: norms as 1 + w, tied head, hard-coded local/global pattern), then

- the converted config against the model's own (which layers slide, window, query scale, soft-capping, the two
  RoPE bases), and the parts llama.cpp leaves to its own defaults (a stated pattern, Gemma 3's linear scaling);
- the weights in fp32 (`--quant none`): the forward equals the original model's on the file's values, so every name,
  the norms' 1 + w and the embedding's sqrt(hidden) factor are right (each of those wrong moves logits by O(1));
- the packed model (the file's own 4/8-bit values) within int8-activation error of the same forward.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import gguf_gemma as gg
from sinkchat.config import ModelConfig
from sinkchat.model import gguf_convert, loader

TYPES = {"token_embd.weight": "Q8_0", "blk.*.ffn_*": "Q4_K", "*": "Q6_K"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("SINKCHAT_CACHE_DIR", str(tmp_path_factory.mktemp("gemma-cache")))
    yield
    mp.undo()


@pytest.fixture(scope="module", params=["gemma2", "gemma3_text"])
def case(request, tmp_path_factory, cache):
    arch = request.param
    ref = gg.tiny_model(arch, seed=2)
    path = gg.write_gguf(ref, tmp_path_factory.mktemp(arch) / f"{arch}.gguf", TYPES)
    ref.load_state_dict(gg.file_state_dict(ref, path), strict=True)
    ref.tie_weights()
    ids = torch.randint(0, 3000, (1, 48), generator=torch.Generator().manual_seed(1))  # 48 > window 8: both kinds
    with torch.no_grad():
        want = ref(ids, use_cache=False).logits[0]
    return arch, path, ref, ids, want


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, use_cache=False).logits[0].float()


def test_the_converted_config_is_the_models(case):
    arch, path, ref, _, _ = case
    cfg = json.loads((gguf_convert.prepare(path, lambda m: None) / "config.json").read_text())
    want = ref.config
    assert cfg["model_type"] == want.model_type
    assert cfg["layer_types"] == want.layer_types and len(set(cfg["layer_types"])) == 2
    assert cfg["sliding_window"] == want.sliding_window and cfg["head_dim"] == want.head_dim
    assert cfg["query_pre_attn_scalar"] == want.query_pre_attn_scalar
    assert cfg["rope_parameters"] == want.rope_parameters
    if arch == "gemma2":
        assert (cfg["attn_logit_softcapping"], cfg["final_logit_softcapping"]) == (50.0, 30.0)


def test_float_weights_give_the_models_forward(case):
    """--quant none: every tensor dequantized to fp32, so the forward is the reference's up to fp32 rounding."""
    _, path, _, ids, want = case
    loaded = loader.load(ModelConfig(model=str(path), quant="none", threads=1))
    got = _logits(loaded.model, ids)
    assert (got - want).abs().max().item() < 1e-3 * (want.max() - want.min()).item()


def test_packed_weights_stay_within_int8_activation_error(case):
    """The file's own 4/8-bit values in the kernels' layouts, int8 activations: measured max |Δ| 1.4-1.6% of the
    logit range; without the embedding's sqrt(hidden) (a scratch edit) it was 30%+."""
    _, path, _, ids, want = case
    loaded = loader.load(ModelConfig(model=str(path), threads=1))
    assert loaded.model.get_input_embeddings().scale == pytest.approx(256 ** 0.5)
    got = _logits(loaded.model, ids)
    spread = (want.max() - want.min()).item()
    assert (got - want).abs().max().item() <= 0.05 * spread


def test_a_stated_pattern_is_followed(tmp_path, cache):
    """Newer converters write `attention.sliding_window_pattern` (one flag a layer); it wins over the default."""
    flags = [True, False, True, True, False, True]
    model = gg.tiny_model("gemma3_text", seed=0)
    path = gg.write_gguf(model, tmp_path / "pattern.gguf", "Q8_0", pattern=flags)
    cfg = json.loads((gguf_convert.prepare(path, lambda m: None) / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention" if f else "full_attention" for f in flags]


def test_gemma3_linear_rope_scaling_goes_to_the_global_layers_only():
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}
    cfg = SimpleNamespace(num_hidden_layers=62, hidden_size=5376, num_attention_heads=32, head_dim=128,
                          rope_parameters=rope)
    gguf_convert.gemma_config(cfg, "gemma3", {"rope.scaling.type": "linear", "rope.scaling.factor": 8.0})
    assert cfg.rope_parameters["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}
    assert cfg.rope_parameters["sliding_attention"] == rope["sliding_attention"]
    assert cfg.query_pre_attn_scalar == 168  # the 27B: hidden / heads, as llama.cpp scales it
    assert cfg.layer_types[5] == "full_attention" and cfg.layer_types.count("full_attention") == 10


def test_a_gemma_file_streams_through_the_native_step_as_through_transformers(case, word_tok):
    """The file's K-quant / Q8_0 layouts decoded token by token by the native step (local layers on their rings)
    across many evictions, against the same packed model decoded by transformers' forward on the same cache
    (tests/test_hybrid.py shows that path exact). Measured by hand: max |Δ| 1.4-1.7% of the logit range (an int8
    rounding that flips stays in the cache)."""
    from sinkchat import decode
    from sinkchat.config import CacheConfig, SamplingConfig
    from sinkchat.core.engine import Engine

    arch, path, _, _, _ = case
    loaded = loader.load(ModelConfig(model=str(path), threads=1))
    step = decode.select(loaded.model, "native", loaded.spec)
    assert type(step).__name__ == "NativeStep", f"{arch}: native step refused"
    ids = torch.randint(0, 2000, (110,), generator=torch.Generator().manual_seed(5)).tolist()
    last = []
    for s in (step, None):
        eng = Engine(loaded.model, word_tok, CacheConfig("sink", 4, 40, 5), SamplingConfig(temperature=0),
                     spec=loaded.spec, step=s)
        list(eng.feed_ids(ids[:8]))
        for t in ids[8:]:
            list(eng.feed_ids([t]))
        assert eng.ledger.evicted > 60
        last.append(eng.last_logits.float().reshape(-1))
    got, want = last
    spread = (want.max() - want.min()).item()
    assert (got - want).abs().max().item() <= 0.05 * spread
