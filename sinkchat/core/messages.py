"""Feeding templated messages into the Engine's cache: the system block pinned on its own, and a message that an
interrupt takes back whole.

Split from engine.py (which holds the model calls and eviction) because the rules here are about the conversation:
what gets pinned, what a cut message leaves behind. Functions take the engine; `Engine.add_message` and
`Engine.feed_system` call them.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterator

from sinkchat.config import ConfigError
from sinkchat.core.events import Event
from sinkchat.core.interrupts import deferred_sigint
from sinkchat.core.literal import Span, control_pattern, placed, shifted, text_ids

if TYPE_CHECKING:
    from sinkchat.core.engine import Engine

log = logging.getLogger(__name__)


def pinned_prefix(eng: Engine) -> str:
    """The system block to pin before the next message (`--pin system`), or "" when nothing is to be pinned: only a
    fresh stream under the sink policy pins, since the prefix must sit right after the sinks. Raises ConfigError
    when the prompt would leave the conversation too little of the cache, before anything is fed."""
    c = eng.cache_cfg
    if c.pin != "system" or c.policy != "sink" or eng.cache.length or not eng.conv.system:
        return ""
    block = eng.conv.system_block()
    n = len(spans_ids(eng, block, system_spans(eng, block))) if block else 0
    least = max(8, c.capacity // 4)  # a window under a quarter of the cache would evict every few tokens
    if n and c.capacity - n < least:
        need = n + 8
        while need - n < max(8, need // 4):  # the smallest cache this prompt leaves enough of
            need += 1
        how = (f"pinned, it would leave {c.capacity - n} of the {c.capacity}-token cache for the conversation (at "
               f"least {least} needed)" if n < c.capacity else f"it does not fit in the {c.capacity}-token cache")
        raise ConfigError(f"the system prompt takes {n} tokens; {how}: use --cache {need} or more, a shorter system "
                          "prompt or --pin none")
    return block


@contextmanager
def taken_back(eng: Engine) -> Iterator[None]:
    """Interrupted (Ctrl-C, or the feeding generator closed) inside the block: if nothing was evicted meanwhile, the
    cache, ledger and conversation go back to how they were before it (`eng.message_taken_back` says so), so a cut
    prompt never leaves half a message in the model's context. Once feeding has evicted, the evicted tokens cannot
    come back, so what was fed stays."""
    length, evicted = eng.cache.length, eng.ledger.evicted
    messages, fed, logits = list(eng.conv.messages), eng.conv.fed, eng.last_logits
    eng.message_taken_back = False
    try:
        yield
    except BaseException:
        # a hybrid model's local rings may have let go of tokens they would need back: like an eviction
        if eng.ledger.evicted == evicted and eng.cache.can_truncate(length):
            with deferred_sigint():
                eng.cache.truncate(length)
                eng.ledger.truncate(length)  # and the pinned count with it
                eng.conv.messages, eng.conv.fed, eng.last_logits = messages, fed, logits
                eng.message_taken_back = True
        raise


def add_message(eng: Engine, role: str, content: str, add_generation_prompt: bool = True, recall: bool = False
                ) -> Iterator[Event]:
    """Template only the new message (plus the assistant header) and feed it; the system block first and on its
    own where it is to be pinned (`pinned_prefix`). `recall`: a person's message (the chat, a served request's
    new message, the API's): the memory's blocks it names are read again before it (`Engine.feed_query`); not for
    log chunks, an agent's tasks and tool results, or history fed again."""
    eng.message_taken_back = False
    prefix = pinned_prefix(eng)  # a ConfigError here: nothing fed, nothing to take back
    with taken_back(eng):
        close = closing(eng) if recall and role == "user" else ""
        delta = eng.conv.delta_for(role, content, add_generation_prompt)
        spans = literal_spans(eng, delta, content, add_generation_prompt)  # fed as text (core/literal.py)
        if prefix and delta.startswith(prefix):  # the system block first, on its own: it is what gets pinned
            yield from eng.feed_ids(spans_ids(eng, prefix, spans))
            eng.ledger.pinned = eng.cache.length
            delta, spans = delta[len(prefix) :], shifted(spans, -len(prefix))
        ids = spans_ids(eng, delta, spans)
        if recall and role == "user":  # what the memory holds that the message names, read again before it, at
            head = eng.encode(close) if close and delta.startswith(close) else []
            if head and head + spans_ids(eng, delta[len(close) :], shifted(spans, -len(close))) != ids:  # a turn
                head = []  # boundary: after the last turn's close (not inside it), where the text splits the same
            yield from eng.feed_query(ids[len(head) :], head)
        else:
            yield from eng.feed_ids(ids)
        eng.reply_turn = add_generation_prompt


