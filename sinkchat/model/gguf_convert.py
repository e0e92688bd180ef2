"""A GGUF's small parts, converted once into a folder under the user cache dir: config.json, the tokenizer and its
chat template (transformers' files), and the table of tensors. No weight is written here (`gguf_load` reads them
from the GGUF itself, and caches them only in the packed layout).

Why a folder at all: transformers rebuilds the tokenizer from GGUF metadata on every load (~0.5 s for the bundled
model, and its config parse took 4.4 s more before `gguf_meta`); with the folder a later start reads a few small
files.

The folder is keyed by the file's content (`gguf_file.content_key`: its size, header and fixed samples of its
tensor data; with the header scan 0.02-0.05 s on the bundled file), not its path: one user's environments (a venv, a wheel install, pipx) each have their own copy
of the bundled GGUF, and when the key held the path's name and mtime every one of them converted and packed it
again (4 identical 101 MB folders were found). The marker records every path the content was seen at and, by its
mtime, the last use, for `sinkchat cache`. The folder's name carries VERSION, so a sinkchat of another version in
another environment builds its own folder beside this one instead of rebuilding this one under it. It is written
to a temp dir and renamed, under a lock, so a crash or a second sinkchat converting at the same time never leaves
a half-written folder that looks done.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

from sinkchat.config import cache_dir
from sinkchat.model import gguf_file
from sinkchat.model.gguf_file import GGUFError, GGUFInfo, TensorInfo

log = logging.getLogger(__name__)

VERSION = 4  # bump when what the folder holds changes: a new folder is made, the old one is left to `cache clean`
PREFIX = f"gguf-v{VERSION}-"  # a folder of this version: PREFIX + content key; anything else is an older layout
MARKER = "sinkchat-gguf.json"
TABLE = "gguf-tensors.json"
ROPE = "rope-freqs.json"
MAX_SOURCES = 16  # paths kept in the marker (newest last); a checkout copied around would otherwise grow it


def models_dir() -> Path:
    return cache_dir() / "models"


def folder(head: gguf_file.Header) -> Path:
    return models_dir() / f"{PREFIX}{gguf_file.content_key(head)}"


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from `path`, or None when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_marker(out: Path) -> dict[str, Any] | None:
    return read_json(out / MARKER)


def is_done(out: Path) -> bool:
    marker = read_marker(out)
    return marker is not None and marker.get("version") == VERSION


@contextlib.contextmanager
def locked(out: Path, wait: bool = True) -> Iterator[bool]:
    """Hold the folder's lock (a file beside it); yields False instead of waiting when `wait` is off and another
    process holds it (a conversion in progress)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path(out), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True


def lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}.lock"


@contextlib.contextmanager
def reading(out: Path) -> Iterator[None]:
    """Hold the folder's lock shared while reading the folder: `cache clean` (which takes it exclusive, without
    waiting) then skips the entry instead of pulling it out from under this process. A lock file that `clean`
    unlinked while this process waited for it is not the folder's lock any more: open it again."""
    out.parent.mkdir(parents=True, exist_ok=True)
    lock_file = lock_path(out)
    while True:
        f = open(lock_file, "a")
        try:
            fcntl.flock(f, fcntl.LOCK_SH)
            try:
                same = os.stat(lock_file).st_ino == os.fstat(f.fileno()).st_ino
            except FileNotFoundError:
                same = False
        except BaseException:
            f.close()
            raise
        if same:
            break
        f.close()
    with f:
        yield


@contextlib.contextmanager
def prepared(path: Path, progress: Callable[[str], None]) -> Iterator[Path]:
    """`prepare(path)`, with the folder held (`reading`) until the block ends: a loader reads the folder (config,
    tokenizer, table, packed weights) inside it. A folder `cache clean` removed between the conversion and the lock
    is converted again."""
    for _ in range(3):
        out = prepare(path, progress)
        with reading(out):
            if is_done(out):
                yield out
                return
    raise GGUFError(f"{path.name}: its cache folder {out} keeps being removed while it loads (`sinkchat cache "
                    "clean` running?)")


def prepare(path: Path, progress: Callable[[str], None]) -> Path:
    """The converted folder of `path`, made once (GGUFError, with nothing written, for a file sinkchat cannot run:
    a damaged or truncated file in well under a second, from the header scan)."""
    head = gguf_file.scan(path)
    out = folder(head)
    if is_done(out):
        _record_use(out, path)
        return out
    info = gguf_file.inspect(path, head)  # every refusal happens here, before the cache dir is touched
    with locked(out):
        done = is_done(out)  # another process converted it while this one waited
        if not done:
            progress(f"reading {path.name}'s tokenizer and config (once; cached in {out.parent})")
            _convert_into(info, out)
    if done:
        _record_use(out, path)
    return out


