"""Bad GGUF files get one line each, before any heavy work, with nothing written to the cache dir; a good one is
converted once (small files) and its packed model cached and read back identically."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from sinkchat.config import ModelConfig
from sinkchat.model import gguf_convert, gguf_packed, loader
from sinkchat.model.gguf_file import GGUFError


@pytest.fixture(scope="module")
def bundled_bytes() -> bytes:
    return loader.bundled_gguf().read_bytes()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("SINKCHAT_CACHE_DIR", str(d))
    return d


def _patch_string(data: bytes, key: bytes, new: bytes) -> bytes:
    """Replace the string value stored under metadata `key` by `new` (same length)."""
    at = data.index(key) + len(key) + 4  # the value type (uint32) follows the key
    (n,) = struct.unpack_from("<Q", data, at)
    assert n == len(new)
    return data[: at + 8] + new + data[at + 8 + n :]


def _patch_tensor_type(data: bytes, name: bytes, qtype: int) -> bytes:
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    at += 4 + 8 * n_dims
    return data[:at] + struct.pack("<I", qtype) + data[at + 4 :]


BAD = {
    "wrong magic": (lambda b: b"GGUX" + b[4:], "is not a GGUF file"),
    "truncated": (lambda b: b[:3_000_000], "truncated"),
    "truncated in the weights": (lambda b: b[: len(b) - 1000], "truncated"),
    "architecture": (lambda b: _patch_string(b, b"general.architecture", b"bertx"), "architecture 'bertx' is not supported"),
    "tensor type": (lambda b: _patch_tensor_type(b, b"token_embd.weight", 20), "is IQ4_NL, which sinkchat does not read"),
    "no tokenizer": (lambda b: _patch_string(b, b"tokenizer.ggml.model", b"none"), "has no tokenizer"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_file_is_one_line_before_any_work_and_writes_nothing(case, bundled_bytes, tmp_path, cache):
    make, words = BAD[case]
    bad = tmp_path / "model.gguf"
    bad.write_bytes(make(bundled_bytes))
    with pytest.raises(GGUFError) as e:
        loader.load(ModelConfig(model=str(bad)))
    msg = str(e.value)
    assert words in msg and "\n" not in msg and len(msg) < 300, msg
    assert not cache.exists() or not any(cache.rglob("*")), list(cache.rglob("*"))


def test_the_cli_prints_one_error_line(bundled_bytes, tmp_path, cache):
    from sinkchat.cli import main

    bad = tmp_path / "model.gguf"
    bad.write_bytes(bundled_bytes[:3_000_000])
    text = tmp_path / "t.txt"
    text.write_text("hello there")
    r = CliRunner().invoke(main, ["ppl", str(text), "--model", str(bad)])
    assert r.exit_code == 1, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert lines[-1].startswith("Error:") and "truncated" in lines[-1], r.output
    assert sum(ln.startswith("Error:") for ln in lines) == 1 and "Traceback" not in r.output


def test_the_packed_cache_reads_back_the_same_model():
    """The bundled model, packed from the GGUF (or read from the cache): reading the cache again gives the same
    tensors, the same wiring and the same logits."""
    loaded = loader.load(ModelConfig(threads=1))
    folder = Path(loaded.path)
    assert (folder / gguf_packed.MANIFEST).is_file() and gguf_convert.is_done(folder)
    assert not list(folder.glob("*.safetensors")) or [p.name for p in folder.glob("*.safetensors")] == [gguf_packed.WEIGHTS]
    model = loaded.model
    again = gguf_packed.load(model.config, folder, gguf_packed.json.loads((folder / gguf_packed.MANIFEST).read_text())["kernels"])
    assert again is not None
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    assert type(again.get_input_embeddings()) is type(model.get_input_embeddings())
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_a_damaged_packed_cache_is_packed_again(tmp_path):
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / gguf_packed.MANIFEST).write_text("{not json")
    assert gguf_packed.load(None, folder, "native") is None