def literal_spans(eng: Engine, delta: str, content: str, add_generation_prompt: bool) -> list[Span]:
    """Where the new message's content and the system prompt sit in `delta` (core/literal.py), for those that hold a
    control token's text: found by rendering the same turn with a placeholder in their place."""
    pattern, conv = _pattern(eng), eng.conv
    if pattern is None:
        return []
    spans = []
    if content and pattern.search(content):
        span = placed(lambda x: conv.last_delta_with(x, delta, add_generation_prompt), delta, content)
        if span is None:
            log.warning("a message holds a control token's text and the chat template changed it: fed as rendered")
        spans += [span] if span else []
    return spans + system_spans(eng, delta)


def system_spans(eng: Engine, text: str) -> list[Span]:
    """Where the system prompt sits in `text` when `text` starts with the system block and the prompt holds a
    control token's text."""
    pattern, conv = _pattern(eng), eng.conv
    if pattern is None or not conv.system or not pattern.search(conv.system):
        return []
    block = conv.system_block()
    if not block or not text.startswith(block):
        return []
    span = placed(lambda x: replace(conv, system=x, messages=[], fed="").system_block() or None, block, conv.system)
    return [span] if span else []


def _pattern(eng: Engine) -> Any:
    pattern = eng.__dict__.get("_control_re", False)
    if pattern is False:
        pattern = eng.__dict__["_control_re"] = control_pattern(eng.tokenizer)
    return pattern


def spans_ids(eng: Engine, text: str, spans: list[Span]) -> list[int]:
    """Token ids of `text`, the control texts inside `spans` read as text (`literal.text_ids`)."""
    return text_ids(eng.encode, _pattern(eng), text, spans)


def closing(eng: Engine) -> str:
    """What ends the last turn ("<|im_end|>\n" after a cut reply, "\n" after a whole one), where a block read again
    goes before the next message; "" before the first message, or where the template cannot say."""
    if not eng.conv.messages:
        return ""
    try:
        return eng.conv.closing() or ""
    except Exception:  # noqa: BLE001 - a template that cannot render the history alone: the copy goes first
        log.debug("chat template cannot render the history alone", exc_info=True)
        return ""


def feed_system(eng: Engine) -> Iterator[Event]:
    """Feed the system block alone into a fresh conversation (pinned as `add_message` would pin it), so that a
    caller can mark the cache right after it. The agent takes its task checkpoint there: each task then starts
    after the system prompt instead of feeding it again (~1,450 tokens a task with the bundled model's tool
    prompt), the sinks and the prompt stay in the cache for the whole run (the sink gauge read 0.00 in a memory
    soak once set-aside had taken them out), and with the recall memory on only the task's own tokens are set
    aside into it, not one more copy of the prompt a task (~33 MB). Does nothing when anything was fed, when there
    is no system prompt, or when the template does not render the system block as the start of every
    conversation."""
    conv = eng.conv
    if eng.cache.length or conv.fed or conv.messages:
        return
    block = conv.system_prefix()
    if not block:
        return
    with taken_back(eng):
        pin = pinned_prefix(eng) == block
        conv.fed = block  # before the feed, as `delta_for` records it: a cut feed that evicted keeps what it fed
        yield from eng.feed_ids(spans_ids(eng, block, system_spans(eng, block)))
        if pin:
            eng.ledger.pinned = eng.cache.length
        eng.reply_turn = False
    log.debug("system block fed alone: %d tokens%s", eng.cache.length, ", pinned" if pin else "")
