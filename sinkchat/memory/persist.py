"""A recall memory saved beside a snapshot and brought back with it, so a loaded or resumed session recalls what
the saved one did.

Saved: the memory's state (block locations, the index's representatives, the queue of evicted tokens not yet a
block, the last call's queries and choice: everything the next call's choice reads, so a resumed session continues
exactly) as snapshot tensors and JSON, and its segment files in a folder beside the snapshot
(`<name>.memory-<tag>/`, 0700, files 0600). The segments are append-only, so a segment is hard-linked where the
filesystem allows (a save costs no copy; bytes the live session appends later lie past the saved length and are
never read) and copied otherwise. Loading copies the saved lengths into a new store folder of the session: the
snapshot's folder is never written, so it can be loaded again.

Every check runs before the memory is touched (`prepare`, then `commit`): a folder that is missing, short, or whose
records do not start where the state says is refused in one line and the session stays as it was.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sinkchat.memory.blocks import HEADER, Shape
from sinkchat.memory.index import Index
from sinkchat.memory.lexical import Lexicon, rebuild
from sinkchat.memory.store import BlockStore, Where

VERSION = 3  # 3: the lexical prior's block of the last chunk; 2: the index's rule and rows a block saved with it (1:
#               the "far" rule, 4 rows, implied)
READS = (1, 2, 3)  # versions a load takes; an index saved under another rule than this session's is rebuilt; the
#                    lexicon (lexical.py) is always rebuilt from the stored token ids, formats 1-2 load with no block
#                    singled out (as their sessions chose: they had no lexical prior)


class MemoryStateError(ValueError):
    """The saved memory cannot be brought back (the message is one line for the user)."""


# ------------------------------------------------------------------------------------------------ save
def save(memory: Any, folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Link or copy the memory's segments into `folder` (created 0700) and return its state (JSON, tensors)."""
    store = memory.store
    folder.mkdir(parents=True, exist_ok=False, mode=0o700)
    if store._fd is not None:
        os.fsync(store._fd)
    for seg, size in store.sizes.items():
        src, dst = store._path(seg), folder / store._path(seg).name
        try:
            os.link(src, dst)
        except OSError:  # another filesystem, or links not allowed: copy what is written so far
            _copy(src, dst, size)
    head = {
        "version": VERSION, "block": memory.B, "topk": memory.topk, "layers": memory.layers,
        "next_id": memory.next_id, "forgotten": memory.forgotten, "copies": memory.copies, "since": memory.since,
        "after_chunk": memory.after_chunk, "q_pos": memory.q_pos, "chosen": memory.chosen, "held": memory.held,
        "lexical": memory.lexical,
        "born": {str(b): t for b, t in memory.born.items()},
        "blocks": [[bid, w.segment, w.offset, w.size, w.first, w.last, w.n] for bid, w in store.where.items()],
        "segments": {str(s): n for s, n in store.sizes.items()}, "current": store.current,
        "queue": [[len(e[2]), e[2], e[3], e[4]] for e in memory.queue],
        "folder": folder.name,
    }
    tensors: dict[str, torch.Tensor] = {}
    ix = memory.index
    if ix.buf is not None and ix.ids:
        tensors["index"] = ix.buf[:, ix.lo * ix.r : ix.hi * ix.r].contiguous()
        head["index"] = {"ids": ix.ids, "r": ix.r, "shape": list(ix.shape), "rule": memory.rule,
                         "reps": memory.reps}
    if memory.queries is not None:
        tensors["queries"] = memory.queries.contiguous()
    if memory.queue:
        tensors["queue.k"] = torch.cat([e[0] for e in memory.queue], 2).contiguous()
        tensors["queue.v"] = torch.cat([e[1] for e in memory.queue], 2).contiguous()
    return head, tensors


