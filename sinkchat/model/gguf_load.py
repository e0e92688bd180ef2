"""A GGUF's weights straight into sinkchat's packed layouts, one tensor at a time: no fp32 model in memory, no fp32
copy on disk.

Each tensor's bytes are read with plain reads (not the mmap: mapped pages that were touched count as resident until
unmapped, which would double the peak), taken apart by `gguf_blocks` into the integers and scales its type holds,
and packed for the kernels at once: for the native kernels Q4_0 into `Int4Q0Linear` ("q40": its own 18 bytes a
block), Q8_0 into `Int8Q0Linear` ("q80": its own 34), Q5_0 / Q5_1 / Q5_K into `Int5Q0Linear` / `Int5Q1Linear` /
`Int5KLinear` ("q50" / "q51" / "q5k": their own 22 / 24 / 176), Q4_K / Q6_K into `Int4KLinear` / `Int6KLinear`
("q4k" / "q6k"), Q4_1 into `Int4Linear` ("q4") and the float types into `Int8GLinear` ("q8g"); for torch's, the
4-bit types into `Int4Linear`. The token table is packed the same way and serves both the embedding lookups (rows
unpacked on demand) and, when tied, the output head. Norms and biases are read as fp32.

llama.cpp's converter permutes the rows of Llama's q and k projections (its RoPE pairs neighbouring dims; transformers'
pairs halves); rows are whole quant blocks, so undoing that is a row permutation of the packed integers and scales.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn

from sinkchat.model import gguf_blocks, int4
from sinkchat.model.gguf_file import GGUFError, TensorInfo
from sinkchat.model.int4q0 import Int4Q0Linear
from sinkchat.model.int8g import Int8GLinear
from sinkchat.model.int5 import Int5KLinear, Int5Q0Linear, Int5Q1Linear
from sinkchat.model.int8q0 import Int8Q0Linear
from sinkchat.model.intk import Int4KLinear, Int6KLinear, Int8KLinear
from sinkchat.model.packed_embedding import PackedEmbedding  # (gguf_load.PackedEmbedding, as before)

log = logging.getLogger(__name__)

_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "attn_qkv": "self_attn.qkv_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# Gemma's four norms a layer: llama.cpp names the one before the MLP ffn_norm (Llama's post_attention_layernorm)
_GEMMA_LAYER = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
GEMMA = ("gemma2", "gemma3")
_PERMUTED = ("llama", "mistral")  # architectures whose q/k rows llama.cpp's converter permutes
TABLE_CHUNK = 8192  # rows of the token table unpacked at a time (bounded transient memory)


def hf_name(name: str, arch: str) -> str | None:
    """transformers' state-dict name of a GGUF tensor, or None for one sinkchat does not load."""
    if name in _TOP:
        return _TOP[name]
    parts = name.split(".")
    layer = {**_LAYER, **_GEMMA_LAYER} if arch in GEMMA else _LAYER
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in layer:
        return None
    mod = "mlp.gate_up_proj" if arch == "phi3" and parts[2] == "ffn_up" else layer[parts[2]]
    return f"model.layers.{parts[1]}.{mod}.{parts[3]}"


def norm_values(t: TensorInfo, arch: str, values: np.ndarray) -> np.ndarray:
    """A norm weight as transformers holds it: Gemma's RMSNorm multiplies by (1 + w) and llama.cpp's converter
    stores 1 + w (ggml multiplies by the weight), so Gemma's norms come back as the file's value - 1 (in fp32,
    as transformers' own GGUF loader does)."""
    if arch in GEMMA and t.name.endswith("norm.weight"):
        return values - np.float32(1.0)
    return values


def read_raw(f: Any, t: TensorInfo, rows: slice | None = None) -> np.ndarray:
    """The bytes of tensor `t` (or of its `rows`) as uint8 [rows, bytes per row], by a plain read."""
    n_rows = t.shape[0] if len(t.shape) == 2 else 1
    per_row = t.nbytes // n_rows
    start, stop = (0, n_rows) if rows is None else rows.indices(n_rows)[:2]
    f.seek(t.offset + start * per_row)
    buf = np.empty((stop - start) * per_row, dtype=np.uint8)
    f.readinto(memoryview(buf))
    return buf.reshape(stop - start, per_row)


