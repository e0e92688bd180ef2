"""Save and restore a live Engine session (KV cache included). Automatic snapshots and `--resume` are in `resume`.

A snapshot is one safetensors file: the cache's live slots, the ledger's token ids / stream indices, the last logits
and the sampler's RNG state as tensors; everything else (conversation, sampling and cache settings, model fingerprint,
caller's `extra`, format version) as JSON in the safetensors metadata. Loading parses JSON and raw tensors only, so
a file can never run code. A sha256 over the header and every tensor's bytes catches truncation and bit flips, and
every check runs before the engine is touched: a refused file leaves the session exactly as it was.

Files are written atomically (temp file in the same dir, fsync, rename, fsync of the dir): a crash mid-save leaves
the previous snapshot intact, which is what automatic snapshots (`--snapshot-every N`) rely on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from sinkchat.errors import UserError
from sinkchat.config import SamplingConfig, data_dir
from sinkchat.private import private_dir
from sinkchat.memory import folders, persist

log = logging.getLogger(__name__)

MAGIC = "sinkchat-snapshot"
FORMAT_VERSION = 1
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")

__all__ = ["SnapshotError", "save_snapshot", "load_snapshot", "snapshot_info", "snapshot_path", "list_snapshots",
           "model_fingerprint"]


class SnapshotError(UserError, RuntimeError):
    """A snapshot cannot be written or does not fit this session; the message is one line for the user."""


# ------------------------------------------------------------------------------------------------ names
def snapshot_path(name: str) -> Path:
    """`/save NAME` -> data_dir()/snapshots/NAME.safetensors; anything that looks like a path is used as a path."""
    if "/" in name or os.sep in name or name.startswith((".", "~")) or name.endswith(".safetensors"):
        return Path(name).expanduser()
    if not NAME_RE.match(name):
        raise SnapshotError(f"bad snapshot name {name!r}: use letters, digits, '.', '_' or '-' (or give a path)")
    return data_dir() / "snapshots" / f"{name}.safetensors"


def list_snapshots() -> list[Path]:
    """Named snapshots in the data dir, newest first (for /load completion)."""
    d = data_dir() / "snapshots"
    return sorted(d.glob("*.safetensors"), key=lambda p: p.stat().st_mtime, reverse=True) if d.is_dir() else []


# ------------------------------------------------------------------------------------------------ fingerprint
def model_fingerprint(engine: Any) -> str:
    """engine.loaded.fingerprint (weights source + quant + dtype) if the loader made it, else a hash of the model
    config plus a sample of the weights (same architecture with other weights must not match)."""
    fp = getattr(getattr(engine, "loaded", None), "fingerprint", None)
    if fp:
        return str(fp)
    model = engine.model
    h = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    params = list(model.state_dict().items())
    for name, t in params[:2] + params[-2:]:
        h.update(name.encode())
        h.update(_tensor_bytes(t.detach().reshape(-1)[:4096]))
    return f"{type(model).__name__}:{h.hexdigest()[:16]}"


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _digest(header: str, tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256(header.encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def _kv_shape(engine: Any) -> tuple[int, int, int]:
    """(batch, kv heads, head dim) that this engine's cache holds: from the live cache, else the model's spec."""
    layer = engine.cache.layers[0]
    if layer.is_initialized:
        return int(layer.keys.shape[0]), int(layer.keys.shape[1]), int(layer.keys.shape[-1])
    return 1, engine.spec.n_kv, engine.spec.head_dim


# ------------------------------------------------------------------------------------------------ save
def save_snapshot(engine: Any, path: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> Path:
    """Write the engine's whole session state to `path` atomically; `extra` (JSON-able, e.g. the transcript
    pointer `log.pointer()`) comes back from load_snapshot. Call between turns, not mid-generation."""
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {f"cache.{k}": v.to("cpu") for k, v in engine.cache.state().items()}
    led = engine.ledger
    tensors["ledger.ids"] = torch.tensor(led.ids, dtype=torch.int64)
    tensors["ledger.abs_index"] = torch.tensor(led.abs_index, dtype=torch.int64)
    tensors["last_reply_ids"] = torch.tensor(list(engine.last_reply_ids), dtype=torch.int64)
    if engine.last_logits is not None:
        tensors["last_logits"] = engine.last_logits.detach().to("cpu").contiguous()
    if engine.generator is not None:
        tensors["rng"] = engine.generator.get_state()
    loaded = getattr(engine, "loaded", None)
    if hasattr(engine, "_taken_back"):
        engine._taken_back()  # the ranges cut where the stream was taken back: saved as they apply from here
    head = {
        "version": FORMAT_VERSION, "created": time.time(), "fingerprint": model_fingerprint(engine),
        "quant": getattr(loaded, "quant", None), "n_layers": engine.n_layers, "kv_shape": list(_kv_shape(engine)),
        "cache": asdict(engine.cache_cfg), "cache_len": engine.cache.length, "sampling": asdict(engine.sampling),
        "ledger": {k: v for k, v in led.state().items() if k not in ("ids", "abs_index")},  # seen, evicted, ...
        "conv": {"system": engine.conv.system, "messages": engine.conv.messages, "fed": engine.conv.fed},
        # stream ranges the memory lets go (`Engine.keep_out`) and, of them, copies of blocks read again
        "unkept": [list(r) for r in getattr(engine, "unkept", [])],
        "copies": [list(r) for r in getattr(engine, "copies", [])],
        "extra": extra or {},
    }
    try:
        json.dumps(extra or {})
    except (TypeError, ValueError) as e:
        raise SnapshotError(f"snapshot extra is not JSON-able: {e}") from None
    folder = _save_memory(engine, path, head, tensors)
    header = json.dumps(head, ensure_ascii=False)
    meta = {"format": MAGIC, "version": str(FORMAT_VERSION), "header": header, "sha256": _digest(header, tensors)}
    try:
        _atomic_save(tensors, meta, path)
    except BaseException:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    folders.prune(path, folder.name if folder is not None else None)  # saved with the memory off: none is kept
    log.info("snapshot %s: %d tokens in cache, %d messages", path, engine.cache.length, len(engine.conv.messages))
    return path


def _save_memory(engine: Any, path: Path, head: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path | None:
    """The recall memory's state into `head` / `tensors` and its segments into a new folder beside `path`."""
    memory = getattr(engine, "memory", None)
    if memory is None:
        return None
    folder = folders.new_folder(path)
    try:
        private_dir(path.parent)
        mem_head, mem_tensors = persist.save(memory, folder)
    except (OSError, persist.MemoryStateError) as e:
        shutil.rmtree(folder, ignore_errors=True)
        raise SnapshotError(f"cannot save the recall memory beside {path}: {getattr(e, 'strerror', None) or e}"
                            ) from None
    head["memory"] = mem_head
    tensors.update({f"memory.{k}": v.to("cpu") for k, v in mem_tensors.items()})
    return folder


