"""Loader: the bundled GGUF path, the cached conversion, 4-bit quantization, and one-line errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from sinkchat.config import ModelConfig
from sinkchat.kv_cache import UnsupportedModel, rope_from_model
from sinkchat.loader import LoadError, load


def test_bundled_loads_from_cached_conversion(bundled):
    assert bundled.source.endswith(".gguf")
    assert "sinkchat-converted.json" in {p.name for p in __import__("pathlib").Path(bundled.path).iterdir()}
    cfg = bundled.model.config
    assert cfg.num_hidden_layers == 30 and cfg.num_key_value_heads == 3


def test_nf4_quantizes_most_linear_weights(bundled_nf4):
    import bitsandbytes as bnb

    assert bundled_nf4.quantized_fraction >= 0.9
    layer = bundled_nf4.model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, bnb.nn.Linear4bit)
    assert isinstance(layer.self_attn.k_proj, torch.nn.Linear) and not isinstance(layer.self_attn.k_proj, bnb.nn.Linear4bit)


def test_missing_model_path():
    with pytest.raises(LoadError, match="not found"):
        load(ModelConfig(model="/nonexistent/model.gguf", quant="none"))
    with pytest.raises(LoadError, match="not found"):
        load(ModelConfig(model="./no/such/folder", quant="none"))


def test_folder_without_config(tmp_path):
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(LoadError, match="config.json"):
        load(ModelConfig(model=str(tmp_path), quant="none"))


def test_not_a_causal_lm(tmp_path):
    from transformers import BertConfig

    BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
               architectures=["BertForMaskedLM"]).save_pretrained(tmp_path)
    with pytest.raises(LoadError, match="not a causal language model"):
        load(ModelConfig(model=str(tmp_path), quant="none"))


def test_position_encoding_without_rope_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=50))
    with pytest.raises(UnsupportedModel, match="RoPE"):
        rope_from_model(model)


def test_cli_reports_missing_model_in_one_line():
    r = subprocess.run([sys.executable, "-m", "sinkchat.cli", "--model", "/nonexistent/m.gguf", "ppl", "/etc/hostname"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert "model file not found" in r.stderr
