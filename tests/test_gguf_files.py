"""Bad GGUF files get one line each, before any heavy work, with nothing written to the cache dir; a good one is
converted once (small files) and its packed model cached and read back identically."""

from __future__ import annotations

import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from gguf import GGUFReader

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
    cfg = ModelConfig(threads=1)
    loaded = loader.load(cfg)
    folder = Path(loaded.path)
    model = loaded.model
    kernels = loader.q4_kernels(cfg.decoder, model.config)
    assert (folder / gguf_packed.manifest_name(kernels)).is_file() and gguf_convert.is_done(folder)
    assert all(p.name.startswith("packed-") for p in folder.glob("*.safetensors"))
    again = gguf_packed.load(model.config, folder, kernels)
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
    (folder / gguf_packed.manifest_name("native")).write_text("{not json")
    assert gguf_packed.load(None, folder, "native") is None


def test_packs_for_other_kernels_live_side_by_side(tmp_path):
    """The folder is shared by every environment of the user: one packing for the torch kernels (`--decoder
    compiled`, or a box without a compiler) must not replace another's native pack (each would then pack again at
    every start, 1 s for the bundled model, tens of seconds for a 3B one)."""
    model = loader.load(ModelConfig(threads=1)).model
    for kernels in ("native", "torch"):
        gguf_packed.save(model, tmp_path, kernels)
    want = model.state_dict()
    for kernels in ("native", "torch"):
        again = gguf_packed.load(model.config, tmp_path, kernels)
        assert again is not None, kernels
        got = again.state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left behind


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_q4_0_file_is_held_at_its_own_bytes(arch, tmp_path, cache):
    """A Q4_0 GGUF on the native kernels: every Q4_0 tensor (the linears, and the tied token table) in `Int4Q0Linear`
    holding exactly the file's bytes (`native.q40_gguf_bytes` puts them back; Llama's q / k rows in transformers'
    order, as llama.cpp's permutation is undone; Qwen2's biases beside them); the packed cache (v2: v1 held Q4_0 as
    q4) reads it back the same, and a v1 pair left in the folder is never read."""
    import numpy as np

    import gguf_models as gm
    from gguf import GGMLQuantizationType as T
    from sinkchat.kernels import native
    from sinkchat.model import gguf_load
    from sinkchat.model.int4q0 import Int4Q0Linear

    if native.unsupported(native.variant()):
        pytest.skip(f"native kernels: {native.unsupported(native.variant())}")
    model = gm.tiny_model(arch, seed=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=256, num_hidden_layers=1, tie_word_embeddings=True)
    path = gm.write_gguf(model, tmp_path / "q40.gguf", "Q4_0")
    loaded = loader.load(ModelConfig(model=str(path), threads=1))
    table = gguf_convert.tensor_table(Path(loaded.path))
    kernels = loader.q4_kernels(ModelConfig(model=str(path)).decoder, loaded.model.config)
    assert kernels == "native" and loaded.quantized_fraction == 1.0
    mods = {n: m for n, m in loaded.model.named_modules() if isinstance(m, Int4Q0Linear)}
    names = {n: gguf_load.hf_name(n, arch) for n, ti in table.items() if ti.qtype == T.Q4_0}
    assert len(names) == 8  # token_embd + 7 linears, all Q4_0
    held = 0
    with open(path, "rb") as f:
        for gname, hf in names.items():
            t = table[gname]
            mod = loaded.model.get_input_embeddings().table if hf == "model.embed_tokens.weight" else \
                mods[hf.removesuffix(".weight")]
            assert isinstance(mod, Int4Q0Linear), gname
            raw = gguf_load.read_raw(f, t)
            heads = {"attn_q": 4, "attn_k": 2}.get(gname.split(".")[2] if gname.startswith("blk.") else "")
            heads = heads if arch == "llama" else None  # llama.cpp permutes Llama's q / k rows only
            want = gguf_load._unpermute(raw, heads) if heads else raw
            assert mod.qw.nbytes + mod.sw.nbytes == t.nbytes, gname  # the file's size, no m
            np.testing.assert_array_equal(native.q40_gguf_bytes(mod.qw, mod.sw), want, err_msg=gname)
            held += t.nbytes
    assert loaded.model.get_output_embeddings() is loaded.model.get_input_embeddings().table  # tied: held once
    if arch == "qwen2":
        assert mods["model.layers.0.self_attn.q_proj"].bias is not None
    folder = Path(loaded.path)
    v = f"packed-v{gguf_packed.VERSION}"
    assert (folder / f"{v}-native.json").is_file() and gguf_packed.weights_name("native").startswith(v)
    for name in ("packed-v1-native.json", "packed-v1-native.safetensors", "packed-v1-torch.json"):
        (folder / name).write_bytes(b"an older version's pack")
    again = gguf_packed.load(loaded.model.config, folder, "native")
    assert again is not None
    left = {p.name for p in folder.iterdir() if p.name.startswith("packed-")}  # v1's native pair dropped on reading
    assert left == {f"{v}-native.json", f"{v}-native.safetensors", "packed-v1-torch.json"}
    a, b = loaded.model.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, loaded.model(ids).logits, rtol=0, atol=0)
    (folder / f"{v}-native.json").rename(folder / "packed-v1-native.json")  # an old pair's names: not read
    (folder / f"{v}-native.safetensors").rename(folder / "packed-v1-native.safetensors")
    assert gguf_packed.load(loaded.model.config, folder, "native") is None


