"""The folders a snapshot's recall memory is saved in, beside the snapshot: `<stem>.memory-<8 hex>`. Light (no
torch): `sinkchat logs rm` removes a session's automatic snapshot and its memory folder without loading a model."""

from __future__ import annotations

import re
import secrets
import shutil
from pathlib import Path


def new_folder(snapshot: Path) -> Path:
    """A fresh folder name beside `snapshot` for its memory (a new tag each save: the old folder stays valid until
    the snapshot file that names it is replaced)."""
    return snapshot.with_name(f"{snapshot.stem}.memory-{secrets.token_hex(4)}")


def prune(snapshot: Path, keep: str | None) -> None:
    """Remove the memory folders of earlier saves of `snapshot` (all but `keep`): exactly `<stem>.memory-<8 hex>`,
    never by a glob (`zed.memory-*` also matched `zed.memory-1.memory-f8d1f6bc`, another session's memory, and a
    stem holding "[" or "*" is a pattern of its own)."""
    own = re.compile(re.escape(snapshot.stem) + r"\.memory-[0-9a-f]{8}")
    for d in snapshot.parent.iterdir() if snapshot.parent.is_dir() else ():
        if d.name != keep and own.fullmatch(d.name) and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)
