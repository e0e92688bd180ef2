"""The records of a soak run: DIR/metrics.jsonl, written while it runs and read back to judge it.

One JSON object per line, flushed and fsynced as it is written, so a run that was killed keeps every record up to
its last second and `sinkchat soak report DIR` can still judge it; the reader tolerates the torn last line such a
kill can leave.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable

import click

log = logging.getLogger(__name__)


class Recorder:
    """metrics.jsonl (one JSON object per line, flushed + fsynced) and the session log. A failing disk is reported
    once and the run carries on with the records kept in memory (the report is attempted again at the end)."""

    def __init__(self, out_dir: Path, session: Any = None, warn: Callable[[str], None] = log.warning) -> None:
        self.path = out_dir / "metrics.jsonl"
        self.session = session
        self.warn = warn
        self.lost: list[dict[str, Any]] = []
        self.failed = False
        try:
            self.fh: Any = open(self.path, "a", encoding="utf-8")
        except OSError as e:
            self.fh = None
            self._fail(e)

    def _fail(self, e: OSError) -> None:
        if not self.failed:
            self.warn(f"cannot write {self.path}: {e.strerror or e}; keeping records in memory")
        self.failed = True

    def write(self, rec: dict[str, Any]) -> None:
        line = json.dumps(rec, default=str) + "\n"
        if self.fh is not None:
            try:
                self.fh.write(line)
                self.fh.flush()
                os.fsync(self.fh.fileno())
            except OSError as e:
                self._fail(e)
                self.lost.append(rec)
        else:
            self.lost.append(rec)
        if self.session is not None and rec.get("kind") == "sample":
            try:
                self.session.metrics(rec)
                self.session.flush()
            except Exception as e:  # noqa: BLE001 - the log is evidence, never a reason to stop the soak
                log.warning("session log: %s", e)

    def size(self) -> int:
        """Bytes of metrics.jsonl written so far (every record is flushed as it is written): what a checkpoint
        covers."""
        return os.fstat(self.fh.fileno()).st_size if self.fh is not None else 0

    def close(self) -> None:
        for closer in (getattr(self.fh, "close", None), getattr(self.session, "close", None)):
            try:
                if closer:
                    closer()
            except Exception as e:  # noqa: BLE001
                self._fail(e) if isinstance(e, OSError) else log.warning("close: %s", e)


def load_run(directory: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any] | None]:
    """(start record, samples, end record or None). Tolerates a torn last line from a killed writer."""
    path = Path(directory) / "metrics.jsonl"
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as e:
        raise click.ClickException(f"cannot read {path}: {e.strerror}") from None
    header: dict[str, Any] = {}
    samples: list[dict[str, Any]] = []
    end = None
    resumes: list[dict[str, Any]] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            log.warning("%s:%d is not JSON (torn write?); skipped", path, n)
            continue
        kind = rec.get("kind")
        if kind == "start":
            header = rec
        elif kind == "resume":  # `soak resume`: kept with the start record (the report says how often)
            resumes.append(rec)
        elif kind == "sample":
            samples.append(rec)
        elif kind == "end":
            end = rec
    if not header and not samples:
        raise click.ClickException(f"{path} holds no soak records")
    if resumes:
        header = {**header, "resumes": resumes}
    return header, samples, end
