"""The one Engine: owns the model, tokenizer, the persistent sink cache and the ledger of what it holds.

gpt-fast shape: `_forward` (one model call at explicit in-cache positions), `_make_room` (evict before a call), and
`feed` / `generate` built from them. Positions come from one place, the cache length. Every public method is a
generator of events; nothing here prints. A call interrupted mid-forward (Ctrl-C) rolls the cache back to the last
completed step, so the cache and the ledger always agree.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

import torch

from sinkchat.core import calls, messages
from sinkchat.core.cache_policy import Eviction, Ledger, chunk_sizes, eviction_runs, pinned_slots, plan_eviction
from sinkchat.config import CacheConfig, ConfigError, SamplingConfig
from sinkchat.core.events import (PREVIEW_CHARS, DoneEvent, EvictionEvent, Event, ForgottenEvent, GaugeEvent,
                                  PrefillEvent, TokenEvent)
from sinkchat.core.gauge import SinkGauge
from sinkchat.core.interrupts import deferred_sigint
from sinkchat.core.hybrid_cache import local_layout, make_cache
from sinkchat.core.kv_cache import SinkKVCache, resolve_kv_dtype
from sinkchat.core.sampling import LogitsProcessor, Sampler
from sinkchat.core.step import DecodeStep
from sinkchat.textutil import utf8_safe
from sinkchat.core.remembering import Remembering
from sinkchat.core.plain import PlainCompletion, ReplyText, end_turn
from sinkchat.core.tokens import IncrementalDecoder, bos_token, stop_ids  # noqa: F401 - re-exported
from sinkchat.core.turns import Conversation
from sinkchat.model.spec import ModelSpec

if TYPE_CHECKING:
    from sinkchat.memory.recall import RecallMemory
    from sinkchat.model.loader import Loaded

log = logging.getLogger(__name__)

PREFILL_CHUNK = 256


class Engine(Remembering):
    """The one model + one sink cache + its ledger. Injected: the model's `ModelSpec` (built from the model when not
    given), the single-token `step` (None: transformers' forward decodes every token) and the `sampler`; the
    bootstrap (`sinkchat.bootstrap.open_engine`) builds all three from the settings."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        cache: CacheConfig = CacheConfig(),
        sampling: SamplingConfig = SamplingConfig(),
        *,
        spec: ModelSpec | None = None,
        step: DecodeStep | None = None,
        sampler: Sampler | None = None,
        loaded: Loaded | None = None,
        system: str | None = None,
        gauge_every: int = 4,
        prefill_chunk: int = PREFILL_CHUNK,
        rerotate: bool = True,
        kv_dtype: str = "auto",
        memory: RecallMemory | None = None,
    ) -> None:
        """`sampling` is used only without a `sampler`. `kv_dtype`: what the cache stores (auto, float32, bfloat16;
        a snapshot's is converted to it). `loaded`: what the loader reports about the weights (source, quant,
        fingerprint), for logs and snapshots; None for a model built in a test. `memory`: the recall memory
        (`sinkchat.memory`), or None: evicted tokens are dropped."""
        self.model, self.tokenizer = model, tokenizer
        self.spec = (spec or ModelSpec.from_model(model)).check()
        self.loaded = loaded
        self.max_positions = self.spec.context_limit
        self.cache_cfg = cache.resolved(self.max_positions)
        self.sampler = sampler or Sampler(sampling)
        self.rope = self.spec.rope(self.spec.global_layers[0])  # what the policy's (global) layers rotate with
        self.rerotate = rerotate
        self.n_layers = self.spec.n_layers
        self.step = step
        self.kv_store = resolve_kv_dtype(kv_dtype, step is not None, model)  # what the buffers hold
        self.memory = memory
        self.cache = self.new_cache(self.cache_cfg.capacity)
        self.ledger = Ledger()
        self.conv = Conversation(tokenizer, system)
        self.gauge = SinkGauge(model, self.spec)
        self.gauge.capture = memory is not None  # transformers' forward hands the memory its last queries
        self.gauge_every = gauge_every
        self.prefill_chunk = prefill_chunk
        self.device = next(model.parameters()).device
        self.last_logits: torch.Tensor | None = None  # [V] after the last fed token
        self.last_reply_ids: list[int] = []
        self.message_taken_back = False  # the last add_message was interrupted and undone
        self.stop_ids = stop_ids(tokenizer, model)
        self.plain = PlainCompletion.detect(tokenizer, self.stop_ids)  # no chat template: says so once (stderr)
        self.reply_turn = False  # the last thing fed was a message with its generation prompt: a reply answers it
        self.processed = 0  # every token a model call completed (fed or generated): `_forward` counts them
        self.unkept: list[tuple[int, int]] = []  # stream ranges the recall memory lets go (`keep_out`)
        self.copies: list[tuple[int, int]] = []  # those of them that are copies of blocks read again (`feed_query`)
        self._forgotten: list[ForgottenEvent] = []  # what the memory forgot, yielded after the eviction that caused it
        self._peak = 0  # the longest the cache was right after a model call, since the last `take_peak`
        messages.pinned_prefix(self)  # a system prompt too large to pin: one line now, not at the first message

    @property
    def sampling(self) -> SamplingConfig:
        return self.sampler.cfg

    @sampling.setter
    def sampling(self, cfg: SamplingConfig) -> None:
        self.sampler.cfg = cfg

    @property
    def generator(self) -> torch.Generator | None:
        """The sampler's RNG (a snapshot saves and restores its state)."""
        return self.sampler.generator

    @generator.setter
    def generator(self, gen: torch.Generator | None) -> None:
        self.sampler.generator = gen

    # ----------------------------------------------------------------------------------------------- core steps
    def _forward(self, ids: list[int], all_logits: bool = False, record: list[int] | None = None) -> torch.Tensor:
        """Run `ids` at in-cache positions [L, L+q); return logits [q or 1, V].

        Ctrl-C during the model call rolls the cache back to L; once the call returns, the ledger (and `record`)
        are updated before any Ctrl-C is delivered, so the cache and the ledger always agree."""
        L = self.cache.length
        with deferred_sigint() as guard:
            try:
                with guard.interruptible(), torch.no_grad():
                    logits = self._run(ids, L, all_logits)  # [q or 1, V]
            except BaseException:
                self.cache.truncate(L)
                raise
            self.ledger.append(ids)
            if record is not None:
                record.extend(ids)
            self.last_logits = logits[-1].float()
            self.processed += len(ids)
            self._peak = max(self._peak, self.cache.length)
        return logits

    def take_peak(self) -> int:
        """The longest the cache was since the last call (the true peak: eviction makes room before a model call,
        never during one, so right after each call is when it is longest); starts over from now."""
        peak, self._peak = max(self._peak, self.cache.length), self.cache.length
        return peak

    def _run(self, ids: list[int], L: int, all_logits: bool) -> torch.Tensor:
        """One model call at slots [L, L + q): `calls.run` (the decode step, its chunk path, or transformers)."""
        return calls.run(self, ids, L, all_logits)

    def _make_room(self, incoming: int) -> Iterator[EvictionEvent | ForgottenEvent]:
        """Evict per policy so that `incoming` tokens fit; yields one event per eviction."""
        c = self.cache_cfg
        ev = plan_eviction(c.policy, self.pinned_slots(), c.capacity, c.evict_chunk, self.cache.length, incoming)
        if ev is not None:
            yield from self._evict(ev)

    def _evict(self, ev: Eviction) -> list[EvictionEvent | ForgottenEvent]:
        """Drop the slots of `ev`: one event per run of consecutive stream positions, so that a block spanning a gap
        (the old sinks plus the oldest window tokens, right after switching sink -> window) never shows as one
        range that claims everything in between. With the recall memory, what it had to forget follows."""
        events: list[EvictionEvent | ForgottenEvent] = []
        for run in eviction_runs(self.ledger.abs_index, ev):
            events.append(self._evict_run(run))
            events += self._forgotten
            self._forgotten = []
        return events

    def _evict_run(self, ev: Eviction) -> EvictionEvent:
        t0 = time.perf_counter()
        with deferred_sigint():
            kept = self.memory is not None and self._remember(ev)  # copied to the memory before the slots are reused
            self.cache.evict(ev)
            dropped, first, last = self.ledger.evict(ev)
        preview = self.tokenizer.decode(dropped[:PREVIEW_CHARS], skip_special_tokens=False)
        preview = " ".join(preview.split())[:PREVIEW_CHARS]
        c = self.cache_cfg
        return EvictionEvent(ev.count, first, last, preview, c.policy, self.cache.length, time.perf_counter() - t0,
                             kept)

    def _step(
        self, ids: list[int], all_logits: bool = False, record: list[int] | None = None
    ) -> Iterator[EvictionEvent | ForgottenEvent | torch.Tensor]:
        yield from self._make_room(len(ids))
        logits = self._forward(ids, all_logits, record)
        yield from self._forgotten  # blocks the memory could not read back for this call
        self._forgotten = []
        yield logits

    # ----------------------------------------------------------------------------------------------- public API
    @property
    def max_chunk(self) -> int:
        return max(1, min(self.prefill_chunk, self.cache_cfg.capacity - self.pinned_slots()))

    def pinned_slots(self, cfg: CacheConfig | None = None) -> int:
        """Leading slots the policy (`cfg`: the current one, or one about to be applied) never evicts: the sinks, or
        the pinned system prompt where it is longer (`cache_policy.pinned_slots`)."""
        return pinned_slots(cfg or self.cache_cfg, self.ledger.pinned)

    def encode(self, text: str) -> list[int]:
        """Token ids of raw text; lone surrogates (from undecodable input bytes) become U+FFFD, never an error."""
        return list(self.tokenizer.encode(utf8_safe(text), add_special_tokens=False))

    def encode_document(self, text: str) -> list[int]:
        """Token ids of a text fed from the start of a stream (`ppl`, `demo`, `bench`): the BOS first where the
        tokenizer puts one in front of every encoding, as the model was trained (`tokens.bos_token`)."""
        bos = bos_token(self.tokenizer)
        return ([self.tokenizer.bos_token_id] if bos else []) + self.encode(text)

    def feed_ids(self, ids: Iterable[int], all_logits: bool = False) -> Iterator[Event | torch.Tensor]:
        """Prefill `ids` in chunks, evicting between chunks; with all_logits also yields each chunk's logits."""
        ids = list(ids)
        pos, self.reply_turn = 0, False
        sizes = chunk_sizes(len(ids), self.max_chunk)
        if self.memory is not None and sizes and sizes[-1] > 1:  # the last token on its own: it recalls with the
            sizes[-1:] = [sizes[-1] - 1, 1]  # queries of the one before it, not of the previous chunk's end
        for n in sizes:
            t0 = time.perf_counter()
            for item in self._step(ids[pos : pos + n], all_logits):
                if isinstance(item, torch.Tensor):
                    if all_logits:
                        yield item
                else:
                    yield item
            pos += n
            yield PrefillEvent(n, time.perf_counter() - t0, self.cache.length)

    def feed(self, text: str) -> Iterator[Event]:
        """Feed raw text (no template) into the cache."""
        yield from self.feed_ids(self.encode(text))  # type: ignore[misc]

    def add_message(self, role: str, content: str, add_generation_prompt: bool = True, recall: bool = False
                    ) -> Iterator[Event]:
        """Template only the new message (plus assistant header) and feed it (`core/messages.py`).

        Interrupted (Ctrl-C, or the generator closed) before the whole message is in: if nothing was evicted
        meanwhile, the message is taken back entirely (cache, ledger and conversation as before it), so a cut
        prompt never leaves half a message in the model's context. Once feeding it has evicted, the evicted
        tokens cannot come back, so what was fed stays and the conversation keeps the message."""
        yield from messages.add_message(self, role, content, add_generation_prompt, recall)

    def feed_system(self) -> Iterator[Event]:
        """Feed the system prompt alone into a fresh conversation, pinned where `--pin system` pins it, so a caller
        (the agent's task checkpoint) can mark the cache after it; a no-op otherwise (`messages.feed_system`)."""
        yield from messages.feed_system(self)

    def generate(
        self, max_tokens: int | None = None, stop: tuple[str, ...] = (), sampling: SamplingConfig | None = None,
        logits_processors: Sequence[LogitsProcessor] = (),
    ) -> Iterator[Event]:
        """Sample tokens until EOS, a stop string or max_tokens. Each yielded token is already in the cache, so
        closing the generator (Ctrl-C) leaves the cache consistent; `last_reply_ids` holds what was produced.
        `sampling` overrides the settings for this reply; `logits_processors` run before sampling (mlx-lm style:
        each maps (recent ids, logits [V]) to logits, e.g. a grammar mask). A plain reply to a message (no chat
        template) also ends at the next turn's marker, control tokens masked (core/plain.py)."""
        cfg = sampling or self.sampling
        limit = max_tokens or cfg.max_tokens
        if self.last_logits is None:
            raise RuntimeError("nothing has been fed yet")
        turn = self.plain is not None and self.reply_turn
        view, procs = ReplyText.start(self.tokenizer, self.plain, turn, logits_processors)
        self.last_reply_ids = ids = []
        text, reason, t_start = "", "length", time.perf_counter()
        for i in range(limit):
            t0 = time.perf_counter()
            recent = self.ledger.ids[-64:]
            tok = self.sampler(self.last_logits, recent, cfg, procs)
            gauge_now = self.gauge_every > 0 and i % self.gauge_every == 0
            self.gauge.armed = gauge_now
            try:
                for item in self._step([tok], record=ids):  # ids gains tok together with the cache
                    if isinstance(item, (EvictionEvent, ForgottenEvent)):
                        yield item
            finally:
                self.gauge.armed = False
            if tok in self.stop_ids:
                reason, rest = "eos", view.finish()  # text held back at a possible marker that never came
                if rest:
                    text += rest
                    yield TokenEvent(tok, rest, time.perf_counter() - t0, self.cache.length)
                break
            piece = view.add(tok, i == limit - 1, stop)
            text += piece
            yield TokenEvent(tok, piece, time.perf_counter() - t0, self.cache.length)
            if gauge_now:
                g = self.measure_gauge()
                if g is not None:
                    yield g
            if view.stopped:
                reason = "stop"
                break
        if turn and (view.ended or reason == "eos"):
            end_turn(self, view.kept(len(ids)))  # the marker / EOS out of the cache
        yield DoneEvent(reason, len(ids), time.perf_counter() - t_start, text, tuple(self.last_reply_ids))

    @property
    def gauge_n(self) -> int:
        """How many first (and newest) slots the sink gauge measures."""
        return max(1, self.cache_cfg.n_sink or 4)

    def measure_gauge(self, n: int | None = None) -> GaugeEvent | None:
        n = n or self.gauge_n
        return self.gauge.measure(self.cache, n, self.ledger.holds_stream_start())

    def chat(self, content: str, role: str = "user", max_tokens: int | None = None) -> Iterator[Event]:
        """One chat turn: feed the templated user message, generate the reply, record it in the conversation."""
        yield from self.add_message(role, content, recall=True)
        try:
            yield from self.generate(max_tokens)
        finally:
            self.conv.add_reply(self.reply_text())

    def reply_text(self) -> str:
        """The last reply exactly as it is in the cache (special tokens included)."""
        return self.tokenizer.decode(self.last_reply_ids, skip_special_tokens=False)

    # ----------------------------------------------------------------------------------------------- control
    def clear(self) -> None:
        """Empty the cache and the conversation (the system prompt is fed again with the next message)."""
        with deferred_sigint():
            self.cache.reset()
            self.ledger.clear()
            self.conv.reset()
            self.last_logits = None
            self.unkept, self.copies = [], []
            if self.memory is not None:
                self.memory.clear(self.cache)

    def reconfigure(self, **changes: Any) -> list[EvictionEvent]:
        """Change policy / n_sink / capacity / evict_chunk live. Shrinking evicts now; growing reallocates."""
        if "capacity" in changes and "evict_chunk" not in changes:
            changes["evict_chunk"] = 0  # re-derive from the new capacity
        new = replace(self.cache_cfg, **changes).resolved(self.max_positions)
        if self.cache.length and local_layout(self.spec, new.capacity) != local_layout(self.spec, self.cache.capacity):
            raise ConfigError(f"--cache {new.capacity} changes how the local layers (window {self.spec.local_window}) "
                              "hold their tokens; /clear first")
        events: list[EvictionEvent] = []
        excess = self.cache.length - new.capacity
        if excess > 0:
            if new.policy == "dense":
                raise ConfigError(f"the cache holds {self.cache.length} tokens, more than --cache {new.capacity}")
            pinned = self.pinned_slots(new)
            if new.capacity - pinned < 8:
                raise ConfigError(f"--cache {new.capacity} cannot hold the {pinned} pinned tokens plus a window")
            events.extend(self._evict(Eviction(pinned, excess)))
        if new.capacity != self.cache.capacity:
            self._rebuild_cache(new.capacity)
        self.cache_cfg = new
        if new.pin == "none":
            self.ledger.pinned = 0  # --pin none: the system prompt becomes evictable like any other turn
        return events

    def use_memory(self, memory: RecallMemory | None) -> None:
        """Start (a memory) or stop (None) recalling mid-session: the cache's tokens move into a fresh cache built
        for it (a memory reserves its region before the first write). Tokens evicted before a memory existed are
        counted forgotten by it, so `ledger.evicted == memory.tokens + memory.forgotten` holds from the start. The
        caller empties and closes the memory it replaces."""
        with deferred_sigint():
            self.memory = memory
            self.gauge.capture = memory is not None  # transformers' forward hands the memory its last queries
            if memory is not None:
                memory.forgotten = self.ledger.evicted
            self._rebuild_cache(self.cache_cfg.capacity)

    def _rebuild_cache(self, capacity: int) -> None:
        """The cache's tokens into a new cache of `capacity` (as `new_cache` builds it now)."""
        state = self.cache.state()
        self.cache = self.new_cache(capacity)
        if state:
            self.cache.load_state(state)

    @property
    def decoder_status(self) -> str:
        """For status lines: "compiled, kv bfloat16", "compiling, kv bfloat16" (eager meanwhile), "hf, kv float32"."""
        how = self.step.status if self.step is not None else "hf"
        return f"{how}, kv {str(self.kv_store).removeprefix('torch.')}"

    def prepare_decoder(self) -> None:
        """Build the compiled decode step now if the mode asks for one (bench calls this before timing)."""
        if self.step is not None:
            self.step.prepare(self.kv_store)

    def new_cache(self, capacity: int) -> SinkKVCache:
        if self.step is not None:
            self.step.warm_up(self.kv_store)
        cache = make_cache(self.spec, capacity, self.rerotate, self.kv_store)
        if self.memory is not None:
            self.memory.attach(cache)
        return cache

    def set_sampling(self, **changes: Any) -> None:
        self.sampler.reconfigure(**changes)

