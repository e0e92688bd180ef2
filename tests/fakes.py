"""The test suite's shared fakes and tiny models, imported explicitly (`from fakes import ...`; tests/ is on the path).

- FakeTokenizer: the one fake tokenizer (per-character ids with a ChatML-like template, or ids written as numbers);
  CharTokenizer and WordTokenizer name its two presets.
- ScriptedEngine: the Engine methods a client calls, without a model; replies come from a script.
- tiny_model / save_tiny_chat_model: small random models in memory or as a model folder the CLI can load.
- stream_logits: prefill then single-token steps through an engine, the logits after each.
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import Any, Iterable, Iterator

EOS_ID = 96  # "<eos>" in the chars encoding


class FakeTokenizer:
    """The fake tokenizer every test uses, in one of two encodings:

    chars (default): one token per printable ASCII character (ids 0-94), 95 = newline, 96 = "<eos>" (the eos token);
        any other character reads as "?". Ids fit the tiny models' vocabulary (128); ids above 96 decode as "~".
    words: the text IS the ids, space-separated ("5 17 3"), so tests feed exact ids through text APIs; no eos.

    chat_template: with a template (any string; only its presence and whether it mentions `tools` matter, see
    agent.protocol.template_has_tools) messages render ChatML-like, prefix-stable like the bundled model's:
    "<role>content<eos>\\n" each, then "<assistant>" as the generation prompt. None: no template, so Conversation
    uses its plain rendering (the words encoding cannot spell a template). Every apply_chat_template call records its
    `tools` argument in `tools_seen`.
    """

    unk_token_id = None

    def __init__(self, encoding: str = "chars", chat_template: str | None = "fake") -> None:
        if encoding not in ("chars", "words"):
            raise ValueError(f"encoding must be chars or words, not {encoding!r}")
        self.encoding = encoding
        self.chat_template = chat_template
        self.eos_token_id = EOS_ID if encoding == "chars" else None
        self.eos_token = "<eos>" if encoding == "chars" else None
        self.tools_seen: list[Any] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if self.encoding == "words":
            return [int(x) for x in text.split()]
        out = []
        for ch in text.replace("<eos>", "\x00"):
            o = ord(ch)
            out.append(EOS_ID if ch == "\x00" else 95 if ch == "\n" else o - 32 if 32 <= o < 127 else ord("?") - 32)
        return out

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        if self.encoding == "words":
            return " ".join(str(int(i)) for i in ids)
        parts = []
        for i in map(int, ids):
            if i == EOS_ID:
                parts.append("" if skip_special_tokens else "<eos>")
            else:
                parts.append("\n" if i == 95 else chr(32 + i) if i < 95 else "~")
        return "".join(parts)

    def convert_tokens_to_ids(self, tok: str) -> None:
        return None

    def apply_chat_template(self, msgs: list[dict[str, str]], tokenize: bool = False,
                            add_generation_prompt: bool = False, tools: Any = None) -> str:
        self.tools_seen.append(tools)
        text = "".join(f"<{m['role']}>{m['content']}<eos>\n" for m in msgs)
        return text + ("<assistant>" if add_generation_prompt else "")


CharTokenizer = FakeTokenizer  # the chars preset (the default); a class, so a test can subclass it


def WordTokenizer() -> FakeTokenizer:  # noqa: N802 - named like the class it is a preset of
    """The words preset: ids written as space-separated integers, no chat template, no eos."""
    return FakeTokenizer("words", chat_template=None)


class ScriptedEngine:
    """The Engine methods a client (the agent) calls, without a model: replies come from a queue and stream in
    3-character tokens. Records what was fed: `fed` (role, content, add_generation_prompt) per message, `raw` texts."""

    def __init__(self, replies: Iterable[str], chat_template: str = "fake") -> None:
        from sinkchat.core.turns import Conversation

        self.tokenizer = FakeTokenizer(chat_template=chat_template)
        self.conv = Conversation(self.tokenizer)
        self.replies = deque(replies)
        self.fed: list[tuple[str, str, bool]] = []
        self.raw: list[str] = []
        self.reply = ""
        self.last_reply_ids: list[int] = []

    def add_message(self, role: str, content: str, add_generation_prompt: bool = True, recall: bool = False
                    ) -> Iterator[Any]:
        from sinkchat.core.events import PrefillEvent

        self.fed.append((role, content, add_generation_prompt))  # `recall`: no memory here to read again
        delta = self.conv.delta_for(role, content, add_generation_prompt)
        yield PrefillEvent(len(delta), 0.0, 0)

    def feed(self, text: str) -> Iterator[Any]:
        from sinkchat.core.events import PrefillEvent

        self.raw.append(text)
        yield PrefillEvent(len(text), 0.0, 0)

    def generate(self, max_tokens: int | None = None, stop: Any = (), sampling: Any = None) -> Iterator[Any]:
        from sinkchat.core.events import DoneEvent, TokenEvent

        text = self.replies.popleft() if self.replies else "I am out of script"
        self.reply = ""
        for i in range(0, len(text), 3):
            self.reply += text[i : i + 3]
            yield TokenEvent(0, text[i : i + 3], 0.0, 0)
        yield DoneEvent("eos", len(text), 0.0, text)

    def reply_text(self) -> str:
        return self.reply


def tiny_model(kind: str = "llama", layers: int = 2, max_pos: int = 512, seed: int = 0, score_std: float | None = None,
               **extra: Any) -> Any:
    """A small random model of the given family (fp32, eval mode).

    score_std: scale q_proj and k_proj so the attention scores (q.k / sqrt(D)) have about this standard deviation.
    transformers' default init (std 0.02) gives ~0.02 * 0.02 * hidden = 0.03: attention is nearly uniform, so a
    query at the wrong position, a wrong mask or wrong scaling moves the logits by ~1e-3 and hides under most
    tolerances. Exactness tests pass e.g. 3.0 (a few slots carry most of each row). None: transformers' init.
    """
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
    if score_std is not None:
        # q_i = sum_c x_c W_ic with x of unit RMS (after RMSNorm) and W ~ N(0, s): q_i, k_i ~ N(0, s^2 C), so
        # q.k / sqrt(D) has std s^2 C; scaling both by g multiplies it by g^2
        cfg = model.config
        g = (score_std / cfg.hidden_size) ** 0.5 / cfg.initializer_range
        with torch.no_grad():
            for layer in model.model.layers:
                attn = layer.self_attn
                projs = [attn.q_proj, attn.k_proj] if hasattr(attn, "q_proj") else [attn.qkv_proj]
                for proj in projs:  # phi3's fused qkv: v scales too, harmless for a random model
                    proj.weight.mul_(g)
                    if proj.bias is not None:
                        proj.bias.mul_(g)
    return model.eval()


def save_tiny_chat_model(dest: Path, seed: int = 0) -> Path:
    """A 1-layer random Llama with the bundled model's real tokenizer and chat template, saved as a model folder that
    `--model DEST --quant none` loads in a second or two. Its output head is untied, so a greedy reply is visible
    words (tied, it echoes the prompt's last token: a reply of newlines)."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from sinkchat.model.loader import resolve_source

    src = Path(resolve_source(None, lambda m: None)[1])
    cfg = json.loads((src / "config.json").read_text())
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(vocab_size=cfg["vocab_size"], hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                 max_position_embeddings=2048, tie_word_embeddings=False,
                                 bos_token_id=cfg.get("bos_token_id"), eos_token_id=cfg.get("eos_token_id"))
                     ).save_pretrained(dest)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (src / f).exists():
            shutil.copy(src / f, Path(dest) / f)
    return Path(dest)


