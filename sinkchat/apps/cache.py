"""`sinkchat cache`: list and clean the model cache (`models/` and `tokenizers/` under the user cache dir).

A converted GGUF's folder is keyed by the file's content and shared by every environment of the user
(`sinkchat.model.gguf_convert`), so nothing here needs to know which environment made an entry. What can pile up:
folders of the older path-keyed layout (one per environment and copy of a file: 4 x 101 MB of the bundled model
were found), folders of another VERSION, a conversion's temp dir left by a killed process, entries whose every
source file is gone or changed (orphans), and tokenizer folders no current entry was built from. The compiled
kernels and inductor's files in the same cache dir are not models and are left alone.
"""

from __future__ import annotations

import fcntl
import json
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click

from sinkchat.config import cache_dir
from sinkchat.model import gguf_convert, gguf_file

# statuses; `clean` removes the REMOVABLE ones (and, with --older-than, "ok" entries unused that long)
OK, ORPHAN, OLD, PARTIAL, UNUSED, BUSY = "ok", "orphan", "old layout", "partial", "unused", "converting"
FOREIGN = "not sinkchat's"  # a folder sinkchat did not make (SINKCHAT_CACHE_DIR may be a folder of the user's): never removed
REMOVABLE = (ORPHAN, OLD, PARTIAL, UNUSED)
KEPT = (BUSY, FOREIGN)  # never removed, even with --all
OLD_NAME = re.compile(r".+-[0-9a-f]{20}")  # the path-keyed layout before content keys: `<stem>-<20 hex>`
OURS = re.compile(r"gguf-v[0-9]+-[0-9a-f]{20}")  # a content-keyed folder of this or another version
FIRST_MARKER = "sinkchat-converted.json"  # the marker of the first layout (`{stem}-{20 hex}`, model.safetensors)
TEMP = (".convert-", ".trash-")  # a conversion's temp dir, a removal's folder renamed away
FRESH_S = 3600  # a tokenizer folder younger than this may belong to a conversion still running: never "unused"


@dataclass
class Entry:
    path: Path
    status: str
    size: int  # bytes
    last_use: float  # newest mtime in the folder: the marker is touched at every use
    name: str = ""  # the model's general.name, where recorded
    sources: list[str] = field(default_factory=list)  # every path it was used from (the newest last)
    live: list[str] = field(default_factory=list)  # those that still hold the content it was made from

    @property
    def label(self) -> str:
        return f"{self.path.parent.name}/{self.path.name}"


def _size_and_mtime(path: Path) -> tuple[int, float]:
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    stats = [p.stat() for p in files if p.exists()]
    return sum(s.st_size for s in stats), max((s.st_mtime for s in stats), default=path.stat().st_mtime)


def _holds(source: str, key: str) -> bool:
    """Whether the file at `source` still has the content the entry was made from (a scan and a key: ~0.03 s)."""
    try:
        return gguf_file.content_key(gguf_file.scan(Path(source))) == key
    except (OSError, gguf_file.GGUFError):
        return False


def _held(entry: Path) -> bool:
    """Whether a process holds the entry's lock now (probed without creating a lock file)."""
    try:
        with open(entry.parent / f".{entry.name}.lock") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # no lock file: nobody is converting it
        return False
    return False


def _sinkchat_made(path: Path) -> bool:
    """Whether sinkchat made this folder of `models/`: its temp dirs, a content-keyed folder with its marker, or a
    path-keyed folder of the older layout with that layout's marker and tensor table. Nothing else is touched."""
    if path.name.startswith(TEMP):
        return True
    marker = gguf_convert.read_marker(path)
    if marker is not None and isinstance(marker.get("version"), int) and OURS.fullmatch(path.name):
        return True
    if not OLD_NAME.fullmatch(path.name):
        return False
    if marker is not None:  # sinkchat 0.x's GGUF folder: config, tokenizer and tensor table
        return "source" in marker and isinstance(marker.get("version"), int) and (path / gguf_convert.TABLE).is_file()
    first = _old_marker(path)  # the first layout: the whole model converted to safetensors
    return first is not None and "source" in first and (path / "config.json").is_file()


