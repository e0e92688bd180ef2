"""A GGUF's transformers config, read from its metadata once, for the first start's conversion (`gguf_convert`).

Why: transformers builds a GGUF's config with `load_gguf_checkpoint`, which parses the whole header with gguf-py's
`GGUFReader` and turns every field part into a Python value: 4.4 s on the bundled file (its 49,152 tokens and 48,900
merges), and `AutoConfig.from_pretrained(gguf_file=...)` and `AutoTokenizer.from_pretrained(gguf_file=...)` each
call it, so a first start parsed the file twice for a config of 20 numbers (and sinkchat's own check a third time).
`config_dict` computes the same dict from transformers' fast metadata reader (`read_gguf_metadata`, 0.02 s: big
string arrays are only counted) with the same mapping tables, and `served` hands it to both calls in place of
`load_gguf_checkpoint`, so they take their usual code paths on the same config. tests/test_startup.py checks the
dict and the converted folder's files against transformers' own, file by file, for every architecture sinkchat maps.

transformers 5.2x reads a GGUF's metadata with its own fast reader (`read_gguf_metadata`) instead, three times in a
conversion (the config, the tokenizer's class, the tokenizer itself), the last with the vocabulary and merges: 0.45-0.56
s on the bundled file (load ~4, 2 cores), nearly all of it numpy's memmap slicing one string at a time. `served` also
answers those calls from the header's bytes read once into a plain `bytes` (transformers' own parsing functions on
them: the same dicts, 0.09-0.15 s), each kind of call parsed once.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger(__name__)


def config_dict(path: Path) -> dict[str, Any]:
    """transformers' `load_gguf_checkpoint(path, return_tensors=False)["config"]` for the architectures sinkchat maps
    (llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3), without gguf-py's parse. The steps below follow that
    function's own (transformers 5.x), minus the branches for architectures sinkchat refuses before this runs."""
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING
    from transformers.integrations.gguf import read_gguf_metadata

    metadata, tensor_names = read_gguf_metadata(str(path))
    arch = metadata["general.architecture"]
    name = metadata.get("general.name")
    # transformers tests `"mistral" in read_field(reader, "general.name")`: membership in a one-item list
    updated = "mistral" if "llama" in arch and name == "mistral" else arch
    if arch not in GGUF_CONFIG_MAPPING and updated not in GGUF_CONFIG_MAPPING:
        raise ValueError(f"GGUF model with architecture {arch} is not supported yet.")
    config: dict[str, Any] = {"tie_word_embeddings": all(t != "output.weight" for t in tensor_names)}
    for key, value in (GGUF_CONFIG_DEFAULTS_MAPPING.get(updated, GGUF_CONFIG_DEFAULTS_MAPPING.get(arch)) or {}).items():
        config.setdefault(key, value)
    for key, value in metadata.items():
        prefix, _, rest = key.replace(arch, updated).partition(".")
        renames = GGUF_CONFIG_MAPPING.get(prefix)
        if renames is None or rest not in renames:
            continue
        value = value[0] if isinstance(value, list) and len(value) == 1 else value
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, updated)
        target = renames[rest]
        if target is not None and target != -1:
            config[target] = value
    if config.get("model_type") == "gemma3":
        config["model_type"] = "gemma3_text"
    if "vocab_size" not in config and isinstance(metadata.get("tokenizer.ggml.tokens"), int):
        config["vocab_size"] = metadata["tokenizer.ggml.tokens"]  # the reader counts big string arrays
    return config


@contextlib.contextmanager
def served(path: Path) -> Iterator[None]:
    """While the block runs, transformers' `load_gguf_checkpoint(path, return_tensors=False)` returns
    {"config": `config_dict(path)`} (a fresh copy each call) instead of parsing the file; any other call goes to
    transformers' own function. Where transformers has no such function (another version), nothing is replaced:
    the conversion is then as slow as before, never different."""
    try:
        from transformers import modeling_gguf_pytorch_utils as mg
    except ImportError:  # pragma: no cover - a transformers without its GGUF module
        yield
        return
    original = getattr(mg, "load_gguf_checkpoint", None)
    if original is None:
        yield
        return
    config = config_dict(path)
    target = str(Path(path).resolve())

    def load_gguf_checkpoint(gguf_checkpoint_path: Any, return_tensors: bool = False, *args: Any, **kwargs: Any
                             ) -> dict[str, Any]:
        if not return_tensors and not args and not kwargs and str(Path(gguf_checkpoint_path).resolve()) == target:
            return {"config": copy.deepcopy(config)}
        return original(gguf_checkpoint_path, return_tensors, *args, **kwargs)

    mg.load_gguf_checkpoint = load_gguf_checkpoint
    try:
        with _metadata_served(path):
            yield
    finally:
        mg.load_gguf_checkpoint = original


@contextlib.contextmanager
def _metadata_served(path: Path) -> Iterator[None]:
    """While the block runs, transformers' `read_gguf_metadata(path, string_arrays)` is answered by its own parsing
    functions on the header's bytes (`bytes`, read once), each `string_arrays` parsed once (a deep copy per call);
    another file, or a transformers without those functions, goes to its own reader."""
    try:
        import transformers.integrations.gguf as package
        from transformers.integrations.gguf import reader
    except ImportError:  # pragma: no cover - another transformers
        yield
        return
    original = getattr(reader, "read_gguf_metadata", None)
    parse, table = getattr(reader, "_read_metadata", None), getattr(reader, "_read_tensor_table", None)
    if original is None or parse is None or table is None:
        yield
        return
    from sinkchat.model import gguf_file

    target, blob = str(Path(path).resolve()), b""
    done: dict[tuple[str, ...], tuple[dict, tuple[str, ...]]] = {}

    def read_gguf_metadata(gguf_path: Any, string_arrays: Any = ()) -> tuple[dict, tuple[str, ...]]:
        nonlocal blob
        if str(Path(gguf_path).resolve()) != target:
            return original(gguf_path, string_arrays)
        key = tuple(sorted(string_arrays))
        if key not in done:
            if not blob:
                with open(target, "rb") as f:
                    blob = f.read(gguf_file.scan(Path(target)).data_start)
            try:  # private helpers: another transformers may take other arguments; then its own reader
                metadata, count, pos = parse(blob, str(gguf_path), key)
                entries, _ = table(blob, count, pos)
            except Exception:  # noqa: BLE001 - any failure of the fast path is the original's to report
                log.debug("transformers' metadata helpers differ: its own reader", exc_info=True)
                return original(gguf_path, string_arrays)
            done[key] = metadata, tuple(name for name, *_ in entries)
        return copy.deepcopy(done[key])

    exported = getattr(package, "read_gguf_metadata", None)  # (the package's lazy attribute, as `from ... import`)
    reader.read_gguf_metadata = read_gguf_metadata
    if exported is not None:
        package.read_gguf_metadata = read_gguf_metadata
    try:
        yield
    finally:
        reader.read_gguf_metadata = original
        if exported is not None:
            package.read_gguf_metadata = exported
