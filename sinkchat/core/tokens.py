"""Tokenizer-side helpers of the Engine: streaming detokenization, the ids that end a reply, and the BOS a stream
starts with."""

from __future__ import annotations

from typing import Any, Iterable


class IncrementalDecoder:
    """Streams text token by token without splitting multi-byte characters (vLLM's prefix/read offsets). `hidden`:
    ids never shown, besides the special tokens `skip_special_tokens` drops (a base model's control tokens that its
    tokenizer does not mark special, e.g. Gemma's <start_of_image>: see `plain.control_ids`)."""

    def __init__(self, tokenizer: Any, hidden: Iterable[int] = ()) -> None:
        self.tok = tokenizer
        self.hidden = frozenset(hidden)
        self.ids: list[int] = []
        self.prefix = self.read = 0

    def add(self, token_id: int) -> str:
        if token_id in self.hidden:
            return ""
        self.ids.append(token_id)
        before = self.tok.decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        after = self.tok.decode(self.ids[self.prefix :], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""


def stop_ids(tokenizer: Any, model: Any) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(src, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    for tok in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(tok) if hasattr(tokenizer, "convert_tokens_to_ids") else None
        unk = getattr(tokenizer, "unk_token_id", None)
        if isinstance(tid, int) and tid >= 0 and tid != unk:
            ids.add(tid)
    return ids


def bos_token(tokenizer: Any) -> str | None:
    """The BOS token's text where the tokenizer puts one in front of every encoding (Gemma, Llama), else None.

    Why: sinkchat encodes without special tokens (turns are fed one delta at a time), so a stream gets its BOS only
    if the chat template writes `{{ bos_token }}`. Without a template (a base model's GGUF: Gemma 3 270M carries
    none) or in `ppl`, a model trained with a BOS in front saw none: measured on that Gemma 3 270M Q4_K_M file,
    the chat answered "2016161616..." to "What is the capital of France?"; with the BOS it answers in words."""
    bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
    if not bos or bos_id is None:
        return None
    try:
        ids = tokenizer("a").input_ids
    except (TypeError, ValueError, AttributeError):
        return None
    return bos if len(ids) and ids[0] == bos_id else None