def _old_marker(path: Path) -> dict | None:
    return gguf_convert.read_json(path / FIRST_MARKER)


def _model_entry(path: Path) -> Entry:
    if not _sinkchat_made(path):  # not walked either: it may be a large tree of the user's
        return Entry(path, FOREIGN, -1, path.stat().st_mtime)
    size, mtime = _size_and_mtime(path)
    marker = gguf_convert.read_marker(path) or _old_marker(path) or {}
    sources = marker.get("sources") or ([marker["source"]] if marker.get("source") else [])
    entry = Entry(path, OLD, size, mtime, marker.get("name", ""), sources)
    if path.name.startswith(".convert-"):  # `.convert-<entry>-<random>`: busy while that entry's lock is held
        owner = path.parent / path.name.removeprefix(".convert-").rsplit("-", 1)[0]
        unknown = not owner.name.startswith(gguf_convert.PREFIX)  # an older sinkchat's `.convert-<random>`
        entry.status = BUSY if _held(owner) or (unknown and time.time() - mtime < FRESH_S) else PARTIAL
    elif path.name.startswith(".trash-"):  # a removal interrupted between its rename and its delete
        entry.status = PARTIAL
    elif path.name.startswith(gguf_convert.PREFIX):
        key = path.name.removeprefix(gguf_convert.PREFIX)
        if not gguf_convert.is_done(path):
            entry.status = PARTIAL
        else:
            entry.live = [s for s in sources if _holds(s, key)]
            entry.status = OK if entry.live else ORPHAN
    return entry


def entries() -> list[Entry]:
    """Every folder of the model cache, classified; models first, then tokenizers."""
    models, out = gguf_convert.models_dir(), []
    if models.is_dir():
        out += [_model_entry(p) for p in sorted(models.iterdir()) if p.is_dir()]
    used = set()
    for e in out:
        if e.status == OK:  # an orphan's tokenizer goes with it
            used.add((gguf_convert.read_marker(e.path) or {}).get("tokenizer"))
    tokenizers = cache_dir() / "tokenizers"
    if tokenizers.is_dir():
        for p in sorted(q for q in tokenizers.iterdir() if q.is_dir()):
            if not (p / gguf_convert.MARKER).is_file():  # sinkchat writes its marker into every tokenizer folder
                out.append(Entry(p, FOREIGN, -1, p.stat().st_mtime))
                continue
            size, mtime = _size_and_mtime(p)
            fresh = time.time() - mtime < FRESH_S
            out.append(Entry(p, OK if p.name in used or fresh else UNUSED, size, mtime))
    return out


def to_remove(found: list[Entry], everything: bool, older_than_days: float | None) -> list[Entry]:
    """What `clean` removes: the removable statuses, plus ok entries unused for `older_than_days`; or, with
    `everything`, all but a conversion in progress. A folder sinkchat did not make is never removed."""
    cutoff = time.time() - older_than_days * 86400 if older_than_days is not None else None
    return [e for e in found if e.status not in KEPT and (
        everything or e.status in REMOVABLE or (cutoff is not None and e.last_use < cutoff))]


def remove(entry: Entry) -> bool:
    """Rename the folder away first (a process that finds it a moment later converts again, rather than reading a
    half-deleted folder), then delete it and its lock file. False, with nothing removed, when another process holds
    the entry's lock: converting it, or loading it (`gguf_convert.reading` holds it shared)."""
    if entry.status in KEPT:
        return False
    with gguf_convert.locked(entry.path, wait=False) as free:
        if not free:
            return False
        trash = entry.path.with_name(f".trash-{entry.path.name}-{time.time_ns()}")
        entry.path.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)
        gguf_convert.lock_path(entry.path).unlink(missing_ok=True)
    return True


