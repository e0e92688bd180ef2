"""How long sinkchat takes to start, phase by phase, each start in a fresh process (issue #33 item 3).

    python benchmarks/startup.py                  # bundled model, 3 rounds
    python benchmarks/startup.py --model FILE.gguf --rounds 5 --cold-kernels

Per round: `sinkchat --help`; a first start (an empty SINKCHAT_CACHE_DIR: the GGUF's tokenizer and config converted,
its weights packed) and a later start (the same dir again), each both as the real command
(`echo hi | sinkchat --max-tokens 1 --no-log`, wall seconds to its exit after the first reply token) and as a probe
that runs the same load under `python -X importtime` and marks each phase: the loader's own (`loader.Phases`:
check, convert, config, tokenizer, weights), then the Engine, then the first token of a reply to "hi". Every
import that finished inside a phase is counted as that phase's imports, so a phase's "own" time is what it did
besides importing. The native kernels, built once per machine and sinkchat version (not per model), are linked into
the empty dir unless --cold-kernels. Prints the median of the rounds; times are noisy on a busy machine: compare
figures from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROBE = r"""
import logging, sys, time
def mark(name):
    sys.stderr.write(f"\n@@PHASE {name} {time.perf_counter():.6f}\n")
    sys.stderr.flush()
mark("python")
import sinkchat.cli
from sinkchat.api import start
from sinkchat.bootstrap import build_settings, read_prompt
mark("cli")
class Marks(logging.Handler):
    def emit(self, record):
        if record.msg.startswith("phase "):
            mark(record.args[0])
log = logging.getLogger("sinkchat.model.loader")
log.setLevel(logging.DEBUG)
log.addHandler(Marks())
log.propagate = False
model = sys.argv[1] or None
engine = start(build_settings({"model": model, "max_tokens": 1, "temperature": 0.0}), read_prompt("system")).engine
mark("engine")
for ev in engine.chat("hi", max_tokens=1):
    if type(ev).__name__ == "TokenEvent":
        break
mark("first token")
"""
PHASES = ("python", "cli", "check", "convert", "config", "tokenizer", "weights", "engine", "first token")
GROUPS = {"imports": (), "tokenizer": ("convert", "config", "tokenizer"), "weights": ("check", "weights"),
          "first token": ("engine", "first token")}


def parse(stderr: str, t_start: float) -> dict[str, tuple[float, float]]:
    """{phase: (wall s, s of it in imports that finished inside it)} from the probe's marks and importtime lines."""
    out: dict[str, list[float]] = {}
    prev, imports = t_start, 0.0
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            _, cum, name = line.split("|", 2)
            if cum.strip().isdigit() and not name[1:].startswith(" "):  # a top-level import, not a nested one
                imports += int(cum) / 1e6
        elif line.startswith("@@PHASE "):
            name, _, t = line.removeprefix("@@PHASE ").rpartition(" ")
            out[name] = [float(t) - prev, imports]
            prev, imports = float(t), 0.0
    return {k: (v[0], v[1]) for k, v in out.items()}


def probe(model: str, env: dict[str, str]) -> dict[str, tuple[float, float]]:
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", PROBE, model], env=env, capture_output=True,
                       text=True, timeout=600)
    if r.returncode:
        raise SystemExit(f"the probe failed ({r.returncode}): {r.stderr[-1500:]}")
    phases = parse(r.stderr, t)
    phases["total"] = (time.perf_counter() - t, sum(v[1] for v in phases.values()))
    return phases


def command(args: list[str], env: dict[str, str], stdin: str | None = None) -> float:
    """Wall seconds of `sinkchat ARGS` (python -m sinkchat, the same entry point), to its exit."""
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "sinkchat", *args], env=env, input=stdin, capture_output=True,
                       text=True, timeout=600)
    if r.returncode:
        raise SystemExit(f"sinkchat {' '.join(args)} failed ({r.returncode}): {r.stderr[-1500:]}")
    return time.perf_counter() - t


def fresh_env(root: Path, cold_kernels: bool) -> dict[str, str]:
    """An environment whose SINKCHAT_CACHE_DIR is a new empty folder (the user's native kernels linked in)."""
    from sinkchat.config import cache_dir

    d = Path(tempfile.mkdtemp(prefix="cache-", dir=root))
    kernels = cache_dir() / "native"
    if not cold_kernels and kernels.is_dir():
        (d / "native").symlink_to(kernels)
    return {**os.environ, "SINKCHAT_CACHE_DIR": str(d), "SINKCHAT_HOME": str(d / "home")}


def one_round(model: str, root: Path, cold: bool) -> dict[str, dict[str, tuple[float, float]] | float]:
    reply = ["--max-tokens", "1", "--no-log", *(["--model", model] if model else [])]
    out: dict[str, dict[str, tuple[float, float]] | float] = {"help": command(["--help"], os.environ.copy())}
    env = fresh_env(root, cold)
    out["first command"] = command(reply, env, "hi\n")
    out["later command"] = command(reply, env, "hi\n")
    env = fresh_env(root, cold)
    out["first"] = probe(model, env)
    out["later"] = probe(model, env)
    return out


def median_phases(runs: list[dict[str, tuple[float, float]]]) -> dict[str, tuple[float, float]]:
    keys = [k for k in (*PHASES, "total") if k in runs[0]]
    return {k: (statistics.median(r[k][0] for r in runs), statistics.median(r[k][1] for r in runs)) for k in keys}


def report(rounds: list[dict]) -> None:
    print(f"sinkchat --help: {statistics.median(r['help'] for r in rounds):.2f} s")
    for kind in ("first", "later"):
        print(f"{kind} start, `echo hi | sinkchat --max-tokens 1`: "
              f"{statistics.median(r[kind + ' command'] for r in rounds):.2f} s to its exit")
    first, later = median_phases([r["first"] for r in rounds]), median_phases([r["later"] for r in rounds])
    print("\nprobe (python -X importtime; median of rounds; s)\n")
    print("| phase | first: wall | of it imports | later: wall | of it imports |\n|---|---|---|---|---|")
    for k in first:
        print(f"| {k} | {first[k][0]:.2f} | {first[k][1]:.2f} | {later[k][0]:.2f} | {later[k][1]:.2f} |")
    print("\n| summary | first s | later s |\n|---|---|---|")
    for group, members in GROUPS.items():
        vals = []
        for ph in (first, later):
            if group == "imports":  # every import, and the interpreter's own start
                vals.append(ph["total"][1] + ph["python"][0] - ph["python"][1])
            else:
                vals.append(sum(ph[m][0] - ph[m][1] for m in members if m in ph))
        print(f"| {group} | {vals[0]:.2f} | {vals[1]:.2f} |")
    print(f"| total (probe) | {first['total'][0]:.2f} | {later['total'][0]:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="a .gguf file or model folder (default: the bundled model)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cold-kernels", action="store_true", help="build the native kernels in the first start too")
    ap.add_argument("--json", help="also write every round's figures to this file")
    a = ap.parse_args()
    rounds = []
    with tempfile.TemporaryDirectory(prefix="sinkchat-startup-") as root:
        for i in range(a.rounds):
            rounds.append(one_round(a.model, Path(root), a.cold_kernels))
            print(f"round {i + 1}/{a.rounds}: later start {rounds[-1]['later command']:.2f} s", file=sys.stderr)
    if a.json:
        Path(a.json).write_text(json.dumps(rounds, indent=1))
    report(rounds)


if __name__ == "__main__":
    main()
