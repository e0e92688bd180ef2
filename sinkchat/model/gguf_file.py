"""What a GGUF file holds, checked before any heavy work: its architecture, every tensor's type, shape and byte
range, and its tokenizer. A file sinkchat cannot run is refused here with one line, before anything is converted,
packed or written to the cache dir.

gguf-py's `GGUFReader` parses the header (it maps the file; nothing is read until a tensor's bytes are asked for).
It is slow on big vocabularies (2.6 s on the bundled file, almost all of it the 49,152 tokens and 48,900 merges
each becoming a numpy array), so the table of tensors it yields is kept in the converted folder and later starts do
not parse the file at all (`TensorInfo`).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

from sinkchat.errors import UserError
from sinkchat.model import gguf_blocks

# general.architecture values whose tensors and config sinkchat maps (llama.cpp writes Mistral as "llama")
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
READABLE = frozenset({T.F32, T.F16, T.BF16, *gguf_blocks.UNPACK})
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
        return T(self.qtype).name

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


def inspect(path: Path) -> GGUFInfo:
    """Parse and check the file: GGUFError (one line) for a bad magic, a truncated file, an architecture or tensor
    type sinkchat does not run, or a vocabulary without a tokenizer."""
    from gguf import GGUFReader

    check_magic(path)
    try:
        reader = GGUFReader(str(path), "r")
    except (ValueError, IndexError, OSError, KeyError, TypeError) as e:  # gguf-py's parse errors, a short file
        raise GGUFError(f"{path.name} is not a readable GGUF file (truncated or damaged: {str(e)[:120]})") from None
    size = os.path.getsize(path)
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path.name}: architecture '{arch}' is not supported (sinkchat reads "
                        f"{', '.join(ARCHITECTURES)} GGUF files)")
    if "tokenizer.ggml.tokens" not in reader.fields or _field(reader, "tokenizer.ggml.model") not in ("gpt2", "llama"):
        raise GGUFError(f"{path.name} has no tokenizer sinkchat can build (tokenizer.ggml.model "
                        f"{_field(reader, 'tokenizer.ggml.model')!r}; a GPT-2 BPE or Llama SentencePiece one is needed)")
    tensors = {}
    for t in reader.tensors:
        info = TensorInfo(t.name, int(t.tensor_type), tuple(int(x) for x in reversed(t.shape.tolist())),
                          int(t.data_offset), int(t.n_bytes))
        _check_tensor(path, info, size)
        tensors[t.name] = info
    key_length = _field(reader, f"{arch}.attention.key_length")
    return GGUFInfo(path=path, architecture=arch, tensors=tensors, size=size,
                    key_length=int(key_length) if key_length is not None else None,
                    tokenizer_key=_tokenizer_key(reader),
                    hparams={k.removeprefix(f"{arch}."): _field(reader, k) for k in reader.fields
                             if k.startswith(f"{arch}.")})


def _tokenizer_key(reader: Any) -> str:
    h = hashlib.sha256()
    for key in sorted(k for k in reader.fields if k.startswith("tokenizer.")):
        h.update(key.encode())
        for part in reader.fields[key].parts:
            h.update(memoryview(part).tobytes())
    return h.hexdigest()[:20]


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return None
    try:
        return f.contents()
    except (ValueError, IndexError):
        return None


def _check_tensor(path: Path, t: TensorInfo, size: int) -> None:
    if t.qtype not in READABLE:
        name = T(t.qtype).name if t.qtype in T._value2member_map_ else f"type {t.qtype}"
        raise GGUFError(f"{path.name}: tensor {t.name} is {name}, which sinkchat does not read; {ADVICE}")
    if t.offset + t.nbytes > size:
        raise GGUFError(f"{path.name} is truncated: tensor {t.name} ends at byte {t.offset + t.nbytes:,}, "
                        f"the file has {size:,}")
    block, _ = GGML_QUANT_SIZES[T(t.qtype)]
    if t.shape and t.shape[-1] % block:
        raise GGUFError(f"{path.name}: tensor {t.name} rows of {t.shape[-1]} do not fill {t.type_name} blocks")
