"""Constrained decoding of tool calls: a logits processor that only lets the model write a valid call or answer.

Why: unconstrained, the bundled 135M model wrote 0 usable calls in 4 steps of a simple task and 0 valid calls in a
54-step soak (`{"tools": [...]}`, prose, invented keys). With the mask every reply is, token by token, either
`{"tool": "<known tool>", "args": {<arguments matching that tool's JSON schema>}}` or `{"final": "<text>"}` (JSON
protocol), or `<tool_call>{"name": ..., "arguments": ...}</tool_call>` / plain text (native protocol), and the end
of the reply (EOS) is forced as soon as the object is complete.

Library: llguidance (Microsoft's Rust grammar engine behind guidance and llama.cpp's `%llguidance`; one wheel with no
Python dependencies). Measured here on the bundled SmolLM2 tokenizer (49,152 tokens), a 29-token read_file call,
warm: mask computation median 16 us (p90 50 us), applying the bitmask to the logits 30 us (p90 58 us), about 50 us
per token, i.e. ~1% of a 5-7 ms decode step at 150-200 tok/s; building the token trie once costs ~1.3 s (cached
per tokenizer), compiling a toolbox's grammar ~9 ms. xgrammar 0.2.9 computes the mask faster (5 us median) but its
CPU apply took 210 us, and it pulls in triton, apache-tvm-ffi and pydantic; outlines-core builds a regex index per
schema (seconds for anyOf-of-objects grammars). Both were correct on the same call.

The processor keeps the matcher state itself: the Sampler contract gives it `recent_ids` (the newest cache ids,
ending with the token sampled after its previous call), so on every call but the first of a reply it consumes
`recent_ids[-1]`. `begin()` resets it before each reply, which is also what makes it reusable after Ctrl-C closed a
generator mid-reply. Any mismatch (a token the matcher refuses) switches the processor off for the rest of the reply,
with a warning, rather than raising inside the engine's loop.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sinkchat.apps.agent.tools.schema import Tool

log = logging.getLogger(__name__)

STRING_CHARS = 600  # cap on each string argument: a small model in a string can loop until max_tokens
FINAL_CHARS = 400
MAX_PATHS = 300  # a bigger workspace gets free-form paths (the grammar would grow with it)
SEPARATORS = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
_LLTOKENIZERS: dict[tuple[int, int], Any] = {}  # (id(tokenizer), vocab) -> llguidance.LLTokenizer (1.3 s to build)


class ConstraintUnavailable(Exception):
    """The grammar cannot be used here (no llguidance, a tokenizer it cannot read); the agent runs unconstrained."""


def workspace_paths(root: Path | None, limit: int = MAX_PATHS) -> list[str] | None:
    """Every file and folder under `root` (relative, symlinks listed but not followed), or None past `limit`."""
    if root is None:
        return None
    out = ["."]
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        rel = os.path.relpath(dirpath, root)
        for name in dirnames + sorted(filenames):
            out.append(name if rel == "." else f"{rel}/{name}")
            if len(out) > limit:
                return None
    return out


def args_schema(t: Tool, string_chars: int = STRING_CHARS, paths: list[str] | None = None) -> dict[str, Any]:
    """The JSON schema of one tool's arguments, strict: known keys only, required ones present, bounded strings.
    Descriptions are left out: they do not constrain anything and make the grammar bigger. With `paths`, the `path`
    argument of a tool without side effects must name one of them: measured, the bundled model otherwise mangled
    most paths it copied from the task (temps.csv -> temp.csv, docs/readme.md -> docs.md: 15 of 31 tasks failed
    with "not found"). Tools that write keep free paths."""
    props: dict[str, Any] = {}
    for p in t.params:
        s = {k: v for k, v in p.json_schema().items() if k != "description"}
        if paths and p.name == "path" and s.get("type") == "string" and not t.side_effects:
            s = {"enum": paths}
        elif s.get("type") == "string" and "enum" not in s:
            s["maxLength"] = string_chars
        props[p.name] = s
    return {"type": "object", "properties": props, "required": [p.name for p in t.params if p.required],
            "additionalProperties": False}


def json_protocol_schema(tools: list[Tool], string_chars: int = STRING_CHARS, final: bool = True,
                         paths: list[str] | None = None) -> dict[str, Any]:
    """One reply of the JSON protocol (prompts/agent.txt): a call of a known tool, or (`final`) the final answer."""
    calls = [{"type": "object", "properties": {"tool": {"const": t.name}, "args": args_schema(t, string_chars, paths)},
              "required": ["tool", "args"], "additionalProperties": False} for t in tools]
    answer = {"type": "object", "properties": {"final": {"type": "string", "minLength": 1, "maxLength": FINAL_CHARS}},
              "required": ["final"], "additionalProperties": False}
    return {"anyOf": [*calls, answer] if final else calls, "x-guidance": SEPARATORS}


def native_protocol_lark(tools: list[Tool], string_chars: int = STRING_CHARS) -> str:
    """One reply of a template with tool support (Hermes/Qwen style): `<tool_call>{json}</tool_call>` or plain
    text that does not start like a call."""
    calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": args_schema(t, string_chars)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema = json.dumps({"anyOf": calls, "x-guidance": SEPARATORS})
    return (f'start: call | TEXT\ncall: "<tool_call>\\n" %json {schema} "\\n</tool_call>"\n'
            f'TEXT: /[^<{{\\s][^<]{{0,{FINAL_CHARS * 2}}}/\n')


def _lltokenizer(tokenizer: Any, vocab: int, eos: list[int]) -> Any:
    try:
        import llguidance.hf
    except ImportError as e:
        raise ConstraintUnavailable(f"llguidance is not installed ({e})") from None
    key = (id(tokenizer), vocab)
    if key not in _LLTOKENIZERS:
        try:
            _LLTOKENIZERS[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)
        except Exception as e:  # noqa: BLE001 - a slow or fake tokenizer: no constraint, say why
            raise ConstraintUnavailable(f"llguidance cannot read this tokenizer: {type(e).__name__}: {e}") from None
    return _LLTOKENIZERS[key]


class ToolCallConstraint:
    """A Sampler logits processor (`fn(recent_ids, logits) -> logits`) masking every token that would leave the
    tool-call grammar. Call `begin()` before each reply; pass the object in `engine.generate(logits_processors=)`.

    `tokenizer`: the engine's Hugging Face (fast) tokenizer; `vocab`: the model's logits size (tokens past the
    tokenizer are always forbidden); `eos`: the ids that end a reply (the engine's stop ids)."""

    def __init__(self, tokenizer: Any, tools: list[Tool], vocab: int, eos: list[int], native: bool = False,
                 string_chars: int = STRING_CHARS, workspace: Path | None = None) -> None:
        self.vocab, self.tools, self.native, self.string_chars = vocab, tools, native, string_chars
        self.workspace = workspace
        self._lt = _lltokenizer(tokenizer, vocab, sorted(eos))
        self._paths: list[str] | None = workspace_paths(workspace)
        self._compile()
        self._bits = np.zeros((vocab + 31) // 32, dtype=np.int32)
        self._pending = False  # a token was sampled after our previous mask: consume it first
        self.active = True
        self.tokens = 0  # masks computed (all replies)
        self.seconds = 0.0  # time spent computing and applying them (and re-reading the workspace listing)
        self._ninf: torch.Tensor | None = None

    def _compile(self) -> None:
        """Both grammars (call or final; call only) for the current tools and workspace listing: ~10 ms each."""
        import llguidance

        if self.native:
            grammars = [llguidance.LLMatcher.grammar_from_lark(native_protocol_lark(self.tools, self.string_chars))] * 2
        else:
            grammars = [llguidance.LLMatcher.grammar_from_json_schema(
                json_protocol_schema(self.tools, self.string_chars, f, self._paths)) for f in (True, False)]
        self._matchers = [llguidance.LLMatcher(self._lt, g) for g in grammars]  # [call or final, call only]
        for m in self._matchers:
            if m.is_error():
                raise ConstraintUnavailable(f"tool grammar rejected: {m.get_error()}")
        self.matcher = self._matchers[0]

    def begin(self, require_call: bool = False) -> None:
        """A new reply starts: back to the start of the grammar (also after a reply cut off by Ctrl-C).
        `require_call`: no final answer allowed in this reply (JSON protocol; the agent asks for it on a task's
        first step: measured, the bundled model otherwise "answered" from the task text without reading anything,
        e.g. `{"final": "10"}` for a file of 11 lines)."""
        if self.workspace is not None:
            t0 = time.perf_counter()
            paths = workspace_paths(self.workspace)
            if paths != self._paths:  # a file was written since: the readable paths changed
                self._paths = paths
                self._compile()
            self.seconds += time.perf_counter() - t0
        self.matcher = self._matchers[1 if require_call else 0]
        self.matcher.reset()
        self._pending, self.active = False, True

    @property
    def complete(self) -> bool:
        """The reply so far is a whole call or answer."""
        return self.matcher.is_accepting()

    def __call__(self, recent_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return logits
        t0 = time.perf_counter()
        if self._pending and recent_ids:
            tok = int(recent_ids[-1])
            if not self.matcher.consume_token(tok):
                log.warning("tool grammar: token %d was not allowed (%s); unconstrained for the rest of this reply",
                            tok, self.matcher.get_error())
                self.active = False
                return logits
        self._pending = True
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        allowed = np.unpackbits(self._bits.view(np.uint8), count=self.vocab, bitorder="little").view(np.bool_)
        mask = torch.from_numpy(allowed).to(logits.device)
        n = logits.shape[-1]
        if n > self.vocab:
            mask = torch.cat([mask, mask.new_zeros(n - self.vocab)])
        if self._ninf is None or self._ninf.dtype != logits.dtype or self._ninf.device != logits.device:
            self._ninf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
        out = torch.where(mask[:n], logits, self._ninf)
        self.tokens += 1
        self.seconds += time.perf_counter() - t0
        return out


def build_constraint(engine: Any, tools: list[Tool], native: bool,
                     workspace: Path | None = None) -> ToolCallConstraint | None:
    """The constraint for this engine, or None (logged) where it cannot work: an engine double whose `generate`
    takes no processors, a tokenizer llguidance cannot read, no llguidance."""
    import inspect

    try:
        if "logits_processors" not in inspect.signature(engine.generate).parameters:
            raise ConstraintUnavailable("this engine's generate() takes no logits processors")
        tok = engine.tokenizer
        cfg = getattr(getattr(engine, "model", None), "config", None)
        vocab = max(int(getattr(cfg, "vocab_size", 0) or 0), len(tok))
        eos = sorted(getattr(engine, "stop_ids", ()) or ([tok.eos_token_id] if tok.eos_token_id is not None else []))
        if not eos:
            raise ConstraintUnavailable("the tokenizer has no end-of-reply token")
        return ToolCallConstraint(tok, tools, vocab, eos, native, workspace=workspace)
    except (ConstraintUnavailable, ImportError, TypeError, ValueError) as e:
        log.info("tool calls are not constrained: %s", e)
        return None
