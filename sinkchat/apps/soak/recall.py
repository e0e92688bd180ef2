"""Recall probes of `sinkchat soak` with the recall memory on (`--memory on`): facts planted into the run and asked
for later, in the window and after they left it.

Every `every`-th scenario step the runner asks the `RecallProbe` to act around the step:

- before it, a **memory probe**: one planted fact, chosen at random among those that left the window and that the
  memory still holds, is asked for; then a new fact is **planted** ("Remember this: the code word for the quiet
  harbor is 4821.", with a scripted acknowledgement), its topic and value drawn from a seeded RNG, never the same
  value twice;
- after it, a **window probe**: the newest fact not yet asked while it is in the window (the ceiling: what the
  model answers with the fact in front of it). A scenario that rewinds its cache before each step (the agent's
  fresh task region, which sets the previous task aside into the memory) asks it right after the plant instead.

A probe is the question, then the start of the answer ("The code word for the quiet harbor is", as the passkey
benchmark asks), completed greedily in up to ANSWER_TOKENS tokens; it is right when the completion holds the value.
Asked as a bare question, the bundled model answered in the manner of the self-play chat around it ("The answer to
this question lies in exploring different programming concepts") for 22 of 41 facts that were in the window. Each
probe also records whether the memory recalled a block holding the fact while it answered (in how many layers), so
a wrong answer tells the memory's miss from the model's.

Then the probe is taken back: the question and the answer leave the cache, the ledger and the conversation (what
feeding them evicted stays in the memory, as any eviction), so no probe is seen by a later one or by the scenario.
Left in, the bundled model copied the last probe's answer into the next one ("the code word for the broken tower is
2517", the value of the fact asked before): the in-window share fell from 5/5 to 14/46 in six minutes. Plants stay:
they are the facts. Probes and plants go through the live cache like any step (their tokens count in the run's
token total, their evictions in the memory), but they are not steps: no Outcome, no perplexity bin, no throughput
or latency figure comes from them.

What a probe found is a `Probe`, which the runner counts (running `recall_*` counts in every sample, one `probe`
record each in metrics.jsonl); the criteria judge them (criteria.py: the "recall" row).
"""

from __future__ import annotations

import random
import re
import time
from bisect import bisect_left
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Iterator

from sinkchat.apps.soak.checkpoint import rng_state, set_rng_state
from sinkchat.apps.soak.steps import logged
from sinkchat.core.events import DoneEvent, PrefillEvent
from sinkchat.memory.report import take_recalled

ADJECTIVES = ("quiet", "golden", "frozen", "hidden", "silver", "northern", "crimson", "hollow", "ancient", "bright",
              "distant", "narrow", "wooden", "rusty", "velvet", "lonely", "stormy", "sunken", "broken", "painted",
              "marble", "copper", "misty", "amber")
NOUNS = ("harbor", "lantern", "orchard", "bridge", "tower", "garden", "engine", "library", "valley", "compass",
         "cellar", "island", "market", "chapel", "mirror", "forest", "castle", "river", "meadow", "station",
         "canyon", "bakery", "planet", "violin")
ACK = "OK, I will remember that."
ANSWER_TOKENS = 32  # a probe's completion: the value and what the model adds (SmolLM2 spells a number a digit a
# token; a bare question's 12-token answer "The code word for the copper canyon is 204" was cut off one digit short)


@dataclass
class Fact:
    """A planted fact: its stream indices [first, end) (the plant message, the only place its value is said)."""

    topic: str
    value: str
    first: int
    end: int
    planted: float  # elapsed seconds
    window_probed: bool = False


@dataclass(frozen=True)
class Probe:
    """One probe: where the fact was when it was asked ("window": the plant wholly in the window; "memory": out of
    it, held by the recall memory), its age in stream tokens and seconds, the answer, and whether it was right."""

    where: str
    topic: str
    value: str
    answer: str
    right: bool
    age_tokens: int
    age_s: float
    first: int  # the fact's stream indices [first, end)
    end: int
    block_layers: int = 0  # in how many memory layers a block holding part of the fact was recalled (at one call)


