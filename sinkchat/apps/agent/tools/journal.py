"""The undo journal: every change a tool makes to a workspace file is recorded with the file's previous content first,
so `sinkchat agent --undo [N]` can put the last N changes back.

Where: `<data dir>/agent-journal/<sha256 of the workspace's resolved path, 16 hex>/`, with a `workspace.txt`
naming the folder. Not a hidden folder in the workspace: there the model's own tools could read it (search_text
would find the text a user undid), the grammar would offer its files as paths, a shell call could delete it, and
the user's `git add .` or backup would pick it up. The price: a workspace moved to another path starts a new
journal (its old one stays under the old path's key).

Crash safety: an entry is written to a temporary file, flushed and fsynced, then linked under its final name
(`os.link` fails if that name exists, so two agents on one workspace never overwrite each other's entry) and the
folder fsynced. A crash leaves either no entry or a whole one; a stray temporary file is ignored. The entry is
written before the file is changed: a crash in between leaves an entry whose file is still as before, which undo
recognizes and drops. Undo restores a file the same way (temporary file in its folder, then `os.replace`) and
removes the entry only after that, so an interrupted undo can simply be run again.

Size: an entry holds the whole previous content of its file (so an append to a big file costs that file again).
The journal is capped per workspace: after each record the oldest entries are pruned while there are more than
MAX_ENTRIES (1,000) or they hold more than MAX_JOURNAL_BYTES (256 MiB) together; a pruned change can no longer be
undone. Undo of N changes reads only the newest N entries.

Undo refuses to touch a file that changed after the agent's write (its SHA-256 is recorded) into anything but its
previous content: that would destroy the user's later edit; it stops there and says which entry to remove by hand.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import stat
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from sinkchat.store.atomic import atomic_write, fsync_dir, write_synced

log = logging.getLogger(__name__)

MAX_PREVIOUS_BYTES = 32 * 1024 * 1024  # a bigger file is not overwritten: it could not be restored cheaply
MAX_ENTRIES = 1000  # entries kept per workspace (the oldest are pruned past it)
MAX_JOURNAL_BYTES = 256 * 1024 * 1024  # bytes of entries kept per workspace (likewise)
VERSION = 1


class JournalError(Exception):
    """The journal cannot record or restore (unwritable data dir, a file changed since): one line for the user."""


@dataclass(frozen=True)
class Entry:
    seq: int
    op: str  # "write" (a new file), "overwrite", "append", "delete"
    path: str  # relative to the workspace
    existed: bool
    previous: bytes | None  # the content before the change (None: the file did not exist)
    mode: int | None
    after_sha256: str | None  # the file's content right after the change (None: deleted)
    time: float
    file: Path  # the entry's own file


def journal_dir_for(root: Path) -> Path:
    from sinkchat.config import data_dir

    key = hashlib.sha256(str(root).encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return data_dir() / "agent-journal" / key


class Journal:
    """The journal of one workspace (`root`: its resolved path). `directory`: where entries live (default: under the
    user data dir, keyed by `root`)."""

    def __init__(self, root: Path, directory: Path | None = None) -> None:
        self.root = root
        self.dir = directory or journal_dir_for(root)

    # ------------------------------------------------------------------------------------------------- record
    def record(self, real: Path, op: str, after: bytes | None) -> Entry:
        """Record the change `op` about to be made to `real` (inside the workspace): its current content is saved.
        `after`: what the file will hold (None: it will be deleted). Raises JournalError; then change nothing."""
        previous, mode = _read_previous(real)
        rel = str(real.relative_to(self.root))
        body = {"v": VERSION, "op": op, "path": rel, "existed": previous is not None, "time": time.time(),
                "previous": None if previous is None else base64.b64encode(previous).decode("ascii"), "mode": mode,
                "after_sha256": None if after is None else hashlib.sha256(after).hexdigest()}
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            if not (self.dir / "workspace.txt").exists():
                atomic_write(self.dir / "workspace.txt", os.fsencode(self.root) + b"\n")  # any bytes a path has
            tmp = self.dir / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            seq = self._next_seq()
            try:
                while True:
                    body["seq"] = seq
                    write_synced(tmp, json.dumps(body).encode())
                    try:
                        os.link(tmp, self.dir / f"{seq:08d}.json")
                        break
                    except FileExistsError:
                        seq += 1  # another agent took this number first
            finally:
                tmp.unlink(missing_ok=True)
            fsync_dir(self.dir)
        except OSError as e:
            raise JournalError(f"cannot write the undo journal in {self.dir}: {e.strerror or e}") from None
        self._prune()
        log.debug("journal: %s %s (entry %d)", op, rel, seq)
        return _entry(body, self.dir / f"{seq:08d}.json")

    def _prune(self) -> None:
        """Delete the oldest entries past MAX_ENTRIES or MAX_JOURNAL_BYTES: every change stores its file's whole
        previous content, so an unpruned journal would grow without end."""
        paths = self._paths()
        sizes = []
        for p in paths:
            try:
                sizes.append(p.stat().st_size)
            except OSError:
                sizes.append(0)
        total, keep = 0, 0
        for size in reversed(sizes):  # newest first; the newest entry is always kept
            if keep and (keep >= MAX_ENTRIES or total + size > MAX_JOURNAL_BYTES):
                break
            total, keep = total + size, keep + 1
        for p in paths[:len(paths) - keep]:
            p.unlink(missing_ok=True)
            log.info("journal: pruned the oldest entry %s (past %d entries or %d MiB)", p.name, MAX_ENTRIES,
                     MAX_JOURNAL_BYTES >> 20)

    def _paths(self) -> list[Path]:
        """The entry files, oldest first."""
        return sorted(self.dir.glob("[0-9]*.json")) if self.dir.is_dir() else []

    def created(self, rel: str) -> bool:
        """Whether the agent created the file `rel` (relative to the root) in this workspace: a kept entry records
        it as new. An entry of a new file saves no content, so a big entry is skipped unread."""
        for p in reversed(self._paths()):
            try:
                if p.stat().st_size > 64 * 1024:
                    continue
                body = json.loads(p.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                log.warning("journal: skipping unreadable entry %s (%s)", p, e)
                continue
            if isinstance(body, dict) and body.get("path") == rel and body.get("existed") is False:
                return True
        return False

    def _next_seq(self) -> int:
        nums = [int(p.stem) for p in self.dir.glob("*.json") if p.stem.isdigit()]
        return max(nums, default=0) + 1

    # ------------------------------------------------------------------------------------------------- read
    def entries(self, last: int | None = None) -> list[Entry]:
        """Every whole entry (or the newest `last`), oldest first (an unreadable one is skipped with a warning,
        never half-applied). Decoding an entry decodes its saved content: read only what is needed."""
        paths = self._paths()
        out = []
        for p in paths if last is None else paths[-last:] if last > 0 else []:
            try:
                out.append(_entry(json.loads(p.read_text(encoding="utf-8")), p))
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("journal: skipping unreadable entry %s (%s)", p, e)
        return out

    # ------------------------------------------------------------------------------------------------- undo
    def undo(self, n: int = 1) -> Iterator[str]:
        """Restore the last `n` changes, newest first, yielding one line per change restored. Raises JournalError
        (after the ones before it are restored) when a file changed since the agent wrote it."""
        for e in reversed(self.entries(last=n) if n > 0 else []):
            yield self._restore(e)

    def _restore(self, e: Entry) -> str:
        real = self.root / e.path
        current, _ = _read_previous(real)
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.time))
        now = None if current is None else hashlib.sha256(current).hexdigest()
        if current == e.previous:  # already as before (an undo interrupted after restoring, or undone by hand)
            what = f"{e.path} was already as before the agent's {e.op} at {when}"
        elif now != e.after_sha256:
            raise JournalError(f"{e.path} changed after the agent's {e.op} at {when}, so it was not restored (its "
                               f"previous content is in {e.file}; delete that file to undo older changes)")
        elif e.previous is None:
            what = f"removed {e.path} (the agent's {e.op} at {when}; it did not exist before)"
        else:
            what = f"restored {e.path} ({len(e.previous)} bytes) as it was before the agent's {e.op} at {when}"
        try:
            if current != e.previous:
                if e.previous is None:
                    real.unlink()
                else:
                    real.parent.mkdir(parents=True, exist_ok=True)
                    atomic_write(real, e.previous, e.mode)
            e.file.unlink()
            fsync_dir(self.dir)
        except OSError as err:
            raise JournalError(f"cannot restore {e.path}: {err.strerror or err}") from None
        return what


def _entry(body: dict[str, Any], file: Path) -> Entry:
    prev = body["previous"]
    return Entry(int(body["seq"]), str(body["op"]), str(body["path"]), bool(body["existed"]),
                 None if prev is None else base64.b64decode(prev), body.get("mode"), body.get("after_sha256"),
                 float(body["time"]), file)


def _read_previous(real: Path) -> tuple[bytes | None, int | None]:
    """The file's bytes and permission bits, or (None, None) when it does not exist."""
    try:
        st = os.lstat(real)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        raise JournalError(f"cannot read {real.name} for the undo journal: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise JournalError(f"{real.name} is not a regular file")
    if st.st_size > MAX_PREVIOUS_BYTES:
        raise JournalError(f"{real.name} is larger than {MAX_PREVIOUS_BYTES >> 20} MiB: too big to keep for undo")
    try:
        return real.read_bytes(), stat.S_IMODE(st.st_mode)
    except OSError as e:
        raise JournalError(f"cannot read {real.name} for the undo journal: {e.strerror}") from None
