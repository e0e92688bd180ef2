"""A packed GGUF's tokenizer on a later start through the `tokenizers` library and jinja2 directly, without
transformers' tokenizer classes (issue #33 item 3).

Why: building transformers' `TokenizersBackend` for the bundled model took 0.33 s besides `Tokenizer.from_file`'s
0.18 s, after importing its module (~0.04 s), on a busy 2-core box; and its classes are one of the things that pull
transformers (1.1 s to import there) into a start whose model runs in sinkchat's own kernels.

Exactness: only where the first start's tokenizer was a plain `TokenizersBackend` whose Rust tokenizer is the
folder's `tokenizer.json` unchanged (compared whole, `to_str`, padding and truncation off as transformers encodes),
without space clean-up on decode (`describe`, stored in the light-start sidecar). The attributes sinkchat reads
(special tokens and their ids, `all_special_ids`, the chat template) are the values transformers gave then; encode,
decode and the added tokens are the same Rust tokenizer's; the chat template is rendered as transformers renders it
(`chat_template`). Anything else (a batch, tensors, `tokenize=True`, an attribute this class lacks) is answered by
transformers' own tokenizer, built on first need (`transformers_tokenizer`, logged). `tests/test_light_tokenizer.py`
compares ids, texts and renderings with transformers' on many inputs.

The Rust tokenizer is read from `tokenizer-light.json` where `describe` could write it (`_write_fast`): the same
tokenizer with a BPE's merges as "a b" strings, not pairs, which the `tokenizers` library reads quicker (bundled
model, fresh processes on the busy 2-core box: 0.52 s against 0.64 s, medians of 6); `tests/test_startup_light.py`
checks that its `to_str` is tokenizer.json's.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable

from sinkchat.model import chat_template as templates

log = logging.getLogger(__name__)

FILE = "tokenizer.json"
FAST = "tokenizer-light.json"  # the same tokenizer, quicker to read (`_write_fast`)
NAMED = ("bos_token", "eos_token", "unk_token", "pad_token")  # the named tokens sinkchat reads (and their ids)


def _stat(folder: Path, name: str = FILE) -> list[int]:
    st = (folder / name).stat()
    return [st.st_size, st.st_mtime_ns]


def _backend(folder: Path, fast: Any = None) -> Any:
    """The folder's Rust tokenizer, from FAST when `fast` (its size and mtime when written) still describes it."""
    import tokenizers

    path = folder / FILE
    try:
        if fast is not None and _stat(folder, FAST) == fast:
            path = folder / FAST
    except OSError:  # gone: tokenizer.json, as before
        pass
    try:
        tk = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - a sidecar this tokenizers cannot read (another version): the original
        if path == folder / FILE:
            raise
        log.info("cannot read %s (%s): reading %s", path.name, e, FILE)
        tk = tokenizers.Tokenizer.from_file(str(folder / FILE))
    tk.no_padding()  # transformers turns both off for an encode that neither pads nor truncates
    tk.no_truncation()
    return tk


