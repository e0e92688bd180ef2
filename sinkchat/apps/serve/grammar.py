"""Constrained replies for the server: tool calls and JSON answers built from the request's own JSON schemas.

The same engine as the agent's tool calls (llguidance, see apps/agent/constrain.py for why and what it costs), but
from schemas the client sends, not from a toolbox: `tools` become an anyOf of `{"name": <const>, "arguments":
<the function's parameters>}` objects, written with fixed separators so that the reply ends (only EOS is allowed)
the moment the object closes; `tool_choice: "auto"` also allows plain text that does not start with `{`.
`response_format` json_object / json_schema constrain the whole reply to that schema.

This module does not import the agent's (apps may not import each other's insides, tests/test_layout.py); the
token trie is built once per tokenizer here as there (~1 s on a 49k vocabulary).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np
import torch

from sinkchat.model.light_tokenizer import llguidance_tokenizer

log = logging.getLogger(__name__)

SEPARATORS = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
CLOSE_RESERVE = 16  # in its last this-many tokens a constrained reply only closes (as the agent's, constrain.py)
CLOSERS = frozenset('"}]')
_LLTOKENIZERS: dict[tuple[int, int], Any] = {}
_CLOSERS: dict[tuple[int, int], np.ndarray] = {}


class GrammarError(ValueError):
    """A schema llguidance cannot compile; the message is llguidance's, cut to one line."""


def tool_call_schema(tools: list[dict[str, Any]], only: str | None = None) -> dict[str, Any]:
    """The JSON schema of one tool call: `{"name": ..., "arguments": {...}}` for any of `tools` (or just `only`)."""
    alts = [{"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": t["parameters"]},
             "required": ["name", "arguments"], "additionalProperties": False}
            for t in tools if only is None or t["name"] == only]
    return {"anyOf": alts, "x-guidance": SEPARATORS}


def tools_lark(tools: list[dict[str, Any]], choice: str) -> str:
    """The grammar of a reply under `tool_choice`: "required" / a function name: exactly one call; "auto": a call
    or plain text (which may not start with `{` or white space, so it cannot be a call gone wrong)."""
    only = None if choice in ("auto", "required") else choice
    call = f"%json {json.dumps(tool_call_schema(tools, only))}"
    if choice != "auto":
        return f"start: {call}\n"
    return f"start: call | TEXT\ncall: {call}\nTEXT: /[^{{\\s][^\\x00]*/\n"


def schema_lark(schema: dict[str, Any]) -> str:
    """A reply that is one JSON value of `schema` (compact separators: the reply ends when the value does)."""
    s = dict(schema)
    s.setdefault("x-guidance", SEPARATORS)
    return f"start: %json {json.dumps(s)}\n"


def _lltokenizer(tokenizer: Any, vocab: int, eos: list[int]) -> Any:
    key = (id(tokenizer), vocab)
    if key not in _LLTOKENIZERS:
        _LLTOKENIZERS[key] = llguidance_tokenizer(tokenizer, vocab, eos)
    return _LLTOKENIZERS[key]


def compile_lark(lark: str) -> Any:
    """The compiled grammar, or GrammarError with what llguidance said (checked before anything is fed)."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        err = llguidance.LLMatcher.validate_grammar(grammar)
    except Exception as e:  # noqa: BLE001 - llguidance raises ValueError / RuntimeError for bad schemas
        err = str(e) or type(e).__name__
    if err:
        raise GrammarError(" ".join(str(err).split())[:300])
    return grammar


def _closers(lt: Any, key: tuple[int, int], vocab: int) -> np.ndarray:
    """Per token: whether it is made only of `"`, `}`, `]` (it ends a string, an object or an array)."""
    if key not in _CLOSERS:
        out = np.zeros(vocab, dtype=np.bool_)
        for i in range(min(vocab, lt.vocab_size)):
            b = b"" if lt.is_special_token(i) else lt.decode_bytes([i])
            out[i] = bool(b) and set(b.decode("latin-1")) <= CLOSERS
        _CLOSERS[key] = out
    return _CLOSERS[key]


class Constraint:
    """A Sampler logits processor (`fn(recent_ids, logits) -> logits`): only tokens the grammar allows. It keeps
    the matcher itself: on every call but the first it consumes `recent_ids[-1]`, the token sampled after its
    previous mask. A token the matcher refuses (a tokenizer llguidance reads differently) ends the reply.

    `budget` (the reply's max_tokens): in its last CLOSE_RESERVE tokens only closing tokens are allowed where the
    grammar allows any, so a free string closes and the call is whole (measured: a random model's free string
    ran to max_tokens and the client got no tool call at all). `text`: the grammar also allows plain text
    (`tool_choice: "auto"`); the reserve then holds only once the reply has started a call (its first token starts
    with `{`): a text reply forced to closers ended `The weather in Paris"]]]]]]]]]]]]]]]` at max_tokens 20."""

    def __init__(self, engine: Any, grammar: Any, budget: int | None = None, text: bool = False) -> None:
        import llguidance

        tok = engine.tokenizer
        cfg = getattr(engine.model, "config", None)
        self.vocab = max(int(getattr(cfg, "vocab_size", 0) or 0), len(tok))
        eos = sorted(e for e in engine.stop_ids if 0 <= e < self.vocab)
        self._eos = torch.tensor(eos, dtype=torch.long)
        lt = _lltokenizer(tok, self.vocab, eos)
        self.matcher = llguidance.LLMatcher(lt, grammar, log_level=0)
        self._closer = _closers(lt, (id(tok), self.vocab), self.vocab)
        self.closing_at = None if budget is None else max(0, budget - CLOSE_RESERVE)
        self._n = 0
        self._decode = engine.tokenizer.decode
        self._call: bool | None = None if text else True  # is the reply a call? (None: not known yet)
        if self.matcher.is_error():
            raise GrammarError(str(self.matcher.get_error()).splitlines()[0][:300])
        self._bits = np.zeros((self.vocab + 31) // 32, dtype=np.int32)
        self._pending = False
        self.active = True

    @property
    def complete(self) -> bool:
        """The reply so far is a whole value of the grammar."""
        return bool(self.matcher.is_accepting())

    def __call__(self, recent_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return logits
        if self._pending and recent_ids and not self.matcher.consume_token(int(recent_ids[-1])):
            log.warning("grammar refused token %d; ending the reply", recent_ids[-1])
            self.active = False
            out = torch.full_like(logits, float("-inf"))
            out[..., self._eos.to(logits.device)] = logits[..., self._eos.to(logits.device)]
            return out
        if self._pending and self._call is None and recent_ids:
            first = self._decode([int(recent_ids[-1])])
            self._call = first.startswith("{") if first else None
        self._pending = True
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        allowed = np.unpackbits(self._bits.view(np.uint8), count=self.vocab, bitorder="little").view(np.bool_)
        closing = self.closing_at is not None and self._n >= self.closing_at and self._call is True
        if closing and (allowed & self._closer).any():
            allowed = allowed & self._closer
        self._n += 1
        mask = torch.from_numpy(allowed.copy()).to(logits.device)
        n = logits.shape[-1]
        if n > self.vocab:
            mask = torch.cat([mask, mask.new_zeros(n - self.vocab)])
        return torch.where(mask[:n], logits, torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))
