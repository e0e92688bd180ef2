"""What a GGUF file holds, checked before any heavy work: its architecture, every tensor's type, shape and byte
range, and its tokenizer. A file sinkchat cannot run is refused here with one line, before anything is converted,
packed or written to the cache dir.

The whole check is `scan`'s walk of the header: it decodes every value but the tokenizer's big arrays, and notes
where each `tokenizer.*` field lies (their bytes are the tokenizer's key). gguf-py's `GGUFReader` did this before
and was slow on big vocabularies (2.6-3.4 s on the bundled file, almost all of it the 49,152 tokens and 48,900
merges each becoming a numpy array; 20 s on Gemma 3's 262k tokens); the table of tensors is kept in the converted
folder, so later starts only `scan`.

Before any of that, `scan` walks the header itself (skipping values it does not need) to find where it ends and where
every tensor's bytes lie: 0.01-0.04 s on the bundled file, 0.04-0.06 s on Gemma 3's 262k-token vocabulary. A file cut short (a truncated download) is refused there, in
words, before gguf-py is asked to map tensors that are not in the file (it then failed with "cannot reshape array of
size 3472320 into shape (262144,680)" after parsing the whole vocabulary: 12-16 s for a Gemma 3 file cut at 10 MB).
The same scan gives the cache its key (`content_key`).
"""

from __future__ import annotations

import functools
import hashlib
import mmap
import os
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sinkchat.errors import UserError
from sinkchat.model import ggml_types

# general.architecture values whose tensors and config sinkchat maps (llama.cpp writes Mistral as "llama")
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
ADVICE = "use a Q4_K_M, Q5_K_M, Q6_K, Q8_0 or Q4_0 file (llama-quantize --allow-requantize converts)"


class GGUFError(UserError, ValueError):
    """A GGUF file sinkchat cannot read; the message says which and why."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: int
    shape: tuple[int, ...]  # as torch sees it: [rows, K] for a matrix (GGUF lists dims innermost first)
    offset: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return ggml_types.name(self.qtype)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "TensorInfo":
        return cls(d["name"], int(d["qtype"]), tuple(d["shape"]), int(d["offset"]), int(d["nbytes"]))


@dataclass(frozen=True)
class GGUFInfo:
    path: Path
    architecture: str
    tensors: dict[str, TensorInfo]
    size: int  # bytes on disk
    key_length: int | None  # {arch}.attention.key_length: the head dim, where transformers' mapping misses it
    tokenizer_key: str  # a hash of every tokenizer.* field: files that share a tokenizer share its conversion
    hparams: dict[str, Any] = field(default_factory=dict)  # every `{arch}.*` field, prefix dropped (arrays as lists)
    name: str = ""  # general.name, for `sinkchat cache list`

    def types(self) -> dict[str, int]:
        """GGUF type name -> how many tensors of it (for messages and the README table)."""
        out: dict[str, int] = {}
        for t in self.tensors.values():
            out[t.type_name] = out.get(t.type_name, 0) + 1
        return out


def check_magic(path: Path) -> None:
    """A file that is not GGUF at all fails here, in a read of four bytes."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise GGUFError(f"cannot read {path}: {e.strerror}") from None
    if head != b"GGUF":
        raise GGUFError(f"{path.name} is not a GGUF file (it starts with {head!r}, not b'GGUF')")


# ------------------------------------------------------------------------------------------------ the header scan
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes
_STRING, _ARRAY = 8, 9
_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_TOKENIZER = b"tokenizer."  # fields whose arrays `scan` skips (the vocabulary) and whose bytes key the tokenizer


class _Short(Exception):
    """The header runs past the end of the file (or a count in it is absurd)."""


@dataclass(frozen=True)
class Header:
    """What `scan` finds: where the header ends, every tensor's byte range, and the metadata values."""

    path: Path
    size: int  # bytes on disk
    data_start: int  # first byte of the tensor data: the header's end, aligned
    tensors: tuple[TensorInfo, ...]  # in the file's order, offsets absolute
    values: dict[str, Any]  # every field's value as gguf-py's `contents()` gives it; tokenizer arrays: None
    tokenizer_spans: tuple[tuple[str, int, int], ...] = ()  # (key, start, end) of each `tokenizer.*` field's bytes

    @property
    def data_end(self) -> int:
        return max((t.offset + t.nbytes for t in self.tensors), default=self.data_start)


