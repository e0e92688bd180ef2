"""Load a safetensors checkpoint straight into the q4 layout, one tensor at a time: peak RSS ~ the q4 model.

`from_pretrained` materialises every weight in fp32 first (the bundled model: 540 MB of checkpoint pages plus
copies) and only then can the linears be packed, so loading peaked at ~1.2 GB for a model that runs in ~0.5 GB.
Here the model skeleton is built on the meta device, each tensor is read from the file with plain reads (no mmap:
touched mmap pages would count as resident until the file is closed), and a decoder linear's weight is packed to
int4 as soon as it is read. Anything unexpected (a key the model does not have, a tensor left unloaded, a dtype
safetensors names differently) returns None and the caller falls back to `from_pretrained`.
"""

from __future__ import annotations

import json
import logging
import struct
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from sinkchat.model import int4
from sinkchat.model.spec import attention_implementation
log = logging.getLogger(__name__)

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
          "U8": torch.uint8, "I8": torch.int8}


class FileRows:
    """Row slices of a 2-D tensor read from the file on demand (valid while `read_tensors` is iterating)."""

    def __init__(self, f: Any, offset: int, shape: list[int], dtype: torch.dtype) -> None:
        self.f, self.offset, self.shape, self.dtype = f, offset, tuple(shape), dtype

    def __getitem__(self, rows: slice) -> torch.Tensor:
        start, stop, _ = rows.indices(self.shape[0])
        t = torch.empty((max(0, stop - start), self.shape[1]), dtype=self.dtype)
        self.f.seek(self.offset + start * self.shape[1] * t.element_size())
        if t.numel():
            self.f.readinto(memoryview(t.view(-1).view(torch.uint8).numpy()))
        return t


def read_tensors(path: Path, lazy: frozenset[str] = frozenset()) -> Iterator[tuple[str, Any]]:
    """Yield (name, tensor) from a .safetensors file, each in freshly allocated memory; 2-D tensors named in
    `lazy` come as a `FileRows` instead."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        base = 8 + n
        for name, meta in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            dtype = DTYPES[meta["dtype"]]  # KeyError -> caller falls back
            start, end = meta["data_offsets"]
            if name in lazy and len(meta["shape"]) == 2:
                yield name, FileRows(f, base + start, meta["shape"], dtype)
                continue
            t = torch.empty(meta["shape"], dtype=dtype)
            f.seek(base + start)
            if end > start:
                f.readinto(memoryview(t.view(-1).view(torch.uint8).numpy()))
            yield name, t


def _tied_table_name(model: nn.Module, config: Any) -> str | None:
    """State-dict name of the token table when it is tied to the output projection and fits the int8 kernel."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not getattr(config, "tie_word_embeddings", False) or not isinstance(emb, nn.Embedding):
        return None
    if not isinstance(head, nn.Linear) or head.bias is not None or emb.embedding_dim % 16:
        return None
    return next(f"{n}.weight" for n, m in model.named_modules() if m is emb)


def _decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Names (as in the state dict, without '.weight') of the linears `int4.quantize_model` would pack."""
    base = getattr(model, "model", model)
    prefix = next(n for n, m in model.named_modules() if m is base.layers)
    return {f"{prefix}.{n}": m for n, m, pack in int4.linears(base.layers) if pack}


def _set(model: nn.Module, name: str, value: torch.Tensor) -> None:
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    if attr in mod._parameters:
        mod._parameters[attr] = nn.Parameter(value, requires_grad=False)
    elif attr in mod._buffers:
        mod._buffers[attr] = value
    else:
        raise KeyError(name)


def load_q4(folder: str, config: Any, dtype: torch.dtype, kernels: str = "torch") -> tuple[nn.Module, float] | None:
    """The model with int4 decoder linears and (if tied) an int8 token table; None if this folder cannot be
    loaded this way. Returns (model, 4-bit share of the decoder linear weights)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    files = sorted(Path(folder).glob("*.safetensors"))
    if not Path(folder).is_dir() or not files:
        return None
    try:
        with init_empty_weights(include_buffers=False), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                     attn_implementation=attention_implementation(config))
        linears = _decoder_linears(model)
        total = sum(m.in_features * m.out_features for _, m, _ in int4.linears(getattr(model, "model", model).layers))
        packed = 0
        table = _tied_table_name(model, config)
        lazy = frozenset([table] if table else [])
        for f in files:
            for name, t in read_tensors(f, lazy):
                mod_name = name.removesuffix(".weight")
                if isinstance(t, FileRows):  # the tied token table, straight to int8 in row blocks
                    int4.install_table(model, int4.Int8Table(t, out_dtype=dtype, kernels=kernels), model.get_input_embeddings().padding_idx)
                    table = None
                elif name.endswith(".weight") and mod_name in linears:
                    lin = linears.pop(mod_name)
                    parent, _, child = mod_name.rpartition(".")
                    shell = nn.Linear(lin.in_features, lin.out_features, bias=False, device="meta")
                    shell.weight = nn.Parameter(t.to(dtype), requires_grad=False)
                    q = int4.Int4Linear(shell, kernels=kernels)
                    if lin.bias is not None:
                        q.bias = lin.bias  # still meta: its own key fills it below
                    setattr(model.get_submodule(parent), child, q)
                    packed += t.numel()
                else:
                    _set(model, name, t.to(dtype) if t.is_floating_point() else t)
        if not lazy:
            model.tie_weights()
        elif table is not None:  # tied, but the file had no table
            return None
        left = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.device.type == "meta"]
        if linears or left:
            log.info("q4 streaming load: %s left unloaded; falling back", (list(linears) + left)[:3])
            return None
    except (KeyError, ValueError, RuntimeError, AttributeError, StopIteration, json.JSONDecodeError) as e:
        log.info("q4 streaming load not possible (%s); falling back", str(e)[:200])
        return None
    for mod in model.modules():  # a bias read before or after its weight: the native kernel adds it in fp32
        if isinstance(mod, int4.Int4Linear) and mod.kernels == "native" and mod.bias is not None:
            mod.bias = nn.Parameter(mod.bias.data.float(), requires_grad=False)
    model.eval()
    model.requires_grad_(False)
    load_generation_config(model, folder)
    int4.quantize_tied_table(model, kernels)  # a tied table not streamed above (no-op when it was)
    return model, packed / max(1, total)


def load_generation_config(model: nn.Module, folder: str) -> None:
    """from_pretrained reads generation_config.json (stop ids live there for some models); from_config does not."""
    if (Path(folder) / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(folder)
