"""The packed model cached on disk: what `gguf_load` builds from a GGUF, saved in the kernels' own layouts so that a
later start reads it back instead of unpacking and packing every tensor again (the bundled model: ~1 s of packing
on each start; a 3B Q4_K_M file: tens of seconds). Never fp32: the file is about the size of the GGUF.

Layout: `packed-v3-native.safetensors` (every tensor of the model once: a tied table is saved under one name) and
`packed-v3-native.json` (each packed module's class, its plain attributes, which of its tensors are parameters, and
how the table is wired), named by VERSION and the kernels packed for: the folder is shared by every environment of
the user (`gguf_convert`), and two of them packing for other kernels each keep their own pair instead of packing
over each other at every start. Another version's pair for the same kernels is deleted once this version's is
written or read (`drop_stale`: this version never reads it). Read back with plain reads (`q4load.read_tensors`), not
an mmap, so the peak is the model once. Both files are written to temp files and renamed, the weights first, after
the model loaded: a crash, or another process packing the same model at the same moment, leaves no half-written
cache.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sinkchat.model import int4, intk
from sinkchat.model.int4q0 import Int4Q0Linear
from sinkchat.model.int8g import Int8GLinear
from sinkchat.model.int5 import Int5KLinear, Int5Q0Linear, Int5Q1Linear
from sinkchat.model.int8q0 import Int8Q0Linear
from sinkchat.model.packed_embedding import PackedEmbedding
from sinkchat.model.q4load import read_tensors

log = logging.getLogger(__name__)

VERSION = 4  # 2: Q4_0 held as q40 (`Int4Q0Linear`, 18 bytes a block), no longer as q4: a v1 cache is not read;
#             3: Q6_K may be held as q6k (`Int6KLinear`, its own 210 bytes per 256) where v2 held q8k;
#             4: q4k's scales at 6 bits (256 bytes per 16 rows x 256, v3: 320), Q8_0 as q80 (`Int8Q0Linear`),
#                Q5_0 / Q5_1 / Q5_K as q50 / q51 / q5k (`int5`) where v3 held q8g / q8k
CLASSES: dict[str, type[nn.Module]] = {c.__name__: c for c in (int4.Int4Linear, Int8GLinear, int4.Int8Table,
                                                                intk.Int4KLinear, intk.Int8KLinear, Int4Q0Linear,
                                                                intk.Int6KLinear, Int8Q0Linear, Int5Q0Linear,
                                                                Int5Q1Linear, Int5KLinear)}


def weights_name(kernels: str) -> str:
    return f"packed-v{VERSION}-{kernels}.safetensors"


def manifest_name(kernels: str) -> str:
    return f"packed-v{VERSION}-{kernels}.json"


def drop_stale(out: Path, kernels: str) -> list[str]:
    """Delete the pairs another VERSION wrote for these kernels in folder `out` (a v1 pair holds Q4_0 as q4, and
    nothing reads it again: left, it would double the folder's size); returns the names removed. Run when this
    version's pair is written or read, so an older install sharing the folder repacks only if it runs again."""
    gone = []
    pat = re.compile(rf"packed-v(\d+)-{re.escape(kernels)}\.(safetensors|json)")
    for p in out.iterdir() if out.is_dir() else ():
        m = pat.fullmatch(p.name)
        if m and int(m.group(1)) != VERSION:
            try:
                p.unlink()
                gone.append(p.name)
            except OSError:  # another process's, or a read-only folder: harmless
                pass
    return gone


def _attrs(mod: nn.Module) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in mod.__dict__.items():
        if k.startswith("_") or k == "training":
            continue
        if isinstance(v, torch.dtype):
            out[k] = {"dtype": str(v).removeprefix("torch.")}
        elif v is None or isinstance(v, (bool, int, float, str)):
            out[k] = v
    return out


def _restore(v: Any) -> Any:
    return getattr(torch, v["dtype"]) if isinstance(v, dict) else v


def save(model: nn.Module, out: Path, kernels: str) -> None:
    """Write the packed cache of `model` into folder `out` (atomically; any failure leaves no cache, only a log)."""
    from safetensors.torch import save_file

    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    table = emb.table if isinstance(emb, (PackedEmbedding, int4.Int8Embedding)) else None
    modules: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    for name, mod in model.named_modules():  # each module once: a tied table appears under its first name
        if type(mod).__name__ in CLASSES:
            modules[name] = {"class": type(mod).__name__, "attrs": _attrs(mod),
                             "params": [k for k, p in mod.named_parameters(recurse=False) if p is not None]}
    for name, t in model.state_dict(keep_vars=False).items():
        if t.data_ptr() in seen:
            continue
        seen[t.data_ptr()] = name
        tensors[name] = t.contiguous()
    names = {id(m): n for n, m in model.named_modules()}
    wiring = {"table": names.get(id(table)), "embedding": type(emb).__name__,
              "head": names.get(id(head.table if isinstance(head, int4.Int8Head) else head)),
              "head_kind": type(head).__name__, "padding_idx": getattr(emb, "padding_idx", None)}
    manifest = json.dumps({"version": VERSION, "kernels": kernels, "modules": modules, "wiring": wiring})
    tmps = []
    try:
        for _ in range(2):
            fd, name = tempfile.mkstemp(prefix=".packed-", dir=out)
            os.close(fd)
            tmps.append(Path(name))
        save_file(tensors, tmps[0])
        tmps[1].write_text(manifest)
        os.replace(tmps[0], out / weights_name(kernels))
        os.replace(tmps[1], out / manifest_name(kernels))
        drop_stale(out, kernels)
    except OSError as e:  # a full disk: the model still runs; the next start packs again
        log.warning("could not cache the packed model in %s: %s", out, e)
    finally:
        for tmp in tmps:
            tmp.unlink(missing_ok=True)


def load(config: Any, out: Path, kernels: str, into: nn.Module | None = None) -> nn.Module | None:
    """The model from the packed cache in `out`, or None when there is none for these kernels. `into`: a module tree
    to fill instead of transformers' skeleton of `config` (`gguf_light.LightModel`)."""
    try:
        man = json.loads((out / manifest_name(kernels)).read_text())
    except (OSError, ValueError):
        return None
    if man.get("version") != VERSION or man.get("kernels") != kernels or not (out / weights_name(kernels)).is_file():
        return None
    if into is None:
        from sinkchat.model.gguf_load import skeleton  # (imports gguf-py: a light start has its tree, `into`)

        model = skeleton(config)
    else:
        model = into
    shells = {name: _shell(spec) for name, spec in man["modules"].items()}
    rest: dict[str, torch.Tensor] = {}  # norms, and anything else left in the skeleton
    for key, t in read_tensors(out / weights_name(kernels)):  # one pass (a scan of every key per module: 0.05 s)
        name, _, attr = key.rpartition(".")
        mod = shells.get(name)
        if mod is None:
            rest[key] = t
        elif attr in man["modules"][name]["params"]:
            setattr(mod, attr, nn.Parameter(t, requires_grad=False))
        else:
            mod.register_buffer(attr, t)
    _wire(model, shells, man["wiring"])
    for key, t in rest.items():
        mod_name, _, attr = key.rpartition(".")
        setattr(model.get_submodule(mod_name), attr, nn.Parameter(t, requires_grad=False))
    left = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.device.type == "meta"]
    if left:
        log.warning("packed cache in %s misses %s; packing again", out, left[:3])
        return None
    drop_stale(out, kernels)
    return model


