"""The Python API: `sinkchat.load()` returns a `Session`, one model and one persistent sink cache behind a few calls.

    import sinkchat
    s = sinkchat.load(cache=1024, temperature=0)
    print(s.chat("Name a planet."))
    for piece in s.stream("And a moon of it?"):
        print(piece, end="")
    s.save("talk.safetensors")
    s2 = sinkchat.load(resume="talk.safetensors")     # the same conversation, the same cache

Why a layer of its own: before it, Python callers had to reach into `bootstrap.open_engine(build_settings(...))`
and fold Engine events themselves. This module is that fold, once, for scripts, `sinkchat serve` and the benchmarks.
It also owns `EngineState`: everything that makes one conversation in an Engine (cache, ledger, template state,
last logits, RNG), so a server can keep one model and swap per-session caches in and out of it (`capture` /
`install`) without copying a tensor.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

from sinkchat.bootstrap import build_settings, open_engine
from sinkchat.config import ConfigError, Settings

log = logging.getLogger(__name__)

__all__ = ["load", "start", "Session", "EngineState", "capture", "install", "fresh_state", "FRIENDLY"]

# the API's short names -> build_settings keys (every other keyword is passed as it is, and an unknown one is a
# ConfigError naming it)
FRIENDLY = {"cache": "cache_size"}
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty", "max_tokens", "seed")
ROLES = ("user", "system", "assistant")  # what Session.chat / stream feed (a chat template knows these)


# ------------------------------------------------------------------------------------------------ engine state
@dataclass
class EngineState:
    """One conversation's share of an Engine: swapping these in and out lets one model serve many sessions, each
    on its own sink cache. Plain references, no copies: a state is only ever installed in one engine at a time."""

    cache: Any
    cache_cfg: Any
    ledger: dict[str, Any]
    conv: Any
    last_logits: Any = None
    last_reply_ids: list[int] = field(default_factory=list)
    reply_turn: bool = False
    generator: Any = None
    memory: Any = None  # the conversation's own recall memory (None: the engine runs without one)
    unkept: list[tuple[int, int]] = field(default_factory=list)  # its stream ranges the memory lets go (keep_out)
    copies: list[tuple[int, int]] = field(default_factory=list)  # of them, copies of blocks read again


def capture(engine: Any) -> EngineState:
    """The engine's current conversation as a state (the engine keeps using the same objects until `install`)."""
    led = {f.name: getattr(engine.ledger, f.name) for f in fields(engine.ledger)}
    return EngineState(engine.cache, engine.cache_cfg, led, engine.conv, engine.last_logits,
                       list(engine.last_reply_ids), engine.reply_turn, engine.generator, engine.memory,
                       list(getattr(engine, "unkept", [])), list(getattr(engine, "copies", [])))


def install(engine: Any, state: EngineState) -> None:
    """Make `state` the engine's conversation. The ledger is updated in place (its counters and lists), as a
    snapshot load does, so whoever holds `engine.ledger` sees the installed one."""
    engine.cache, engine.cache_cfg, engine.conv = state.cache, state.cache_cfg, state.conv
    for k, v in state.ledger.items():
        setattr(engine.ledger, k, v)
    engine.last_logits, engine.last_reply_ids = state.last_logits, list(state.last_reply_ids)
    engine.reply_turn, engine.generator = state.reply_turn, state.generator
    engine.memory = state.memory
    engine.unkept, engine.copies = list(state.unkept), list(state.copies)


def fresh_state(engine: Any, system: str | None) -> EngineState:
    """A new, empty conversation for `engine` (its own cache buffers, an empty ledger) with `system` as its system
    prompt; the engine's current conversation is untouched."""
    from sinkchat.core.cache_policy import Ledger
    from sinkchat.core.turns import Conversation

    empty = Ledger()
    led = {f.name: getattr(empty, f.name) for f in fields(empty)}
    cache = engine.new_cache(engine.cache_cfg.capacity)
    memory = None
    if engine.memory is not None:  # a memory of its own: another conversation's evicted tokens never come back
        memory = engine.memory.sibling()
        memory.attach(cache)
    return EngineState(cache, engine.cache_cfg, led, Conversation(engine.tokenizer, system), None, [], False, None,
                       memory)


