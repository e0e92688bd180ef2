"""ModelSpec against the modules it describes: for every family sinkchat knows, the spec's dims, RoPE (checked
against the model's own rotary embedding at real positions), softmax scale, norms and linear names must be what
transformers' forward uses, and what cannot run must be refused in one line."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from sinkchat.model.spec import ModelSpec, UnsupportedModel, check_config

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)


def build(kind: str, **extra):
    torch.manual_seed(0)
    c = {**COMMON, **extra}
    makers = {
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**c)),
        "llama3": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**c, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
        "yarn": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**c, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64})),
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**c)),
        "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**c, head_dim=16)),
        "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**c, sliding_window=128)),
        "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**c, partial_rotary_factor=0.5, pad_token_id=0)),
        "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(**c, head_dim=16)),
        "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(**c, head_dim=16, query_pre_attn_scalar=32,
                                                               sliding_window=64)),
        "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**{**c, "num_hidden_layers": 3}, head_dim=16,
                                                                   sliding_window=32, sliding_window_pattern=2)),
    }
    return makers[kind]().eval()


def _cos_from_model(model, spec: ModelSpec, layer: int, pos: torch.Tensor) -> torch.Tensor:
    """cos of the rotary embedding that transformers' forward gives layer `layer` at positions `pos`."""
    base = model.model
    x = torch.zeros(1, len(pos), spec.dim)
    types = getattr(model.config, "layer_types", None)
    if types and hasattr(base.rotary_emb, f"{types[layer]}_inv_freq"):
        cos, _ = base.rotary_emb(x, pos[None], types[layer])
    else:
        cos, _ = base.rotary_emb(x, pos[None])
    return cos[0]  # [T, rot_dim]


@pytest.mark.parametrize("kind", ["llama", "llama3", "yarn", "qwen2", "qwen3", "mistral", "phi3", "gemma", "gemma2",
                                  "gemma3"])
def test_spec_describes_what_the_forward_uses(kind):
    model = build(kind)
    spec = ModelSpec.from_model(model)
    layers = model.model.layers
    assert (spec.n_layers, spec.dim, spec.vocab) == (len(layers), 64, 96)
    assert (spec.n_heads, spec.n_kv) == (4, 2)
    assert spec.head_dim == layers[0].self_attn.head_dim
    pos = torch.tensor([0, 1, 7, 100, 255])
    for i, layer in enumerate(layers):
        ls = spec.layers[i]
        assert ls.scaling == pytest.approx(layer.self_attn.scaling)
        ang = pos[:, None].double() * torch.tensor(ls.rope.inv_freq, dtype=torch.float64)  # [T, R/2]
        cos = torch.cat([ang, ang], -1).cos() * ls.rope.attention_scaling
        torch.testing.assert_close(cos.float(), _cos_from_model(model, spec, i, pos).float(), rtol=0, atol=2e-5)
        if getattr(layer.self_attn, "sliding_window", None):
            assert ls.attention == "sliding" and ls.window == layer.self_attn.sliding_window
    for name in spec.linears:
        assert isinstance(layers[0].get_submodule(name), torch.nn.Linear)
    assert spec.norm.eps == pytest.approx(model.config.rms_norm_eps)
    assert spec.norm.qk_norm == (kind in ("qwen3", "gemma3"))
    assert spec.norm.unit_offset == kind.startswith("gemma")
    assert spec.norm.sandwich == (kind in ("gemma2", "gemma3"))
    assert spec.act == ("gelu_tanh" if kind.startswith("gemma") else "silu")
    assert spec.attn_bias == (kind == "qwen2")
    assert spec.tied == bool(model.config.tie_word_embeddings)


def test_partial_rotary_and_fused_projections_of_phi3():
    spec = ModelSpec.from_model(build("phi3"))
    assert spec.layers[0].rope.rot_dim == spec.head_dim // 2
    assert spec.linears == ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def test_fast_steps_take_llama_and_qwen2_shapes_only():
    assert ModelSpec.from_model(build("llama")).fast_step_refusal(native=True) is None
    assert ModelSpec.from_model(build("qwen2")).fast_step_refusal(native=True) is None
    assert "qwen3" in ModelSpec.from_model(build("qwen3")).fast_step_refusal(native=False)
    narrow = ModelSpec.from_model(build("llama", head_dim=8))  # the C attention sums 16 lanes at a time
    assert narrow.fast_step_refusal(native=False) is None
    assert "head dim 8" in narrow.fast_step_refusal(native=True)


def test_hybrid_models_are_described_layer_by_layer():
    """Gemma 3 mixes local and global layers (held by core/hybrid_cache.py; tests/test_hybrid.py), each with its RoPE."""
    spec = ModelSpec.from_model(build("gemma3"))
    assert [layer.attention for layer in spec.layers] == ["sliding", "full", "sliding"]
    assert spec.layers[0].rope != spec.layers[1].rope  # local and global layers rotate with different bases
    assert spec.check() is spec and spec.hybrid and spec.global_layers == (1,) and spec.local_window == 32
    ropes = spec.ropes()
    assert ropes[0] is ropes[2] and ropes[0] is not ropes[1]


def test_an_all_sliding_model_caps_the_cache_at_its_window():
    spec = ModelSpec.from_model(build("mistral"))
    assert spec.check() is spec and spec.context_limit == 128
    assert ModelSpec.from_model(build("llama")).context_limit == 256


def test_position_encodings_that_cannot_be_rerotated_are_refused_from_the_config():
    cfg = tf.LlamaConfig(**COMMON, rope_parameters={"rope_type": "mrope", "rope_theta": 10000.0})
    with pytest.raises(UnsupportedModel, match="RoPE type 'mrope'"):
        check_config(cfg)


def test_kv_bytes_follow_the_spec():
    spec = ModelSpec.from_model(build("qwen3"))
    assert spec.kv_bytes_per_token(16) == 2 * 2 * 2 * 16 * 2  # k and v, 2 layers, 2 kv heads, head dim 16, 2 bytes