def _copy(src: Path, dst: Path, size: int) -> None:
    with open(src, "rb") as f, open(dst, "wb", opener=lambda p, fl: os.open(p, fl, 0o600)) as g:
        left = size
        while left:
            chunk = f.read(min(left, 1 << 20))
            if not chunk:
                raise MemoryStateError(f"memory segment {src.name} is shorter than its saved length")
            g.write(chunk)
            left -= len(chunk)
        g.flush()
        os.fsync(g.fileno())


# ------------------------------------------------------------------------------------------------ load
@dataclass
class Restored:
    """A saved memory rebuilt in a new store folder, not yet swapped into the live memory."""

    head: dict[str, Any]
    store: BlockStore
    index: Index
    queue: list[tuple[torch.Tensor, torch.Tensor, list[int], list[int], list[int]]]
    queries: torch.Tensor | None
    lexicon: Lexicon


def prepare(memory: Any, head: dict[str, Any], tensors: dict[str, torch.Tensor], snapshot: Path) -> Restored:
    """Check the saved memory against this one and its folder, and copy its segments into a new store folder;
    MemoryStateError (nothing of the live memory touched) if anything does not fit."""
    if head.get("version") not in READS:
        raise MemoryStateError(f"its recall memory has format {head.get('version')!r}; this sinkchat reads "
                               f"{', '.join(map(str, READS))}")
    if head["block"] != memory.B or list(head["layers"]) != memory.layers:
        raise MemoryStateError(f"its recall memory has blocks of {head['block']} tokens over layers "
                               f"{head['layers']}: start with --memory-block {head['block']}")
    folder = snapshot.parent / str(head["folder"])
    if not folder.is_dir():
        raise MemoryStateError(f"its recall memory folder {folder} is missing")
    sizes = {int(s): int(n) for s, n in head["segments"].items()}
    where = {int(b[0]): Where(*map(int, b[1:])) for b in head["blocks"]}
    _check_records(folder, sizes, where)
    store = BlockStore(memory.store.root.with_name(f"{memory.store.root.name}-{secrets.token_hex(3)}"),
                       memory.store.budget, memory.store.bits)
    try:
        for seg, size in sizes.items():
            _copy(folder / store._path(seg).name, store._path(seg), size)
        store.sizes, store.where, store.current = sizes, where, int(head["current"])
        store.continue_current()
    except (OSError, MemoryStateError) as e:
        store.close(remove=True)
        raise MemoryStateError(f"cannot copy its recall memory: {getattr(e, 'strerror', None) or e}") from None
    try:
        index = _index(head, tensors) if _same_rule(memory, head) else _rebuild(memory, store, _dtype(tensors))
        lexicon = _lexicon(store, index.ids)
    except MemoryStateError:
        store.close(remove=True)
        raise
    return Restored(head, store, index, _queue(head, tensors), tensors.get("queries"), lexicon)


def _lexicon(store: BlockStore, ids: list[int]) -> Lexicon:
    """The lexical prior's terms of the restored blocks, from their stored token ids (each block's header and token
    arrays, checked by their CRC: ~1 KB a block read, not its keys)."""
    try:
        return rebuild(Lexicon(), ((bid, store.token_ids(bid).tolist()) for bid in ids))
    except OSError as e:
        raise MemoryStateError(f"its recall memory's token ids cannot be read: {e}") from None


def _same_rule(memory: Any, head: dict[str, Any]) -> bool:
    """Whether the saved index rows are what this memory's rule makes (format 1 saved rule "far", 4 rows)."""
    meta = head.get("index") or {}
    return (meta.get("rule", "far"), int(meta.get("reps", 4))) == (memory.rule, memory.reps)


def _dtype(tensors: dict[str, torch.Tensor]) -> torch.dtype | None:
    """The cache's dtype, which the live memory's index rows have (an 8-bit store reads back fp32 keys)."""
    return next((tensors[k].dtype for k in ("index", "queue.k") if k in tensors), None)


