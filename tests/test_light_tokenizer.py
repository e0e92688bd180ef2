"""The light tokenizer (`sinkchat.model.light_tokenizer`, issue #33 item 3): a later start's tokenizer through the
`tokenizers` library and jinja2 must give exactly what transformers' tokenizer gives: ids, texts, special tokens,
chat-template renderings; and refuse (None: the start uses transformers') where it could not."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest

from sinkchat.model import chat_template, gguf_convert, light_tokenizer
from sinkchat.model.light_tokenizer import LightTokenizer, tokenizer_json

TEXTS = [
    "", " ", "  ", "\n", "\t", "hello", "Hello, world!", "  leading and trailing  ", "tabs\t\tand\nnewlines\n\n\n",
    "   \n  \t ", " " * 50, "\n" * 7, "héllo wörld ß", "e\u0301 combining", "zero\u200bwidth", "日本語のテキスト",
    "中文，标点。", "مرحبا بالعالم", "👍🏽 family 👨\u200d👩\u200d👧 flags 🇫🇷", "\x00ctrl\x7f\x1b[0m",
    "<|im_start|>user\nhi<|im_end|>\n", "a<|endoftext|>b", "<|im_end|><|im_end|>", "<|im_", "<file_sep><repo_name>",
    "def f(x):\n    return x ** 2  # square\n", "1234567890 3.14159 -42", "URL: https://example.com/a?b=c&d=e",
    "what's  it's don't", "\r\nwindows\r\n", "<|eot_id|> <end_of_turn> not in this vocabulary",
]


def _random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    pools = [range(0x20, 0x7f), range(0xa0, 0x250), range(0x3040, 0x30ff), range(0x1f300, 0x1f64f), [9, 10, 13, 32]]
    out = []
    for _ in range(n):
        out.append("".join(chr(rng.choice(rng.choice(pools))) for _ in range(rng.randrange(0, 40))))
    return out


CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "sys"}, {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
     {"role": "user", "content": "q2 <|im_end|> ü 日本"}],
    [{"role": "user", "content": "run it"}, {"role": "assistant", "content": '{"tool": "calc", "args": {}}'},
     {"role": "tool", "content": "4"}, {"role": "user", "content": "thanks", "name": None}],
    [{"role": "user", "content": "  spaces  \n\n"}, {"role": "assistant", "content": "", "reasoning": "hmm"}],
]
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Compute <b>x</b> & \"y\" — ü 日本",
                                           "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                                                          "required": ["expr"]}}}]


def _pair(folder: Path) -> tuple[Any, LightTokenizer | None]:
    """transformers' tokenizer of a converted folder as the first start's loader makes it, and the light one (None
    where `describe` refuses it: then only for a tokenizer class of transformers' own, which rebuilds parts of the
    Rust tokenizer: Qwen2's pre-tokenizer and normalizer)."""
    from transformers import AutoTokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    real = AutoTokenizer.from_pretrained(str(folder))
    info = light_tokenizer.describe(real, folder)
    assert (info is None) == (type(real) is not TokenizersBackend), type(real)
    light = LightTokenizer.load(folder, info)
    assert (light is None) == (info is None)
    return real, light


@pytest.fixture(scope="module")
def bundled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, LightTokenizer]:
    from sinkchat.model.loader import bundled_gguf

    with pytest.MonkeyPatch.context() as m:
        m.setenv("SINKCHAT_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        folder = gguf_convert.prepare(bundled_gguf(), lambda msg: None)
    real, light = _pair(folder)
    assert light is not None
    return real, light


def check_same(real: Any, light: LightTokenizer, texts: list[str]) -> None:
    """Everything sinkchat reads of a tokenizer, the light one against transformers'."""
    from sinkchat.core.plain import control_ids
    from sinkchat.core.tokens import bos_token, stop_ids

    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id", "unk_token_id",
                 "pad_token_id", "all_special_ids", "all_special_tokens", "special_tokens_map", "chat_template",
                 "vocab_size"):
        assert getattr(light, name) == getattr(real, name), name
    assert len(light) == len(real) and light.get_vocab() == real.get_vocab()
    assert {i: (t.content, t.special) for i, t in light.added_tokens_decoder.items()} == \
        {i: (t.content, t.special) for i, t in real.added_tokens_decoder.items()}
    assert bos_token(light) == bos_token(real) and control_ids(light) == control_ids(real)
    model = type("M", (), {"config": None, "generation_config": None})()
    assert stop_ids(light, model) == stop_ids(real, model)
    names = ["<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>", "hello", "nope-not-a-token"]
    assert light.convert_tokens_to_ids(names) == real.convert_tokens_to_ids(names)
    rng = random.Random(1)
    for text in texts:
        for special in (False, True):
            ids = light.encode(text, add_special_tokens=special)
            assert ids == real.encode(text, add_special_tokens=special), (text, special)
            assert light(text, add_special_tokens=special).input_ids == real(text, add_special_tokens=special).input_ids
            for skip in (False, True):
                assert light.decode(ids, skip_special_tokens=skip) == real.decode(ids, skip_special_tokens=skip)
        noise = [rng.randrange(len(real)) for _ in range(rng.randrange(1, 12))] + rng.sample(real.all_special_ids, 1)
        rng.shuffle(noise)
        for skip in (False, True):
            assert light.decode(noise, skip_special_tokens=skip) == real.decode(noise, skip_special_tokens=skip)
            assert light.convert_ids_to_tokens(noise, skip) == real.convert_ids_to_tokens(noise, skip)
        assert light.decode(noise[0]) == real.decode(noise[0])


