"""tests/gguf_models.py: tiny random models written as llama.cpp-style GGUF files read back by transformers' GGUF loader.

Files for the weight checks are written without the tokenizer keys (`tokenizer=False`): transformers' GGUF loader
parses a 49k-token vocabulary and its merges with gguf.GGUFReader twice per from_pretrained (~6 s), and the weights do
not depend on it. One full file (with the tokenizer) is loaded once, for the tokenizer and the token-id config keys.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gguf_models as gm

# name -> (arch, tiny_config overrides). Between them: untied and tied embeddings, llama3 rope scaling, GQA everywhere.
F32_CASES = {
    "llama": ("llama", {}),
    "llama3_rope_tied": ("llama", {"rope_scaling": "llama3", "tie_word_embeddings": True}),
    "qwen2_tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),
    "phi3": ("phi3", {}),
}

# type -> (arch it is written for, tied, largest relative RMS error of a dequantized 2-D weight vs the original).
# Every arch gets two types; rows of 256 (hidden 256, 8 heads) so the K-quants fit.
QUANT_CASES = {
    "F16": ("mistral", True, 1e-3),
    "BF16": ("phi3", False, 5e-3),
    "Q8_0": ("llama", False, 0.01),
    "Q4_0": ("qwen2", True, 0.1),
    "Q4_1": ("qwen3", True, 0.1),
    "Q5_0": ("mistral", True, 0.05),
    "Q5_1": ("phi3", False, 0.05),
    "Q4_K": ("llama", False, 0.1),
    "Q5_K": ("qwen2", True, 0.05),
    "Q6_K": ("qwen3", True, 0.025),
}
QUANT_SHAPE = {"hidden_size": 256, "num_attention_heads": 8}

SAMPLE_TEXT = (
    "<|im_start|>user\nHello, world! What's 12+30?  Tabs\tand  spaces, ünïcödé, 日本語, emoji 🙂.<|im_end|>\n"
    "<|im_start|>assistant\n42<|endoftext|>"
)


def _assert_same_weights(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == torch.float32, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def _stored_as_hf(path, config) -> dict[str, tuple[str, torch.Tensor]]:
    """{hf name: (ggml type, gguf.quants.dequantize of the stored blocks in transformers layout)}."""
    out = {}
    for gguf_name, (type_name, values) in gm.read_gguf_tensors(path).items():
        hf_name, values = gm.gguf_to_hf(gguf_name, values, config)
        if hf_name is not None:
            out[hf_name] = (type_name, torch.from_numpy(np.ascontiguousarray(values)))
    return out


# ------------------------------------------------------------------------------------------------------ F32, per arch


@pytest.fixture(scope="module")
def f32_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-f32")
    out = {}
    for case, (arch, over) in F32_CASES.items():
        model = gm.tiny_model(arch, seed=len(out), **over)
        out[case] = (model, gm.write_gguf(model, root / f"{case}.gguf", tokenizer=False))
    return out


@pytest.mark.parametrize("case", list(F32_CASES))
def test_f32_roundtrips_exactly_through_transformers(f32_files, case):
    model, path = f32_files[case]
    loaded = gm.load_with_transformers(path)
    _assert_same_weights(loaded.state_dict(), model.state_dict())

    # mistral is written as arch "llama", as llama.cpp does, so transformers builds a Llama (same weights and maths
    # for these settings; a Mistral sliding window is not in the file either way).
    want_class = "LlamaForCausalLM" if model.config.model_type == "mistral" else type(model).__name__
    assert type(loaded).__name__ == want_class
    want, got = model.config, loaded.config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "vocab_size", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(got, key) == getattr(want, key), key
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)  # stored as float32
    assert got.rope_parameters["rope_theta"] == want.rope_parameters["rope_theta"]
    head_dim = lambda c: getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads  # noqa: E731
    assert head_dim(got) == head_dim(want)
    if want.rope_parameters.get("rope_type") == "llama3":
        # transformers' GGUF loader does not rebuild rope scaling for llama: the scaling lives in rope_freqs.weight
        # (checked in test_llama3_rope_freqs), and its config falls back to plain rope.
        assert got.rope_parameters.get("rope_type", "default") == "default"


@pytest.mark.parametrize("case", list(F32_CASES))
def test_layout_matches_llama_cpp(f32_files, case):
    """Names from gguf-py's map, the inverse map the loader needs, llama's q/k permutation, metadata keys."""
    model, path = f32_files[case]
    config = model.config
    arch = gm.GGUF_ARCH[config.model_type]
    stored = gm.read_gguf_tensors(path)
    hf = model.state_dict()

    want_names = {gm._hf_to_gguf_name(n, config.model_type, config.num_hidden_layers) for n in hf}
    if config.tie_word_embeddings:
        want_names.discard("output.weight")
    if config.rope_parameters.get("rope_type") == "llama3":
        want_names.add("rope_freqs.weight")
    assert set(stored) == want_names

    for gguf_name, (type_name, values) in stored.items():
        assert type_name == "F32"
        hf_name, restored = gm.gguf_to_hf(gguf_name, values, config)
        if hf_name is None:
            continue
        assert np.array_equal(restored, hf[hf_name].numpy()), gguf_name
        permuted = config.model_type in gm.PERMUTED_ARCHS and gguf_name.endswith(("attn_q.weight", "attn_k.weight"))
        assert np.array_equal(values, hf[hf_name].numpy()) != permuted, gguf_name

    if config.model_type == "phi3":
        q_rows = config.num_attention_heads * (config.hidden_size // config.num_attention_heads)
        kv_rows = config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
        assert stored["blk.0.attn_qkv.weight"][1].shape == (q_rows + 2 * kv_rows, config.hidden_size)
        assert stored["blk.0.ffn_up.weight"][1].shape == (2 * config.intermediate_size, config.hidden_size)
        assert not any(".ffn_gate." in n for n in stored)

    meta = {k: v for k, v, _, _ in gm.read_gguf_metadata(path)}
    assert meta["general.architecture"] == arch
    expect = {
        "context_length": config.max_position_embeddings,
        "embedding_length": config.hidden_size,
        "block_count": config.num_hidden_layers,
        "feed_forward_length": config.intermediate_size,
        "attention.head_count": config.num_attention_heads,
        "attention.head_count_kv": config.num_key_value_heads,
        "vocab_size": config.vocab_size,
    }
    for key, value in expect.items():
        assert meta[f"{arch}.{key}"] == value, key
    assert meta[f"{arch}.rope.freq_base"] == pytest.approx(config.rope_parameters["rope_theta"])
    assert meta[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(config.rms_norm_eps, rel=1e-6)
    if arch == "llama":
        assert meta["llama.rope.dimension_count"] == config.head_dim
    if arch == "phi3":  # int(partial_rotary_factor * hidden) // heads
        assert meta["phi3.rope.dimension_count"] == config.hidden_size // config.num_attention_heads
        assert meta["phi3.rope.scaling.original_context_length"] == config.original_max_position_embeddings
        assert meta["phi3.attention.sliding_window"] == 0
    if config.model_type in ("llama", "mistral", "qwen3"):
        assert meta[f"{arch}.attention.key_length"] == config.head_dim
    assert meta["general.file_type"] == 0  # ALL_F32
    assert not any(k.startswith("tokenizer.") for k in meta)


def test_llama3_rope_freqs(f32_files):
    """rope_freqs.weight holds llama.cpp's per-frequency divisors: transformers' llama3 inv_freq = plain / factor."""
    model, path = f32_files["llama3_rope_tied"]
    factors = torch.from_numpy(gm.read_gguf_tensors(path)["rope_freqs.weight"][1])
    config = model.config
    assert factors.shape == (config.head_dim // 2,)
    plain = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim))
    scaled = model.model.rotary_emb.inv_freq
    assert torch.allclose(scaled, plain / factors, rtol=1e-5, atol=0)
    assert factors.min() == 1.0 and factors.max() == 8.0  # both ends of the scaling are in use at these shapes


def test_qwen3_head_dim_needs_the_override(tmp_path):
    """transformers' GGUF config for qwen3 drops attention.key_length, so head_dim stays Qwen3Config's 128: a qwen3 file
    with any other head_dim only loads with transformers_overrides (load_with_transformers passes them)."""
    model = gm.tiny_model("qwen3", head_dim=32)
    path = gm.write_gguf(model, tmp_path / "qwen3-hd32.gguf", tokenizer=False)
    assert gm.transformers_overrides(path) == {"head_dim": 32}
    with pytest.raises(RuntimeError, match="mismatch"):
        gm.load_with_transformers(path, fix_config=False)
    _assert_same_weights(gm.load_with_transformers(path).state_dict(), model.state_dict())


# ------------------------------------------------------------------------------------------------------ quantized


@pytest.fixture(scope="module")
def quant_models():
    archs = {(arch, tied) for arch, tied, _ in QUANT_CASES.values()}
    return {
        (arch, tied): gm.tiny_model(arch, seed=10 + i, tie_word_embeddings=tied, **QUANT_SHAPE)
        for i, (arch, tied) in enumerate(sorted(archs))
    }


@pytest.mark.parametrize("type_name", list(QUANT_CASES))
def test_quantized_file_roundtrips_through_transformers(quant_models, tmp_path, type_name):
    arch, tied, tolerance = QUANT_CASES[type_name]
    model = quant_models[(arch, tied)]
    path = gm.write_gguf(model, tmp_path / f"{arch}-{type_name}.gguf", type_name, tokenizer=False)

    stored = _stored_as_hf(path, model.config)
    original = model.state_dict()
    for name, (stored_type, _) in stored.items():
        assert stored_type == (type_name if original[name].dim() == 2 else "F32"), name

    got = gm.expected_state_dict(path)
    assert sorted(got) == sorted(original)
    for name, want in original.items():
        source = "model.embed_tokens.weight" if (tied and name == "lm_head.weight") else name
        # transformers' values are exactly gguf-py's dequantization of the stored blocks (permutation undone) ...
        assert torch.equal(got[name], stored[source][1]), name
        # ... and close to the original weights
        if want.dim() == 2:
            err = gm.relative_rms_error(got[name].numpy(), want.numpy())
            assert err < tolerance, (name, err)
        else:
            assert torch.equal(got[name], want), name


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "BF16"])
def test_blocks_decode_the_same_in_transformers_torch_dequantizer(type_name):
    """A second, independent decoder of the byte layouts: transformers' torch dequantizer (its new GGUF path; it has
    no Q5_0/Q5_1). Checks the K-quant blocks built here against something other than gguf-py."""
    from transformers.integrations.gguf import dequant

    rng = np.random.default_rng(1)
    x = (rng.standard_normal((64, 512)) * 0.02).astype(np.float32)
    x[1] = 0.0
    x[2] = 3.0
    x[3, :100] = -1.0
    data = gm.quantize(x, type_name)
    ours = gm.dequantize(data, type_name).reshape(x.shape)
    if type_name == "BF16":
        theirs = torch.from_numpy(data.copy()).view(torch.bfloat16).float().numpy()
    else:
        qtype = int(gm._qtype(type_name))
        theirs = dequant.dequantize(torch.from_numpy(data.copy()).reshape(-1), qtype).reshape(x.shape).numpy()
    np.testing.assert_allclose(theirs, ours, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("type_name", gm.K_QUANTS)
def test_k_quant_blocks(type_name):
    """Blocks built here decode (gguf.quants.dequantize) close to the input, including awkward rows."""
    import gguf

    rng = np.random.default_rng(2)
    x = (rng.standard_normal((32, 512)) * 0.02).astype(np.float32)
    edge = np.zeros((6, 512), dtype=np.float32)
    edge[1] = 5.0  # constant
    edge[2] = -np.abs(rng.standard_normal(512))  # all negative
    edge[3] = np.abs(rng.standard_normal(512))  # all positive
    edge[4] = rng.standard_normal(512) * np.logspace(-4, 1, 512)  # wildly different sub-block scales
    edge[5, ::7] = 1.0  # sparse
    block, type_size = gguf.GGML_QUANT_SIZES[gm._qtype(type_name)]
    data = gm.quantize(np.concatenate([x, edge]), type_name)
    assert data.dtype == np.uint8 and data.shape == (38, 512 // block * type_size)
    out = gm.dequantize(data, type_name).reshape(38, 512)
    bound = {"Q4_K": 0.1, "Q5_K": 0.05, "Q6_K": 0.025}[type_name]
    assert gm.relative_rms_error(out[:32], x) < bound
    assert np.all(out[32] == 0.0)
    for row in range(33, 38):
        assert gm.relative_rms_error(out[row], edge[row - 32]) < 2 * bound, row


def test_mixed_types_by_pattern(quant_models, tmp_path):
    model = quant_models[("llama", False)]
    types = {"token_embd.weight": "Q8_0", "output.weight": "Q6_K", "blk.*.attn_*": "Q4_K", "blk.1.*": "Q5_0",
             "blk.*.ffn_*": "Q5_1"}
    path = gm.write_gguf(model, tmp_path / "mixed.gguf", types, tokenizer=False)
    stored = gm.read_gguf_tensors(path)
    assert stored["token_embd.weight"][0] == "Q8_0"
    assert stored["output.weight"][0] == "Q6_K"
    assert stored["blk.1.attn_q.weight"][0] == "Q4_K"  # first matching pattern wins
    assert stored["blk.1.ffn_up.weight"][0] == "Q5_0"
    assert stored["blk.2.ffn_down.weight"][0] == "Q5_1"
    assert stored["blk.2.attn_norm.weight"][0] == "F32"
    meta = {k: v for k, v, _, _ in gm.read_gguf_metadata(path)}
    assert meta["general.file_type"] == 14  # MOSTLY_Q4_K_S: Q4_K is the most common 2-D type (12 of 24)
    got = gm.expected_state_dict(path)
    for name, (_, values) in _stored_as_hf(path, model.config).items():
        assert torch.equal(got[name], values), name


def test_unquantizable_rows_are_refused(tmp_path):
    model = gm.tiny_model("llama")  # hidden 128: rows too short for a 256-value K-quant block
    with pytest.raises(ValueError, match="multiple of 256"):
        gm.write_gguf(model, tmp_path / "bad.gguf", "Q4_K", tokenizer=False)
    with pytest.raises(ValueError, match="unknown tensor type"):
        gm.write_gguf(model, tmp_path / "bad.gguf", "Q3_K", tokenizer=False)


# ------------------------------------------------------------------------------------------------------ full file


@pytest.fixture(scope="module")
def full_file(tmp_path_factory):
    model = gm.tiny_model("llama", seed=99, rope_scaling="llama3")
    return model, gm.write_gguf(model, tmp_path_factory.mktemp("gguf-full") / "tiny-llama.gguf", "Q8_0")


def test_full_file_metadata(full_file):
    _, path = full_file
    written = gm.read_gguf_metadata(path)
    bundled = [f for f in gm.read_gguf_metadata(gm.bundled_gguf_path()) if f[0].startswith("tokenizer.")]
    assert [f for f in written if f[0].startswith("tokenizer.")] == bundled  # every key, value and type
    meta = {k: v for k, v, _, _ in written}
    assert len(meta["tokenizer.ggml.tokens"]) == gm.vocab_size() == 49152
    assert meta["general.file_type"] == 7  # MOSTLY_Q8_0
    assert meta["general.quantization_version"] == 2


@pytest.mark.slow  # transformers' own load of a full file, ~10 s idle
def test_full_file_loads_in_transformers(full_file):
    model, path = full_file
    loaded = gm.load_with_transformers(path)
    for name, (_, values) in _stored_as_hf(path, model.config).items():
        assert torch.equal(loaded.state_dict()[name], values), name
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(loaded.config, key) == getattr(model.config, key), key


def test_tokenizer_matches_the_bundled_one(full_file):
    from transformers import AutoTokenizer

    _, path = full_file
    bundled = gm.bundled_gguf_path()
    ours = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    theirs = AutoTokenizer.from_pretrained(str(bundled.parent), gguf_file=bundled.name)
    ids = ours.encode(SAMPLE_TEXT)
    assert ids == theirs.encode(SAMPLE_TEXT)
    assert ids[0] == 1 and ids[-1] == 0  # <|im_start|> and <|endoftext|> stay whole
    assert ours.decode(ids) == SAMPLE_TEXT
    assert ours.chat_template == theirs.chat_template
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) == theirs.apply_chat_template(messages, tokenize=False)


# ------------------------------------------------------------------------------------------------------ every combination


@pytest.mark.slow
@pytest.mark.parametrize("arch", gm.ARCHS)
def test_every_arch_every_type(tmp_path, arch):
    """The whole arch x type matrix through transformers (~1 min): `pytest -m slow tests/test_gguf_models.py`."""
    model = gm.tiny_model(arch, tie_word_embeddings=True, **QUANT_SHAPE)
    original = model.state_dict()
    for type_name in gm.TYPES:
        path = gm.write_gguf(model, tmp_path / f"{type_name}.gguf", type_name, tokenizer=False)
        got = gm.expected_state_dict(path)
        stored = _stored_as_hf(path, model.config)
        for name in original:
            source = "model.embed_tokens.weight" if name == "lm_head.weight" else name
            assert torch.equal(got[name], stored[source][1]), (type_name, name)