def _shell(spec: dict[str, Any]) -> nn.Module:
    mod = CLASSES[spec["class"]].__new__(CLASSES[spec["class"]])
    nn.Module.__init__(mod)
    for k, v in spec["attrs"].items():
        setattr(mod, k, _restore(v))
    for p in spec["params"]:
        setattr(mod, p, None)
    return mod


def _wire(model: nn.Module, shells: dict[str, nn.Module], w: dict[str, Any]) -> None:
    table = shells.get(w["table"]) if w["table"] else None
    for name, mod in shells.items():
        if name != w["table"] and name != w["head"]:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, mod)
    pad, scale = w["padding_idx"], int4.embed_scale(model.get_input_embeddings())  # the skeleton's own factor
    if w["embedding"] == "PackedEmbedding":
        model.set_input_embeddings(PackedEmbedding(table, pad, scale=scale))
    elif w["embedding"] == "Int8Embedding":
        model.set_input_embeddings(int4.Int8Embedding(table, pad, scale))
    head = shells.get(w["head"]) if w["head"] else None
    if w["head_kind"] == "Int8Head" or isinstance(head, int4.Int8Table):  # (a cache from before heads were wrapped)
        model.set_output_embeddings(int4.Int8Head(head))
    elif head is not None:
        model.set_output_embeddings(head)
