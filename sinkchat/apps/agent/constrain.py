"""Constrained decoding of tool calls: a logits processor that only lets the model write a valid call or answer.

Why: unconstrained, the bundled 135M model wrote 0 usable calls in 4 steps of a simple task and 0 valid calls in a
54-step soak (`{"tools": [...]}`, prose, invented keys). With the mask every reply is, token by token, either
`{"tool": "<known tool>", "args": {<arguments matching that tool's JSON schema>}}` or `{"final": "<text>"}` (JSON
protocol), or `<tool_call>{"name": ..., "arguments": ...}</tool_call>` / plain text (native protocol), and the end
of the reply (EOS) is forced as soon as the object is complete. The grammar is the reply's JSON schema (grammar.py)
written as Lark (larkgen.py), rebuilt when the workspace listing, the task's target files or the numbers its tool
results held change (`set_task`; ~10-20 ms a matcher, built only when a reply needs it).

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

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sinkchat.apps.agent.grammar import (
    STRING_CHARS, TaskContext, WorkspaceView, json_protocol_lark, json_protocol_schema, native_protocol_lark,
    scan_workspace, shortest_calls,
)
from sinkchat.apps.agent.tools.schema import Tool
from sinkchat.errors import UserError
from sinkchat.model.light_tokenizer import llguidance_tokenizer

log = logging.getLogger(__name__)

MIN_FREE_TOKENS = 24  # a reply budget keeps at least this many tokens before the closing reserve starts
CLOSERS = frozenset('"}]')  # a token made only of these ends a string, an object or an array
_LLTOKENIZERS: dict[tuple[int, int], Any] = {}  # (id(tokenizer), vocab) -> llguidance.LLTokenizer (1.3 s to build)
_TOKEN_INFO: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # same key -> _token_info()


class ConstraintUnavailable(Exception):
    """The grammar cannot be used with this engine or tokenizer (one llguidance cannot read, an engine whose
    generate() takes no processors): the agent runs unconstrained, and `build_constraint` warns on stderr."""


class LlguidanceMissing(UserError):
    """llguidance, a required dependency, cannot be imported: a broken install, shown as one `Error:` line.

    Why an error and not a warning: unconstrained, the bundled model wrote 0 valid calls in a 54-step soak, so a
    run that went on would fail every task, its one hint buried in the log (it was an info line nobody saw). The
    user fixes the install, or says `--no-constrain` and gets exactly that, knowingly. (A tokenizer llguidance
    cannot read is different: reinstalling fixes nothing there, so that is a warning and the run goes on.)"""


def _lltokenizer(tokenizer: Any, vocab: int, eos: list[int]) -> Any:
    try:
        import llguidance  # noqa: F401 - installed? (the message below says how to fix it)
    except ImportError as e:
        raise LlguidanceMissing(f"llguidance, which constrains the agent's tool calls, cannot be imported ({e}): "
                                "reinstall sinkchat (pip install 'llguidance>=1.0,<2'), or run with --no-constrain"
                                ) from None
    key = (id(tokenizer), vocab)
    if key not in _LLTOKENIZERS:
        try:
            _LLTOKENIZERS[key] = llguidance_tokenizer(tokenizer, vocab, eos)
        except Exception as e:  # noqa: BLE001 - a slow or fake tokenizer: no constraint, say why
            raise ConstraintUnavailable(f"llguidance cannot read this tokenizer: {type(e).__name__}: {e}") from None
    return _LLTOKENIZERS[key]


def _token_info(lt: Any, key: tuple[int, int], vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per token: whether it only closes (made of `"`, `}`, `]`), whether it is such a token with a `"`, and its
    length in bytes (once per tokenizer)."""
    if key not in _TOKEN_INFO:
        closer, quote = np.zeros(vocab, dtype=np.bool_), np.zeros(vocab, dtype=np.bool_)
        nbytes = np.zeros(vocab, dtype=np.int32)
        for i in range(min(vocab, lt.vocab_size)):
            b = b"" if lt.is_special_token(i) else lt.decode_bytes([i])
            nbytes[i] = len(b)
            closer[i] = bool(b) and set(b.decode("latin-1")) <= CLOSERS
            quote[i] = b'"' in b
        _TOKEN_INFO[key] = closer, quote & closer, nbytes
    return _TOKEN_INFO[key]