class _Cursor:
    def __init__(self, buf: Any, order: str) -> None:
        self.buf, self.pos, self.order = buf, 0, order
        self.u32s, self.u64s = struct.Struct(order + "I"), struct.Struct(order + "Q")

    def u32(self) -> int:
        (v,) = self.u32s.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self) -> int:
        (v,) = self.u64s.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def skip(self, n: int) -> None:
        self.pos += n
        if self.pos > len(self.buf):
            raise _Short

    def string(self) -> bytes:
        n = self.u64()
        self.skip(n)
        return self.buf[self.pos - n:self.pos]

    def count(self, n: int, least: int) -> int:
        """A count of items of at least `least` bytes each, checked against what is left (a damaged count of 2^60
        strings would otherwise loop for minutes)."""
        if n * least > len(self.buf) - self.pos:
            raise _Short
        return n

    def decoded(self, vtype: int, key: bytes) -> Any:
        """One value of type `vtype`, decoded (arrays as lists of their items); a tokenizer array is skipped: None."""
        if vtype == _ARRAY and not key.startswith(_TOKENIZER):
            etype, n = self.u32(), self.u64()
            if etype in _FORMATS:
                size = struct.calcsize(_FORMATS[etype])
                self.skip(self.count(n, size) * size)
                return list(struct.unpack_from(f"{self.order}{n}{_FORMATS[etype]}", self.buf, self.pos - n * size))
            return [self.decoded(etype, key) for _ in range(self.count(n, 1 if etype != _STRING else 8))]
        raw = self.value(vtype)
        if vtype == _STRING:
            return bytes(raw).decode("utf-8", "replace")
        return struct.unpack(self.order + _FORMATS[vtype], raw)[0] if vtype in _FORMATS else None

    def value(self, vtype: int) -> Any:
        """Skip one value of type `vtype`; return it when it is a scalar or a string (arrays: None)."""
        if vtype in _SCALAR_BYTES:
            self.skip(_SCALAR_BYTES[vtype])
            return self.buf[self.pos - _SCALAR_BYTES[vtype]:self.pos]
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise _Short
        etype = self.u32()
        n = self.u64()
        if etype in _SCALAR_BYTES:
            self.skip(self.count(n, _SCALAR_BYTES[etype]) * _SCALAR_BYTES[etype])
        elif etype == _STRING:  # the vocabulary and merges: only the lengths are read (50k strings: ~15 ms)
            unpack, buf, pos = self.u64s.unpack_from, self.buf, self.pos
            for _ in range(self.count(n, 8)):
                pos += 8 + unpack(buf, pos)[0]
            self.pos = pos
            self.skip(0)
        else:
            for _ in range(self.count(n, 12)):
                self.value(etype)
        return None