# ------------------------------------------------------------------------------------------------ cut short
@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    import gguf_models as gm

    model = gm.tiny_model("llama", vocab_size=256)  # under 1 MB: the message gives its sizes in bytes
    return gm.write_gguf(model, tmp_path_factory.mktemp("tiny") / "tiny.gguf", "Q8_0", tokenizer=False)


def _extents(path: Path) -> tuple[int, int]:
    """(where the tensor data starts, where the last tensor ends), from gguf-py's reader of the whole file."""
    r = GGUFReader(str(path))  # imported by name here, before `no_gguf_reader` replaces the module's
    return min(t.data_offset for t in r.tensors), max(t.data_offset + t.n_bytes for t in r.tensors)


@pytest.fixture
def no_gguf_reader(monkeypatch):
    """gguf-py's reader parses the whole vocabulary first (2.6 s on the bundled file, 12-16 s on Gemma 3's 262k
    tokens) and then fails on the missing tensors with a numpy message: a file cut short must not reach it."""
    import gguf

    def boom(*a, **k):
        raise AssertionError("gguf.GGUFReader was asked to parse a file the header scan should have refused")

    monkeypatch.setattr(gguf, "GGUFReader", boom)


@pytest.mark.parametrize("where", ["in the data", "one byte short", "in the tensor table", "in the metadata"])
def test_a_gguf_cut_short_is_refused_from_its_header_in_words(where, tiny_gguf, tmp_path, cache, no_gguf_reader):
    start, end = _extents(tiny_gguf)
    assert end == tiny_gguf.stat().st_size < 10**6
    cut = {"in the data": (start + end) // 2, "one byte short": end - 1, "in the tensor table": start - 100,
           "in the metadata": 200}[where]
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(tiny_gguf.read_bytes()[:cut])
    t = time.perf_counter()
    with pytest.raises(GGUFError) as e:
        loader.load(ModelConfig(model=str(bad)))
    msg = str(e.value)
    assert time.perf_counter() - t < 1.0 and "\n" not in msg and msg.endswith("truncated download?"), msg
    if cut >= start:  # the file's own size and the extent gguf-py computes for the whole file, both in bytes
        assert f"the file ends at {cut:,} bytes but its tensors need {end:,} bytes" in msg, msg
    else:
        assert f"cut inside its header (the file ends at {cut:,} bytes)" in msg, msg
    assert not cache.exists() or not any(cache.rglob("*"))


def test_a_truncated_download_is_refused_before_torch_loads(bundled_bytes, tmp_path):
    """The user's report: the bundled file cut at 10 MB failed after 12-16 s with a numpy reshape message. It must
    fail in words, in well under a second, before transformers or torch is imported."""
    bad = tmp_path / "model.gguf"
    bad.write_bytes(bundled_bytes[:10_000_000])
    code = ("import sys, time\n"
            "from sinkchat.config import ModelConfig\n"
            "from sinkchat.model import loader\n"
            "t = time.perf_counter()\n"
            "try:\n"
            f"    loader.load(ModelConfig(model={str(bad)!r}))\n"
            "except Exception as e:\n"
            "    print(type(e).__name__, e)\n"
            "print(round(time.perf_counter() - t, 3), 'torch' in sys.modules, 'transformers' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    error, stats = r.stdout.strip().splitlines()
    assert error == ("GGUFError model.gguf: the file ends at 10 MB but its tensors need "
                     f"{len(bundled_bytes) / 1e6:.0f} MB: truncated download?"), r.stdout + r.stderr
    seconds, torch_loaded, transformers_loaded = stats.split()
    assert float(seconds) < 1.0 and torch_loaded == transformers_loaded == "False", stats


@pytest.mark.parametrize("content", [b"", b"hello, this is a text file\n" * 100, b"GGUF", b"GGUF\x03\x00\x00\x00\x05"])
def test_a_file_that_is_no_gguf_or_only_its_start_is_one_line(content, tmp_path, cache, no_gguf_reader):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(content)
    with pytest.raises(GGUFError) as e:
        loader.load(ModelConfig(model=str(bad)))
    msg = str(e.value)
    assert "\n" not in msg and ("is not a GGUF file" in msg or "cut inside its header" in msg), msg