def stream_logits(eng: Any, ids: list[int]) -> Any:
    """Prefill 12 tokens through `eng`, then feed the rest one at a time; logits after each single token [n, V]."""
    import torch

    list(eng.feed_ids(ids[:12]))
    out = []
    for t in ids[12:]:
        list(eng.feed_ids([t]))
        out.append(eng.last_logits.clone())
    return torch.stack(out)


def emit_reply(engine: Any, text: str) -> Iterator[Any]:
    """Feed `text` into a real engine as its reply and yield what `Engine.generate` would for it: the feed's events,
    one token event, a done event (scripted replies on a real cache)."""
    from sinkchat.core.events import DoneEvent, TokenEvent

    ids = engine.encode(text)
    yield from engine.feed_ids(ids)
    engine.last_reply_ids = ids
    yield TokenEvent(ids[-1], text, 0.0, engine.cache.length)
    yield DoneEvent("eos", len(ids), 0.0, text, tuple(ids))


def tap_ledger(eng: Any) -> list[int]:
    """Every token id the engine's ledger takes in from now on, in stream order (the list fills as it feeds)."""
    ids: list[int] = []
    real = eng.ledger.append

    def append(token_ids: list[int]) -> None:
        ids.extend(token_ids)
        real(token_ids)

    eng.ledger.append = append
    return ids