def _unpermute(x: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of q / k rows: [n_head * D, ...] rows back to transformers' order."""
    return x.reshape(n_head, x.shape[0] // n_head // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def parts_of(f: Any, t: TensorInfo, rows: slice | None = None) -> gguf_blocks.Parts:
    raw = read_raw(f, t, rows)
    if t.qtype in gguf_blocks.UNPACK:
        return gguf_blocks.unpack(t.qtype, raw)
    return gguf_blocks.absmax_q8g(gguf_blocks.to_float(t.qtype, raw))  # F32 / F16 / BF16: 8 bits, per 16


def pack(p: gguf_blocks.Parts, kernels: str) -> nn.Module:
    """Parts -> the module the kernels run. q8g needs the native kernels; under torch's it becomes int4 (lossy)."""
    q, d, m = torch.from_numpy(np.ascontiguousarray(p.q)), torch.from_numpy(p.d), torch.from_numpy(p.m)
    if p.layout == "q4":
        return int4.Int4Linear.from_values(q, d, m, kernels=kernels)
    if kernels == "native":
        return Int8GLinear.from_values(q, d, m)
    w = torch.from_numpy(p.dequantize())
    shell = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
    shell.weight = nn.Parameter(w, requires_grad=False)
    return int4.Int4Linear(shell, kernels=kernels)


def module_of(f: Any, t: TensorInfo, kernels: str, rows: slice | None = None, heads: int | None = None) -> nn.Module:
    """Tensor `t` (or its `rows`) packed for `kernels`, its rows permuted back for `heads` heads when given.

    K-quants go to the layouts that keep their super-blocks (`Int4KLinear` / `Int8KLinear`: the file's own integer
    scales and fp16 d, bit-exact and about the file's size), Q4_0 to `Int4Q0Linear` (its d alone, the file's size);
    under torch's kernels, and for every other type, to q4 / q8g (`pack`)."""
    if kernels == "native" and t.qtype in gguf_blocks.UNPACK_K:
        k = gguf_blocks.unpack_k(t.qtype, read_raw(f, t, rows))
        arrays = [k.q, k.d, k.dmin, k.sc, k.mn]
        if heads:
            arrays = [_unpermute(a, heads) for a in arrays]
        cls = Int4KLinear if k.layout == "q4k" else Int8KLinear
        if t.qtype == gguf_blocks.T.Q6_K:  # Q6_K at its own 210 bytes per 256 (intk: Int6KLinear)
            cls = Int6KLinear
        elif t.qtype == gguf_blocks.T.Q5_K:  # Q5_K at its own 176 bytes per 256 (int5: Int5KLinear)
            cls = Int5KLinear
        return cls.from_values(*[torch.from_numpy(np.ascontiguousarray(a)) for a in arrays])
    if kernels == "native" and t.qtype in (gguf_blocks.T.Q4_0, gguf_blocks.T.Q4_1):
        raw = read_raw(f, t, rows)
        if raw.shape[0] % 16 == 0:
            return _q4_module(t.qtype, _unpermute(raw, heads) if heads else raw)
        p = gguf_blocks.unpack(t.qtype, raw)  # refused below by `from_values`, with its message
    else:
        p = parts_of(f, t, rows)
    if kernels == "native" and t.qtype in (gguf_blocks.T.Q4_0, gguf_blocks.T.Q8_0):  # d alone, as the file holds it
        q, d = (_unpermute(a, heads) if heads else a for a in (p.q, p.d))  # Q4_0's m is -8·d, Q8_0's 0
        if t.qtype == gguf_blocks.T.Q4_0:
            return Int4Q0Linear.from_values(torch.from_numpy(np.ascontiguousarray(q)),
                                            torch.from_numpy(np.ascontiguousarray(d)))
        return Int8Q0Linear.from_values(torch.from_numpy(np.ascontiguousarray(q)),  # Parts' d per 16: one a block
                                        torch.from_numpy(np.ascontiguousarray(d[:, ::2])))
    if kernels == "native" and t.qtype in (gguf_blocks.T.Q5_0, gguf_blocks.T.Q5_1):  # their own 22 / 24 bytes
        q, d, m = (torch.from_numpy(np.ascontiguousarray(_unpermute(a, heads) if heads else a))
                   for a in (p.q, p.d, p.m))
        if t.qtype == gguf_blocks.T.Q5_0:
            return Int5Q0Linear.from_values(q, d)
        return Int5Q1Linear.from_values(q, d, m)
    if heads:
        p = gguf_blocks.Parts(p.layout, _unpermute(p.q, heads), _unpermute(p.d, heads), _unpermute(p.m, heads))
    return pack(p, kernels)


def _q4_module(qtype: int, raw: np.ndarray) -> nn.Module:
    """Q4_0 / Q4_1 rows (uint8 [N, bytes per row]) as `Int4Q0Linear` / `Int4Linear` for the native kernels, their
    buffers tiled straight from the file's bytes (`gguf_blocks.q4_tiles`): the module `from_values` builds from the
    unpacked values, attribute for attribute (tests/test_startup_pack.py). Every matrix of the bundled model
    packed: 0.18-0.25 CPU s, against 2.9-5.7 through `from_values` (load 3-4 on the 2-core box)."""
    if qtype == gguf_blocks.T.Q4_0:
        qw, sw = gguf_blocks.q4_tiles(raw, 18)
        return Int4Q0Linear.from_tiles(torch.from_numpy(qw), torch.from_numpy(sw.reshape(sw.shape[0], sw.shape[1], -1)))
    qw, sw = gguf_blocks.q4_tiles(raw, 20)
    return int4.Int4Linear.from_tiles(torch.from_numpy(qw), torch.from_numpy(sw))


def _heads(hf: str, config: Any, arch: str) -> int | None:
    """How many heads llama.cpp permuted the rows of this q / k tensor by (None: not permuted)."""
    if arch not in _PERMUTED or not hf.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
        return None
    return config.num_attention_heads if "q_proj" in hf else config.num_key_value_heads


def _table(f: Any, t: TensorInfo, kernels: str) -> nn.Module:
    """The token table packed in row chunks (a 128k-row table never exists unpacked whole)."""
    n = t.shape[0]
    if n % 16 or t.qtype not in gguf_blocks.UNPACK or kernels != "native":  # (UNPACK covers the K-quants too)
        rows = _FloatRows(f, t)  # per-row int8 (the kernels' head layout for odd vocabularies / float tables)
        return int4.Int8Table(rows, out_dtype=torch.float32, kernels=kernels)
    first = module_of(f, t, kernels, slice(0, min(n, TABLE_CHUNK)))
    if n <= TABLE_CHUNK:
        return first
    bufs = {k: torch.empty((n // 16, *b.shape[1:]), dtype=b.dtype) for k, b in first.named_buffers()}
    for start in range(0, n, TABLE_CHUNK):
        part = first if start == 0 else module_of(f, t, kernels, slice(start, start + TABLE_CHUNK))
        for k, b in part.named_buffers():
            bufs[k][start // 16 : start // 16 + b.shape[0]] = b
    for k, b in bufs.items():
        setattr(first, k, b)
    first.out_features = n
    return first


class _FloatRows:
    """Row slices of a table as fp32, dequantized from the file on demand (for `Int8Table`)."""

    def __init__(self, f: Any, t: TensorInfo) -> None:
        self.f, self.t, self.shape = f, t, t.shape

    def __getitem__(self, rows: slice) -> torch.Tensor:
        return torch.from_numpy(gguf_blocks.to_float(self.t.qtype, read_raw(self.f, self.t, rows)))


def _set(model: nn.Module, name: str, value: torch.Tensor) -> None:
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    if attr not in mod._parameters and attr not in mod._buffers:
        raise GGUFError(f"tensor {name} has no place in the model")
    setattr(mod, attr, nn.Parameter(value, requires_grad=False))


def _put(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _mapped(table: dict[str, TensorInfo], arch: str, gguf: Path, long_rope: bool
            ) -> Iterator[tuple[TensorInfo, str]]:
    """The tensors sinkchat loads with their transformers names, in file order (the plain reads then go forwards);
    the rest skipped, logged. `long_rope=False`: LongRoPE's factor tensors refused (the packed path cannot take them;
    the float path has always skipped them)."""
    for t in sorted(table.values(), key=lambda t: t.offset):
        hf = hf_name(t.name, arch)
        if hf is not None:
            yield t, hf
        elif t.name.startswith("rope_factors") and not long_rope:
            raise GGUFError(f"{gguf.name}: LongRoPE factor tensors ({t.name}) are not supported yet")
        else:
            log.info("gguf: skipping %s", t.name)


def _float_values(f: Any, t: TensorInfo, arch: str) -> np.ndarray:
    """A tensor as fp32 in its own shape, as transformers holds it (Gemma's norms back to w)."""
    return norm_values(t, arch, gguf_blocks.to_float(t.qtype, read_raw(f, t)).reshape(t.shape))


def _check_filled(model: nn.Module, gguf: Path) -> None:
    """Refuse a model with a weight still on the meta device: the file had no tensor for it."""
    left = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.device.type == "meta"]
    if left:
        raise GGUFError(f"{gguf.name}: no tensor for {', '.join(left[:3])}")


def load_weights(model: nn.Module, gguf: Path, table: dict[str, TensorInfo], arch: str, kernels: str,
                 progress: Callable[[str], None]) -> float:
    """Fill the meta-device `model` from the GGUF; returns the share of decoder linear weights in 4/8 bits (every
    one is packed, float types too: 1.0, or 0.0 for a file without linears)."""
    biases: dict[str, torch.Tensor] = {}
    linears = False
    with open(gguf, "rb") as f:
        for t, hf in _mapped(table, arch, gguf, long_rope=False):
            if hf == "model.embed_tokens.weight":
                _install_table(model, _table(f, t, kernels), tied="output.weight" not in table)
            elif hf == "lm_head.weight":  # an untied head; a per-row int8 one (a float file's) projects as a head
                head = _table(f, t, kernels)
                _put(model, "lm_head", int4.Int8Head(head) if isinstance(head, int4.Int8Table) else head)
            elif len(t.shape) == 2:
                _put(model, hf.removesuffix(".weight"), module_of(f, t, kernels, heads=_heads(hf, model.config, arch)))
                linears = True
            elif hf.endswith(".bias"):
                biases[hf] = torch.from_numpy(gguf_blocks.to_float(t.qtype, read_raw(f, t)).reshape(-1).copy())
            else:
                _set(model, hf, torch.from_numpy(np.ascontiguousarray(_float_values(f, t, arch), dtype=np.float32)))
    for hf, b in biases.items():
        mod = model.get_submodule(hf.removesuffix(".bias"))
        heads = _heads(hf, model.config, arch)
        if heads:
            b = torch.from_numpy(_unpermute(b.numpy(), heads).copy())
        mod.bias = nn.Parameter(b.float(), requires_grad=False)
    _check_filled(model, gguf)
    return 1.0 if linears else 0.0


def load_float(model: nn.Module, gguf: Path, table: dict[str, TensorInfo], arch: str) -> None:
    """Fill the meta-device `model` with every tensor dequantized to fp32 (--quant none / nf4 / int8: those modes
    quantize the float model themselves). One tensor at a time; the float model is what those modes hold anyway."""
    with open(gguf, "rb") as f:
        for t, hf in _mapped(table, arch, gguf, long_rope=True):
            w = _float_values(f, t, arch)
            heads = _heads(hf, model.config, arch)
            _set(model, hf, torch.from_numpy(np.ascontiguousarray(_unpermute(w, heads) if heads else w)))
    if "output.weight" not in table:
        model.lm_head.weight = model.model.embed_tokens.weight
    _check_filled(model, gguf)


def _install_table(model: nn.Module, table: nn.Module, tied: bool) -> None:
    emb = model.get_input_embeddings()
    pad, scale = getattr(emb, "padding_idx", None), int4.embed_scale(emb)
    if isinstance(table, int4.Int8Table):
        if tied:
            int4.install_table(model, table, pad)
        else:
            model.set_input_embeddings(int4.Int8Embedding(table, pad, scale))
        return
    model.set_input_embeddings(PackedEmbedding(table, pad, scale=scale))
    if tied:
        model.set_output_embeddings(table)


def skeleton(config: Any) -> nn.Module:
    """The model on the meta device (no memory): every weight is put in place by `load_weights`. A light model's
    config (`gguf_light.LightConfig`) stands for its transformers model's own."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from sinkchat.model.spec import attention_implementation

    if hasattr(type(config), "real"):
        config = config.real()

    with init_empty_weights(include_buffers=False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                 attn_implementation=attention_implementation(config))
    return model
