"""Plain completion: replies of a model without a chat template (a base model's GGUF; Gemma 3 270M carries none).

Such a model is fed the transcript format of `turns._plain_render` ("User: ...\\n\\nAssistant: "), which gives it no
token that ends its turn. Measured on Gemma 3 270M Q4_K_M (20 chat questions, greedy and at temperature 0.7 with two
seeds, 120 tokens each, the default system prompt): 50 of the 60 replies ran to max_tokens writing the dialogue on
(122 `User:` and 105 `Assistant:` turns, 3 `assistant:`, 2 `System:`); the other labels it began a line with were
`Answer:` (twice), `Fruit:` and `Student:`, each after a blank line, as the format separates turns, and no label
ever followed a single newline. So a reply ends (`ReplyText`):

- at a line that starts with one of the format's own labels (User, Assistant, System, Tool; any case) and a colon;
- at a paragraph (a line after a blank line) that starts with a speaker label: one or two capitalised words, a
  colon, and speech on the same line ("Student: 1.) Explain..."). A heading ("Ingredients:" then a newline), a list
  line after a single newline ("Name: Bob") or a sentence ("Answer the following questions...") is not one.

The marker is never shown: text from the last line start on is held back while that line may still become one
(at most a few words), and the reply ends before the whitespace in front of it. The Engine then takes the marker's
tokens (and an EOS) back out of the cache, so the cache holds the reply as the transcript renders it and the next
turn's "\\n\\nUser: " follows it exactly (see `Engine.generate`).

`control_ids` are the tokens a plain reply never shows and is never allowed to generate: the tokenizer's special
tokens (Gemma: <pad>, <bos>, <mask>, <start_of_turn>, 6,242 <unusedN>) and its other added tokens except
whitespace runs and HTML tags (Gemma: <start_of_image>, <end_of_image>, [multimodal]; the GGUF marks these "user
defined" like <b>, and transformers does not mark them special, so `skip_special_tokens` printed them). Measured on
the same 60 Gemma replies with the mask off (2,881 steps): these 6,250 tokens held 0.022% of the probability on
average (median 4e-6, p99 0.36%, max 2.6%), <start_of_image> the likeliest of them at 2,849 steps, and never the
argmax. So masking them leaves greedy replies as they were and takes from sampling only tokens that print as raw
markup (the chat that printed <start_of_image> was a longer session). The mask costs ~50 us a token (one
index_fill over 262k logits), against 20-45 ms a token for this model here (22-48 tok/s).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Iterable, Sequence

import torch

from sinkchat.core.interrupts import deferred_sigint
from sinkchat.core.tokens import IncrementalDecoder

log = logging.getLogger(__name__)

NOTICE = "no chat template: plain completion, replies stop at the next 'User:' (or another speaker's line)"

_OWN = ("user", "assistant", "system", "tool")  # the roles `turns._plain_render` writes, capitalised
_WORD = r"[A-Z][\w'’.-]{0,23}"
_SPEAKER = re.compile(rf"{_WORD}(?: {_WORD})?:[ \t]+\S")
_SPEAKER_SO_FAR = re.compile(rf"(?:{_WORD}(?: (?:{_WORD})?)?(?::[ \t]*)?)?")
_HTML_TAG = re.compile(r"</?[a-z][a-z0-9]*>")


def _own_label(line: str) -> str:
    """'marker', 'maybe' (could still become one) or 'no', for the format's own labels."""
    low = line.lower()
    for label in _OWN:
        if label.startswith(low):
            return "maybe"
        if low.startswith(label):
            rest = low[len(label):].lstrip(" \t")
            if rest.startswith(":"):
                return "marker"
            if not rest:
                return "maybe"
    return "no"


def classify(line: str, after_blank: bool) -> str:
    """Whether `line` (the text of a line so far, from its start) is the next turn's marker: 'marker', 'maybe' or
    'no'. Prefix-closed: once 'no', no continuation of the line makes it a marker."""
    own = _own_label(line)
    if own != "no" or not after_blank:
        return own
    if _SPEAKER.match(line):
        return "marker"
    return "maybe" if _SPEAKER_SO_FAR.fullmatch(line) else "no"


