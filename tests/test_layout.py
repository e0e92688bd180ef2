"""The package layout is the architecture: imports point down only (cli -> apps -> bootstrap -> decode -> core ->
model / store -> kernels -> leaves), with no circle. Checked statically (every `import` and `from ... import` in
every module, function-level ones included), so a new upward import fails here, not in review."""

from __future__ import annotations

import ast
from pathlib import Path

import sinkchat

ROOT = Path(sinkchat.__file__).parent

# lower number = lower layer; a module may import its own package and anything strictly lower
LAYERS = {
    "sinkchat": 0, "sinkchat.errors": 0, "sinkchat.textutil": 0, "sinkchat.prompts": 0, "sinkchat.private": 0,
    "sinkchat.config": 1,
    "sinkchat.kernels": 2,
    "sinkchat.model": 3,
    "sinkchat.memory": 3.5,  # the recall memory: below the Engine that it is injected into
    "sinkchat.store": 3.7,  # snapshots carry the recall memory
    "sinkchat.core": 4,
    "sinkchat.decode": 5,
    "sinkchat.bootstrap": 6,
    "sinkchat.api": 6.5,  # the Python API (`sinkchat.load`): over the bootstrap, under the apps that use it
    "sinkchat.apps": 7,  # what the apps share: rendering, the session-log recorder, the logs command
    "sinkchat.apps.chat": 8, "sinkchat.apps.agent": 8, "sinkchat.apps.summarize": 8, "sinkchat.apps.evals": 8,
    "sinkchat.apps.serve": 8,
    "sinkchat.apps.soak": 9,  # soak drives the agent and summarize apps
    "sinkchat.cli": 10, "sinkchat.__main__": 11,
}


# The only upward imports allowed: (importing module, imported module). `sinkchat.load` is the Python API's entry
# point (issue 31), imported lazily inside the package's module `__getattr__` (PEP 562), so `import sinkchat` still
# loads no torch; it is an upward import all the same and is named here rather than hidden behind importlib.
LAZY_EXCEPTIONS = {("sinkchat", "sinkchat.api")}


def unit(module: str) -> str:
    """The layer unit a module belongs to: its longest prefix in LAYERS."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in LAYERS:
            return name
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS (and to the README's layout section)")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _target(module: str, name: str) -> str:
    """`from module import name`: the submodule module.name where that is a module, else module itself."""
    sub = ROOT.joinpath(*f"{module}.{name}".split(".")[1:])
    return f"{module}.{name}" if sub.with_suffix(".py").is_file() or sub.is_dir() else module


def imports() -> list[tuple[str, str, int]]:
    """(importing module, imported module, line) for every sinkchat import in the package."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        mod = ".".join(("sinkchat", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing_only = {id(n) for guard in ast.walk(tree) if isinstance(guard, ast.If) and _is_type_checking(guard.test)
                       for stmt in guard.body for n in ast.walk(stmt)}  # `if TYPE_CHECKING:` imports never run
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "sinkchat":
                names = [_target(node.module, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == "sinkchat"]
            else:
                continue
            out += [(mod, name, node.lineno) for name in names]
    return out


def test_every_import_points_down_or_stays_in_its_package():
    bad = []
    for mod, target, line in imports():
        if target == "sinkchat.__version__" or (mod, target) in LAZY_EXCEPTIONS:
            continue
        a, b = unit(mod), unit(target)
        if a != b and LAYERS[b] >= LAYERS[a]:
            bad.append(f"{mod}:{line} imports {target} ({a} is layer {LAYERS[a]}, {b} layer {LAYERS[b]})")
    assert not bad, "\n".join(bad)


def test_no_import_circle_between_modules():
    graph: dict[str, set[str]] = {}
    for mod, target, _ in imports():
        graph.setdefault(mod, set()).add(target)
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for mod in list(graph):
        if mod not in state:
            visit(mod, [mod])


def test_the_check_catches_an_upward_import():
    """The rule itself can fail: core importing an app is flagged."""
    assert LAYERS[unit("sinkchat.core.engine")] < LAYERS[unit("sinkchat.apps.chat.repl")]
    assert unit("sinkchat.apps.render") == "sinkchat.apps" and unit("sinkchat.apps.soak.report") == "sinkchat.apps.soak"
