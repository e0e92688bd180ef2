"""How long sinkchat takes to start, phase by phase, each start in a fresh process (issue #33 item 3).

    python benchmarks/startup.py                  # bundled model, 3 rounds
    python benchmarks/startup.py --model FILE.gguf --rounds 5 --cold-kernels

Per round: `sinkchat --help`; a first start (an empty SINKCHAT_CACHE_DIR: the GGUF's tokenizer and config converted,
its weights packed) and a later start (the same dir again), each both as the real command
(`echo hi | sinkchat --max-tokens 1 --no-log`: wall seconds to the first reply token, the first byte on its stdout,
and to its exit, the interpreter's end included) and as a probe
that runs the same load under `python -X importtime` and marks each phase: the loader's own (`loader.Phases`:
check, convert, config, tokenizer, weights), then the Engine, then the first token of a reply to "hi". Every
import that finished inside a phase is counted as that phase's imports, so a phase's "own" time is what it did
besides importing. The native kernels, built once per machine and sinkchat version (not per model), are linked into
the empty dir unless --cold-kernels. Prints the median of the rounds; times are noisy on a busy machine: compare
figures from one run.

Python bytecode: the commands run as an installed sinkchat does, its modules' bytecode written on the first start
and read on later ones (PYTHONDONTWRITEBYTECODE is dropped from their environment; it was set on the 2-core box,
where compiling sinkchat's ~80 modules at every start took 0.42 s under cProfile). --env-bytecode keeps the environment's
setting. The sinkchat measured is the one this interpreter imports (PYTHONPATH=TREE to measure a checkout): printed.
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
from typing import Any

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
end = getattr(sinkchat.cli, "exit_now", None)  # as the CLI ends a piped chat (a checkout without it: as before)
if end is not None:
    end(0)
"""
PHASES = ("python", "cli", "check", "convert", "config", "tokenizer", "weights", "engine", "first token", "exit")
GROUPS = {"imports": (), "tokenizer": ("convert", "config", "tokenizer"), "weights": ("check", "weights"),
          "first token": ("engine", "first token"), "exit": ("exit",)}


def parse(stderr: str, t_start: float) -> dict[str, tuple[float, float]]:
    """{phase: (wall s, s of it in imports that finished inside it)} from the probe's marks and importtime lines, and
    "@last": (the last mark's time, 0), from which `probe` times the exit (the child's perf_counter is the same
    monotonic clock as this process's)."""
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
    out["@last"] = [prev, 0.0]
    return {k: (v[0], v[1]) for k, v in out.items()}


def probe(model: str, env: dict[str, str]) -> dict[str, tuple[float, float]]:
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", PROBE, model], env=env, capture_output=True,
                       text=True, timeout=600)
    if r.returncode:
        raise SystemExit(f"the probe failed ({r.returncode}): {r.stderr[-1500:]}")
    end = time.perf_counter()
    phases = parse(r.stderr, t)
    phases["exit"] = (end - phases.pop("@last")[0], 0.0)
    phases["total"] = (end - t, sum(v[1] for v in phases.values()))
    return phases


def command(args: list[str], env: dict[str, str], stdin: str | None = None) -> tuple[float, float]:
    """Wall seconds of `sinkchat ARGS` (python -m sinkchat, the same entry point) to the first byte on its stdout
    (a reply's first token; NaN with none) and to its exit."""
    t = time.perf_counter()
    first = float("nan")
    with tempfile.TemporaryFile() as err:
        p = subprocess.Popen([sys.executable, "-m", "sinkchat", *args], env=env, stdout=subprocess.PIPE,
                             stderr=err, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL)
        if stdin is not None and p.stdin is not None:
            p.stdin.write(stdin.encode())
            p.stdin.close()
        assert p.stdout is not None
        while chunk := p.stdout.read1(65536):
            if first != first:  # (NaN: nothing yet)
                first = time.perf_counter() - t
        code = p.wait(timeout=600)
        end = time.perf_counter() - t
        if code:
            err.seek(0)
            raise SystemExit(f"sinkchat {' '.join(args)} failed ({code}): {err.read()[-1500:].decode()}")
    return first, end


def base_env(env_bytecode: bool) -> dict[str, str]:
    """The commands' environment: this one, less PYTHONDONTWRITEBYTECODE unless `env_bytecode`."""
    env = os.environ.copy()
    if not env_bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def fresh_env(root: Path, cold_kernels: bool, env_bytecode: bool) -> dict[str, str]:
    """An environment whose SINKCHAT_CACHE_DIR is a new empty folder (the user's native kernels linked in)."""
    from sinkchat.config import cache_dir

    d = Path(tempfile.mkdtemp(prefix="cache-", dir=root))
    kernels = cache_dir() / "native"
    if not cold_kernels and kernels.is_dir():
        (d / "native").symlink_to(kernels)
    return {**base_env(env_bytecode), "SINKCHAT_CACHE_DIR": str(d), "SINKCHAT_HOME": str(d / "home")}


Round = dict[str, Any]


def one_round(model: str, root: Path, cold: bool, env_bytecode: bool) -> Round:
    reply = ["--max-tokens", "1", "--no-log", *(["--model", model] if model else [])]
    out: Round = {"help": command(["--help"], base_env(env_bytecode))[1]}
    env = fresh_env(root, cold, env_bytecode)
    out["first token"], out["first command"] = command(reply, env, "hi\n")
    out["later token"], out["later command"] = command(reply, env, "hi\n")
    env = fresh_env(root, cold, env_bytecode)
    out["first"] = probe(model, env)
    out["later"] = probe(model, env)
    return out


def median_phases(runs: list[dict[str, tuple[float, float]]]) -> dict[str, tuple[float, float]]:
    keys = [k for k in (*PHASES, "total") if k in runs[0]]
    return {k: (statistics.median(r[k][0] for r in runs), statistics.median(r[k][1] for r in runs)) for k in keys}


def report(rounds: list[Round]) -> None:
    import sinkchat

    print(f"sinkchat {sinkchat.__file__}")
    print(f"sinkchat --help: {statistics.median(r['help'] for r in rounds):.2f} s")
    for kind in ("first", "later"):
        print(f"{kind} start, `echo hi | sinkchat --max-tokens 1`: "
              f"{statistics.median(r[kind + ' token'] for r in rounds):.2f} s to the first reply token, "
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
    ap.add_argument("--env-bytecode", action="store_true",
                    help="keep PYTHONDONTWRITEBYTECODE as set (default: bytecode written and read, as installed)")
    a = ap.parse_args()
    rounds: list[Round] = []
    with tempfile.TemporaryDirectory(prefix="sinkchat-startup-") as root:
        for i in range(a.rounds):
            rounds.append(one_round(a.model, Path(root), a.cold_kernels, a.env_bytecode))
            print(f"round {i + 1}/{a.rounds}: later start {rounds[-1]['later command']:.2f} s", file=sys.stderr)
    if a.json:
        Path(a.json).write_text(json.dumps(rounds, indent=1))
    report(rounds)


if __name__ == "__main__":
    main()
