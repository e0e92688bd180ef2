"""The workloads `sinkchat soak` runs on the one persistent cache, and the probe that scores a fixed passage.

Each scenario's `step(engine)` does one unit of work and yields engine events, `Scores` (NLL of tokens the scenario
fed, given what the cache holds: the running perplexity of the model's own input) and `Fault`s it detected and
handled (an empty or undecodable reply, a tool that failed, non-finite logits). Anything a step raises is counted by
the runner as an error; `recover` puts the engine back in a usable state afterwards.
"""

from __future__ import annotations

import codecs
import itertools
import logging
import random
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import click

from sinkchat.bootstrap import read_prompt
from sinkchat.core.events import DoneEvent, TokenEvent

log = logging.getLogger(__name__)

PROBE_TEXT = (
    "The river starts high in the mountains, where snow melts in the spring and runs down through narrow valleys. "
    "Small towns grew along its banks because the water turned their mills and carried their goods to the sea. "
    "Today most of the mills are museums, but the river still floods every few years, and the people who live "
    "there keep sandbags in their cellars and watch the weather reports closely each April."
)
READ_BYTES = 1 << 18
CHAT_MAX_TOKENS = 96


@dataclass(frozen=True)
class Fault:
    """Something went wrong and was handled. `error=True` counts against the errors criterion (a guard tripped);
    otherwise it is a fault the scenario is expected to meet now and then (a small model's malformed output)."""

    kind: str
    detail: str = ""
    error: bool = False


class Scores(tuple):
    """NLLs (nats) of tokens just fed through the cache."""


class InputExhausted(Exception):
    """The stream scenario's stdin ended: the soak stops cleanly."""


def _finite(t: Any) -> bool:
    import torch

    return bool(torch.isfinite(t).all())


def scored_feed(engine: Any, ids: list[int]) -> Iterator[Any]:
    """Feed `ids` into the cache, yielding its events and the NLL of every fed token (the first one is predicted by
    the logits after the previous token, so a stream is scored without gaps)."""
    import torch

    if not ids:
        return
    if engine.last_logits is not None:
        yield Scores([float(-torch.log_softmax(engine.last_logits.float(), -1)[ids[0]])])
    pos = 0
    for item in engine.feed_ids(ids, all_logits=True):
        if not isinstance(item, torch.Tensor):
            yield item
            continue
        n = item.shape[0]
        if not _finite(item):
            yield Fault("nonfinite_logits", f"NaN/inf logits while feeding tokens {pos}..{pos + n}", error=True)
        targets = ids[pos + 1 : pos + n + 1]
        if targets:
            logp = torch.log_softmax(item[: len(targets)].float(), -1)
            tgt = torch.tensor(targets, dtype=torch.long, device=logp.device)[:, None]
            yield Scores((-logp.gather(1, tgt)[:, 0]).tolist())
        pos += n


def guarded_generate(engine: Any, max_tokens: int) -> Iterator[Any]:
    """engine.generate, checking every step's logits (sampling maps NaN to -1e9, which would hide a broken model)."""
    bad = 0
    for ev in engine.generate(max_tokens):
        if isinstance(ev, TokenEvent) and engine.last_logits is not None and not _finite(engine.last_logits):
            bad += 1
        yield ev
    if bad:
        yield Fault("nonfinite_logits", f"{bad} generated tokens had NaN/inf logits", error=True)


def recover(engine: Any, exc: BaseException) -> None:
    """After a failed step: a full dense cache (ContextFull) or any cache/ledger mismatch starts a fresh cache."""
    from sinkchat.core.cache_policy import ContextFull

    if isinstance(exc, ContextFull) or engine.cache.length != len(engine.ledger):
        log.warning("soak: clearing the cache after %s", type(exc).__name__)
        engine.clear()


