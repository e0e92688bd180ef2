"""Checkpoints of a soak run: a run killed mid-way (kill -9, a reboot, a machine lent for shorter sessions than the
run) goes on with `sinkchat soak resume DIR` from its last checkpoint instead of starting over.

Every `--checkpoint-every` seconds of the soak's own clock (default 10 min), at a step boundary and right after a
sample, the run writes DIR/checkpoint/<n>/: the engine's snapshot (cache, ledger, conversation, sampler state, and
the recall memory's state with its segments hard-linked beside it: store/snapshot.py, memory/persist.py), a copy of
the agent's workspace, and, in the snapshot's checksummed header, everything else the run needs to go on as if it
had not stopped: the settings, the runner's counts and clock, the scenario's and the recall probe's state (their
random generators included), the session log's id and how many bytes of metrics.jsonl the checkpoint covers. Then
DIR/checkpoint/current names it (written to a temp file and renamed: a kill mid-checkpoint leaves the previous one
in force) and the older ones are removed.

Resuming loads all of that into a fresh process and moves the records written after the checkpoint (work that is
done again) to metrics.discarded.jsonl; a `resume` record says how many seconds of work that was. The soak's clock
(`elapsed`, the --duration) counts the run's own time only, not the time it lay stopped; every sample carries its
`segment` (0 before the first resume), so the RSS criterion compares samples of one process only. Resumed, an agent
soak continues its task sequence, its planted facts and its memory exactly where the checkpoint left them.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from sinkchat.errors import UserError
from sinkchat.memory import sweep
from sinkchat.store.atomic import atomic_write, fsync_tree

log = logging.getLogger(__name__)

CHECKPOINT_EVERY = 600.0  # seconds of soak time between checkpoints: what a kill can cost at most (besides a step)
POINTER = "current"


class CheckpointError(UserError):
    """A run directory that cannot be resumed (the message is one line for the user)."""


def rng_state(rng: random.Random) -> list[Any]:
    """A random.Random's state as JSON."""
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def set_rng_state(rng: random.Random, state: list[Any]) -> None:
    rng.setstate((state[0], tuple(state[1]), state[2]))


def save(out: Path, engine: Any, state: dict[str, Any], workspace: Path | None) -> Path:
    """Write checkpoint n+1 of the run in `out` (see the module docstring) and make it the current one; returns its
    folder. SnapshotError / OSError on a failed write, the previous checkpoint still in force."""
    from sinkchat.store.snapshot import save_snapshot

    root = out / "checkpoint"
    root.mkdir(exist_ok=True, mode=0o700)
    seq = (current_seq(out) or 0) + 1
    folder = root / f"{seq:06d}"
    shutil.rmtree(folder, ignore_errors=True)  # a torn earlier attempt at this number
    folder.mkdir(mode=0o700)
    try:
        if workspace is not None and workspace.is_dir():
            shutil.copytree(workspace, folder / "workspace", symlinks=True)
            fsync_tree(folder / "workspace")  # on disk before the pointer names this checkpoint
        save_snapshot(engine, folder / "engine.safetensors", extra={"soak": state})
        atomic_write(root / POINTER, json.dumps({"seq": seq}).encode())
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    for old in root.iterdir():  # the earlier checkpoints (the current one is complete and named)
        if old.is_dir() and old.name != folder.name:
            shutil.rmtree(old, ignore_errors=True)
    log.info("soak checkpoint %d at %.0f s", seq, state["runner"]["elapsed"])
    return folder