def check_renderings(real: Any, light: LightTokenizer) -> None:
    from sinkchat.core.turns import Conversation

    for conv in CONVERSATIONS:
        for gen in (False, True):
            for tools in (None, TOOLS):
                want = real.apply_chat_template(conv, tools=tools, tokenize=False, add_generation_prompt=gen)
                assert light.apply_chat_template(conv, tools=tools, tokenize=False, add_generation_prompt=gen) == want
    deltas = []
    for tok in (real, light):  # the engine's turn-by-turn rendering
        c = Conversation(tok, "You are brief.")
        deltas.append([c.system_block(), c.delta_for("user", "hi"), c.add_reply("hello<|im_end|>"),
                       c.delta_for("user", "bye"), c.closing()])
    assert deltas[0] == deltas[1]


def test_the_bundled_tokenizer_is_transformers_own(bundled):
    real, light = bundled
    check_same(real, light, TEXTS + _random_texts(60))
    check_renderings(real, light)
    assert light._real is None  # nothing above needed transformers' tokenizer


def test_other_uses_go_to_transformers(bundled):
    """A batch, `tokenize=True`, an attribute the light tokenizer lacks: transformers' tokenizer answers."""
    real, light = bundled
    conv = CONVERSATIONS[1]
    assert light.apply_chat_template(conv, add_generation_prompt=True, return_dict=False) == \
        real.apply_chat_template(conv, add_generation_prompt=True, return_dict=False)
    assert light(["a b", "c"]).input_ids == real(["a b", "c"]).input_ids
    assert light.model_max_length == real.model_max_length
    assert type(light._real) is type(real)


def test_llguidance_reads_it_as_it_reads_transformers_tokenizer(bundled):
    """The agent's and the server's constraints build llguidance's tokenizer from the light tokenizer's Rust
    tokenizer JSON (no transformers class needed) as `llguidance.hf.from_tokenizer` does from transformers' own."""
    from sinkchat.model.light_tokenizer import llguidance_tokenizer

    real, light = bundled
    assert tokenizer_json(light) == tokenizer_json(real)
    llguidance_hf = pytest.importorskip("llguidance.hf")
    want = llguidance_hf.from_tokenizer(real, n_vocab=len(real), eos_token=[2])
    text = "What is 2+2? 日本 <|im_end|>"
    got = llguidance_tokenizer(light, len(real), [2])
    assert got.tokenize_str(text) == want.tokenize_str(text)
    assert got.eos_token == want.eos_token and got.vocab_size == want.vocab_size


