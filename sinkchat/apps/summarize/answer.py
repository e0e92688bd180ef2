"""Asking for one summary so that the model answers only from what it still holds, and checking the answer.

Window sizing (`Budget`): the chunks of a period are fed as they arrive, and the question (with the digest) and the
answer come after them in the same sink cache. For the model to answer from every line of the period, the period's
tokens plus the question plus the answer budget plus one eviction step must fit in the window: the raw-line budget
is capacity - sinks - eviction step - digest budget - question - answer - one long line. The Summarizer asks as soon
as the next chunk would pass it, so --every / --interval are honoured by asking *more* often, never by letting the
first lines fall out of the cache before the question. A window too small to hold even MIN_RAW tokens of log falls
back to the old stream-through behaviour, and the record still says truthfully how many lines were in full
(`lines_in_cache`, measured on the ledger after the answer).

Asking (`ask`): one generation; its claims are checked (factcheck.py); an unsupported claim rolls the reply back
(the cache and ledger are truncated to before it, as Engine.add_message does for an interrupted message; only
when nothing was evicted meanwhile) and regenerates once with the claim's words banned. A reply cut by the token
limit is trimmed back to its last full sentence. Given the digest, what is still unsupported after that is dropped
sentence by sentence and the digest's incidents the prose leaves out are stated by code (guard.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from sinkchat.apps.summarize.digest import render
from sinkchat.apps.summarize.factcheck import Support, ban_processor, trim_sentence, unsupported
from sinkchat.apps.summarize.guard import guard
from sinkchat.apps.summarize.output import fill

log = logging.getLogger(__name__)

DIGEST_TOKENS = 384  # at most this much of the window goes to the digest text
MIN_RAW = 128  # below this many tokens of room for log lines, fitting is given up (tiny test windows)
LONG_LINE_TOKENS = 160  # one line can overshoot the budget before the check sees it (lines are cut at 500 chars)
TEMPLATE_TOKENS = 16  # chat-template tokens around one message, with slack


@dataclass(frozen=True)
class Budget:
    """How the window is shared between log lines, the digest, the question and the answer."""

    capacity: int
    digest: int
    question: int
    answer: int
    raw: int

    @property
    def fits(self) -> bool:
        return self.raw >= MIN_RAW

    @classmethod
    def for_engine(cls, engine: Any, prompt: str, answer: int) -> "Budget":
        cfg = engine.cache_cfg
        capacity = cfg.capacity
        pinned = cfg.n_sink if cfg.policy == "sink" else 0
        step = getattr(cfg, "evict_chunk", 0) or 0
        digest = min(DIGEST_TOKENS, capacity // 5) if "{digest}" in prompt else 0
        sample = fill(prompt, first_line=999999, last_line=999999, lines=999999, summarized=999999, filtered=999999,
                      deduped=999999, skipped=999999, binary=999999, digest="",
                      note=" 999999 lines were skipped because they came faster than they could be read.")
        question = len(engine.encode(sample)) + TEMPLATE_TOKENS
        raw = capacity - pinned - step - digest - question - answer - LONG_LINE_TOKENS
        return cls(capacity, digest, question, answer, raw)


@dataclass
class Answer:
    """One summary and what the check found."""

    text: str = ""
    unsupported: list[str] = field(default_factory=list)
    regenerated: bool = False
    cut: bool = False  # the reply hit the token limit and was trimmed to its last full sentence
    first_unsupported: list[str] = field(default_factory=list)
    reply: str = ""  # the model's last reply as generated (the one left in the cache)
    prose: str = "none"  # "none" (not asked), "model"; guard.py: "model+digest" or "digest"
    dropped: list[str] = field(default_factory=list)  # the model's sentences taken out (unsupported or unfinished)
    added: list[str] = field(default_factory=list)  # the sentences written by code from the digest
    why: list[str] = field(default_factory=list)  # reasons other than unsupported words ("echoed the question")
    question_tokens: int = 0  # tokens fed for the question (its chat template included)
    question_seconds: float = 0.0  # seconds spent feeding them
    earlier: list[str] = field(default_factory=list)  # model sentences kept on an earlier line, citing it
    cited: list[int] = field(default_factory=list)  # the numbers of the earlier lines they cite
    asked: bool = True  # False: written from the digest without asking the model (a stop left no time)


def lines_in_cache(ledger: Any, chunks: list[tuple[int, int, int]]) -> int:
    """Lines of the fed chunks (absolute token span start, end, lines) whose every token is still in the cache."""
    present = set(ledger.abs_index)
    return sum(n for a, b, n in chunks if all(i in present for i in range(a, b)))


def _generate(engine: Any, events: Callable[[Any], str], max_tokens: int, processors: list[Any]) -> tuple[str, str]:
    holder: dict[str, str] = {"reason": "eos"}

    def watch(evs: Any) -> Any:
        from sinkchat.core.events import DoneEvent

        for ev in evs:
            if isinstance(ev, DoneEvent):
                holder["reason"] = ev.reason
            yield ev

    gen = engine.generate(max_tokens, logits_processors=processors) if processors else engine.generate(max_tokens)
    text = events(watch(gen)).strip()
    return text, holder["reason"]


def _roll_back(engine: Any, length: int, evicted: int, logits: Any, question_tokens: int) -> bool:
    """Take the reply out of the cache, back to just after the question. Eviction during the reply removed the
    oldest unpinned tokens, all before the question (fitting leaves room for it), so the question's last token now
    sits `evicted since` slots earlier; refused when the question itself may have been evicted."""
    gone = engine.ledger.evicted - evicted
    cfg = engine.cache_cfg
    pinned = cfg.n_sink if cfg.policy == "sink" else 0
    new_length = length - gone
    if gone and new_length - question_tokens < pinned:
        return False
    engine.cache.truncate(new_length)
    engine.ledger.truncate(new_length)
    engine.last_logits = logits
    return True


def ask(engine: Any, events: Callable[[Any], str], question: str, support: Support, max_tokens: int,
        retry: bool = True, digest: dict[str, Any] | None = None,
        earlier: list[tuple[int, str]] | None = None) -> Answer:
    """Feed the question, generate, check; regenerate once with unsupported words banned (see the module doc).
    The reply that stays in the cache is recorded in the conversation. With `digest`, the reply then goes through
    guard.py: unsupported sentences out, missing incidents in, a complete last sentence. `earlier`: notable lines
    before the period (number, text); a claim they back is no reason to regenerate, and guard.py keeps a sentence
    they back, citing them."""
    wide = support.extended([t for _, t in earlier]) if earlier else support
    before, t0 = engine.ledger.seen, time.perf_counter()
    events(engine.add_message("user", question))
    question_tokens = engine.ledger.seen - before
    length, evicted, logits = engine.cache.length, engine.ledger.evicted, engine.last_logits
    ans = Answer(question_tokens=question_tokens, question_seconds=time.perf_counter() - t0)
    try:
        text, reason = _generate(engine, events, max_tokens, [])
        bad = unsupported(text, wide)
        ans.first_unsupported = list(bad)
        if bad and retry and _roll_back(engine, length, evicted, logits, question_tokens):
            ban = ban_processor(bad, engine.encode)
            log.info("summary claims unsupported %s; regenerating with %d token(s) banned", bad, len(ban.banned))
            text, reason = _generate(engine, events, max_tokens, [ban])
            ans.regenerated = True
    finally:
        engine.conv.add_reply(engine.reply_text())
    ans.reply = text
    if reason == "length":
        text, ans.cut = trim_sentence(text)
    ans.text, ans.unsupported, ans.prose = text, unsupported(text, support), "model"
    if digest is not None:
        g = guard(text, ans.cut, support, digest, question, earlier)
        ans.text, ans.prose, ans.dropped, ans.added = g.text, g.prose, g.dropped, g.added
        ans.unsupported, ans.why, ans.earlier, ans.cited = g.unsupported, g.why, g.earlier, g.cited
    return ans


def digest_answer(support: Support, digest: dict[str, Any], why: str) -> Answer:
    """The summary written from the digest alone, the model not asked (`why`: "stopped: ..."), held to the same
    rule as any (guard.py)."""
    g = guard("", False, support, digest)
    return Answer(text=g.text, prose=g.prose, added=g.added, why=[why], asked=False)


def settle_conversation(engine: Any, keep: int, sink: Callable[[Any], Any] | None = None) -> None:
    """Close the last turn in the cache and trim the conversation to its last `keep` messages, so its memory and
    the cost of templating the next turn stay flat however long the log runs. The cache is not touched beyond the
    closing text (it already holds, or has evicted, everything before). `sink(ev)` gets the closing feed's events
    (an eviction there is logged like any other)."""
    conv = engine.conv
    try:
        closing = conv.closing()
        if closing is None:
            return  # a template that rewrites history: leave it to the conversation's own fallback
        if closing:
            for ev in engine.feed(closing):
                if sink is not None:
                    sink(ev)
            conv.fed += closing
        conv.trim(keep)
    except Exception as e:  # noqa: BLE001 - a strict template that will not render the kept turns alone
        log.debug("conversation not trimmed: %s", e)


def question_text(prompt: str, p: Any, digest: dict[str, Any], stopping: bool, count_tokens: Callable[[str], int],
                  digest_budget: int) -> str:
    """The question: `prompt` filled with period `p`'s line range, counts, notes and the digest text (cut to
    `digest_budget` tokens; none when 0)."""
    why = "the summarizer was stopped before it fed them" if stopping else "they came faster than they could be read"
    other = p.skipped - p.binary
    note = f" {other} lines were skipped because {why}." if other else ""
    if p.binary:
        note += f" {p.binary} binary (non-text) lines were skipped and are not shown."
    text = render(digest, count_tokens, digest_budget) if digest_budget else ""
    return fill(prompt, first_line=p.first_line, last_line=p.last_line, lines=p.lines, summarized=p.summarized,
                filtered=p.filtered, deduped=p.deduped, skipped=p.skipped, binary=p.binary, note=note, digest=text)