def release(state: EngineState) -> None:
    """A conversation that is over: its recall memory's folder goes (a snapshot of it keeps its own copy)."""
    if state.memory is not None:
        state.memory.close()


# ------------------------------------------------------------------------------------------------ session
class Session:
    """One model and one persistent sink cache. Every call continues the same stream: the cache never fills up
    (the oldest tokens past the sinks are evicted), so a Session can be fed forever in flat memory."""

    def __init__(self, engine: Any, settings: Settings | None = None) -> None:
        self.engine = engine
        self.settings = settings
        self.evictions = 0  # eviction events seen through this Session
        self.last_done: Any = None  # the DoneEvent of the latest reply (reason, tokens, seconds)

    # ---------------------------------------------------------------------------------------- talking
    def chat(self, text: str, role: str = "user", **sampling: Any) -> str:
        """Send one message and return the whole reply (`max_tokens`, `temperature`, ... override the settings
        for this reply only)."""
        return "".join(self.stream(text, role, **sampling))

    def stream(self, text: str, role: str = "user", **sampling: Any) -> Iterator[str]:
        """Send one message and yield the reply as it is generated. Closing the iterator early stops the reply;
        what was generated stays in the cache and the conversation, as after a Ctrl-C in the chat REPL. A bad
        setting, role or message is a ConfigError before anything is fed (it was fed, then refused: the
        conversation held the message and a copy of the previous reply)."""
        plan = self._plan(dict(sampling))
        if not isinstance(text, str):
            raise ConfigError(f"the message must be a string, not {type(text).__name__}")
        if role not in ROLES:
            raise ConfigError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
        self._drain(self.engine.add_message(role, text, recall=role == "user"))
        yield from self._reply(*plan)

    def feed(self, text: str) -> int:
        """Feed raw text (no chat template) into the cache; returns how many tokens it was."""
        if not isinstance(text, str):  # `feed(5)` was an AttributeError from inside the tokenizer
            raise ConfigError(f"the text to feed must be a string, not {type(text).__name__}")
        before = self.engine.ledger.seen
        self._drain(self.engine.feed(text))
        return int(self.engine.ledger.seen - before)

    def generate(self, max_tokens: int | None = None, stop: Sequence[str] = (),
                 logits_processors: Sequence[Any] = (), **sampling: Any) -> str:
        """Continue the stream from what is in the cache (after `feed`, a raw completion); returns the text, up to
        the first of the `stop` strings (left out, as OpenAI's API leaves it out; the cache holds it)."""
        max_tokens, stop, cfg = self._plan({**sampling, "max_tokens": max_tokens, "stop": stop})
        return "".join(self._tokens(max_tokens, stop, logits_processors, cfg))

    def _plan(self, sampling: dict[str, Any]) -> tuple[int | None, tuple[str, ...], Any]:
        """(max_tokens, stop, sampling config or None) from a call's keywords, every one checked: ConfigError
        naming it (a misspelled key, `max_tokens=0`, which meant the default, `temperature="x"`, a TypeError)."""
        unknown = sorted(set(sampling) - set(SAMPLING_KEYS) - {"stop"})
        if unknown:
            raise ConfigError(f"unknown sampling setting {', '.join(map(repr, unknown))}; "
                              f"sampling: {', '.join(SAMPLING_KEYS)}, stop")
        stop = sampling.pop("stop", None) or ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, (list, tuple)) else (None,)
        if not all(isinstance(x, str) and x for x in stop):
            raise ConfigError("stop must be a string or a list of non-empty strings")
        sampling = {k: v for k, v in sampling.items() if v is not None}
        for k, v in sampling.items():
            whole = k in ("max_tokens", "top_k", "seed")
            if isinstance(v, bool) or not isinstance(v, int if whole else (int, float)):
                raise ConfigError(f"{k} must be {'a whole number' if whole else 'a number'}, not {v!r}")
        max_tokens = sampling.pop("max_tokens", None)
        if max_tokens is not None and max_tokens < 1:
            raise ConfigError("max_tokens must be >= 1")
        cfg = replace(self.engine.sampling, **sampling) if sampling else None
        return max_tokens, stop, cfg

    def _reply(self, max_tokens: int | None, stop: tuple[str, ...], cfg: Any) -> Iterator[str]:
        eng = self.engine
        try:
            yield from self._tokens(max_tokens, stop, (), cfg)
        finally:
            eng.conv.add_reply(eng.reply_text())

    def _tokens(self, max_tokens: int | None, stop: tuple[str, ...], procs: Sequence[Any],
                cfg: Any) -> Iterator[str]:
        from sinkchat.core.events import DoneEvent, EvictionEvent, TokenEvent
        from sinkchat.core.stops import StopText

        out = StopText(stop)  # the stop string itself is left out of the text, as OpenAI's API does
        for ev in self.engine.generate(max_tokens, stop, cfg, logits_processors=procs):
            if isinstance(ev, TokenEvent) and ev.text:
                piece = out.add(ev.text)
                if piece:
                    yield piece
            elif isinstance(ev, EvictionEvent):
                self.evictions += 1
            elif isinstance(ev, DoneEvent):
                self.last_done = ev
        rest = out.finish()
        if rest:
            yield rest

    def _drain(self, events: Iterator[Any]) -> None:
        from sinkchat.core.events import EvictionEvent

        for ev in events:
            if isinstance(ev, EvictionEvent):
                self.evictions += 1

    # ---------------------------------------------------------------------------------------- state
    def stats(self) -> dict[str, Any]:
        """What the cache holds and has done: fill, capacity, tokens seen / evicted, messages, last reply."""
        eng = self.engine
        led, cfg = eng.ledger, eng.cache_cfg
        done = self.last_done
        return {"cache_len": int(eng.cache.length), "capacity": int(cfg.capacity), "sinks": int(cfg.n_sink),
                "policy": cfg.policy, "pinned": int(led.pinned), "seen": int(led.seen), "evicted": int(led.evicted),
                "evictions": self.evictions, "messages": len(eng.conv.messages), "processed": int(eng.processed),
                "last_reply": None if done is None else {"reason": done.reason, "tokens": done.tokens,
                                                          "seconds": round(done.seconds, 4)}}

    def save(self, path: str | os.PathLike[str]) -> Path:
        """A snapshot of the whole session (cache, conversation, settings) that `sinkchat.load(resume=path)` or
        the chat REPL's `/load PATH` continues exactly."""
        from sinkchat.store.snapshot import save_snapshot

        return save_snapshot(self.engine, Path(path).expanduser(), {"evictions": {"tokens": int(self.engine.ledger.evicted),
                                                                                   "count": self.evictions}})

    def clear(self) -> None:
        """Empty the cache and the conversation."""
        self.engine.clear()


