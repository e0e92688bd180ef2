"""Save and restore a live Engine session (KV cache included), and resume a logged session after a crash.

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
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from sinkchat.config import SamplingConfig, attention_shape, data_dir
from sinkchat.store.transcript import NullLog, Turn, auto_snapshot_path, get_session, turns

log = logging.getLogger(__name__)

MAGIC = "sinkchat-snapshot"
FORMAT_VERSION = 1
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
REPLAY_ROLES = ("user", "assistant", "tool", "system")

__all__ = ["SnapshotError", "save_snapshot", "load_snapshot", "snapshot_info", "snapshot_path", "list_snapshots",
           "auto_snapshot_path", "AutoSnapshot", "ResumeResult", "resume_session", "model_fingerprint"]


class SnapshotError(RuntimeError):
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
    """(batch, kv heads, head dim) that this engine's cache holds: from the live cache, else the model config."""
    layer = engine.cache.layers[0]
    if layer.is_initialized:
        return int(layer.keys.shape[0]), int(layer.keys.shape[1]), int(layer.keys.shape[-1])
    _, kv, hd = attention_shape(engine.model.config)
    return 1, int(kv), int(hd)


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
    head = {
        "version": FORMAT_VERSION, "created": time.time(), "fingerprint": model_fingerprint(engine),
        "quant": getattr(loaded, "quant", None), "n_layers": engine.n_layers, "kv_shape": list(_kv_shape(engine)),
        "cache": asdict(engine.cache_cfg), "cache_len": engine.cache.length, "sampling": asdict(engine.sampling),
        "ledger": {"seen": led.seen, "evicted": led.evicted},
        "conv": {"system": engine.conv.system, "messages": engine.conv.messages, "fed": engine.conv.fed},
        "extra": extra or {},
    }
    try:
        header = json.dumps(head, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise SnapshotError(f"snapshot extra is not JSON-able: {e}") from None
    meta = {"format": MAGIC, "version": str(FORMAT_VERSION), "header": header, "sha256": _digest(header, tensors)}
    _atomic_save(tensors, meta, path)
    log.info("snapshot %s: %d tokens in cache, %d messages", path, engine.cache.length, len(engine.conv.messages))
    return path


def _atomic_save(tensors: dict[str, torch.Tensor], meta: dict[str, str], path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)
        with open(tmp, "rb+") as f:
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
    ids, abs_index = tensors["ledger.ids"].tolist(), tensors["ledger.abs_index"].tolist()
    n = int(head["cache_len"])
    if len(ids) != n or len(abs_index) != n:
        raise SnapshotError(f"{path} is inconsistent (ledger {len(ids)} tokens, cache {n})")
    try:
        sampling = SamplingConfig(**head["sampling"])
        cache_cfg = replace(mine, policy=cc["policy"], evict_chunk=int(cc["evict_chunk"]))
        new_cache = engine.new_cache(mine.capacity)
        dev = engine.device
        if n:
            new_cache.load_state({k[len("cache."):]: v.to(dev) for k, v in tensors.items() if k.startswith("cache.")})
        gen = None
        if "rng" in tensors:
            gen = torch.Generator()
            gen.set_state(tensors["rng"])
        conv = head["conv"]
        messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in conv["messages"]]
        logits = tensors["last_logits"].to(dev) if "last_logits" in tensors else None
    except SnapshotError:
        raise
    except Exception as e:  # noqa: BLE001 - anything odd in a checksummed file means it is not ours
        raise SnapshotError(f"{path} does not fit this session: {str(e).splitlines()[0][:120]}") from None
    if new_cache.length != n:
        raise SnapshotError(f"{path} is inconsistent (cache tensors hold {new_cache.length} tokens, header {n})")
    # ---- commit: plain assignments only from here on, so a refused file never leaves a half-loaded engine
    engine.cache = new_cache
    engine.cache_cfg = cache_cfg
    led = engine.ledger
    led.ids[:], led.abs_index[:] = ids, abs_index
    led.seen, led.evicted = int(head["ledger"]["seen"]), int(head["ledger"]["evicted"])
    engine.conv.system, engine.conv.messages[:], engine.conv.fed = conv["system"], messages, str(conv["fed"])
    engine.last_logits = logits
    engine.last_reply_ids = tensors["last_reply_ids"].tolist()
    engine.sampling, engine.generator = sampling, gen
    head["path"] = str(path)
    log.info("loaded snapshot %s: %d tokens, %d messages", path, n, len(messages))
    return head


