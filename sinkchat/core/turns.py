"""Template only the NEW turn, with the model's own chat template; history is never re-encoded.

The trick: render the whole conversation with the template, and feed only the text past what is already in the cache.
`fed` mirrors, as template text, what the cache has seen in this conversation. After a reply the template usually
adds a closing (ChatML: '<|im_end|>\\n'); whatever of it the model did not generate itself is fed with the next turn,
so a reply cut by Ctrl-C or max_tokens is still closed properly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from sinkchat.core.tokens import bos_token

log = logging.getLogger(__name__)


@dataclass
class Conversation:
    """Messages so far plus the template text the cache has been fed for them."""

    tokenizer: Any
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    fed: str = ""
    max_messages: int = 64  # older ones are long gone from the cache; keeps each turn's rendering O(1)

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        msgs = ([{"role": "system", "content": self.system}] if self.system is not None else []) + messages
        tmpl = getattr(self.tokenizer, "chat_template", None)
        if not tmpl:  # a base model: the transcript format, after the BOS its tokenizer puts first (if any)
            return (bos_token(self.tokenizer) or "") + _plain_render(msgs, add_generation_prompt)
        return self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt)

    def delta_for(self, role: str, content: str, add_generation_prompt: bool = True) -> str:
        """Text to feed for a new message (and the assistant header after it); records the message."""
        if len(self.messages) >= self.max_messages:
            self.trim(self.max_messages // 2)
        self.messages.append({"role": role, "content": content})
        delta = self._delta(self.messages, self.fed, add_generation_prompt, warn=True)
        self.fed += delta
        return delta

    def _delta(self, messages: list[dict[str, str]], fed: str, add_generation_prompt: bool, warn: bool = False
               ) -> str:
        full = self._render(messages, add_generation_prompt)
        if full.startswith(fed):
            return full[len(fed) :]
        # Templates that rewrite history (date stamps, dropped reasoning) cannot be extended by prefix; fall back
        # to rendering the closing of the last turn plus the new message alone.
        if warn:
            log.warning("chat template is not prefix-stable; templating the new turn on its own")
        prev = self._render(messages[:-1], False)
        alone = self._render(messages, add_generation_prompt)
        common = _common_prefix_len(prev, alone)
        return _closing(fed, prev) + alone[common:]

    def last_delta_with(self, content: str, delta: str, add_generation_prompt: bool) -> str:
        """The last message's delta (`delta`, as `delta_for` returned it) had its content been `content`: a probe
        for where the template put the content (core/literal.py); nothing is recorded."""
        last = {**self.messages[-1], "content": content}
        return self._delta(self.messages[:-1] + [last], self.fed[: len(self.fed) - len(delta)], add_generation_prompt)

    def system_block(self) -> str:
        """The template text of the system message alone (what a conversation's rendering starts with), or "" where
        the template cannot render it on its own."""
        if self.system is None:
            return ""
        try:
            return self._render([], False)
        except Exception:  # templates may insist on a user message (jinja raises their own errors)
            log.debug("chat template cannot render the system message alone", exc_info=True)
            return ""

    def system_prefix(self) -> str:
        """`system_block()` where every conversation's rendering starts with it (so it can be fed ahead of the first
        message and the next delta extends it), else ""."""
        block = self.system_block()
        try:
            probe = self._render([{"role": "user", "content": "x"}], True)
        except Exception:  # noqa: BLE001 - a template that cannot render this: feed the system prompt with a message
            log.debug("chat template cannot render a probe message", exc_info=True)
            return ""
        return block if block and probe.startswith(block) else ""

    def add_reply(self, text: str) -> None:
        """Record the assistant reply as generated; `text` must be exactly what the model produced (stop tokens
        included as text), because it is now in the cache. A template closes the turn after its stop token; the
        plain transcript has none, so there the reply is recorded as the cache holds it (the Engine takes an EOS
        or the next turn's marker back out where it can, see core/plain.py, and a leftover stays prefix-stable)."""
        plain = not getattr(self.tokenizer, "chat_template", None)
        self.messages.append({"role": "assistant", "content": text if plain else _strip_eos(text, self.tokenizer)})
        self.fed += text

    def reset(self) -> None:
        self.messages.clear()
        self.fed = ""

    def closing(self) -> str | None:
        """Template text that closes what has been fed (e.g. ChatML's '\\n' after a reply's '<|im_end|>'), or None
        when the template rewrites history and has no such prefix. Clients that restart their bookkeeping feed it
        first, so the cache ends on a complete turn."""
        full = self._render(self.messages, False)
        return full[len(self.fed) :] if full.startswith(self.fed) else None

    def trim(self, keep: int) -> None:
        """Forget all but the last `keep` messages (starting at a user message), rewriting `fed` to what the
        template renders for them, so the next delta is exactly what it would have been. The cache is untouched:
        this is bookkeeping for the template only."""
        start = max(0, len(self.messages) - keep)
        while start < len(self.messages) and self.messages[start]["role"] != "user":
            start += 1
        if start == 0:
            return
        full_all = self._render(self.messages, False)
        kept = self.messages[start:]
        full_kept = self._render(kept, False)
        if full_all.startswith(self.fed):  # e.g. a reply whose closing '\n' is not fed yet
            missing = len(full_all) - len(self.fed)
            new_fed = full_kept[: len(full_kept) - missing]
        elif self.fed.startswith(full_all):  # e.g. a message fed without a generation prompt after it
            new_fed = full_kept + self.fed[len(full_all) :]
        else:
            return  # not prefix-stable: keep everything rather than guess
        self.messages, self.fed = kept, new_fed


def _strip_eos(text: str, tokenizer: Any) -> str:
    for tok in (getattr(tokenizer, "eos_token", None), "<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>"):
        if tok and text.endswith(tok):
            return text[: -len(tok)]
    return text


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _closing(fed: str, prev: str) -> str:
    """The part of the rendered history after what was fed (e.g. the '<|im_end|>\\n' closing a cut reply)."""
    return prev[len(fed) :] if prev.startswith(fed) else ""


def _plain_render(msgs: list[dict[str, str]], add_generation_prompt: bool) -> str:
    """For base models without a chat template: a simple, prefix-stable transcript format."""
    out = "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in msgs)
    # "Assistant: " + reply is a prefix of the rendered "Assistant: {reply}\n\n", so the next turn extends it
    return out + ("Assistant: " if add_generation_prompt else "")
