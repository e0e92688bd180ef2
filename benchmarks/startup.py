"""How long sinkchat takes to start, phase by phase, each start in a fresh process (issue #33 item 3).

    python benchmarks/startup.py                  # bundled model, 3 rounds
    python benchmarks/startup.py --model FILE.gguf --rounds 5 --cold-kernels
    python benchmarks/startup.py --against /tmp/wt --later-only --rounds 8   # before/after, later starts only

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

Before and after in one run: `--against TREE` (e.g. a `git worktree add` of HEAD) measures TREE's sinkchat too
(PYTHONPATH=TREE), round by round, the two in alternating order, every process started in an empty working folder
(with `python -m` the working folder comes first on sys.path, before PYTHONPATH). Each round also times
`python -c "import torch"`, the floor under any start, so a loaded machine's figures can be read as ratios, and
records each command's CPU seconds (user + system, from the children's rusage), which a busy neighbour disturbs far
less than wall time. `--later-only`: one untimed first start per sinkchat, then only later starts.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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
try:  # as `cli.run` starts a command: the garbage collector off until the load ends (a checkout without it: on)
    from sinkchat.model import collector
    collector.pause()
except ImportError:
    pass
import sinkchat.cli
from sinkchat.bootstrap import build_settings, read_prompt
try:  # the API's one way in (a checkout from before it: bootstrap's open_engine, the same load)
    from sinkchat.api import start
except ImportError:
    from sinkchat.bootstrap import open_engine
    start = lambda settings, system: type("S", (), {"engine": open_engine(settings, system)})
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
try:  # as the CLI ends a piped chat (`apps.exits.exit_now`; a checkout without it: the interpreter's exit)
    from sinkchat.apps.exits import exit_now as end
except ImportError:
    end = getattr(sinkchat.cli, "exit_now", None)
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


def probe(model: str, env: dict[str, str], cwd: Path) -> dict[str, tuple[float, float]]:
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", PROBE, model], env=env, capture_output=True,
                       text=True, timeout=600, cwd=cwd)
    if r.returncode:
        raise SystemExit(f"the probe failed ({r.returncode}): {r.stderr[-1500:]}")
    end = time.perf_counter()
    phases = parse(r.stderr, t)
    phases["exit"] = (end - phases.pop("@last")[0], 0.0)
    phases["total"] = (end - t, sum(v[1] for v in phases.values()))
    return phases


def child_cpu() -> float:
    """CPU seconds (user + system) of this process's finished children so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


CPU: dict[str, float] = {"last": 0.0}  # the CPU seconds of the last `command` / `torch_floor`


def command(args: list[str], env: dict[str, str], cwd: Path, stdin: str | None = None) -> tuple[float, float]:
    """Wall seconds of `sinkchat ARGS` (python -m sinkchat, the same entry point) to the first byte on its stdout
    (a reply's first token; NaN with none) and to its exit; its CPU seconds in CPU["last"]."""
    c0 = child_cpu()
    t = time.perf_counter()
    first = float("nan")
    with tempfile.TemporaryFile() as err:
        p = subprocess.Popen([sys.executable, "-m", "sinkchat", *args], env=env, stdout=subprocess.PIPE, cwd=cwd,
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
    CPU["last"] = child_cpu() - c0
    return first, end


def torch_floor(env: dict[str, str], cwd: Path) -> float:
    """Wall seconds of `python -c "import torch"`: what no start can go below (same environment and moment)."""
    c0, t = child_cpu(), time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], env=env, cwd=cwd, check=True, timeout=600)
    CPU["last"] = child_cpu() - c0
    return time.perf_counter() - t