# ------------------------------------------------------------------------------------------------ auto + resume
class AutoSnapshot:
    """`--snapshot-every N`: call `after_turn(engine, log)` after each completed exchange (reply logged); every Nth
    call rewrites the session's automatic snapshot. A failed write warns once and never stops the session."""

    def __init__(self, every: int, warn: Callable[[str], None] | None = None) -> None:
        self.every, self._warn, self._warned, self.calls = every, warn or log.warning, False, 0

    def after_turn(self, engine: Any, session_log: NullLog) -> Path | None:
        self.calls += 1
        if self.every <= 0 or self.calls % self.every:
            return None
        return self.save(engine, session_log)

    def save(self, engine: Any, session_log: NullLog) -> Path | None:
        """Write the automatic snapshot now (also useful on a clean exit)."""
        if session_log.id is None:
            return None
        home = session_log.path.parent if session_log.path is not None else None
        try:
            p = save_snapshot(engine, auto_snapshot_path(session_log.id, home), session_log.pointer())
        except SnapshotError as e:
            if not self._warned:
                self._warned = True
                self._warn(f"automatic snapshot failed (continuing): {e}")
            return None
        return p


@dataclass
class ResumeResult:
    """How a session was resumed: method 'snapshot' (auto snapshot + any turns logged after it were re-fed),
    'rebuild' (newest turns re-fed), or 'empty'. `pending` is a last user message that never got a reply (the
    crash hit mid-reply): it is NOT in the cache; the client may send it again with engine.chat (already logged)."""

    method: str
    session_id: int
    turns_replayed: int = 0
    turns_total: int = 0
    pending: str | None = None
    note: str = ""

    def describe(self) -> str:
        what = {"snapshot": "restored from its automatic snapshot", "rebuild": "rebuilt the cache from the transcript",
                "empty": "nothing logged yet"}[self.method]
        s = f"session {self.session_id}: {what}"
        if self.method != "empty":
            s += f", {self.turns_replayed} of {self.turns_total} turns re-fed"
        return s + (f" ({self.note})" if self.note else "")


def resume_session(engine: Any, session_log: NullLog | None, session_id: int | None = None, *,
                   path: str | os.PathLike[str] | None = None) -> ResumeResult:
    """Bring `engine` back to where session `session_id` (default: session_log.id) stopped.

    With an automatic snapshot: load it, then re-feed the turns logged after it. Without one (or if it is refused):
    clear the engine and re-feed the newest turns that fit the window, in order, after the session's system prompt
    (so the sinks are the system prompt again)."""
    sid = session_id if session_id is not None else getattr(session_log, "id", None)
    if sid is None:
        raise SnapshotError("no session to resume")
    db = Path(path) if path is not None else getattr(session_log, "path", None)
    try:
        info, log_turns = get_session(sid, db), turns(sid, db)
    except Exception as e:  # LogError / sqlite3.Error: the log is the user's, say it in one line
        raise SnapshotError(f"cannot resume session {sid}: {e}") from None
    log_turns = [t for t in log_turns if t.role in REPLAY_ROLES]
    snap, note = auto_snapshot_path(sid, db.parent if db is not None else None), ""
    if snap.is_file():
        try:
            if snapshot_info(snap).get("extra", {}).get("session_id") not in (None, sid):
                raise SnapshotError(f"{snap} belongs to another session")
            head = load_snapshot(engine, snap)
            after = int(head.get("extra", {}).get("turns_logged", 0))
            rest = [t for t in log_turns if t.seq > after]
            fed, pending = _replay(engine, rest)
            return ResumeResult("snapshot", sid, fed, len(log_turns), pending)
        except SnapshotError as e:
            note = f"automatic snapshot refused: {e}"
            log.warning("%s; rebuilding from the transcript", note)
    if not log_turns:
        return ResumeResult("empty", sid, note=note)
    engine.clear()
    if info.system is not None:
        engine.conv.system = info.system
    chosen = _newest_that_fit(engine, log_turns)
    fed, pending = _replay(engine, chosen)
    return ResumeResult("rebuild", sid, fed, len(log_turns), pending, note)


def _newest_that_fit(engine: Any, items: list[Turn]) -> list[Turn]:
    """The longest suffix of whole turns that fits the cache (minus the system prompt and room for a reply),
    starting at a non-assistant turn so the replay opens with a prompt, not half an exchange."""
    c = engine.cache_cfg
    system = len(engine.encode(engine.conv.system)) + 8 if engine.conv.system else 0
    budget = c.capacity - max(system, c.n_sink) - min(engine.sampling.max_tokens, c.capacity // 4)
    used, start = 0, len(items)
    for i in range(len(items) - 1, -1, -1):
        used += len(engine.encode(items[i].text)) + 8  # + template tokens (role header, end marker)
        if used > budget:
            break
        start = i
    while start < len(items) and items[start].role == "assistant":
        start += 1
    return items[start:]


def _replay(engine: Any, items: list[Turn]) -> tuple[int, str | None]:
    """Feed logged turns as the live session did: prompts through the chat template, replies as generated text.
    A trailing prompt without a reply is returned as pending instead of being fed."""
    pending = None
    if items and items[-1].role != "assistant":
        pending, items = items[-1].text, items[:-1]
    for i, t in enumerate(items):
        if t.role == "assistant":
            for _ in engine.feed(t.text):
                pass
            engine.conv.add_reply(t.text)
        else:
            nxt_is_reply = i + 1 < len(items) and items[i + 1].role == "assistant"
            for _ in engine.add_message(t.role, t.text, add_generation_prompt=nxt_is_reply):
                pass
    return len(items), pending