def recalled(answer: str, value: str) -> bool:
    """The answer holds the value as a number of its own ("4821", "is 4,821."), not inside a longer one."""
    return value in re.findall(r"\d+", answer.replace(",", ""))


def in_window(abs_index: list[int], first: int, end: int) -> str:
    """"all" when stream indices [first, end) are all in the window (abs_index: ascending), "none" when none is,
    "some" otherwise. A window only loses its oldest tokens, so the first and the last index tell."""
    if end <= first:
        return "none"
    i = bisect_left(abs_index, first)
    if i < len(abs_index) and abs_index[i] == first:
        j = bisect_left(abs_index, end - 1)
        return "all" if j < len(abs_index) and abs_index[j] == end - 1 else "some"
    return "some" if i < len(abs_index) and abs_index[i] < end else "none"


def held(spans: list[tuple[int, int, int]], first: int, end: int) -> bool:
    """The memory holds every stream index in [first, end) (spans: report.spans' runs (first, last, tokens))."""
    return any(a <= first and end <= b for a, b, _ in spans)


def memory_spans(memory: Any) -> list[tuple[int, int, int]]:
    from sinkchat.memory.report import spans

    return spans(memory)


def disk_usage(memory: Any) -> int | None:
    """Bytes the memory's segment files take on disk, read from the folder itself (not the store's own
    bookkeeping; its small owner file is no block's)."""
    import os

    try:
        return sum(e.stat().st_size for e in os.scandir(memory.store.root)
                   if e.is_file() and e.name.startswith("seg-"))
    except OSError:
        return None


def memory_figures(memory: Any) -> dict[str, Any]:
    """What the memory holds, for a sample: blocks, tokens (blocks and queue), tokens reported forgotten (and of them
    the copies of blocks read again: their originals are held), disk bytes (the store's count and the folder's
    files) and the budget."""
    return {"mem_blocks": memory.blocks, "mem_tokens": memory.tokens, "mem_forgotten": memory.forgotten,
            "mem_copies": getattr(memory, "copies", 0),
            "mem_disk_bytes": memory.disk_bytes, "mem_disk_files": disk_usage(memory),
            "mem_budget": memory.store.budget}


