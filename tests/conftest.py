"""Shared fixtures: tiny random models (no download, exact) and the real bundled model (session-scoped)."""

from __future__ import annotations

import os
import signal
import tempfile

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# A shell's background job (`.ci/run &`) starts with SIGINT ignored; Python then never installs its Ctrl-C handler,
# and every child process inherits the ignore. The Ctrl-C tests need the usual disposition, however pytest started.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
_home = tempfile.mkdtemp(prefix="sinkchat-test-home-")
os.environ.setdefault("SINKCHAT_HOME", _home)  # never touch the user's data dir from tests
os.environ.setdefault("SINKCHAT_DECODER", "native")  # no background compiles in test processes (test_fastdecode builds one)


class WordTokenizer:
    """Token ids written as space-separated integers: lets tests feed exact ids through text APIs."""

    eos_token_id = None
    eos_token = None
    unk_token_id = None
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [int(x) for x in text.split()]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids)

    def convert_tokens_to_ids(self, tok: str) -> None:
        return None


def tiny_model(kind: str = "llama", layers: int = 2, max_pos: int = 512, seed: int = 0, **extra):
    """A small random model of the given family (fp32, eval mode)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos)
    common.update(extra)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(rope_theta=10000.0, **common))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(rope_theta=100000.0, **common))
    elif kind == "phi3":
        model = Phi3ForCausalLM(Phi3Config(partial_rotary_factor=0.5, rope_theta=10000.0, pad_token_id=0, **common))
    else:
        raise ValueError(kind)
    return model.eval()


def stream_logits(eng, ids: list[int]):
    """Prefill 12 tokens through `eng`, then feed the rest one at a time; logits after each single token [n, V]."""
    import torch

    list(eng.feed_ids(ids[:12]))
    out = []
    for t in ids[12:]:
        list(eng.feed_ids([t]))
        out.append(eng.last_logits.clone())
    return torch.stack(out)


@pytest.fixture
def word_tok():
    return WordTokenizer()


@pytest.fixture(scope="session")
def bundled():
    """The real bundled SmolLM2-135M-Instruct (fp32, unquantized for exactness tests), loaded once per session."""
    from sinkchat.config import ModelConfig
    from sinkchat.model.loader import load

    return load(ModelConfig(quant="none", threads=1))


@pytest.fixture(scope="session")
def bundled_nf4():
    from sinkchat.config import ModelConfig
    from sinkchat.model.loader import load

    return load(ModelConfig(quant="nf4", threads=1))
