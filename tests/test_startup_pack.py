"""A first start's quick paths give exactly what the slow ones gave (issue #33 item 3).

- Q4_0 / Q4_1 tiled straight from the file's bytes (`gguf_blocks.q4_tiles`, `gguf_load._q4_module`): the same module,
  attribute for attribute and buffer for buffer, as unpacking every nibble and packing it again (`from_values`), on
  random blocks (q/k rows permuted back too) and on every tensor of the bundled model.
- The light tokenizer's exactness test (`light_tokenizer._same_as_file`): its quick form (tokenizer.json is the
  tokenizer's own pretty serialisation) says yes exactly where the full one (the file read back and serialised) does,
  and gives the same text, on the bundled model and every fixture architecture whose tokenizer is eligible.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from sinkchat.model import gguf_blocks, gguf_convert, gguf_file, gguf_load, gguf_packed, int4, light_tokenizer
from sinkchat.model.int4q0 import Int4Q0Linear
from sinkchat.model.loader import bundled_gguf
from tests.test_gguf_blocks import random_blocks


def slow_module(qtype: int, raw: np.ndarray, heads: int | None = None) -> torch.nn.Module:
    """The module as `module_of` built it before the quick path: values unpacked, then `from_values`."""
    p = gguf_blocks.unpack(qtype, raw)
    q, d, m = (gguf_load._unpermute(a, heads) if heads else a for a in (p.q, p.d, p.m))
    q, d, m = (torch.from_numpy(np.ascontiguousarray(a)) for a in (q, d, m))
    if qtype == T.Q4_0:
        return Int4Q0Linear.from_values(q, d)
    return int4.Int4Linear.from_values(q, d, m, kernels="native")


def assert_same_module(a: torch.nn.Module, b: torch.nn.Module) -> None:
    assert type(a) is type(b)
    assert list(a.__dict__) == list(b.__dict__)  # the packed cache's manifest lists attributes in this order
    assert gguf_packed._attrs(a) == gguf_packed._attrs(b)
    assert [k for k, p in a.named_parameters()] == [k for k, p in b.named_parameters()]
    assert (a.bias is None) == (b.bias is None)
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape, k
        assert sa[k].is_contiguous() and sb[k].is_contiguous(), k
        assert torch.equal(sa[k].view(-1).view(torch.uint8), sb[k].view(-1).view(torch.uint8)), k  # bits, NaN too


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1], ids=lambda t: T(t).name)
@pytest.mark.parametrize("heads", [None, 4])
def test_tiles_from_the_file_bytes_are_the_packed_values(qtype: int, heads: int | None) -> None:
    raw = random_blocks(qtype, rows=64, k=256, seed=7)
    quick = gguf_load._q4_module(qtype, gguf_load._unpermute(raw, heads) if heads else raw)
    assert_same_module(quick, slow_module(qtype, raw, heads))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1], ids=lambda t: T(t).name)
def test_module_of_takes_the_quick_path_and_leaves_odd_row_counts_to_from_values(qtype: int) -> None:
    raw = random_blocks(qtype, rows=48, k=64, seed=3)
    t = gguf_file.TensorInfo(name="blk.0.attn_q.weight", qtype=int(qtype), shape=(48, 64), offset=0,
                             nbytes=raw.nbytes)
    assert_same_module(gguf_load.module_of(io.BytesIO(raw.tobytes()), t, "native", heads=4),
                       slow_module(qtype, raw, heads=4))
    part = gguf_load.module_of(io.BytesIO(raw.tobytes()), t, "native", rows=slice(16, 48))
    assert_same_module(part, slow_module(qtype, raw[16:48]))
    with pytest.raises(ValueError):  # 8 rows: refused as before, by the packing's own shape check
        gguf_load.module_of(io.BytesIO(raw.tobytes()), t, "native", rows=slice(0, 8))


def test_every_q4_tensor_of_the_bundled_model_packs_the_same() -> None:
    path = bundled_gguf()
    info = gguf_file.inspect(path, gguf_file.scan(path))
    seen = 0
    with open(path, "rb") as f:
        for t in info.tensors.values():
            if t.qtype not in (T.Q4_0, T.Q4_1) or len(t.shape) != 2:
                continue
            rows = slice(0, min(t.shape[0], gguf_load.TABLE_CHUNK))  # the token table: packed in chunks
            raw = gguf_load.read_raw(f, t, rows)
            assert_same_module(gguf_load.module_of(f, t, "native", rows=rows), slow_module(t.qtype, raw))
            seen += 1
    assert seen > 100


def full_test(theirs: object, folder) -> str | None:
    """The exactness test as `describe` made it before the quick form: the file read back, serialised, compared."""
    text = str(light_tokenizer._backend(folder).to_str())
    return text if text == theirs.to_str() else None  # type: ignore[attr-defined]


@pytest.mark.parametrize("arch", ["bundled", "llama", "mistral", "phi3", "qwen2"])
def test_the_quick_tokenizer_test_agrees_with_the_full_one(arch, tmp_path, monkeypatch) -> None:
    import gguf_models
    from transformers import AutoTokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    monkeypatch.setenv("SINKCHAT_CACHE_DIR", str(tmp_path / "cache"))
    path = bundled_gguf() if arch == "bundled" else gguf_models.write_gguf(
        gguf_models.tiny_model(arch, seed=1), tmp_path / f"{arch}.gguf", "F32")
    folder = gguf_convert.prepare(path, lambda msg: None)
    real = AutoTokenizer.from_pretrained(str(folder))
    if type(real) is not TokenizersBackend:  # (Qwen2Tokenizer: never light, whatever the file holds)
        return
    theirs = real.backend_tokenizer
    assert theirs.to_str(pretty=True) == (folder / "tokenizer.json").read_text(encoding="utf-8")  # the quick form
    assert light_tokenizer._same_as_file(theirs, folder) == full_test(theirs, folder) is not None
    real.add_bos_token = True  # transformers rebuilds its post-processor: no longer the file's tokenizer
    assert light_tokenizer._same_as_file(real.backend_tokenizer, folder) is None
    assert full_test(real.backend_tokenizer, folder) is None
    compact = folder / "tokenizer.json"  # the same tokenizer written otherwise: only the full test can say so
    compact.write_text(light_tokenizer._backend(folder).to_str(), encoding="utf-8")
    again = AutoTokenizer.from_pretrained(str(folder)).backend_tokenizer
    assert light_tokenizer._same_as_file(again, folder) == full_test(again, folder) is not None


@pytest.mark.parametrize("arch", ["bundled", "llama", "qwen3", "phi3", "gemma2", "gemma3_text"])
def test_served_metadata_is_transformers_own(arch, tmp_path) -> None:
    """`gguf_meta.served` answers transformers' `read_gguf_metadata` (all three ways a conversion calls it) with what
    transformers' own reader returns, and puts the reader back after."""
    import gguf_gemma
    import gguf_models
    import transformers.integrations.gguf as package
    from transformers.integrations.gguf import reader

    from sinkchat.model import gguf_meta

    mod = gguf_gemma if arch.startswith("gemma") else gguf_models
    path = bundled_gguf() if arch == "bundled" else mod.write_gguf(mod.tiny_model(arch, seed=1),
                                                                   tmp_path / f"{arch}.gguf", "Q8_0")
    original = reader.read_gguf_metadata
    kinds = [(), ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"), ("tokenizer.ggml.merges",
                                                                       "tokenizer.ggml.tokens")]
    want = [original(str(path), k) for k in kinds]
    with gguf_meta.served(path):
        for _ in range(2):
            assert [package.read_gguf_metadata(str(path), k) for k in kinds] == want
            assert [reader.read_gguf_metadata(path, k) for k in kinds] == want
        got = package.read_gguf_metadata(str(path))
        got[0].clear()  # a caller's changes stay its own
        assert package.read_gguf_metadata(str(path)) == want[0]
    assert reader.read_gguf_metadata is original is package.read_gguf_metadata
