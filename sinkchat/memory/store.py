"""The recall memory's blocks on disk: append-only segment files, one record per block, each checksummed.

Why segments: the budget removes the oldest blocks; an append-only file cannot shrink at its front, a folder of
segments can (the oldest segment is deleted whole). A record is written with one `os.write` of its header and
payload, so a process killed mid-write leaves at most that one record short: reading it back fails its length or
its CRC32 and it is reported, never used. The folder is the user's alone (0700) and removed with the session.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sinkchat.memory.blocks import HEADER, Block, Shape, layer_of, tokens_of
from sinkchat.memory.sweep import claim
from sinkchat.private import private_dir

log = logging.getLogger(__name__)

SEGMENTS = 8  # a segment holds about budget / SEGMENTS bytes: the budget is met to within one segment


@dataclass(frozen=True)
class Where:
    """A stored block: its segment, offset and record size, and the stream range it holds."""

    segment: int
    offset: int
    size: int
    first: int
    last: int
    n: int


class StoreError(OSError):
    """A block that cannot be read back (its segment gone, or the record damaged)."""


class BlockStore:
    """Blocks of one session under `root`, at most `budget` bytes on disk (the oldest segments go first)."""

    def __init__(self, root: Path, budget: int, bits: int = 16) -> None:
        self.root = Path(root)
        os.chmod(private_dir(self.root), 0o700)  # the folders it makes above too (mkdir(parents=True): 0755)
        claim(self.root)  # so that a store this process leaves behind (killed) can be swept (sweep.py)
        self.budget, self.bits = budget, bits  # bits: how records are written (8: int8 keys / values)
        self.segment_bytes = max(1, budget // SEGMENTS)
        self.where: dict[int, Where] = {}  # block id -> location, oldest first
        self.sizes: dict[int, int] = {}  # segment -> bytes written
        self.current = 0
        self._fd: int | None = None

    def _path(self, segment: int) -> Path:
        return self.root / f"seg-{segment:06d}.mem"

    @property
    def disk_bytes(self) -> int:
        return sum(self.sizes.values())

    def append(self, block: Block) -> list[tuple[int, Where]]:
        """Write `block`; returns what the budget pushed out to make room (the blocks of the oldest segments).
        OSError (disk full, ...) propagates: the caller reports the block forgotten."""
        record = block.encode(self.bits)
        if len(record) > self.budget:
            raise OSError(errno.EFBIG, f"one block ({len(record)} bytes) exceeds the memory budget")
        dropped: list[tuple[int, Where]] = []
        while self.sizes and self.disk_bytes + len(record) > self.budget:
            dropped += self._drop_oldest()
        if self._fd is None or self.sizes.get(self.current, 0) + len(record) > self.segment_bytes:
            self._roll()
        assert self._fd is not None
        offset = self.sizes[self.current]
        try:
            written = os.write(self._fd, record)
        except OSError:
            os.ftruncate(self._fd, offset)  # nothing half-written stays behind a later record
            raise
        if written != len(record):
            os.ftruncate(self._fd, offset)
            raise OSError(errno.ENOSPC, "short write to the memory store")
        self.sizes[self.current] = offset + len(record)
        self.where[block.id] = Where(self.current, offset, len(record), block.first, block.last, block.n)
        return dropped

    def continue_current(self) -> None:
        """Append the next block to the current segment, as the session this store was restored from would have
        (persist.prepare: its segments copied into this folder). Rolled over instead, the segments' boundaries, and
        so which blocks the budget drops together, differed from the saved session's: a resumed soak forgot other
        tokens than an uninterrupted one."""
        if self._fd is None and self.current in self.sizes:
            self._fd = os.open(self._path(self.current), os.O_WRONLY | os.O_APPEND)

    def _roll(self) -> None:
        """Start a new segment file (readable by the user alone)."""
        if self._fd is not None:
            os.close(self._fd)
        self.current += 1
        self._fd = os.open(self._path(self.current), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        self.sizes[self.current] = 0

    def _drop_oldest(self) -> list[tuple[int, Where]]:
        """Delete the oldest segment; return its blocks (id, where)."""
        seg = min(self.sizes)
        gone = [(b, w) for b, w in self.where.items() if w.segment == seg]
        for bid, _ in gone:
            del self.where[bid]
        if seg == self.current and self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._path(seg).unlink(missing_ok=True)
        del self.sizes[seg]
        return gone

    def read(self, bid: int) -> Block:
        """Block `bid` from disk, checked (StoreError: gone, short or failing its checksum)."""
        w = self.where.get(bid)
        if w is None:
            raise StoreError(f"block {bid} is not in the store")
        try:
            with open(self._path(w.segment), "rb") as f:
                f.seek(w.offset)
                raw = f.read(w.size)
        except OSError as e:
            raise StoreError(f"block {bid}: {e.strerror}") from None
        if len(raw) != w.size:
            raise StoreError(f"block {bid} is short ({len(raw)} of {w.size} bytes)")
        try:
            return Block.decode(raw[: HEADER.size], raw[HEADER.size :])
        except (ValueError, Exception) as e:  # struct.error, a bad shape: the record is damaged either way
            raise StoreError(f"block {bid}: {e}") from None

    def read_layers(self, bid: int, layers: list[int]) -> tuple[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
        """Block `bid`'s keys and values [H_kv, n, D] in the memory layers `layers` alone, each checked against its
        own CRC, and the position its keys sit at (StoreError: gone, short or failing a checksum)."""
        _, slots, out = self._read_part(bid, layers)
        return int(slots[0]), out

    def token_ids(self, bid: int) -> np.ndarray:
        """Block `bid`'s token ids, from its header and token arrays alone (checked by their CRC): what `/recall`
        shows, without reading the ~1.5 MB of keys and values."""
        return self._read_part(bid, [])[0]

    def _read_part(self, bid: int, layers: list[int]) -> tuple[np.ndarray, np.ndarray, dict[int, Any]]:
        """(token ids, slots, {layer: (keys, values)}) of block `bid`, reading only the layers asked for."""
        w = self.where.get(bid)
        if w is None:
            raise StoreError(f"block {bid} is not in the store")
        try:
            with open(self._path(w.segment), "rb") as f:
                head = os.pread(f.fileno(), HEADER.size, w.offset)
                sh = Shape.of(head)
                meta = os.pread(f.fileno(), sh.meta, w.offset + HEADER.size)
                _, ids, slots, crcs = tokens_of(sh, meta)
                out = {i: layer_of(sh, os.pread(f.fileno(), sh.chunk, w.offset + sh.layer_at(i)), crcs[i], i)
                       for i in layers}
        except OSError as e:
            raise StoreError(f"block {bid}: {e.strerror}") from None
        except (ValueError, IndexError, Exception) as e:  # noqa: BLE001 - struct.error, a bad shape: damaged
            raise StoreError(f"block {bid}: {e}") from None
        return ids, slots, out

    def forget(self, bid: int) -> None:
        """Stop listing a block (damaged on read): its bytes stay counted until its segment goes."""
        self.where.pop(bid, None)

    def close(self, remove: bool = True) -> None:
        """Close the open segment; remove the folder (the session's memory goes with the session)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)
            self.where.clear()
            self.sizes.clear()


def scan(root: Path) -> tuple[list[Block], str | None]:
    """Every intact block under `root` in write order, and a one-line note on a damaged tail (a record cut by a
    kill, or failing its checksum), or None. Reading stops at the first bad record of a segment."""
    blocks: list[Block] = []
    note = None
    for path in sorted(Path(root).glob("seg-*.mem")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            head = data[at : at + HEADER.size]
            try:
                size = HEADER.unpack(head)[8] if len(head) == HEADER.size else -1
                if size < 0 or at + HEADER.size + size > len(data):
                    raise ValueError(f"a record cut short at byte {at}")
                blocks.append(Block.decode(head, data[at + HEADER.size : at + HEADER.size + size]))
            except Exception as e:  # noqa: BLE001 - any damage ends this segment's readable part
                note = f"memory store {path.name}: {e}; {len(data) - at} bytes after it dropped"
                break
            at += HEADER.size + size
    return blocks, note