TEMPLATES = {
    "tools and tojson (Qwen 2.5 style)": (
        "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}"
        "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}{%- for m in messages %}{%- if m.role == 'tool' %}"
        "{{- '<tool_response>' + m.content + '</tool_response>' }}{%- else %}"
        "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"),
    "namespace, raise_exception, strftime_now, dict (Llama 3.1 style)": (
        "{{- bos_token }}{%- set ns = namespace(sys='') %}{%- if messages[0].role == 'system' %}"
        "{%- set ns.sys = messages[0].content %}{%- endif %}{%- set d = dict(a=1) %}"
        "{{- 'Today: ' + strftime_now('%Y') + ' ' + d.a|string + '\\n' + ns.sys }}"
        "{%- for m in messages %}{%- if m.role not in ['system', 'user', 'assistant', 'tool'] %}"
        "{{- raise_exception('bad role') }}{%- endif %}\n  {% if m.role != 'system' %}\n"
        "<|{{ m.role }}|>{{ m.content | trim }}{{ eos_token }}\n  {% endif %}\n{%- endfor %}"
        "{%- if tools %}{{ tools | tojson(indent=2) }}{%- endif %}"),
    "generation tags and loop controls": (
        "{% for m in messages %}{% if loop.index > 3 %}{% break %}{% endif %}{% if m.role == 'assistant' %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"),
}


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_templates_render_as_transformers_renders_them(bundled, name):
    real, light = bundled
    saved = real.chat_template
    try:
        real.chat_template = light.chat_template = TEMPLATES[name]
        check_renderings(real, light)
        real.chat_template = light.chat_template = {"default": TEMPLATES[name], "tool_use": TEMPLATES[
            "tools and tojson (Qwen 2.5 style)"]}
        check_renderings(real, light)
    finally:
        real.chat_template = light.chat_template = saved
    with pytest.raises(Exception, match="bad role"):
        chat_template.render(TEMPLATES["namespace, raise_exception, strftime_now, dict (Llama 3.1 style)"],
                             [{"role": "robot", "content": "x"}], {})
    with pytest.raises(Exception, match="underscore"):
        chat_template.render("{% set ns = namespace(_x=1) %}", [{"role": "user", "content": "x"}], {})


def test_refused_where_it_would_not_be_exact(bundled, tmp_path):
    """No light tokenizer for a tokenizer transformers changed (a BOS post-processor), one that cleans up spaces,
    nor from a folder whose tokenizer.json changed since it was described."""
    import shutil

    from transformers import AutoTokenizer

    real, light = bundled
    folder = tmp_path / "tok"
    shutil.copytree(light._folder, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    other = AutoTokenizer.from_pretrained(str(folder))
    info = light_tokenizer.describe(other, folder)
    assert info is not None and LightTokenizer.load(folder, info) is not None
    other.add_bos_token = True  # transformers rebuilds the post-processor: no longer the file's tokenizer
    assert light_tokenizer.describe(other, folder) is None
    other = AutoTokenizer.from_pretrained(str(folder), clean_up_tokenization_spaces=True)
    assert light_tokenizer.describe(other, folder) is None
    st = (folder / "tokenizer.json").stat()
    os.utime(folder / "tokenizer.json", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert LightTokenizer.load(folder, info) is None
    assert LightTokenizer.load(folder, None) is None


ARCHS = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text"]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_fixture_architecture(arch, tmp_path, monkeypatch):
    """The tiny GGUF of each architecture the tests build, converted as a first start converts it."""
    import gguf_gemma
    import gguf_models

    monkeypatch.setenv("SINKCHAT_CACHE_DIR", str(tmp_path / "cache"))
    mod = gguf_gemma if arch.startswith("gemma") else gguf_models
    model = mod.tiny_model(arch, seed=1)
    path = mod.write_gguf(model, tmp_path / f"{arch}.gguf", "F32")
    real, light = _pair(gguf_convert.prepare(path, lambda msg: None))
    if light is None:  # a tokenizer class of transformers' own (Qwen2Tokenizer, GemmaTokenizer): a later start keeps it
        return
    check_same(real, light, TEXTS[::3])
    if real.chat_template:
        check_renderings(real, light)


GEMMA3 = Path.home() / ".cache" / "sinkchat" / "gguf-real" / "gemma-3-270m-q4_k_m.gguf"


@pytest.mark.slow
@pytest.mark.skipif(not GEMMA3.is_file(), reason=f"{GEMMA3} not present")
def test_gemma3_270m(tmp_path, monkeypatch):
    """A real 262k-token SentencePiece-style vocabulary (the conversion takes ~10-20 s)."""
    monkeypatch.setenv("SINKCHAT_CACHE_DIR", str(tmp_path / "cache"))
    from transformers import AutoTokenizer

    folder = gguf_convert.prepare(GEMMA3, lambda msg: None)
    real = AutoTokenizer.from_pretrained(str(folder))
    info = light_tokenizer.describe(real, folder)
    if info is None:  # then the later start keeps transformers' tokenizer: say which check refused
        pytest.skip(f"not light-eligible: {type(real).__name__}")
    light = LightTokenizer.load(folder, info)
    check_same(real, light, TEXTS + _random_texts(20, seed=3))
    if real.chat_template:
        check_renderings(real, light)