def _rebuild(memory: Any, store: BlockStore, dtype: torch.dtype | None) -> Index:
    """The index of the restored store's blocks made again from their keys under this memory's rule (a session
    saved by an older sinkchat, or under another rule): every block read back whole and checked by its CRCs
    (~1.5 MB a block on the bundled model; an 8-bit store's keys as read back, so rows a little off the ones the
    saved session had made)."""
    ix = Index()
    for bid in list(store.where):
        try:
            block = store.read(bid)
        except OSError as e:
            raise MemoryStateError(f"its recall memory cannot be re-indexed: {e}") from None
        rows = memory.index_rows(block)
        ix.add(bid, rows if dtype is None else rows.to(dtype))
    return ix


def _check_records(folder: Path, sizes: dict[int, int], where: dict[int, Where]) -> None:
    """Every segment at least its saved length, and a block record header where each block is said to start."""
    for seg, size in sizes.items():
        path = folder / f"seg-{seg:06d}.mem"
        if not path.is_file() or path.stat().st_size < size:
            raise MemoryStateError(f"its recall memory segment {path.name} is missing or short")
    for bid, w in where.items():
        if w.segment not in sizes or w.offset + w.size > sizes[w.segment]:
            raise MemoryStateError(f"its recall memory lists block {bid} outside its segments")
    for seg in sizes:
        with open(folder / f"seg-{seg:06d}.mem", "rb") as f:
            for bid, w in ((b, w) for b, w in where.items() if w.segment == seg):
                try:
                    sh = Shape.of(os.pread(f.fileno(), HEADER.size, w.offset))
                except Exception:  # noqa: BLE001 - struct.error or ValueError: not a record there
                    sh = None
                if sh is None or sh.bid != bid or sh.n != w.n:
                    raise MemoryStateError(f"its recall memory has no block {bid} where it says")


def _index(head: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Index:
    ix = Index()
    meta = head.get("index")
    if meta and "index" in tensors:
        buf = tensors["index"]
        ix.buf, ix.lo, ix.hi, ix.r = buf.clone(), 0, len(meta["ids"]), int(meta["r"])
        ix.shape, ix.ids = tuple(meta["shape"]), [int(i) for i in meta["ids"]]
        if buf.shape[1] != ix.hi * ix.r:
            raise MemoryStateError("its recall memory's index does not match its blocks")
    return ix


def _queue(head: dict[str, Any], tensors: dict[str, torch.Tensor]) -> list[Any]:
    out, at = [], 0
    for n, ids, abs_, slots in head["queue"]:
        k, v = tensors["queue.k"][:, :, at : at + n], tensors["queue.v"][:, :, at : at + n]
        out.append((k.clone(), v.clone(), list(ids), list(abs_), list(slots)))
        at += n
    return out


def commit(memory: Any, r: Restored, cache: Any) -> None:
    """Swap the restored state into the live memory (plain assignments after the old store is removed)."""
    h = r.head
    memory.store.close(remove=True)
    memory.store, memory.index, memory.queue, memory.queries = r.store, r.index, r.queue, r.queries
    memory.slices.clear()
    memory.next_id, memory.forgotten, memory.q_pos = int(h["next_id"]), int(h["forgotten"]), int(h["q_pos"])
    memory.copies = int(h.get("copies", 0))  # saved before blocks were read again: none
    memory.since, memory.after_chunk, memory.held = int(h["since"]), bool(h["after_chunk"]), int(h.get("held", 0))
    memory.chosen = [[int(b) for b in c] for c in h["chosen"]]
    memory.lexicon = r.lexicon
    lexical = h.get("lexical")  # formats 1-2: none (their sessions had no lexical prior)
    memory.lexical = int(lexical) if lexical is not None and int(lexical) in r.lexicon.blocks else None
    if int(h["topk"]) != memory.topk:  # another top-k: choose again at the next call
        memory.since = memory.every
    memory.born = {int(b): float(t) for b, t in h["born"].items()}
    memory.recalled = {}
    memory.placed = [() for _ in memory.layers]
    memory.queue_placed = ()
    for i in memory.layers:
        cache.layers[i].used = 0
