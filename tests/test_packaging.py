"""sinkchat as a user installs it: a wheel built from this tree, installed (not editable) into a fresh venv and run from
another directory. Its prompts ship as package data, `sinkchat --version` and `python -m sinkchat` work.

Offline: the wheel is built without build isolation when the test environment has a recent setuptools (the `test`
extra brings one), and the venv borrows the test environment's packages (torch, transformers, ...) through a .pth file
instead of installing them.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

import sinkchat
from fakes import save_tiny_chat_model

ROOT = Path(__file__).resolve().parent.parent
# What a checkout has besides the sources (see .gitignore): none of it goes into the copy the wheel is built from.
NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__", "*.pyc",
                                     ".pytest_cache", ".env", "*.gguf", "*.safetensors", "out", "soak-*")


def _no_isolation_ok() -> bool:
    """Whether this environment can build the wheel itself (setuptools >= 70.1 builds wheels without `wheel`)."""
    try:
        major, minor = (int(x) for x in metadata.version("setuptools").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (70, 1)


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    assert p.returncode == 0, f"{cmd[:4]} exited {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    return p


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the tree (the checkout keeps no build/ leftovers and is never raced)."""
    src = tmp_path_factory.mktemp("src") / "sinkchat-src"
    shutil.copytree(ROOT, src, ignore=NOT_SOURCES)
    out = tmp_path_factory.mktemp("wheelhouse")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)]
    if _no_isolation_ok():
        cmd.insert(4, "--no-build-isolation")
    _run(cmd)
    (whl,) = out.glob("sinkchat-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed non-editable; its dependencies come from the test environment."""
    v = tmp_path_factory.mktemp("venv") / "v"
    _run([sys.executable, "-m", "venv", "--without-pip", str(v)])
    py = v / "bin" / "python"
    purelib = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())
    # Plain path lines: the test environment's packages, but not its .pth files (so not its editable sinkchat).
    (purelib / "test-env.pth").write_text("".join(f"{d}\n" for d in site.getsitepackages()))
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index", str(wheel)])
    return v


@pytest.fixture
def elsewhere(tmp_path) -> dict:
    """subprocess kwargs: run in an empty directory, with nothing pointing at this checkout."""
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {"cwd": cwd, "env": env}


def test_wheel_holds_every_module_the_prompts_and_the_c_sources(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    tree = {p.relative_to(ROOT).as_posix() for p in (ROOT / "sinkchat").rglob("*.py") if "__pycache__" not in p.parts}
    assert tree - names == set(), "modules missing from the wheel: add their package to pyproject.toml's `packages`"
    prompts = {f"sinkchat/prompts/{p.name}" for p in (ROOT / "prompts").glob("*.txt")}
    assert prompts and prompts <= names
    assert any(n.startswith("sinkchat/kernels/csrc/") and n.endswith(".c") for n in names)
    assert "sinkchat/memory/csrc/memk.c" in names  # the memory's C dots and rotation, built on first use
    assert not any(n.startswith(("tests/", "prompts/")) for n in names)


def test_installed_wheel_runs_from_another_directory(venv, elsewhere, tmp_path):
    sinkchat_exe, py = venv / "bin" / "sinkchat", venv / "bin" / "python"
    version = f"sinkchat {sinkchat.__version__}"
    assert _run([str(sinkchat_exe), "--version"], **elsewhere).stdout.strip() == version
    assert _run([str(py), "-m", "sinkchat", "--version"], **elsewhere).stdout.strip() == version

    where = _run([str(py), "-c", "import sinkchat, sinkchat.bootstrap as b; print(sinkchat.__file__); "
                  "print(b.read_prompt('system'))"], **elsewhere).stdout
    path, prompt = where.split("\n", 1)
    assert Path(path).resolve().is_relative_to(venv.resolve())  # the installed copy, not this checkout
    assert prompt.strip() == (ROOT / "prompts" / "system.txt").read_text(encoding="utf-8").strip()

    model = save_tiny_chat_model(tmp_path / "tiny")
    p = subprocess.run([str(sinkchat_exe), "chat", "--model", str(model), "--quant", "none", "--threads", "1",
                        "--cache", "64", "--max-tokens", "4", "--temperature", "0", "--no-log"],
                       input="hello\n", capture_output=True, text=True, timeout=300, **elsewhere)
    assert "cannot read prompt file" not in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip(), f"no reply\n{p.stderr[-2000:]}"