def _atomic_save(tensors: dict[str, torch.Tensor], meta: dict[str, str], path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        private_dir(path.parent)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)
        with open(tmp, "rb+") as f:
            os.fchmod(f.fileno(), 0o600)  # the conversation's text is in its header: the user's alone
            os.fsync(f.fileno())
        os.replace(tmp, path)
        try:
            dfd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:  # some filesystems cannot fsync a directory; the rename is still atomic
            pass
    except Exception as e:  # noqa: BLE001 - OSError, or safetensors' own error for a failed write
        _remove(tmp)
        raise SnapshotError(f"cannot write snapshot {path}: {getattr(e, 'strerror', None) or e}") from None
    except BaseException:
        _remove(tmp)
        raise


def _remove(p: Path) -> None:
    try:
        p.unlink(missing_ok=True)
    except OSError:
        pass


# ------------------------------------------------------------------------------------------------ load
def _read(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Header and tensors of a verified snapshot file (format, version and checksum checked)."""
    from safetensors import safe_open

    if not path.is_file():
        raise SnapshotError(f"no snapshot at {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != MAGIC:
                raise SnapshotError(f"{path} is not a sinkchat snapshot")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except SnapshotError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for damaged files
        raise SnapshotError(f"{path} is not a readable snapshot (truncated or corrupt: {str(e)[:80]})") from None
    try:
        version = int(meta.get("version", "0"))
    except ValueError:
        version = -1
    if not 1 <= version <= FORMAT_VERSION:
        raise SnapshotError(f"{path} has snapshot format {meta.get('version')!r}; this sinkchat reads 1..{FORMAT_VERSION}")
    if _digest(meta.get("header", ""), tensors) != meta.get("sha256"):
        raise SnapshotError(f"{path} is corrupt (checksum mismatch)")
    try:
        head = json.loads(meta["header"])
    except ValueError:
        raise SnapshotError(f"{path} is corrupt (bad header)") from None
    return head, tensors


def snapshot_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The verified header of a snapshot (settings, fingerprint, extra, ...) without touching any engine; lets a
    client build an engine with the snapshot's cache sizes before loading."""
    head, _ = _read(Path(path))
    head["path"] = str(path)
    return head


def load_snapshot(engine: Any, path: str | os.PathLike[str]) -> dict[str, Any]:
    """Restore a session saved by save_snapshot into `engine`; returns the header (with 'extra' and 'path').

    Refuses (SnapshotError, engine unchanged) a missing, foreign, truncated, corrupt or newer file, another model,
    or another cache shape (capacity, sinks, layers, kv heads, head dim). The snapshot's policy, evict chunk and
    sampling settings are adopted: they decide what the next reply is."""
    path = Path(path)
    head, tensors = _read(path)
    _check_fits(engine, head, path)
    state = _decode(engine, head, tensors, path)
    state.memory = _prepare_memory(engine, head, tensors, path)
    _commit(engine, state)
    head["path"] = str(path)
    log.info("loaded snapshot %s: %d tokens, %d messages", path, state.cache.length, len(state.messages))
    return head


@dataclass
class _Restored:
    """Everything a snapshot puts into an engine, built and checked before the engine is touched."""

    cache: Any
    cache_cfg: Any
    ledger: Any
    system: str | None
    messages: list[dict[str, str]]
    fed: str
    logits: torch.Tensor | None
    reply_ids: list[int]
    sampling: SamplingConfig
    generator: torch.Generator | None
    memory: Any = None  # persist.Restored: the saved recall memory, copied into a new store folder
    unkept: list[tuple[int, int]] = field(default_factory=list)  # the saved stream's ranges (older files: none)
    copies: list[tuple[int, int]] = field(default_factory=list)


def _prepare_memory(engine: Any, head: dict[str, Any], tensors: dict[str, torch.Tensor], path: Path) -> Any:
    """The snapshot's recall memory rebuilt beside this session's (None: it has none, or this session runs
    without one); SnapshotError, nothing touched, if it does not fit."""
    memory, saved = getattr(engine, "memory", None), head.get("memory")
    if saved is None or memory is None:
        if saved is not None and saved.get("blocks"):
            log.warning("the snapshot's recall memory (%d blocks) is not loaded: this session runs with --memory off "
                        "(--memory on loads it; saved again with the memory off, the snapshot lets it go)",
                        len(saved["blocks"]))
        return None
    mem = {k[len("memory."):]: v for k, v in tensors.items() if k.startswith("memory.")}
    try:
        return persist.prepare(memory, saved, mem, path)
    except (persist.MemoryStateError, KeyError, TypeError, ValueError) as e:
        raise SnapshotError(f"{path}: {e}") from None


def _check_fits(engine: Any, head: dict[str, Any], path: Path) -> None:
    """Same model, same cache shape, else SnapshotError."""
    fp = model_fingerprint(engine)
    if head.get("fingerprint") != fp:
        raise SnapshotError(f"{path} was saved with model {head.get('fingerprint')}; this session runs {fp}")
    cc, mine = head["cache"], engine.cache_cfg
    if (cc["capacity"], cc["n_sink"]) != (mine.capacity, mine.n_sink):
        raise SnapshotError(f"{path} needs --cache {cc['capacity']} --sinks {cc['n_sink']}; this session has "
                            f"--cache {mine.capacity} --sinks {mine.n_sink}")
    if head.get("n_layers") != engine.n_layers or tuple(head.get("kv_shape", ())) != _kv_shape(engine):
        raise SnapshotError(f"{path} has a different cache shape ({head.get('n_layers')} layers, kv "
                            f"{head.get('kv_shape')}) than this model ({engine.n_layers}, {list(_kv_shape(engine))})")


def _decode(engine: Any, head: dict[str, Any], tensors: dict[str, torch.Tensor], path: Path) -> _Restored:
    """Build the restored state from a verified file; SnapshotError if anything in it does not fit."""
    ids, abs_index = tensors["ledger.ids"].tolist(), tensors["ledger.abs_index"].tolist()
    n = int(head["cache_len"])
    if len(ids) != n or len(abs_index) != n:
        raise SnapshotError(f"{path} is inconsistent (ledger {len(ids)} tokens, cache {n})")
    try:
        cc, mine, dev = head["cache"], engine.cache_cfg, engine.device
        new_cache = engine.new_cache(mine.capacity)
        if n:
            new_cache.load_state({k[len("cache."):]: v.to(dev) for k, v in tensors.items() if k.startswith("cache.")})
        gen = None
        if "rng" in tensors:
            gen = torch.Generator()
            gen.set_state(tensors["rng"])
        conv = head["conv"]
        state = _Restored(
            new_cache, replace(mine, policy=cc["policy"], evict_chunk=int(cc["evict_chunk"])),
            type(engine.ledger).from_state({**head["ledger"], "ids": ids, "abs_index": abs_index}),
            conv["system"], [{"role": str(m["role"]), "content": str(m["content"])} for m in conv["messages"]],
            str(conv["fed"]), tensors["last_logits"].to(dev) if "last_logits" in tensors else None,
            tensors["last_reply_ids"].tolist(), SamplingConfig(**head["sampling"]), gen,
            unkept=[(int(a), int(b)) for a, b in head.get("unkept", [])],
            copies=[(int(a), int(b)) for a, b in head.get("copies", [])])
    except SnapshotError:
        raise
    except Exception as e:  # noqa: BLE001 - anything odd in a checksummed file means it is not ours
        raise SnapshotError(f"{path} does not fit this session: {str(e).splitlines()[0][:120]}") from None
    if new_cache.length != n:
        raise SnapshotError(f"{path} is inconsistent (cache tensors hold {new_cache.length} tokens, header {n})")
    return state


def _commit(engine: Any, st: _Restored) -> None:
    """Plain assignments only, so a refused file never leaves a half-loaded engine. The ledger is updated in place
    (every counter it has: seen, evicted, cleared, ...), so whoever holds `engine.ledger` sees the loaded one."""
    engine.cache, engine.cache_cfg = st.cache, st.cache_cfg
    for f in fields(st.ledger):
        setattr(engine.ledger, f.name, getattr(st.ledger, f.name))
    engine.conv.system, engine.conv.messages[:], engine.conv.fed = st.system, st.messages, st.fed
    engine.last_logits, engine.last_reply_ids = st.logits, st.reply_ids
    engine.sampling, engine.generator = st.sampling, st.generator
    if hasattr(engine, "unkept"):
        engine.unkept, engine.copies = st.unkept, st.copies  # the loaded stream's (`Engine.keep_out`), not the old
    memory = getattr(engine, "memory", None)
    if memory is not None and st.memory is not None:
        persist.commit(memory, st.memory, engine.cache)
    elif memory is not None:  # what it holds belongs to the conversation that was here, not to the loaded one
        memory.clear(engine.cache)
        memory.forgotten = st.ledger.evicted  # the loaded session's evictions: in no memory
        if st.ledger.evicted:
            log.warning("the loaded session's %d evicted tokens are not in the recall memory: it was saved "
                        "without one", st.ledger.evicted)