class Probe:
    """Perplexity of a fixed passage by a separate dense forward (use_cache=False): it never touches the engine's
    cache, ledger or gauge, so scoring it between two events of a running turn changes nothing the turn sees."""

    def __init__(self, engine: Any, text: str = PROBE_TEXT, max_tokens: int = 128) -> None:
        self.model, self.device = engine.model, engine.device
        self.ids = engine.encode(text)[:max_tokens]

    def ppl(self) -> float:
        import math

        import torch

        x = torch.tensor([self.ids], dtype=torch.long, device=self.device)
        with torch.no_grad():
            logits = self.model(input_ids=x, use_cache=False).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, x[0, 1:])
        return round(math.exp(float(nll)), 4)


class ChatScenario:
    """Self-play: prompts from prompts/soak_chat.txt, every other turn the model's own last reply quoted back."""

    name = "chat"
    recover = staticmethod(recover)

    def __init__(self, prompts: list[str], max_tokens: int = CHAT_MAX_TOKENS, seed: int = 0) -> None:
        if not prompts:
            raise click.UsageError("no self-play prompts")
        self.prompts, self.max_tokens = prompts, max_tokens
        self.rng = random.Random(seed)
        self.turn = 0
        self.last_reply = ""

    def next_message(self) -> str:
        self.turn += 1
        words = self.last_reply.split()
        if self.turn % 2 == 0 and words:
            return f'You said: "{" ".join(words[:30])}". Tell me more about that, briefly.'
        return self.rng.choice(self.prompts)

    def step(self, engine: Any) -> Iterator[Any]:
        delta = engine.conv.delta_for("user", self.next_message())
        yield from scored_feed(engine, engine.encode(delta))
        done = None
        try:
            for ev in guarded_generate(engine, self.max_tokens):
                done = ev if isinstance(ev, DoneEvent) else done
                yield ev
        finally:
            engine.conv.add_reply(engine.reply_text())
        text = done.text if done else ""
        self.last_reply = text
        if not text.strip():
            yield Fault("empty_reply", f"reply of {done.tokens if done else 0} tokens has no text")
        elif "\ufffd" in text:
            yield Fault("malformed_output", "reply holds undecodable bytes")


class StreamScenario:
    """Feeds a text (a file, looped; or stdin until EOF) block by block, scoring every token through the cache."""

    name = "stream"
    recover = staticmethod(recover)

    def __init__(self, engine: Any, path: str, block: int | None = None) -> None:
        self.path, self.block = path, block or engine.max_chunk
        self.ids: deque[int] = deque()
        self.pieces = self._pieces()
        self.encode = engine.encode

    def _read_chunks(self) -> Iterator[bytes]:
        if self.path == "-":
            while data := sys.stdin.buffer.read(READ_BYTES):
                yield data
            return
        for lap in itertools.count():
            try:
                with open(self.path, "rb") as f:
                    got = False
                    while data := f.read(READ_BYTES):
                        got = True
                        yield data
            except OSError as e:
                raise click.ClickException(f"cannot read {self.path}: {e.strerror}") from None
            if not got:
                return
            log.info("stream: lap %d of %s done", lap + 1, self.path)
            yield b"\n\n"

    def _pieces(self) -> Iterator[str]:
        """Decoded text cut at whitespace (invalid UTF-8 becomes U+FFFD rather than an error)."""
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        rest = ""
        for data in self._read_chunks():
            text = rest + dec.decode(data)
            cut = max(text.rfind(" "), text.rfind("\n"))
            if cut <= 0 and len(text) > 4 * READ_BYTES:  # one endless "word" (a 10 MB line): cut it anyway
                cut = len(text)
            if cut <= 0:
                rest = text
                continue
            rest = text[cut:]
            yield text[:cut]
        tail = rest + dec.decode(b"", final=True)
        if tail.strip():
            yield tail

    def step(self, engine: Any) -> Iterator[Any]:
        while len(self.ids) < self.block:
            piece = next(self.pieces, None)
            if piece is None:
                break
            self.ids.extend(self.encode(piece))
        if not self.ids:
            raise InputExhausted()
        block = [self.ids.popleft() for _ in range(min(self.block, len(self.ids)))]
        engine.gauge.armed = True  # keep the last fed token's queries: the gauge for this block
        try:
            yield from scored_feed(engine, block)
        finally:
            engine.gauge.armed = False
        g = engine.measure_gauge()
        if g is not None:
            yield g