def scan(path: Path) -> Header:
    """Read a GGUF's header without gguf-py (0.01-0.04 s on the bundled 98 MB file; its vocabulary is most of it) and
    refuse, in one line, a file that is not a GGUF, is cut inside its header, or whose tensors run past its end."""
    check_magic(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            head = _parse(path, buf)
        except (_Short, struct.error):
            raise GGUFError(f"{path.name} is cut inside its header (the file ends at {_size(size)}): "
                            "truncated download?") from None
    end = head.data_end
    if end > size:
        have, need = _size(size), _size(end)
        if have == need:
            have, need = f"byte {size:,}", f"{end:,} bytes"
        raise GGUFError(f"{path.name}: the file ends at {have} but its tensors need {need}: truncated download?")
    return head


def _parse(path: Path, buf: Any) -> Header:
    version = struct.unpack_from("<I", buf, 4)[0]
    order = "<" if version < 0x10000 else ">"  # a big-endian file reads its version byte-swapped
    cur = _Cursor(buf, order)
    cur.pos = 4
    version = cur.u32()
    if version not in (2, 3):
        raise GGUFError(f"{path.name} is GGUF version {version}; sinkchat reads versions 2 and 3 "
                        "(convert it again with a current llama.cpp)")
    n_tensors, n_kv = cur.u64(), cur.u64()
    values: dict[str, Any] = {}
    spans = []
    for _ in range(cur.count(n_kv, 12)):
        start = cur.pos
        key = bytes(cur.string())
        name = key.decode("utf-8", "replace")
        values[name] = cur.decoded(cur.u32(), key)
        if key.startswith(_TOKENIZER):
            spans.append((name, start, cur.pos))
    rows = []
    for _ in range(cur.count(n_tensors, 24)):
        name = bytes(cur.string()).decode("utf-8", "replace")
        n_dims = cur.u32()
        if n_dims > 8:
            raise _Short
        dims = [cur.u64() for _ in range(n_dims)]
        rows.append((name, cur.u32(), dims, cur.u64()))
    align = values.get("general.alignment") or 32
    start = cur.pos + (-cur.pos % align)
    return Header(path, len(buf), start, tuple(_tensor(path, start, *r) for r in rows), values, tuple(spans))


def _tensor(path: Path, start: int, name: str, qtype: int, dims: list[int], offset: int) -> TensorInfo:
    known = ggml_types.known(qtype)
    if known is None:
        raise GGUFError(f"{path.name}: tensor {name} has type {qtype}, which sinkchat does not read; {ADVICE}")
    _, block, type_size = known
    n = 1
    for d in dims:
        n *= d
    return TensorInfo(name, qtype, tuple(reversed(dims)), start + offset, n * type_size // block)


def _size(n: int) -> str:
    """10 MB, 253 MB, 4.7 GB (decimal units, as download sizes are given)."""
    if n >= 10**9:
        return f"{n / 1e9:.1f} GB"
    if n >= 10**6:
        return f"{n / 1e6:.0f} MB" if n >= 10**7 else f"{n / 1e6:.1f} MB"
    return f"{n:,} bytes"


# Samples `content_key` reads besides the header: 64 bytes at the start and middle of every tensor (a requantized
# or fine-tuned tensor changes there) and 32 pieces of 4 KiB evenly over the data.
TENSOR_SAMPLE, SPREAD, SPREAD_BYTES = 64, 32, 4096


def content_key(head: Header) -> str:
    """The identity of a GGUF for the model cache, by content: sha256 of its size, its whole header (metadata,
    tokenizer, tensor table) and fixed samples of its tensor data, so the same file reached by any path, in any
    environment, finds one cache entry, and a changed file another. Not a hash of every byte: sha256 of a 3.7 GB
    file took 6.8 s, at every start; this reads the header and < 1 MB: measured 6 ms on the bundled 98 MB file (84 ms
    with its pages dropped from the page cache), 1.5 ms on a 3.7 GB file (77 ms cold). A change that keeps the size,
    the header and every sampled byte (one hand-edited weight away from the sampled bytes) is missed."""
    h = hashlib.sha256(b"sinkchat-gguf-key-1\0" + head.size.to_bytes(8, "little"))
    with open(head.path, "rb") as f:
        fd = f.fileno()
        h.update(os.pread(fd, head.data_start, 0))
        for t in head.tensors:
            h.update(os.pread(fd, min(TENSOR_SAMPLE, t.nbytes), t.offset))
            h.update(os.pread(fd, min(TENSOR_SAMPLE, t.nbytes), t.offset + t.nbytes // 2))
        span = max(0, head.size - head.data_start - SPREAD_BYTES)
        for i in range(SPREAD):
            h.update(os.pread(fd, SPREAD_BYTES, head.data_start + span * i // (SPREAD - 1)))
    return h.hexdigest()[:20]


def inspect(path: Path, head: Header | None = None) -> GGUFInfo:
    """Parse and check the file: GGUFError (one line) for a bad magic, a truncated file, an architecture or tensor
    type sinkchat does not run, or a vocabulary without a tokenizer. `head`: the file's `scan`, if already made."""
    head = head or scan(path)  # a file cut short is refused here, before gguf-py maps tensors it does not have
    arch = head.values.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path.name}: architecture '{arch}' is not supported (sinkchat reads "
                        f"{', '.join(ARCHITECTURES)} GGUF files)")
    tensors = {}
    for info in head.tensors:
        _check_tensor(path, info)
        tensors[info.name] = info
    values = head.values
    model = values.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in values or model not in ("gpt2", "llama"):
        raise GGUFError(f"{path.name} has no tokenizer sinkchat can build (tokenizer.ggml.model {model!r}; a GPT-2 "
                        "BPE or Llama SentencePiece one is needed)")
    key_length = values.get(f"{arch}.attention.key_length")
    return GGUFInfo(path=path, architecture=arch, tensors=tensors, size=head.size,
                    key_length=int(key_length) if key_length is not None else None,
                    tokenizer_key=_tokenizer_key(head),
                    hparams={k.removeprefix(f"{arch}."): v for k, v in values.items() if k.startswith(f"{arch}.")},
                    name=str(values.get("general.name") or ""))


def _tokenizer_key(head: Header) -> str:
    """A hash of the bytes of every `tokenizer.*` field (key, type and value), in key order: two files with the same
    tokenizer (quantizations of one model) share one conversion of it."""
    h = hashlib.sha256(b"sinkchat-tokenizer-key-2\0")
    with open(head.path, "rb") as f:
        for _, start, end in sorted(head.tokenizer_spans):
            h.update(os.pread(f.fileno(), end - start, start))
    return h.hexdigest()[:20]


@functools.lru_cache(maxsize=None)
def readable() -> frozenset[int]:
    """The GGML types sinkchat reads (from `gguf_blocks`, which imports gguf-py: `inspect` runs at a first start)."""
    from sinkchat.model import gguf_blocks

    return frozenset({ggml_types.F32, ggml_types.F16, ggml_types.BF16, *gguf_blocks.UNPACK})


def _check_tensor(path: Path, t: TensorInfo) -> None:
    if t.qtype not in readable():
        raise GGUFError(f"{path.name}: tensor {t.name} is {t.type_name}, which sinkchat does not read; {ADVICE}")
    block = (ggml_types.known(t.qtype) or ("", 1, 0))[1]  # (every readable type has a size)
    if t.shape and t.shape[-1] % block:
        raise GGUFError(f"{path.name}: tensor {t.name} rows of {t.shape[-1]} do not fill {t.type_name} blocks")