def stale_locks() -> list[Path]:
    """Lock files of folders that no longer exist and that nobody holds (0 bytes each; tidied by `clean`)."""
    models = gguf_convert.models_dir()
    if not models.is_dir():
        return []
    owners = {p: models / p.name[1:].removesuffix(".lock") for p in models.glob(".*.lock")}
    ours = {lock: owner for lock, owner in owners.items()  # only the lock files of names sinkchat gives
            if owner.name.startswith(TEMP) or OURS.fullmatch(owner.name) or OLD_NAME.fullmatch(owner.name)}
    return [lock for lock, owner in ours.items() if not owner.exists() and not _held(owner)]


def _mb(n: int) -> str:
    if n < 0:  # a folder not sinkchat's: not measured
        return "-"
    return f"{n / 1e6:,.1f} MB" if n < 10**8 else f"{n / 1e6:,.0f} MB"


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


def format_entries(found: list[Entry]) -> str:
    w = min(60, max(len(e.label) for e in found))
    lines = [f"{'ENTRY':{w}}  {'SIZE':>9}  {'LAST USE':16}  {'STATUS':10}  SOURCE"]
    for e in found:
        src = ([*e.sources, *e.live] or ["-" if e.path.parent.name == "models" else "(tokenizer)"])[-1]
        more = f" (+{len(e.sources) - 1} more)" if len(e.sources) > 1 else ""
        name = e.label if len(e.label) <= w else e.label[:w - 3] + "..."
        lines.append(f"{name:{w}}  {_mb(e.size):>9}  {_when(e.last_use):16}  {e.status:10}  {src}{more}")
    return "\n".join(lines)


@click.group("cache", invoke_without_command=True)
@click.pass_context
def cache_command(ctx: click.Context) -> None:
    """The model cache (converted GGUFs, keyed by content and shared by all your environments). `cache list`
    (the default) shows each entry; `cache clean` removes old-layout, half-written, orphaned and unused ones."""
    if ctx.invoked_subcommand is None:
        ctx.invoke(list_command)


@cache_command.command("list")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def list_command(as_json: bool) -> None:
    """Each entry: size, last use, status (ok; orphan: no file with its content is where it was seen; old layout:
    from an older sinkchat; partial: a conversion that did not finish; unused: a tokenizer no entry needs; not sinkchat's: a folder sinkchat
    did not make, never removed)."""
    found = entries()
    if as_json:
        click.echo(json.dumps([{**asdict(e), "path": str(e.path)} for e in found], indent=1))
        return
    if not found:
        click.echo(f"the model cache is empty ({cache_dir()})")
        return
    freed = sum(e.size for e in to_remove(found, False, None))
    click.echo(format_entries(found))
    total = _mb(sum(e.size for e in found if e.status != FOREIGN))
    click.echo(f"\n{len(found)} entries, {total} in {cache_dir()}; "
               + (f"`sinkchat cache clean` would free {_mb(freed)}" if freed else "nothing to clean"))


@cache_command.command("clean")
@click.option("--dry-run", "-n", is_flag=True, help="only say what would be removed")
@click.option("--all", "everything", is_flag=True, help="remove every entry (each model converts again when next used)")
@click.option("--older-than", "older_than", type=click.FloatRange(0, None), default=None, metavar="DAYS",
              help="also remove entries not used for DAYS days")
def clean_command(dry_run: bool, everything: bool, older_than: float | None) -> None:
    """Remove old-layout, half-written and orphaned entries and unused tokenizers (a conversion running now is
    left alone)."""
    gone = []
    for e in to_remove(entries(), everything, older_than):
        if not dry_run and not remove(e):  # one entry in use must not stop the rest
            click.echo(f"skipped {e.label}: in use by another sinkchat (loading or converting it)")
            continue
        gone.append(e)
        click.echo(f"{'would remove' if dry_run else 'removed'} {e.label} ({_mb(e.size)}, {e.status})")
    if not dry_run:
        for lock in stale_locks():
            lock.unlink(missing_ok=True)
    total = _mb(sum(e.size for e in gone))
    click.echo(f"{'would free' if dry_run else 'freed'} {total}" if gone else "nothing to remove")