class ToolCallConstraint:
    """A Sampler logits processor (`fn(recent_ids, logits) -> logits`) masking every token that would leave the
    tool-call grammar. Call `begin()` before each reply; pass the object in `engine.generate(logits_processors=)`.

    `tokenizer`: the engine's Hugging Face (fast) tokenizer; `vocab`: the model's logits size (tokens past the
    tokenizer are always forbidden); `eos`: the ids that end a reply (the engine's stop ids).

    Closing within the budget (JSON protocol): `begin(budget=n)` tells it the reply's token limit. `reserve` is
    the most tokens a call can still need once every free string is closed at once (the longest of the grammar's
    shortest calls, enums at their longest, plus slack); in the last `reserve` tokens it closes: of the allowed
    tokens only those made of `"`, `}`, `]` are kept when there are any (with a `"` first), else the longest allowed one (forced key
    text, an enum value, EOS). Measured before: 142 of 1,155 soak replies were cut off mid-call at 96 tokens."""

    def __init__(self, tokenizer: Any, tools: list[Tool], vocab: int, eos: list[int], native: bool = False,
                 string_chars: int = STRING_CHARS, workspace: Path | None = None) -> None:
        self.vocab, self.tools, self.native, self.string_chars = vocab, tools, native, string_chars
        self.workspace, self._hf = workspace, tokenizer
        self._lt = _lltokenizer(tokenizer, vocab, sorted(eos))
        self._eos = torch.tensor(sorted(e for e in eos if 0 <= e < vocab), dtype=torch.long)
        self._closer, self._quote, self._nbytes = _token_info(self._lt, (id(tokenizer), vocab), vocab)
        self.view: WorkspaceView | None = scan_workspace(workspace)
        self.task = TaskContext()  # what the current task lets the grammar offer (set_task)
        self.reserve = 0
        self._compile()
        self._bits = np.zeros((vocab + 31) // 32, dtype=np.int32)
        self._pending = False  # a token was sampled after our previous mask: consume it first
        self.active = True
        self.budget: int | None = None  # this reply's token limit (None: no closing)
        self._n = 0  # masks computed in this reply
        self.tokens = 0  # masks computed (all replies)
        self.seconds = 0.0  # time spent computing and applying them (and re-reading the workspace listing)
        self._ninf: torch.Tensor | None = None

    def set_task(self, ctx: TaskContext) -> None:
        """The task's files to write and grounded numbers changed: rebuild the grammar (~5-10 ms) if they did."""
        if ctx != self.task:
            t0 = time.perf_counter()
            self.task = ctx
            self._compile(lazy=True)
            self.seconds += time.perf_counter() - t0

    def set_tools(self, tools: list[Tool]) -> None:
        """Offer only `tools` from now on (a tool whose every call would be denied is taken out)."""
        if [t.name for t in tools] != [t.name for t in self.tools]:
            self.tools = list(tools)
            self._compile(lazy=True)

    def _compile(self, lazy: bool = False) -> None:
        """Both grammars (call or final; call only) for the current tools, workspace view and task: ~10-20 ms each
        to build a matcher. `lazy`: build each only when a reply needs it (a recompile in a task)."""
        import llguidance

        if self.native:
            lark = native_protocol_lark(self.tools, self.string_chars, self.view, self.task)
            self._grammars = [llguidance.LLMatcher.grammar_from_lark(lark)] * 2
        else:
            schemas = [json_protocol_schema(self.tools, self.string_chars, f, self.view, self.task)
                       for f in (True, False)]
            self._grammars = [llguidance.LLMatcher.grammar_from_lark(json_protocol_lark(s)) for s in schemas]
            self.reserve = self._reserve(schemas[0])
        self._matchers: list[Any] = [None, None]  # [call|final, call]
        if not lazy:
            self.matcher = self._matcher(0)
            self._matcher(1)

    def _matcher(self, i: int) -> Any:
        import llguidance

        if self._matchers[i] is None:
            # log_level 0: a refused token is reported once by __call__, not as llguidance's multi-line parser dump
            m = llguidance.LLMatcher(self._lt, self._grammars[i], log_level=0)
            if m.is_error():
                raise ConstraintUnavailable(f"tool grammar rejected: {m.get_error()}")
            self._matchers[i] = m
        return self._matchers[i]

    def _reserve(self, schema: dict[str, Any]) -> int:
        """Tokens to keep for closing a call: the longest shortest call, plus one per quoted value (a value the
        closing rule writes in more tokens than the tokenizer would) and the end token."""
        texts = shortest_calls(schema)
        return max(len(self._hf.encode(t, add_special_tokens=False)) + t.count('"') // 2 for t in texts) + 2

    def begin(self, require_call: bool = False, budget: int | None = None) -> None:
        """A new reply starts: back to the start of the grammar (also after a reply cut off by Ctrl-C).
        `require_call`: no final answer allowed in this reply (JSON protocol; the agent asks for it on a task's
        first step: measured, the bundled model otherwise "answered" from the task text without reading anything,
        e.g. `{"final": "10"}` for a file of 11 lines). `budget`: the reply's token limit; raised to leave
        MIN_FREE_TOKENS before the reserve (read `self.budget` back and generate with it)."""
        t0 = time.perf_counter()
        if self.workspace is not None:
            view = scan_workspace(self.workspace)
            if view != self.view:  # a file was written since: the paths (or a header) changed
                self.view = view
                self._compile(lazy=True)
        self.matcher = self._matcher(1 if require_call else 0)
        self.seconds += time.perf_counter() - t0
        self.matcher.reset()
        self._pending, self.active, self._n = False, True, 0
        self.budget = None if budget is None or self.native else max(budget, self.reserve + MIN_FREE_TOKENS)

    @property
    def closing_at(self) -> int | None:
        """The index (0-based) of this reply's first token the closing rule shapes: the last `reserve` tokens of
        the budget (None: no budget, no closing). The one place that says where closing starts, so the reserve
        that `_reserve` sizes is exactly what the reply gets."""
        return None if self.budget is None else self.budget - self.reserve

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
                return self._refused(tok, logits)
        self._pending = True
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        allowed = np.unpackbits(self._bits.view(np.uint8), count=self.vocab, bitorder="little").view(np.bool_)
        if self.closing_at is not None and self._n >= self.closing_at:
            allowed = self._closing(allowed)
        self._n += 1
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

    def _refused(self, tok: int, logits: torch.Tensor) -> torch.Tensor:
        """The matcher refused a sampled token (a tokenizer whose pieces llguidance reads differently): end the
        reply here (only the end tokens allowed) rather than let it run unconstrained to the token limit, as it
        once did (512 tokens of a broken call). The agent then reports the reply as unusable, in one line."""
        err = (self.matcher.get_error() or "").splitlines()[0][:120]
        log.warning("tool grammar: token %d was not allowed (%s); ending this reply", tok, err)
        self.active = False
        out = torch.full_like(logits, float("-inf"))
        idx = self._eos.to(logits.device)
        out[..., idx] = logits[..., idx]
        return out

    def _closing(self, allowed: np.ndarray) -> np.ndarray:
        """The reply is in its last `reserve` tokens: only closing tokens (those with a `"` first: in a string `}`
        is text, `"` ends it), else the one longest allowed token."""
        if self._n == self.closing_at:
            log.debug("tool grammar: closing the reply at token %d of %d", self._n, self.budget)
        closing = allowed & self._closer
        if closing.any():
            quoted = closing & self._quote
            return quoted if quoted.any() else closing
        only = np.zeros_like(allowed)
        only[int(np.argmax(np.where(allowed, self._nbytes, -1)))] = True
        return only


def build_constraint(engine: Any, tools: list[Tool], native: bool,
                     workspace: Path | None = None) -> ToolCallConstraint | None:
    """The constraint for this engine, or None where it cannot work (an engine whose `generate` takes no
    processors, a tokenizer llguidance cannot read): then one warning on stderr says the run is unconstrained, as
    with --no-constrain. No llguidance at all is a broken install: LlguidanceMissing (a one-line error)."""
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
    except (ConstraintUnavailable, TypeError, ValueError) as e:
        log.warning("tool calls are not constrained (as with --no-constrain): %s", e)
        return None