def start(settings: Settings, system: str | None = None, progress: Any = None) -> Session:
    """A Session on `settings` already built (the CLI apps build theirs from flags with `build_settings`): the one
    way every client, the apps, `serve` and the benchmarks included, opens the model and its sink cache."""
    return Session(open_engine(settings, system, progress), settings)


def settings_for(model: str | None = None, cache: int | None = None, **settings: Any) -> Settings:
    """The Settings `load` builds: friendly names mapped, then `build_settings` (flags > env > .env > defaults),
    which names any unknown key."""
    opts = {FRIENDLY.get(k, k): v for k, v in settings.items()}
    opts["model"] = model
    if opts.get("cache_size") is None:  # `cache_size=` (the settings' own name) wins over the default `cache`
        opts["cache_size"] = cache
    return build_settings(opts, FRIENDLY)


class _DefaultCache(int):
    """`load`'s default cache size (2048), told apart from a caller's own 2048 by identity."""


_CACHE_DEFAULT = _DefaultCache(2048)
_SHAPE = {"cache_size": "capacity", "sinks": "n_sink", "policy": "policy", "evict_chunk": "evict_chunk", "pin": "pin"}


def load(model: str | None = None, cache: int | None = _CACHE_DEFAULT, *,
         resume: str | os.PathLike[str] | None = None, system: str | None = None, progress: Any = None,
         **settings: Any) -> Session:
    """Load a model and return a Session on a fresh sink cache of `cache` tokens (`None`: the configured size).

    `model`: a .gguf file, a Hugging Face folder or None (the bundled demo model); `system`: a system prompt
    (pinned in the cache); `resume`: a snapshot written by `Session.save` (or the chat REPL's /save), which goes on
    with its own cache (size, sinks, policy): one of those given here that differs is a ConfigError, while sampling
    settings given here (`temperature=`, `seed=`, `max_tokens=`, ...) replace the snapshot's; any other keyword is
    a setting (`temperature=0`, `sinks=4`, `policy="sink"`, ...): a misspelled one raises ConfigError naming it."""
    s = settings_for(model, None if cache is _CACHE_DEFAULT and resume is not None else cache, **settings)
    given = {FRIENDLY.get(k, k) for k, v in settings.items() if v is not None}  # what the caller asked for
    if resume is not None:
        from sinkchat.store.snapshot import snapshot_info

        head = snapshot_info(Path(resume).expanduser())
        shape = given | ({"cache_size"} if cache is not None and cache is not _CACHE_DEFAULT else set())
        s = _resumed_cache(s, head.get("cache") or {}, shape, resume)
    session = start(s, system, progress)
    engine = session.engine
    if resume is not None:
        from sinkchat.store.snapshot import load_snapshot

        got = load_snapshot(engine, Path(resume).expanduser())
        record = (got.get("extra") or {}).get("evictions") or {}
        session.evictions = int(record.get("count", 0)) if isinstance(record, dict) else 0
        session.settings = _resumed_sampling(session, s, given)
    return session


