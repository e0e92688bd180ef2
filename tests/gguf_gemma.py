"""Tiny random Gemma 2 / Gemma 3 text models written as llama.cpp GGUF files (what convert_hf_to_gguf.py writes for
Gemma2ForCausalLM / Gemma3ForCausalLM), for tests: no download.

As llama.cpp's converter does: norm weights stored as 1 + w (ggml multiplies by the weight; Gemma's RMSNorm by
1 + w), no output.weight (Gemma ties its head to the token table), q/k rows not permuted (Gemma's RoPE is NeoX
style in llama.cpp), `{arch}.attention.sliding_window` and key/value lengths written; Gemma 2 also writes its two
soft-capping values. llama.cpp hard-codes the local/global pattern (every 2nd layer global for Gemma 2, every 6th
for Gemma 3) and Gemma 3's local RoPE base (10,000); `pattern=` writes `attention.sliding_window_pattern` as newer
converters do for some models.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

import gguf_models as gm

GEMMA_ARCH = {"gemma2": "gemma2", "gemma3_text": "gemma3"}


def tiny_config(arch: str, **over: Any) -> Any:
    """A small Gemma config: hidden 256, 4 heads of 64, 2 kv heads, intermediate 512, vocab = the bundled
    tokenizer's, window 8; query_pre_attn_scalar = head_dim (what a file expresses: llama.cpp scales by head_dim
    except on the 27B models). Gemma 2: 2 layers (local, global), soft-capping 50 / 30. Gemma 3: 6 layers (5 local,
    1 global), q/k norms, RoPE base 10,000 local and 1,000,000 global."""
    import transformers

    meta = gm.bundled_tokenizer_meta()
    params: dict[str, Any] = dict(
        vocab_size=gm.vocab_size(), hidden_size=256, intermediate_size=512, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64, max_position_embeddings=2048,
        rms_norm_eps=1e-6, sliding_window=8, tie_word_embeddings=True,
        bos_token_id=int(meta["tokenizer.ggml.bos_token_id"]), eos_token_id=int(meta["tokenizer.ggml.eos_token_id"]),
        pad_token_id=int(meta["tokenizer.ggml.padding_token_id"]))
    if arch == "gemma2":
        params.update(num_hidden_layers=2, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
        params.update(over)
        return transformers.Gemma2Config(**params)
    if arch != "gemma3_text":
        raise ValueError(f"arch must be gemma2 or gemma3_text, not {arch!r}")
    params.update(num_hidden_layers=6, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
    params.update(over)
    return transformers.Gemma3TextConfig(**params)


def tiny_model(arch: str, seed: int = 0, **over: Any) -> Any:
    """A random Gemma causal LM, fp32, eval mode; norm weights random around 0 (Gemma multiplies by 1 + w), q and k
    scaled so attention is peaked (a wrong position or mask then moves logits by O(0.1))."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **over), dtype=torch.float32)
    cfg = model.config
    g = (3.0 / cfg.hidden_size) ** 0.5 / cfg.initializer_range
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(0.1 * torch.randn_like(p))
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.normal_(0, cfg.initializer_range * g)
            layer.self_attn.k_proj.weight.normal_(0, cfg.initializer_range * g)
    return model.eval()


def gguf_tensors(model: Any) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, fp32 array) in llama.cpp's layout: norms as 1 + w, no output.weight."""
    import gguf

    cfg = model.config
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == GEMMA_ARCH[cfg.model_type])
    names = gguf.get_tensor_name_map(arch_enum, cfg.num_hidden_layers)
    out = []
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight":
            continue
        base, _, suffix = hf_name.rpartition(".")
        mapped = names.get_name(base)
        if mapped is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        a = t.detach().float().numpy().copy()
        if hf_name.endswith("norm.weight"):
            a = a + np.float32(1.0)
        out.append((f"{mapped}.{suffix}", a))
    return out


def write_gguf(model: Any, path: str | os.PathLike, types: Mapping[str, str] | str = "F32", *,
               pattern: int | Sequence[bool] | None = None, tokenizer: bool = True) -> Path:
    """Write a tiny Gemma as llama.cpp's converter would; `types` as in gguf_models.write_gguf."""
    import gguf

    cfg = model.config
    arch = GEMMA_ARCH[cfg.model_type]
    tensors = gguf_tensors(model)
    chosen = [gm._type_for(n, a.ndim, types) for n, a in tensors]
    weight_types = [t for (n, a), t in zip(tensors, chosen) if a.ndim >= 2]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(path, arch)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(f"tiny-random-{arch}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(float((rope.get("full_attention") or rope)["rope_theta"]))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_sliding_window(int(cfg.sliding_window))
    if arch == "gemma2":
        w.add_attn_logit_softcapping(float(cfg.attn_logit_softcapping))
        w.add_final_logit_softcapping(float(cfg.final_logit_softcapping))
    if pattern is not None:
        w.add_sliding_window_pattern(pattern)
    main = max(set(weight_types), key=weight_types.count) if weight_types else "F32"
    w.add_file_type(getattr(gguf.LlamaFileType, gm._FILE_TYPE[main]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if tokenizer:
        for key, value, vtype, sub in gm.bundled_tokenizer_fields():
            w.add_key_value(key, list(value) if isinstance(value, tuple) else value, vtype, sub)
    for (name, array), type_name in zip(tensors, chosen):
        data = gm.quantize(array, type_name)
        if type_name in ("F32", "F16"):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=gm._qtype(type_name))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def file_state_dict(model: Any, path: str | os.PathLike) -> dict[str, Any]:
    """The weights `path` holds, in `model`'s (transformers') names and values: dequantized with gguf-py, norms
    back to w (file value - 1), the tied head = the table. (transformers' own GGUF loader refuses these tiny Gemma
    files: it rebuilds the config with its defaults, e.g. head_dim 256.)"""
    import gguf
    import torch

    cfg = model.config
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == GEMMA_ARCH[cfg.model_type])
    names = gguf.get_tensor_name_map(arch_enum, cfg.num_hidden_layers)
    to_hf = {}
    for hf_name in model.state_dict():
        base, _, suffix = hf_name.rpartition(".")
        if hf_name != "lm_head.weight":
            to_hf[f"{names.get_name(base)}.{suffix}"] = hf_name
    out = {}
    for name, (_, values) in gm.read_gguf_tensors(path).items():
        hf_name = to_hf[name]
        if hf_name.endswith("norm.weight"):
            values = values - np.float32(1.0)
        out[hf_name] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out