def current_seq(out: Path, strict: bool = False) -> int | None:
    """The current checkpoint's number (None: none yet); `strict`: a pointer that is there but unreadable is a
    CheckpointError, not "none"."""
    path = out / "checkpoint" / POINTER
    try:
        return int(json.loads(path.read_text())["seq"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        if strict:
            raise CheckpointError(f"{path} is damaged ({e}); the checkpoint folders beside it are kept") from None
        return None


def load(out: Path) -> tuple[Path, dict[str, Any]]:
    """The current checkpoint's folder and its soak state (verified: the snapshot's checksum covers it), or a
    CheckpointError saying why the run cannot be resumed."""
    from sinkchat.store.snapshot import SnapshotError, snapshot_info

    seq = current_seq(out, strict=True)
    if seq is None:
        raise CheckpointError(f"{out} has no soak checkpoint to resume from (runs take one every "
                              f"{CHECKPOINT_EVERY / 60:g} min of soak time unless --checkpoint-every 0 or the input "
                              "is stdin)")
    folder = out / "checkpoint" / f"{seq:06d}"
    try:
        state = snapshot_info(folder / "engine.safetensors")["extra"]["soak"]
    except SnapshotError as e:
        raise CheckpointError(f"the checkpoint cannot be read: {e}") from None
    except (KeyError, TypeError):
        raise CheckpointError(f"{folder} is a snapshot, not a soak checkpoint") from None
    return folder, state


def restore_workspace(folder: Path, workspace: Path) -> None:
    """The workspace as it was at the checkpoint: what the tasks after it wrote is work that is done again."""
    saved = folder / "workspace"
    if not saved.is_dir():
        return
    shutil.rmtree(workspace, ignore_errors=True)
    shutil.copytree(saved, workspace, symlinks=True)


def cut_records(out: Path, size: int) -> tuple[int, float | None]:
    """Move metrics.jsonl's records past byte `size` (written after the checkpoint) to metrics.discarded.jsonl;
    returns how many there were and the last elapsed among them (None: none)."""
    path = out / "metrics.jsonl"
    with open(path, "rb+") as f:
        f.seek(size)
        tail = f.read()
        if tail:
            tail = tail if tail.endswith(b"\n") else tail + b"\n"
            with open(out / "metrics.discarded.jsonl", "ab+") as d:
                d.seek(max(0, d.seek(0, os.SEEK_END) - len(tail)))
                if d.read() != tail:  # not there yet (a resume killed right after moving it: not twice)
                    d.write(tail)
                    d.flush()
                    os.fsync(d.fileno())
            f.truncate(size)
            f.flush()
            os.fsync(f.fileno())
    n, last = 0, None
    for line in tail.decode("utf-8", "replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        n += 1
        last = rec.get("elapsed", last)
    return n, last


def settings_from(d: dict[str, Any]) -> Any:
    """The run's Settings from their recorded dict (asdict)."""
    from sinkchat.config import CacheConfig, MemoryConfig, ModelConfig, SamplingConfig, Settings

    try:
        return Settings(model=ModelConfig(**d["model"]), cache=CacheConfig(**d["cache"]),
                        sampling=SamplingConfig(**d["sampling"]), gauge_every=int(d["gauge_every"]),
                        memory=MemoryConfig(**d["memory"]))
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"the checkpoint's settings do not fit this sinkchat: {e}") from None


COUNTS = ("steps", "errors", "faults", "attempts", "faulted_steps", "jobs", "jobs_ok", "evicted0", "mem_peak")


def runner_state(soak: Any) -> dict[str, Any]:
    """The runner's clock and running counts (runner.Soak), for a checkpoint."""
    return {"elapsed": time.monotonic() - soak.t0, "tokens": soak.tokens, "segment": soak.segment,
            "calls": dict(soak.calls), "calls_at_sample": dict(soak.calls_at_sample),
            "fault_kinds": dict(soak.fault_kinds), **{k: getattr(soak, k) for k in COUNTS}}


def load_runner_state(soak: Any, d: dict[str, Any]) -> None:
    """A fresh runner continues a checkpointed one: its clock goes on from the checkpoint's elapsed seconds (the
    time the run lay stopped is not soak time), its token count from the checkpoint's, its samples in segment + 1."""
    now = time.monotonic()
    soak.t0 = now - float(d["elapsed"])
    soak.last_checkpoint, soak.next_sample = now, now + soak.sample_every
    if soak.tally is not None:
        soak.tokens0 = soak.tally.tokens - int(d["tokens"])
    else:
        soak.processed = int(d["tokens"])
    for k in COUNTS:
        setattr(soak, k, int(d[k]))
    soak.calls, soak.calls_at_sample = dict(d["calls"]), dict(d["calls_at_sample"])
    soak.fault_kinds = dict(d["fault_kinds"])
    soak.segment = int(d["segment"]) + 1


def lock_run(out: Path) -> Any:
    """Hold DIR/.lock for this process's life (released by the kernel however the process ends, kill -9 too), so
    two processes never run one directory: a second resume would cut the first one's records and replace its
    workspace. CheckpointError naming the holder otherwise. Returns the open lock file (keep it referenced)."""
    try:
        import fcntl
    except ImportError:  # not on this platform: no lock, as before
        return None
    f = open(out / ".lock", "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise CheckpointError(f"{out} is being run by {holder}: stop it first, then resume") from None
    f.seek(0)
    f.truncate()
    f.write(f"sinkchat process {os.getpid()}")
    f.flush()
    return f


@contextmanager
def holding(out: Path) -> Iterator[None]:
    """lock_run for the block, released at its end (a test or the Python API may run the directory again in the
    same process)."""
    f = lock_run(out)
    try:
        yield
    finally:
        if f is not None:
            f.close()


def note_store(out: Path, engine: Any) -> None:
    """Name this process's recall-memory store in DIR/.stores: a process killed cannot remove its own, so the
    resume after it does (its blocks are in the checkpoint, hard-linked)."""
    mem = getattr(engine, "memory", None)
    if mem is not None:
        note_root(out, mem.store.root)


def note_root(out: Path, root: Any) -> None:
    with open(out / ".stores", "a") as f:
        f.write(f"{root}\n")


def _owner_runs(root: Path) -> bool:
    """The store's process (its folder is named `<time>-<pid>`, bootstrap.py) still runs: a copy of a run directory
    resumed beside the original names the original's live store."""
    pid = sweep.owner(root)
    return pid is not None and sweep.pid_runs(pid)


def check_writer(out: Path, state: dict[str, Any]) -> None:
    """A checkpoint that names its writer (those of 2026-12-03 morning, which took no lock): refused while that
    process runs."""
    from sinkchat.store import procs

    p = state.get("process") or {}
    if p.get("pid") not in (None, os.getpid()) and \
            procs.liveness(p.get("pid"), p.get("started"), p.get("host")) == "running":
        raise CheckpointError(f"{out} is being run by process {p['pid']}: stop it first, then resume")


def remove_dead_stores(out: Path, engine: Any) -> None:
    """Remove the stores DIR/.stores names but this process's (resumed, holding the run's lock: every earlier
    process of the run is gone). Only folders that hold nothing but segment files: never what we did not write."""
    mem = getattr(engine, "memory", None)
    mine = Path(mem.store.root) if mem is not None else None
    try:
        roots = [Path(x) for x in (out / ".stores").read_text().split("\n") if x]
    except OSError:
        return
    for root in roots:
        if root == mine or not root.is_dir() or _owner_runs(root):
            continue
        if sweep.only_segments(root):
            shutil.rmtree(root, ignore_errors=True)
            log.info("removed a stopped process's memory store %s (its blocks are in the checkpoint)", root)
    (out / ".stores").write_text(f"{mine}\n" if mine else "")


def arm(soak: Any, out: Path, run: dict[str, Any]) -> None:
    """Take a checkpoint every run["every"] seconds of soak time; `run`: what a resume needs besides the state of
    the runner, the scenario and the probe (settings, options, the session log). A stream from stdin is not
    checkpointed (what was read is gone). A checkpoint that cannot be written is a warning and a record; the run
    goes on."""
    scen = soak.scenario
    if not run["every"] or not hasattr(scen, "state") or not getattr(scen, "resumable", True):
        return

    def take(s: Any) -> None:
        if s.rec.failed:  # records were lost: a checkpoint could not say which it covers
            return
        state = {**run, "runner": runner_state(s), "scenario": scen.state(),
                 "recall": s.recall.state() if s.recall is not None else None, "metrics_bytes": s.rec.size(),
                 "taken": time.time()}  # wall clock: what the session log holds after it is done again
        try:
            save(out, s.engine, state, getattr(scen, "workspace", None))
        except (UserError, OSError) as e:
            log.warning("soak checkpoint failed: %s", e)
            s.rec.write({"kind": "checkpoint_failed", "elapsed": round(state["runner"]["elapsed"], 3),
                         "detail": str(e)[:300]})

    soak.on_checkpoint, soak.checkpoint_every = take, float(run["every"])