def _resumed_cache(s: Settings, saved: dict[str, Any], given: set[str], resume: Any) -> Settings:
    """The settings with the snapshot's cache; a cache setting the caller gave that differs is a ConfigError (it
    was ignored: `load(resume=..., cache=256)` went on at 512, and `settings` said 256)."""
    for key, attr in _SHAPE.items():
        if key in given and attr in saved and getattr(s.cache, attr) != saved[attr]:
            name = next((k for k, v in FRIENDLY.items() if v == key), key)
            raise ConfigError(f"{resume} goes on with its own cache ({attr} {saved[attr]!r}): {name}="
                              f"{getattr(s.cache, attr)!r} cannot apply to it; leave it out, or load without resume")
    kept = {attr: type(getattr(s.cache, attr))(saved[attr]) for attr in _SHAPE.values() if attr in saved}
    return replace(s, cache=replace(s.cache, **kept))


def _resumed_sampling(session: Session, s: Settings, given: set[str]) -> Settings:
    """Sampling settings the caller gave replace the snapshot's (which `load_snapshot` adopted); the Session's
    `settings` then say what runs: the engine's cache and sampling."""
    eng = session.engine
    mine = {k: getattr(s.sampling, k) for k in SAMPLING_KEYS if k in given}
    if mine:
        eng.sampling = replace(eng.sampling, **mine)
        if "seed" in mine:
            from sinkchat.core.sampling import make_generator

            eng.generator = make_generator(mine["seed"])
    return replace(s, cache=eng.cache_cfg, sampling=eng.sampling)