AGENT_TASKS = (
    "What is {a} times {b}? Use the calculator tool.",
    "Write the word '{w}' into the file {f}.txt, then read the file back.",
    "List the files in the workspace.",
    "What time is it? Use the clock tool.",
    "Search the workspace files for the text '{w}'.",
    "Save a note that says '{w}', then tell me what you saved.",
    "Read the file {f}.txt and tell me what it says.",
    "Compute ({a} + {b}) * 2 with the calculator.",
)
WORDS = ("apple", "harbor", "violet", "copper", "meadow", "falcon", "pepper", "glacier")


class AgentScenario:
    """The agent loop with the built-in tools on generated tasks. File names come from a small fixed set, so the
    workspace stays bounded however long the soak runs. The model's malformed calls and failed tools are faults the
    agent feeds back (counted, expected from a small model); only an exception out of the loop is an error."""

    name = "agent"
    recover = staticmethod(recover)

    def __init__(self, engine: Any, workspace: Path, allow_shell: bool = False, max_tokens: int | None = None,
                 seed: int = 0, max_steps: int = 4) -> None:
        from sinkchat.apps.agent.agent import Agent
        from sinkchat.apps.agent.tools import build_default_tools

        try:
            workspace.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise click.ClickException(f"cannot create the agent workspace {workspace}: {e.strerror}") from None
        tools = build_default_tools(workspace, allow_shell)
        self.agent = Agent(engine, tools, workspace, approve=None, max_tokens=max_tokens or CHAT_MAX_TOKENS)
        self.rng, self.max_steps = random.Random(seed), max_steps

    def next_task(self) -> str:
        r = self.rng
        return r.choice(AGENT_TASKS).format(a=r.randint(2, 99), b=r.randint(2, 99), w=r.choice(WORDS),
                                            f=f"file{r.randint(1, 4)}")

    def step(self, engine: Any) -> Iterator[Any]:
        from sinkchat.apps.agent.protocol import AgentErrorEvent, ToolResultEvent

        reported = -1  # the step whose failure an AgentErrorEvent already reported
        for ev in self.agent.run(self.next_task(), self.max_steps):
            if isinstance(ev, AgentErrorEvent):
                reported = ev.step
                yield Fault("agent_error", ev.message[:300])
            elif isinstance(ev, ToolResultEvent):
                if not ev.ok and ev.step != reported:
                    yield Fault("tool_failed", f"{ev.name}: {ev.text[:300]}")
            elif isinstance(ev, TokenEvent) and engine.last_logits is not None and not _finite(engine.last_logits):
                yield ev
                yield Fault("nonfinite_logits", "a generated token had NaN/inf logits", error=True)
            else:
                yield ev


def chat_prompts() -> list[str]:
    lines = read_prompt("soak_chat").splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def check_input(path: str | None) -> None:
    """Reject a missing or empty --input before the model is loaded (stdin can only be judged by reading it)."""
    if not path:
        raise click.UsageError("--scenario stream needs --input FILE or -")
    if path != "-" and not Path(path).is_file():
        raise click.UsageError(f"--input {path}: {'not a regular file' if Path(path).exists() else 'no such file'}")
    if path != "-" and Path(path).stat().st_size == 0:
        raise click.UsageError(f"--input {path} is empty")


def make_scenario(name: str, engine: Any, *, input_path: str | None = None, workspace: Path | None = None,
                  allow_shell: bool = False, max_tokens: int | None = None, seed: int = 0) -> Any:
    if name == "chat":
        return ChatScenario(chat_prompts(), max_tokens or CHAT_MAX_TOKENS, seed)
    if name == "stream":
        check_input(input_path)
        return StreamScenario(engine, input_path)
    if name == "agent":
        return AgentScenario(engine, workspace or Path("soak-workspace"), allow_shell, max_tokens, seed)
    raise click.UsageError(f"unknown scenario {name!r}")