def _record_use(out: Path, path: Path) -> None:
    """Mark the folder used now (its marker's mtime) and remember `path` among its sources, dropping those gone from
    disk (for `cache list`: an entry none of whose sources still holds this content is an orphan). Best effort: a
    read-only cache still runs."""
    try:
        os.utime(out / MARKER)
        marker = read_marker(out) or {}
        if str(path) in marker.get("sources", []):
            return
        with locked(out, wait=False) as free:  # never wait for a process loading the entry (`reading`)
            if not free:
                return
            marker = read_marker(out) or {}
            sources = [s for s in marker.get("sources", []) if s != str(path) and os.path.exists(s)] + [str(path)]
            _write_json(out / MARKER, {**marker, "sources": sources[-MAX_SOURCES:]})
    except OSError as e:
        log.info("could not record the use of %s: %s", out, e)


def _write_json(target: Path, data: dict[str, Any]) -> None:
    """Replace `target` whole (a reader sees the old file or the new one, never a part)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}-", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def tensor_table(out: Path) -> dict[str, TensorInfo]:
    rows = json.loads((out / TABLE).read_text())["tensors"]
    return {r["name"]: TensorInfo.from_json(r) for r in rows}


def _save_rope_freqs(info: GGUFInfo, tmp: Path) -> None:
    """Llama 3.1+ files carry their llama3 RoPE scaling only as a tensor, `rope_freqs` (inv_freq divisors), which
    transformers' GGUF reader ignores: keep it beside the config, so every load applies it (`apply_rope_freqs`)."""
    t = info.tensors.get("rope_freqs.weight")
    if t is None:
        return
    from sinkchat.model import gguf_blocks
    from sinkchat.model.gguf_load import read_raw

    with open(info.path, "rb") as f:
        raw = read_raw(f, t).reshape(1, -1)
    (tmp / ROPE).write_text(json.dumps({"rope_freqs": gguf_blocks.to_float(t.qtype, raw).reshape(-1).tolist()}))


def apply_rope_freqs(model: Any, out: Path) -> None:
    """Divide the model's RoPE inverse frequencies by the file's `rope_freqs` (llama3 scaling), if it has them."""
    if not (out / ROPE).is_file():
        return
    import torch

    factors = torch.tensor(json.loads((out / ROPE).read_text())["rope_freqs"], dtype=torch.float32)
    emb = model.model.rotary_emb
    base = getattr(emb, "original_inv_freq", None)
    base = emb.inv_freq if base is None else base
    if base.shape != factors.shape:
        raise GGUFError(f"rope_freqs has {factors.numel()} factors for {base.numel()} RoPE frequencies")
    inv = (base.float() / factors).to(base.dtype)
    emb.inv_freq = inv
    emb.original_inv_freq = inv.clone()


def finish(model: Any, folder: Path) -> Any:
    """A loaded GGUF model made ready: the file's llama3 RoPE factors applied, eval mode, no grads, and the folder's
    generation config (stop ids) where it has one."""
    from sinkchat.model.q4load import load_generation_config

    apply_rope_freqs(model, folder)
    model.eval()
    model.requires_grad_(False)
    load_generation_config(model, str(folder))
    return model


# llama.cpp's own defaults where a Gemma file states no pattern (llama-model.cpp: set_swa_pattern(2) / (6)): layer i
# is local (sliding) unless i % period == period - 1, as transformers' layer_types are derived.
GEMMA_SWA_PERIOD = {"gemma2": 2, "gemma3": 6}
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp scales queries by hidden / heads for these only