class RecallProbe:
    """Plants facts and asks for them (see the module docstring). `style`: "chat" (messages: chat, summarize,
    agent) or "text" (raw text in a stream); `window_after`: the window probe comes after the scenario's step
    (False: right after the plant, for a scenario that rewinds before each step); `every`: act every this many
    scenario steps; `clock`: the run's elapsed seconds."""

    def __init__(self, style: str = "chat", window_after: bool = True, every: int = 2, seed: int = 0,
                 clock: Callable[[], float] | None = None, slog: Callable[[], Any] | None = None) -> None:
        if style not in ("chat", "text"):
            raise ValueError(f"probe style must be chat or text, not {style!r}")
        self.style, self.window_after, self.every = style, window_after, max(1, every)
        self.rng = random.Random(f"recall-{seed}")
        t0 = time.monotonic()
        self.clock = clock or (lambda: time.monotonic() - t0)
        self.slog = slog or (lambda: None)
        self.facts: list[Fact] = []
        self.values: set[str] = set()
        self.topics: list[str] = []
        self.laps = 0
        self.counts = {"window": 0, "window_ok": 0, "memory": 0, "memory_ok": 0, "planted": 0, "lost": 0, "kept": 0,
                       "taken_back": 0, "window_block": 0, "memory_block": 0}

    @classmethod
    def for_scenario(cls, scenario: Any, **kw: Any) -> "RecallProbe | None":
        """The probe a scenario takes: `recall_style` ("chat", "text"; None: no probes), `recall_window_after`."""
        style = getattr(scenario, "recall_style", "chat")
        if style is None:
            return None
        return cls(style, bool(getattr(scenario, "recall_window_after", True)), **kw)

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (checkpoint.py): the facts planted and still held, what comes next, the counts."""
        return {"rng": rng_state(self.rng), "facts": [asdict(f) for f in self.facts], "values": sorted(self.values),
                "topics": self.topics, "laps": self.laps, "counts": self.counts}

    def load_state(self, d: dict[str, Any]) -> None:
        set_rng_state(self.rng, d["rng"])
        self.facts = [Fact(**f) for f in d["facts"]]
        self.values, self.topics, self.laps = set(d["values"]), list(d["topics"]), int(d["laps"])
        self.counts = {k: int(v) for k, v in d["counts"].items()}

    def due(self, steps: int) -> bool:
        """Act around the next step? Not before the scenario's first step (it sets up its prompt and checkpoint)."""
        return steps > 0 and steps % self.every == 0

    def figures(self) -> dict[str, int]:
        """The running counts a sample carries."""
        c = self.counts
        return {"recall_window": c["window"], "recall_window_ok": c["window_ok"], "recall_memory": c["memory"],
                "recall_memory_ok": c["memory_ok"], "recall_planted": c["planted"], "recall_lost": c["lost"],
                "recall_kept": c["kept"], "recall_tokens_taken_back": c["taken_back"],
                "recall_memory_block": c["memory_block"]}

    # ------------------------------------------------------------------------------------------ the facts
    def _sync(self, engine: Any) -> None:
        """Facts the run no longer holds anywhere are dropped (counted `lost`): those the memory reported forgotten
        (over its budget, a damaged block) and all of them after a clear, which empties the window and the memory."""
        if not self.facts:
            return
        abs_index, spans = engine.ledger.abs_index, memory_spans(engine.memory)
        keep = []
        for f in self.facts:
            if in_window(abs_index, f.first, f.end) == "none" and not held(spans, f.first, f.end):
                self.counts["lost"] += 1
            else:
                keep.append(f)
        self.facts = keep

    def _topic(self) -> str:
        live = {f.topic for f in self.facts}
        for _ in range(2):
            while self.topics:
                t = self.topics.pop()
                if t not in live:
                    return t
            self.laps += 1
            self.topics = [f"{a} {n}" for a in ADJECTIVES for n in NOUNS]
            self.rng.shuffle(self.topics)
        return f"{self.rng.choice(ADJECTIVES)} {self.rng.choice(NOUNS)} {self.laps}"  # every topic still held

    def _value(self) -> str:
        digits = 4
        while True:
            v = str(self.rng.randrange(10 ** (digits - 1), 10**digits))
            if v not in self.values:
                self.values.add(v)
                return v
            if len(self.values) > 10**digits // 2:
                digits += 1

    # ------------------------------------------------------------------------------------------ the actions
    def before(self, engine: Any) -> Iterator[Any]:
        """Before the step: a memory probe (when a fact qualifies), a plant, and the window probe when it does not
        come after the step."""
        self._sync(engine)
        yield from self._probe_memory(engine)
        yield from self._plant(engine)
        if not self.window_after:
            yield from self._probe_window(engine)

    def after(self, engine: Any) -> Iterator[Any]:
        if self.window_after:
            self._sync(engine)
            yield from self._probe_window(engine)

    def _plant(self, engine: Any) -> Iterator[Any]:
        topic, value = self._topic(), self._value()
        text = f"Remember this: the code word for the {topic} is {value}."
        first = engine.ledger.seen
        if self.style == "text":
            yield from self._feed(engine, f"\n\n{text}\n\n")
            end = engine.ledger.seen
        else:
            yield from self._say(engine, "user", text)
            end = engine.ledger.seen
            yield from self._say(engine, "assistant", ACK)
        self.facts.append(Fact(topic, value, first, end, self.clock()))
        self.counts["planted"] += 1

    def window_candidate(self, engine: Any) -> Fact | None:
        """The newest fact not yet asked in the window, if it is wholly in it."""
        abs_index = engine.ledger.abs_index
        return next((f for f in reversed(self.facts)
                     if not f.window_probed and in_window(abs_index, f.first, f.end) == "all"), None)

    def memory_candidates(self, engine: Any) -> list[Fact]:
        """The facts wholly held by the memory (so wholly out of the window: every token is in one place)."""
        spans = memory_spans(engine.memory)
        return [f for f in self.facts if held(spans, f.first, f.end)]

    def _probe_window(self, engine: Any) -> Iterator[Any]:
        f = self.window_candidate(engine)
        if f is not None:
            f.window_probed = True
            yield from self._ask(engine, f, "window")

    def _probe_memory(self, engine: Any) -> Iterator[Any]:
        ready = self.memory_candidates(engine)
        if ready:
            yield from self._ask(engine, self.rng.choice(ready), "memory")

    def _ask(self, engine: Any, f: Fact, where: str) -> Iterator[Any]:
        age_tokens, age_s = engine.ledger.seen - f.end, self.clock() - f.planted
        question = f"What is the code word for the {f.topic}? Answer with the code word only."
        greedy = replace(engine.sampling, temperature=0.0, repetition_penalty=1.0)
        state = _state(engine)
        take_recalled(engine.memory)  # what this probe recalls, from here
        try:
            start = f"The code word for the {f.topic} is"
            if self.style == "text":  # what the memory holds that the question names read again first, as a
                ask = f"\n\nQuestion: {question}\nAnswer: {start}"  # chat message gets it (`Engine.feed_query`)
                yield from logged(engine.feed_query(engine.encode(ask)), self.slog() or _null())
            else:  # logged as an event by the runner, not as turns: it is taken back
                yield from logged(engine.add_message("user", question, recall=True), self.slog() or _null())
                yield from self._feed(engine, start)  # the reply's first words
                engine.reply_turn = True  # still the reply to the question (a model without a chat template)
            done = yield from self._generate(engine, greedy)
            layers = max((r.layers for r in take_recalled(engine.memory) if r.first < f.end and f.first < r.last),
                         default=0)
        finally:
            fed = engine.ledger.seen - state[0]
            if take_back(engine, state):
                self.counts["taken_back"] += fed
            else:
                self.counts["kept"] += 1
        answer = done.text if done else ""
        right = recalled(answer, f.value)
        self.counts[where] += 1
        self.counts[f"{where}_ok"] += right
        self.counts[f"{where}_block"] += layers > 0
        yield Probe(where, f.topic, f.value, answer, right, age_tokens, round(age_s, 3), f.first, f.end, layers)

    # ------------------------------------------------------------------------------------------ engine calls
    def _generate(self, engine: Any, sampling: Any) -> Iterator[Any]:
        done = None
        for ev in logged(engine.generate(ANSWER_TOKENS, sampling=sampling), self.slog() or _null()):
            done = ev if isinstance(ev, DoneEvent) else done
            yield ev
        return done

    def _feed(self, engine: Any, text: str) -> Iterator[Any]:
        yield from logged(engine.feed_ids(engine.encode(text)), self.slog() or _null())

    def _say(self, engine: Any, role: str, text: str) -> Iterator[Any]:
        """A message without a reply to follow (the plant, its scripted acknowledgement), logged as a turn."""
        slog = self.slog() or _null()
        fed, seconds = 0, 0.0
        for ev in logged(engine.add_message(role, text, add_generation_prompt=False), slog):
            if isinstance(ev, PrefillEvent):
                fed, seconds = fed + ev.tokens, seconds + ev.seconds
            yield ev
        slog.turn(role, text, fed, seconds)


def _state(engine: Any) -> tuple[Any, ...]:
    return (engine.ledger.seen, list(engine.conv.messages), engine.conv.fed, engine.last_logits, engine.reply_turn,
            list(engine.last_reply_ids))


def take_back(engine: Any, state: tuple[Any, ...]) -> bool:
    """Take what was fed and generated since `state` (_state) out of the cache, the ledger and the conversation:
    the cache as it was, less what feeding it evicted (which went to the memory). False, and nothing taken back,
    when it is not all at the window's end any more or the cache cannot truncate exactly (a hybrid model's
    local rings that let go of tokens)."""
    from sinkchat.core.interrupts import deferred_sigint

    seen, messages, fed, logits, turn, reply = state
    led = engine.ledger
    k = bisect_left(led.abs_index, seen)
    if led.seen - seen != len(led) - k or not engine.cache.can_truncate(k):
        return False
    with deferred_sigint():
        engine.cache.truncate(k)
        led.truncate(k)
        engine.conv.messages, engine.conv.fed, engine.last_logits = messages, fed, logits
        engine.reply_turn, engine.last_reply_ids = turn, reply
    return True


def _null() -> Any:
    from sinkchat.store.sessionlog import NullLog

    return NullLog()