def base_env(env_bytecode: bool, tree: str | None = None) -> dict[str, str]:
    """The commands' environment: this one, less PYTHONDONTWRITEBYTECODE unless `env_bytecode`; with `tree`, that
    checkout's sinkchat first on the path."""
    env = os.environ.copy()
    if not env_bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    if tree:
        env["PYTHONPATH"] = os.pathsep.join([tree, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    return env


def fresh_env(root: Path, cold_kernels: bool, env_bytecode: bool, tree: str | None = None) -> dict[str, str]:
    """An environment whose SINKCHAT_CACHE_DIR is a new empty folder (the user's native kernels linked in)."""
    from sinkchat.config import cache_dir

    d = Path(tempfile.mkdtemp(prefix="cache-", dir=root))
    kernels = cache_dir() / "native"
    if not cold_kernels and kernels.is_dir():
        (d / "native").symlink_to(kernels)
    return {**base_env(env_bytecode, tree), "SINKCHAT_CACHE_DIR": str(d), "SINKCHAT_HOME": str(d / "home")}


Round = dict[str, Any]


def reply_args(model: str) -> list[str]:
    return ["--max-tokens", "1", "--no-log", *(["--model", model] if model else [])]


def one_round(model: str, root: Path, cold: bool, env_bytecode: bool, tree: str | None = None,
              ready: dict[str, str] | None = None) -> Round:
    """Every figure of one round for the sinkchat of `tree` (None: the one this interpreter imports); with `ready`
    (an environment whose cache a first start filled), only the later start's."""
    cwd = Path(tempfile.mkdtemp(prefix="cwd-", dir=root))  # empty: no .env, no checkout shadowing PYTHONPATH
    reply = reply_args(model)
    out: Round = {"torch": torch_floor(base_env(env_bytecode, tree), cwd)}
    out["torch cpu"] = CPU["last"]
    out["help"] = command(["--help"], base_env(env_bytecode, tree), cwd)[1]
    env = ready or fresh_env(root, cold, env_bytecode, tree)
    if ready is None:
        out["first token"], out["first command"] = command(reply, env, cwd, "hi\n")
        out["first cpu"] = CPU["last"]
    out["later token"], out["later command"] = command(reply, env, cwd, "hi\n")
    out["later cpu"] = CPU["last"]
    if ready is not None:
        out["later"] = probe(model, ready, cwd)
        return out
    env = fresh_env(root, cold, env_bytecode, tree)
    out["first"] = probe(model, env, cwd)
    out["later"] = probe(model, env, cwd)
    return out


def median_phases(runs: list[dict[str, tuple[float, float]]]) -> dict[str, tuple[float, float]]:
    keys = [k for k in (*PHASES, "total") if k in runs[0]]
    return {k: (statistics.median(r[k][0] for r in runs), statistics.median(r[k][1] for r in runs)) for k in keys}


def where(tree: str | None) -> str:
    """The sinkchat a tree's processes import."""
    if tree is None:
        import sinkchat

        return str(sinkchat.__file__)
    return f"{tree} (PYTHONPATH)"


def report(rounds: list[Round], tree: str | None = None) -> None:
    print(f"sinkchat {where(tree)}")
    print(f"python -c 'import torch': {statistics.median(r['torch'] for r in rounds):.2f} s"
          + (f" ({statistics.median(r['torch cpu'] for r in rounds):.2f} CPU s)" if "torch cpu" in rounds[0] else ""))
    print(f"sinkchat --help: {statistics.median(r['help'] for r in rounds):.2f} s")
    for kind in [k for k in ("first", "later") if k + " token" in rounds[0]]:
        print(f"{kind} start, `echo hi | sinkchat --max-tokens 1`: "
              f"{statistics.median(r[kind + ' token'] for r in rounds):.2f} s to the first reply token, "
              f"{statistics.median(r[kind + ' command'] for r in rounds):.2f} s to its exit"
              + (f" ({statistics.median(r[kind + ' cpu'] for r in rounds):.2f} CPU s)" if kind + " cpu" in rounds[0]
                 else ""))
    later = median_phases([r["later"] for r in rounds])
    first = median_phases([r["first"] for r in rounds]) if "first" in rounds[0] else later  # (--later-only: twice)
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


def compare(ours: list[Round], theirs: list[Round], tree: str) -> None:
    """The commands' medians side by side: this sinkchat, the one of `tree`, and their ratio."""
    print(f"\nside by side (median of {len(ours)} rounds, s): this sinkchat vs {tree}\n")
    print("| figure | this | against | ratio |\n|---|---|---|---|")
    keys = ("torch", "torch cpu", "help", "first token", "first command", "first cpu", "later token", "later command",
            "later cpu")
    for key in [k for k in keys if k in ours[0] and k in theirs[0]]:
        a, b = statistics.median(r[key] for r in ours), statistics.median(r[key] for r in theirs)
        print(f"| {key} | {a:.2f} | {b:.2f} | {a / b:.2f} |")
    for key in [k for k in ("first token", "later token") if k in ours[0]]:  # what a start adds to torch's import
        a, b = (statistics.median(r[key] - r["torch"] for r in rs) for rs in (ours, theirs))
        print(f"| {key} - torch (per round) | {a:.2f} | {b:.2f} | {a / b:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="a .gguf file or model folder (default: the bundled model)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cold-kernels", action="store_true", help="build the native kernels in the first start too")
    ap.add_argument("--json", help="also write every round's figures to this file")
    ap.add_argument("--env-bytecode", action="store_true",
                    help="keep PYTHONDONTWRITEBYTECODE as set (default: bytecode written and read, as installed)")
    ap.add_argument("--against", metavar="TREE", help="also measure this checkout's sinkchat, round by round")
    ap.add_argument("--later-only", action="store_true",
                    help="one first start per sinkchat (not timed), then only later starts (and --help) per round")
    a = ap.parse_args()
    trees: list[str | None] = [None, *([str(Path(a.against).resolve())] if a.against else [])]
    rounds: dict[str | None, list[Round]] = {t: [] for t in trees}
    with tempfile.TemporaryDirectory(prefix="sinkchat-startup-") as root:
        ready: dict[str | None, dict[str, str] | None] = {t: None for t in trees}
        for tree in trees if a.later_only else ():
            ready[tree] = fresh_env(Path(root), a.cold_kernels, a.env_bytecode, tree)
            command(reply_args(a.model), ready[tree], Path(tempfile.mkdtemp(dir=root)), "hi\n")
        for i in range(a.rounds):
            for tree in (trees if i % 2 == 0 else trees[::-1]):  # alternating: neither always runs first
                rounds[tree].append(one_round(a.model, Path(root), a.cold_kernels, a.env_bytecode, tree,
                                              ready[tree]))
                print(f"round {i + 1}/{a.rounds} {where(tree)}: later start {rounds[tree][-1]['later command']:.2f} s",
                      file=sys.stderr)
    if a.json:
        data: Any = rounds[None] if not a.against else {"this": rounds[None], a.against: rounds[trees[1]]}
        Path(a.json).write_text(json.dumps(data, indent=1))
    for tree in trees:
        report(rounds[tree], tree)
        print()
    if a.against:
        compare(rounds[None], rounds[trees[1]], trees[1] or "")


if __name__ == "__main__":
    main()