def gemma_config(cfg: Any, arch: str, hp: dict[str, Any]) -> None:
    """What transformers' GGUF reader leaves out of a Gemma 2 / 3 config, set as llama.cpp reads the same file:
    which layers slide (`attention.sliding_window_pattern`, a period or one flag a layer, else the default period),
    the query scale (`query_pre_attn_scalar`: head_dim, but hidden / heads on the 27B models), Gemma 2's
    soft-capping values, and Gemma 3's linear RoPE scaling of its global layers (4B and up: factor 8)."""
    n = cfg.num_hidden_layers
    pattern = hp.get("attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) == n:
        local = [bool(x) for x in pattern]
    else:
        period = int(pattern) if isinstance(pattern, int) and pattern > 0 else GEMMA_SWA_PERIOD[arch]
        local = [i % period < period - 1 for i in range(n)]
    cfg.layer_types = ["sliding_attention" if x else "full_attention" for x in local]
    head_dim = int(hp.get("attention.key_length") or cfg.head_dim)
    cfg.query_pre_attn_scalar = (cfg.hidden_size // cfg.num_attention_heads if n == GEMMA_27B_LAYERS[arch]
                                 else head_dim)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if arch == "gemma2" and hp.get(key) is not None:
            setattr(cfg, key, float(hp[key]))
    if hp.get("attention.sliding_window"):
        cfg.sliding_window = int(hp["attention.sliding_window"])
    factor = hp.get("rope.scaling.factor")
    if arch == "gemma3" and hp.get("rope.scaling.type") == "linear" and factor and float(factor) != 1.0:
        rope = dict(cfg.rope_parameters)
        rope["full_attention"] = {**rope["full_attention"], "rope_type": "linear", "factor": float(factor)}
        cfg.rope_parameters = rope


def _tokenizer_into(info: GGUFInfo, tmp: Path, build: Callable[[], Any]) -> None:
    """The tokenizer's files into `tmp`: copied from an earlier conversion of the same tokenizer (another
    quantization of the same model: the same tokenizer.* fields) or built by transformers (~10-20 s) and kept."""
    shared = cache_dir() / "tokenizers" / info.tokenizer_key
    if not (shared / MARKER).is_file():
        tok = build()
        part = Path(tempfile.mkdtemp(prefix=".tok-", dir=tmp))
        tok.save_pretrained(part)
        (part / MARKER).write_text(json.dumps({"from": str(info.path)}))
        shared.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(part, shared)
        except OSError:  # another process got there first: theirs is the same tokenizer
            shutil.rmtree(part, ignore_errors=True)
    for f in shared.iterdir():
        if f.name != MARKER:
            shutil.copy(f, tmp / f.name)


def architecture(out: Path) -> str:
    return json.loads((out / TABLE).read_text())["architecture"]


def _convert_into(info: GGUFInfo, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from sinkchat.model import gguf_meta

    tmp = Path(tempfile.mkdtemp(prefix=f".convert-{out.name}-", dir=out.parent))  # `cache clean` finds its lock
    try:
        # transformers' GGUF reader draws its own tqdm bar on stderr; we report progress ourselves. `served`: both
        # calls get the config without parsing the file (4.4 s each on the bundled file, 20 s on Gemma 3 270M)
        with warnings.catch_warnings(), open(os.devnull, "w") as null, contextlib.redirect_stderr(null), \
                gguf_meta.served(info.path):
            warnings.simplefilter("ignore")
            try:
                cfg = AutoConfig.from_pretrained(str(info.path.parent), gguf_file=info.path.name)
                _tokenizer_into(info, tmp, lambda: AutoTokenizer.from_pretrained(str(info.path.parent),
                                                                                 gguf_file=info.path.name))
            except (ValueError, KeyError, TypeError) as e:
                raise GGUFError(f"{info.path.name}: transformers cannot read its config or tokenizer "
                                f"({str(e).splitlines()[0][:160]})") from None
        cfg.tie_word_embeddings = "output.weight" not in info.tensors  # llama.cpp omits the head when tied
        if info.key_length and getattr(cfg, "head_dim", None) not in (None, info.key_length):
            cfg.head_dim = info.key_length  # transformers maps no head-dim key for qwen3 (it keeps 128)
        _save_rope_freqs(info, tmp)
        if info.architecture in GEMMA_SWA_PERIOD:
            gemma_config(cfg, info.architecture, info.hparams)
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        cfg.save_pretrained(tmp)
        (tmp / TABLE).write_text(json.dumps({"architecture": info.architecture, "size": info.size,
                                             "tensors": [t.to_json() for t in info.tensors.values()]}))
        (tmp / MARKER).write_text(json.dumps({
            "version": VERSION, "source": str(info.path), "sources": [str(info.path)], "size": info.size,
            "name": info.name, "types": info.types(), "tokenizer": info.tokenizer_key}))
        if out.exists() and not is_done(out):  # a folder left half-written by an older sinkchat (no marker)
            shutil.rmtree(out)
        try:
            os.replace(tmp, out)
        except OSError:  # a done folder is there: another process made it (the same content) without our lock
            if not is_done(out):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