def describe(tokenizer: Any, folder: Path) -> dict[str, Any] | None:
    """What `LightTokenizer` needs to answer as `tokenizer` (transformers', from `folder`), or None where it would
    not answer exactly: another class, space clean-up on decode, special tokens split, or a Rust tokenizer that is
    not the folder's `tokenizer.json` as written."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    if type(tokenizer) is not TokenizersBackend or getattr(tokenizer, "clean_up_tokenization_spaces", True) or \
            getattr(tokenizer, "split_special_tokens", True) or not (folder / FILE).is_file():
        return None
    template = tokenizer.chat_template
    if not (template is None or isinstance(template, str) or
            (isinstance(template, dict) and all(isinstance(v, str) for v in template.values()))):
        return None
    text = _same_as_file(tokenizer.backend_tokenizer, folder)
    if text is None:
        log.info("the tokenizer of %s is not its tokenizer.json alone: no light tokenizer", folder)
        return None
    return {"file": _stat(folder), "fast": _write_fast(folder, text), "chat_template": template,
            "special_tokens_map": dict(tokenizer.special_tokens_map), "named": {n: getattr(tokenizer, n) for n in NAMED},
            "ids": {n: getattr(tokenizer, f"{n}_id") for n in NAMED},
            "all_special_tokens": list(tokenizer.all_special_tokens),
            "all_special_ids": [int(i) for i in tokenizer.all_special_ids], "name_or_path": str(tokenizer.name_or_path)}


def _same_as_file(theirs: Any, folder: Path) -> str | None:
    """`theirs` (transformers' Rust tokenizer) as `to_str` gives it, padding and truncation off, where the folder's
    tokenizer.json read by `_backend` is that same tokenizer; else None.

    Quick test first: tokenizer.json is `theirs` serialised (`to_str(pretty=True)`, as transformers' save_pretrained
    writes it) character for character, so reading the file deserialises `theirs`' own serialisation, as reading
    `tokenizer-light.json` (written from that same text) always did. Else the full test: the file read back
    (`_backend`) and serialised again is `theirs`' serialisation. Why: reading the file is 0.28 s of a first start
    and the comparison of two serialisations 0.13 s more, against 0.06 s for the one pretty serialisation
    (bundled model, load ~4 on the 2-core box); the two tests agree on every fixture (tests/test_startup_pack.py)."""
    if theirs.padding is None and theirs.truncation is None:
        try:
            same = theirs.to_str(pretty=True) == (folder / FILE).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            same = False
        if same:
            return str(theirs.to_str())
    else:  # (a copy is 0.37 s: only when it must be)
        theirs = copy.copy(theirs)
        theirs.no_padding()
        theirs.no_truncation()
    text = str(_backend(folder).to_str())
    return text if text == theirs.to_str() else None


def _write_fast(folder: Path, text: str) -> list[int] | None:
    """Write FAST beside tokenizer.json: `text` (the folder's tokenizer as `to_str` gives it, padding and truncation
    off) with a BPE's merges as "a b" strings, the form `tokenizers` splits at the one space back into the same pairs
    (it skips a line starting "#version"); return its size and mtime, or None where that would not be the same
    tokenizer (a merge part holding a space, another model) or it cannot be written (then tokenizer.json is read, as
    before). Not read back to check (0.4 s of a first start): `tests/test_startup_light.py` compares the two."""
    data = json.loads(text)
    model = data.get("model") or {}
    merges = model.get("merges")
    if model.get("type") != "BPE" or not isinstance(merges, list) or not all(
            isinstance(m, list) and len(m) == 2 and all(isinstance(x, str) and " " not in x for x in m)
            and not m[0].startswith("#version") for m in merges):
        return None
    model["merges"] = [f"{a} {b}" for a, b in merges]
    fast = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    tmp = None
    try:  # a temp file renamed: a reader sees the old file or the new one
        fd, tmp = tempfile.mkstemp(prefix=".tokenizer-", dir=folder)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(fast)
        os.replace(tmp, folder / FAST)
        return _stat(folder, FAST)
    except OSError as e:
        log.info("could not write %s in %s: %s", FAST, folder, e)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        return None


class Encoded(dict):
    """What `tokenizer(text)` returns, for one text: `input_ids` and `attention_mask`, as keys and attributes."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class LightTokenizer:
    """transformers' tokenizer as sinkchat uses it (see the module doc); other uses go to transformers' own."""

    def __init__(self, folder: Path, info: dict[str, Any]) -> None:
        self._tk = _backend(folder, info.get("fast"))
        self._folder, self._info, self._real = folder, info, None
        self.chat_template = info["chat_template"]
        self.special_tokens_map: dict[str, str] = dict(info["special_tokens_map"])
        self.all_special_tokens: list[str] = list(info["all_special_tokens"])
        self.all_special_ids: list[int] = list(info["all_special_ids"])
        self.name_or_path: str = info["name_or_path"]
        for name in NAMED:
            setattr(self, name, info["named"][name])
            setattr(self, f"{name}_id", info["ids"][name])

    @classmethod
    def load(cls, folder: Path, info: Any) -> LightTokenizer | None:
        """The light tokenizer of `folder` as `describe` recorded it, or None (nothing recorded, or the folder's
        tokenizer.json changed since)."""
        if not isinstance(info, dict):
            return None
        try:
            if _stat(folder) != info["file"]:
                return None
            return cls(folder, info)
        except Exception as e:  # noqa: BLE001 - a missing key, an unreadable file, the tokenizers library's own errors
            log.info("no light tokenizer from %s: %s", folder, e)
            return None

    def transformers_tokenizer(self) -> Any:
        """transformers' tokenizer of the same folder (built once, on the first use this class does not answer)."""
        if self._real is None:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend

            log.info("building transformers' tokenizer of %s", self._folder)
            self._real = TokenizersBackend.from_pretrained(str(self._folder))
        return self._real

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_tk", "_folder", "_info", "_real"):
            raise AttributeError(name)
        return getattr(self.transformers_tokenizer(), name)

    def __len__(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    def __bool__(self) -> bool:
        return True

    @property
    def backend_tokenizer(self) -> Any:
        return self._tk

    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self._tk.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        return self._tk.get_added_tokens_decoder()

    def encode(self, text: Any, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if type(text) is not str or kwargs:
            return self.transformers_tokenizer().encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: Any, add_special_tokens: bool = True, **kwargs: Any) -> Any:
        if type(text) is not str or kwargs:
            return self.transformers_tokenizer()(text, add_special_tokens=add_special_tokens, **kwargs)
        enc = self._tk.encode(text, add_special_tokens=add_special_tokens)
        return Encoded(input_ids=enc.ids, attention_mask=enc.attention_mask)

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> Any:
        ids = _ints(token_ids)
        if ids is None or kwargs:
            return self.transformers_tokenizer().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        return self._tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> Any:
        if isinstance(tokens, str):
            tid = self._tk.token_to_id(tokens)
            return self.unk_token_id if tid is None else tid
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: Any, skip_special_tokens: bool = False) -> Any:
        if isinstance(ids, int):
            return self._tk.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tk.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def get_chat_template(self, chat_template: str | None = None, tools: Any = None) -> str:
        if chat_template is not None:
            return self.transformers_tokenizer().get_chat_template(chat_template, tools)
        return templates.pick(self.chat_template, tools)

    def apply_chat_template(self, conversation: Any, tools: Any = None, add_generation_prompt: bool = False,
                            tokenize: bool = True, **kwargs: Any) -> Any:
        """The rendering of transformers' `apply_chat_template` for `tokenize=False` and plain messages and tools
        (what sinkchat asks); anything else through transformers' tokenizer."""
        if not tokenize and not set(kwargs) & _TRANSFORMERS_ONLY:
            try:
                return templates.render(self.chat_template, conversation, self.special_tokens_map, tools,
                                        add_generation_prompt, **kwargs)
            except templates.NotPlain:
                pass
        return self.transformers_tokenizer().apply_chat_template(
            conversation, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=tokenize, **kwargs)


# apply_chat_template's own arguments (not template variables): rendered by transformers
_TRANSFORMERS_ONLY = frozenset(("documents", "chat_template", "continue_final_message", "sanitize_control_tokens",
                                "padding", "truncation", "max_length", "return_tensors", "return_dict",
                                "return_assistant_tokens_mask", "tokenizer_kwargs"))


def _ints(token_ids: Any) -> list[int] | None:
    """One sequence of ids as a list of ints (an int, a list or tuple of ints, a 1-D tensor), else None."""
    if isinstance(token_ids, int):
        return [token_ids]
    if hasattr(token_ids, "tolist") and getattr(token_ids, "ndim", None) == 1:
        token_ids = token_ids.tolist()
    if isinstance(token_ids, (list, tuple)) and all(isinstance(i, int) for i in token_ids):
        return [int(i) for i in token_ids]
    return None


def tokenizer_json(tokenizer: Any) -> str | None:
    """The Rust tokenizer of `tokenizer` (a `LightTokenizer` or transformers' fast tokenizer) as JSON, padding and
    truncation off, as llguidance's `hf.from_tokenizer` serializes it (None: no Rust tokenizer behind it). Why:
    the agent's and serve's grammars build `llguidance.LLTokenizer` from it without importing transformers."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        return None
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return str(backend.to_str())


def llguidance_tokenizer(tokenizer: Any, n_vocab: int, eos: list[int]) -> Any:
    """llguidance's tokenizer (for the agent's and serve's grammars) from the Rust tokenizer's JSON, as
    `llguidance.hf.from_tokenizer` builds it but without importing transformers (a light tokenizer has no
    transformers class), else `hf.from_tokenizer` itself (which raises ValueError for a slow tokenizer)."""
    import llguidance

    text = tokenizer_json(tokenizer)
    if text is None:
        import llguidance.hf  # imports transformers

        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=eos)
    return llguidance.LLTokenizer(text, n_vocab=n_vocab, eos_token=eos)