class ReplyText:
    """The text of one reply as it streams, token by token.

    `turn=False` (a chat template, or a reply that answers no turn): each token's text as soon as it decodes, as
    before. `turn=True`: text that may be the start of the next turn's marker is held back; `ended` turns True at a
    marker; `kept(n)` says how many of the reply's tokens come before it. `hidden` ids are never shown."""

    def __init__(self, tokenizer: Any, hidden: Iterable[int] = (), turn: bool = False) -> None:
        self.dec = IncrementalDecoder(tokenizer, hidden)
        self.turn = turn
        self.raw = ""  # everything decoded (hidden tokens aside)
        self.shown = 0  # raw[:shown] has been handed out
        self.ends: list[int] = []  # len(raw) after each token
        self.cut: int | None = None  # where the reply ends in raw: before the marker and the whitespace in front
        self.hit = False  # a stop string (the caller's) is in the text

    @classmethod
    def start(cls, tokenizer: Any, plain: PlainCompletion | None, turn: bool,
              processors: Sequence[Any]) -> tuple[ReplyText, Sequence[Any]]:
        """The view of a new reply and the logits processors to sample it with: a plain reply to a message (`turn`)
        also gets the control-token mask."""
        if plain is None:
            return cls(tokenizer), processors
        return cls(tokenizer, plain.hidden, turn), (*processors, plain.mask) if turn else processors

    @property
    def ended(self) -> bool:
        """A turn marker ended the reply."""
        return self.cut is not None

    @property
    def stopped(self) -> bool:
        """A turn marker or a stop string ended the reply."""
        return self.hit or self.cut is not None

    def add(self, token_id: int, last: bool = False, stop: Sequence[str] = ()) -> str:
        """The text to show after this token (`last`: no token follows, so nothing is held back). A stop string in
        the text decoded so far releases everything (the caller reads it in the text, as without a template)."""
        self.raw += self.dec.add(token_id)
        self.ends.append(len(self.raw))
        if stop and any(s in self.raw for s in stop):
            self.hit = True
            return self._release(len(self.raw))
        if not self.turn:
            return self._release(len(self.raw))
        start = self.raw.rfind("\n") + 1  # the last line's start; 0: still the reply's first line
        run = start  # the whitespace in front of the line starts here (read from the tail, not the whole reply)
        while run and self.raw[run - 1].isspace():
            run -= 1
        state = "no" if start == 0 else classify(self.raw[start:], self.raw.count("\n", run, start) >= 2)
        if state == "marker":
            self.cut = run
            return self._release(run)
        if state == "maybe" and not last:
            return self._release(run)
        return self._release(len(self.raw.rstrip()) if last else len(self.raw))

    def finish(self) -> str:
        """What is still held back, when the reply ends without a marker (EOS, a stop string); trailing whitespace
        is dropped."""
        return "" if self.ended else self._release(len(self.raw.rstrip()))

    def kept(self, n_tokens: int) -> int:
        """How many of the reply's first `n_tokens` tokens to keep in the cache: those whose text ends by the
        reply's end (the marker's tokens, trailing whitespace and an EOS go)."""
        end = self.cut if self.cut is not None else len(self.raw.rstrip())
        return min(n_tokens, sum(1 for e in self.ends if e <= end))

    def _release(self, upto: int) -> str:
        if upto <= self.shown:
            return ""
        out, self.shown = self.raw[self.shown : upto], upto
        return out


def control_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of the tokenizer's control tokens (see the module doc): special tokens and added tokens that are neither
    whitespace nor an HTML tag. Empty for a tokenizer that lists no added tokens."""
    ids = {int(i) for i in (getattr(tokenizer, "all_special_ids", None) or [])}
    try:
        added = dict(getattr(tokenizer, "added_tokens_decoder", None) or {})
    except (TypeError, ValueError):
        added = {}
    for i, tok in added.items():
        text = str(getattr(tok, "content", tok))
        if getattr(tok, "special", False) or not (text.isspace() or _HTML_TAG.fullmatch(text)):
            ids.add(int(i))
    return frozenset(ids)


class PlainCompletion:
    """What the Engine needs for a model without a chat template: the notice, the ids hidden from a reply's text,
    and the logits mask that keeps a reply from generating them (the stop ids stay allowed: they end a reply)."""

    notice = NOTICE

    def __init__(self, tokenizer: Any, stop: Iterable[int]) -> None:
        self.hidden = control_ids(tokenizer)
        self.banned = sorted(self.hidden - set(stop))
        self._index: torch.Tensor | None = None

    @classmethod
    def detect(cls, tokenizer: Any, stop: Iterable[int]) -> PlainCompletion | None:
        """For a tokenizer without a chat template: the plain completion, named once on stderr (a WARNING: every
        app shows those); None where there is a template."""
        if getattr(tokenizer, "chat_template", None):
            return None
        log.warning(NOTICE)
        return cls(tokenizer, stop)

    def mask(self, recent: list[int], logits: torch.Tensor) -> torch.Tensor:
        """A logits processor: the control tokens at -inf (ids past the logits' width are left alone)."""
        if not self.banned:
            return logits
        if self._index is None or self._index.device != logits.device:
            idx = torch.tensor(self.banned, dtype=torch.long, device=logits.device)
            self._index = idx[idx < logits.shape[-1]]
        return logits.index_fill(-1, self._index, float("-inf"))


def end_turn(engine: Any, keep: int) -> None:
    """Take a plain reply's end (the next turn's marker, an EOS, trailing whitespace: what follows its first `keep`
    tokens) back out of the Engine's cache and ledger, so the next message's blank line and "User: " follow the reply
    exactly as the transcript renders it. Where the cache cannot drop them (a hybrid model's local ring has let go of
    what it would need back) they stay, and `Conversation.add_reply` records them as part of the reply: the
    transcript stays prefix-stable either way. The logits after the kept text were not kept: `last_logits` is None
    until something is fed."""
    ids = engine.last_reply_ids
    new = engine.cache.length - len(ids) + keep
    if keep >= len(ids) or new < engine.pinned_slots() or not engine.cache.can_truncate(new):
        return
    with deferred_sigint():
        engine.cache.truncate(new)
        engine.ledger.truncate(new)
        engine.last_reply_ids, engine.last_logits = ids[:keep], None
