"""Side by side: `sinkchat serve` and llama.cpp's `llama-server` on one conversation that grows turn by turn.

The same GGUF, a 2048-token cache (`--cache 2048` / `-c 2048`), one conversation sent the way OpenAI clients send it
(the whole history every turn, streaming). At each checkpoint (4k, 16k, 64k tokens of conversation by default) the
next turn's time to first token is recorded, and whether it was answered at all:

- sinkchat: one session (`X-Session-Id`): each turn feeds only the new message into the sink cache;
- llama.cpp: `cache_prompt: true`, with context shift off (its default: an over-long conversation is refused with
  `exceed_context_size_error`) and on (`--context-shift`).

    python benchmarks/serve_vs_llamacpp.py                      # the bundled model, 4k / 16k / 64k
    python benchmarks/serve_vs_llamacpp.py --sizes 1024,4096 --only sinkchat   # a quick look, no llama.cpp build

llama-server is built once from the llama-cpp-python sdist next to the other tools (benchmarks/llamacpp_tools.py;
~5-25 min on 2 cores). Prints a markdown table and writes --json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp_tools as lt  # noqa: E402

WORDS = ("river stone lantern orchard meadow harbor violet summit copper willow falcon ember tide quartz canyon "
         "thistle beacon saffron glacier maple").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_up(url: str, proc: subprocess.Popen[Any], timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not come up")


def llama_server(bin_dir: Path) -> Path:
    """llama-server, built into the same build folder as llama.cpp's other tools."""
    exe = bin_dir / "llama-server"
    if not exe.is_file():
        subprocess.run(["cmake", "--build", str(bin_dir.parent), f"-j{os.cpu_count() or 2}", "--target",
                        "llama-server"], check=True, capture_output=True)
    return exe


def user_turn(i: int, words: int) -> str:
    return f"Note {i}: " + " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(words)) + ". Reply with one word."


def turn(url: str, model: str, messages: list[dict[str, str]], headers: dict[str, str], extra: dict[str, Any],
         max_tokens: int) -> dict[str, Any]:
    """One streamed turn: time to the first content token, the reply, the prompt size the server reports."""
    body = {"model": model, "messages": messages, "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "stream_options": {"include_usage": True}, **extra}
    t0, ttft, text, usage, error = time.perf_counter(), None, "", {}, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=3600) as r:
        if r.status_code != 200:
            r.read()
            return {"ok": False, "error": _error(r.text), "ttft": None, "text": "", "prompt_tokens": None}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = _error(json.dumps(chunk))
                break
            for c in chunk.get("choices") or []:
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text += piece
            usage = chunk.get("usage") or usage
    return {"ok": error is None, "error": error, "ttft": ttft, "text": text,
            "prompt_tokens": usage.get("prompt_tokens")}


def _error(text: str) -> str:
    try:
        err = json.loads(text).get("error") or {}
        return str(err.get("type") or err.get("code") or err.get("message"))[:80]
    except (ValueError, AttributeError):
        return text[:80]


def grow(url: str, model: str, sizes: list[int], headers: dict[str, str], extra: dict[str, Any], words: int,
         max_tokens: int, log: Any) -> list[dict[str, Any]]:
    """Grow one conversation until it passes each size; record the turn that follows each crossing. A refused
    turn keeps the conversation going client-side (its reply is empty), as a user would retry."""
    messages: list[dict[str, str]] = []
    total, i, rows = 0, 0, []
    for size in sizes:
        while True:
            messages.append({"role": "user", "content": user_turn(i, words)})
            res = turn(url, model, messages, headers, extra, max_tokens)
            i += 1
            messages.append({"role": "assistant", "content": res["text"] or "ok"})
            total = res["prompt_tokens"] or total + words * 2
            if total >= size:
                rows.append({"size": size, "turn": i, "conversation_tokens": total, **res})
                log(f"  {size}: turn {i}, {total} tokens, ttft {res['ttft']}, ok {res['ok']} {res['error'] or ''}")
                break
    return rows


def run_sinkchat(gguf: Path, cache: int, sizes: list[int], words: int, max_tokens: int) -> list[dict[str, Any]]:
    port = free_port()
    cmd = [sys.executable, "-m", "sinkchat", "serve", "--model", str(gguf), "--cache", str(cache), "--port",
           str(port), "--temperature", "0", "--no-log"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(url, proc)
        print(f"sinkchat serve --cache {cache}", file=sys.stderr)
        return grow(url, "sinkchat", sizes, {"X-Session-Id": f"bench-{port}"}, {}, words, max_tokens,
                    lambda m: print(m, file=sys.stderr))
    finally:
        proc.terminate()
        proc.wait(30)


def run_llama(gguf: Path, cache: int, sizes: list[int], words: int, max_tokens: int,
              shift: bool) -> list[dict[str, Any]]:
    exe = llama_server(lt.ensure_tools(lambda m: print(m, file=sys.stderr)))
    port = free_port()
    cmd = [str(exe), "-m", str(gguf), "-c", str(cache), "--port", str(port), "-np", "1",
           *(["--context-shift"] if shift else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(url, proc)
        print(f"llama-server -c {cache} context shift {'on' if shift else 'off'}", file=sys.stderr)
        return grow(url, "model", sizes, {}, {"cache_prompt": True}, words, max_tokens,
                    lambda m: print(m, file=sys.stderr))
    finally:
        proc.terminate()
        proc.wait(30)


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    sizes = sorted({r["size"] for rows in results.values() for r in rows})
    head = "| server | " + " | ".join(f"{s / 1024:g}k: TTFT" if s >= 1024 else f"{s}: TTFT" for s in sizes) + " |"
    lines = [head, "|---|" + "---|" * len(sizes)]
    for name, rows in results.items():
        by = {r["size"]: r for r in rows}
        cells = []
        for s in sizes:
            r = by.get(s)
            cells.append("-" if r is None else f"{r['ttft']:.2f} s" if r["ok"] and r["ttft"] is not None
                         else f"refused ({r['error']})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="a GGUF (default: the bundled SmolLM2-135M)")
    ap.add_argument("--cache", type=int, default=2048)
    ap.add_argument("--sizes", default="4096,16384,65536", help="conversation sizes in tokens, comma-separated")
    ap.add_argument("--words", type=int, default=120, help="words per user turn")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--only", choices=["sinkchat", "llama"], default=None)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    gguf = a.model or lt.bundled()
    sizes = [int(s) for s in re.split(r"[,\s]+", a.sizes.strip()) if s]
    results: dict[str, list[dict[str, Any]]] = {}
    if a.only in (None, "sinkchat"):
        results["sinkchat serve (session)"] = run_sinkchat(gguf, a.cache, sizes, a.words, a.max_tokens)
    if a.only in (None, "llama"):
        results["llama-server, context shift off"] = run_llama(gguf, a.cache, sizes, a.words, a.max_tokens, False)
        results["llama-server, context shift on"] = run_llama(gguf, a.cache, sizes, a.words, a.max_tokens, True)
    print(table(results))
    if a.json:
        a.json.write_text(json.dumps({"model": str(gguf), "cache": a.cache, "results": results}, indent=1))


if __name__ == "__main__":
    main()
