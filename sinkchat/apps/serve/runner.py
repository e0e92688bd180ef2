"""One request on the engine: bring the session's cache in line with the request's messages, feed only what is new,
generate (constrained when the request has tools or a response_format), and record the reply.

How a request meets its session (documented in docs/serve.md):
- its messages extend the history: only the new ones are fed (`cached_tokens` says how much was already there);
- they diverge from it: the cache goes back to the last message both share while its tokens are in the cache (a
  truncation, and its last token fed again when older tokens were evicted since), and the rest is fed; when the
  tokens to go back to are evicted already, the answer is a 409 `session_diverged` error (start a new session id,
  or send the history the session holds);
- a different system prompt or tool list is a new conversation in the same session (same rule: only while nothing
  was evicted).
Tool results are fed as user messages (`[tool result]` + text), so any chat template takes them; tool calls are fed
and generated as `{"name": ..., "arguments": {...}}`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

from sinkchat.apps.serve.grammar import Constraint, GrammarError, compile_lark, schema_lark, tools_lark
from sinkchat.apps.serve.requests import ApiError, ChatRequest, Msg, canonical_args
from sinkchat.apps.serve.sessions import ServeSession, SessionStore, conversation_key, figures, mark, rollback
from sinkchat.core.stops import StopText
from sinkchat.api import capture
from sinkchat.errors import UserError

log = logging.getLogger(__name__)

TOOLS_INTRO = ("You can call these tools. To call one, reply with only a JSON object "
               '{"name": "<tool name>", "arguments": {...}} and nothing else; otherwise answer in plain text.')


@dataclass
class Result:
    text: str = ""
    finish: str = "stop"
    calls: list[dict[str, Any]] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    status: dict[str, Any] = field(default_factory=dict)


def system_text(req: ChatRequest) -> str | None:
    """The system prompt a conversation starts with: the request's system messages, then the tools it offers (with
    any tool_choice: clients send the same tools with every request, and only the grammar follows the choice, so a
    round trip that ends with `tool_choice: "none"` keeps its cache)."""
    if not req.tools:
        return req.system
    lines = [TOOLS_INTRO] + [f"- {t['name']}: {t['description']} Arguments (JSON schema): "
                             f"{json.dumps(t['parameters'], ensure_ascii=False)}" for t in req.tools]
    return "\n\n".join(x for x in (req.system, "\n".join(lines)) if x)


def call_text(calls: tuple[tuple[str, str], ...]) -> str:
    return "\n".join(json.dumps({"name": n, "arguments": json.loads(a)}, ensure_ascii=False) for n, a in calls)


def feed_as(m: Msg) -> tuple[str, str]:
    """(role, content) that the chat template is given for a message."""
    if m.role == "tool":
        return "user", f"[tool result]\n{m.text}"
    if m.role == "assistant" and m.calls:
        return "assistant", "\n".join(x for x in (m.text, call_text(m.calls)) if x)
    return m.role, m.text


def common_prefix(a: list[Msg], b: list[Msg]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class Runner:
    """Runs requests one at a time on the engine (the caller serializes them)."""

    def __init__(self, engine: Any, store: SessionStore, default_system: str | None = None) -> None:
        self.engine, self.store, self.default_system = engine, store, default_system
        self.client_gone = threading.Event()  # the running request's client went away (not the shutdown's deadline)

    def chat(self, req: ChatRequest, sid: str | None, emit: Callable[[str], None], cancelled: threading.Event,
             on_ready: Callable[[], None] = lambda: None, client_gone: threading.Event | None = None) -> Result:
        """Answer `req` in session `sid` (None: stateless); `emit` gets text pieces as they come (not for a tool
        call, whose arguments are only whole at the end); `cancelled` set stops the reply. `on_ready` is called
        once the prompt is in the cache: a streaming response starts then, so every error before it (a bad
        schema, a diverged session) is still an HTTP status, not an event in a started stream."""
        self.client_gone = client_gone or threading.Event()  # checked between a long prompt's chunks (`_feed`)
        constraint = self._constraint(req)  # a schema that does not compile: 400 before the session is touched
        if req.system is None and req.raw_prompt is None:
            req.system = self.default_system
        system = system_text(req)
        new = sid is not None and not self.store.exists(sid)
        sess = self.store.activate(sid, system)
        try:
            return self._answer(sess, req, system, constraint, emit, cancelled, on_ready)
        except BaseException:
            if new and sess.requests == 0 and sid is not None:  # refused at its first request: no empty session
                self.store.delete(sid)  # left behind (GET /v1/sessions/ID said 200, 0 requests)
            raise

    def _answer(self, sess: ServeSession, req: ChatRequest, system: str | None, constraint: Any,
                emit: Callable[[str], None], cancelled: threading.Event, on_ready: Callable[[], None]) -> Result:
        try:
            if req.raw_prompt is not None:
                cached, fed = 0, self._feed_raw(sess, req.raw_prompt)
            else:
                cached, fed = self._sync(sess, req, system)
            on_ready()
            res = self._generate(sess, req, constraint, emit, cancelled)
            res.cached_tokens, res.prompt_tokens = cached, cached + fed
            sess.requests += 1
            res.status = figures(sess, capture(self.engine))  # before `save` lets a stateless request's cache go
            self.store.save(sess)
            return res
        except UserError as e:  # e.g. a system prompt too large to pin in this cache
            raise ApiError(400, str(e), code="context_length_exceeded") from None

    def _constraint(self, req: ChatRequest) -> Any:
        if req.tools and req.tool_choice != "none":
            lark = tools_lark(req.tools, req.tool_choice)
        elif req.schema is not None:
            lark = schema_lark(req.schema)
        else:
            return None
        try:
            return compile_lark(lark)
        except GrammarError as e:
            raise ApiError(400, f"the schema cannot be compiled to a grammar: {e}", param="tools" if req.tools
                           else "response_format", code="invalid_schema") from None

    def _feed_raw(self, sess: ServeSession, prompt: str) -> int:
        """/v1/completions: the prompt as raw text on a fresh stream (the session's own cache, if it has one)."""
        self.store.reset(sess, None)(True)
        sess.key = "completion"
        self._drain(sess, self.engine.feed(prompt))
        return int(self.engine.ledger.seen)

    def _drain(self, sess: ServeSession, gen: Iterator[Any]) -> None:
        """Run a feed to its end, counting its evictions; a client that went away mid-prompt stops it (499: the
        message is taken back, as an interrupted add_message is)."""
        try:
            for ev in gen:
                sess.evictions += type(ev).__name__ == "EvictionEvent"
                if self.client_gone.is_set():
                    raise ApiError(499, "the client closed the request", code="client_closed")
        finally:
            gen.close()

    def _sync(self, sess: ServeSession, req: ChatRequest, system: str | None) -> tuple[int, int]:
        """Feed what the session does not hold yet; returns (tokens it held of this prompt, tokens fed now)."""
        eng = self.engine
        key = conversation_key(system, req.tools)
        k = common_prefix(sess.history, req.messages) if key == sess.key else 0
        at = sess.marks.get(k)
        if k == len(req.messages) and not (at is not None and at.reply_turn and at.last_logits is not None):
            k -= 1  # the whole request is history, but not fed to be answered (or reloaded without its logits)
        end = sess.marks.get(len(sess.history))
        moved = end is not None and (end.cache_len, end.seen) != (eng.cache.length, eng.ledger.seen)
        reset: Callable[[bool], None] | None = None
        if key != sess.key or k < len(sess.history) or moved:  # moved: a reply that failed half-way
            if k == 0 and (eng.ledger.evicted == 0 or key != sess.key):  # a new system prompt or tool list: a new
                reset = self.store.reset(sess, system)  # conversation asked for, at any length (it was a 409 past
                #                                         the first eviction, a user audit)
            elif k not in sess.marks or not rollback(eng, sess.marks[k]):
                raise ApiError(409, f"this request goes back to message {k} of this session's history (of "
                                    f"{len(sess.history)}), and the tokens to go back to were evicted already: send "
                                    "the history the session holds, or use a new X-Session-Id",
                               type_="invalid_request_error", code="session_diverged")
            del sess.history[k:]
            sess.marks = {i: m for i, m in sess.marks.items() if i <= k}
        sess.key = key
        try:
            cached, fed = self._feed(sess, req, k)
        except BaseException:  # refused (a system prompt too large to pin) or failed: one started over is put back
            if reset is not None:
                reset(False)
            raise
        if reset is not None:
            reset(True)
        return cached, fed

    def _feed(self, sess: ServeSession, req: ChatRequest, k: int) -> tuple[int, int]:
        """Feed the request's messages from the k-th on."""
        eng = self.engine
        seen0 = eng.ledger.seen
        cached = seen0 - eng.ledger.start
        for i, m in enumerate(req.messages[k:], start=k):
            role, text = feed_as(m)
            before, t0 = eng.ledger.seen, time.perf_counter()
            last = i == len(req.messages) - 1  # the request's new message (not history, not a tool result)
            self._drain(sess, eng.add_message(role, text, add_generation_prompt=last,
                                              recall=last and m.role == "user"))
            sess.history.append(m)
            sess.marks[i + 1] = mark(eng)
            if sess.log is not None:
                sess.log.turn(m.role, m.text, int(eng.ledger.seen - before), time.perf_counter() - t0)
        return int(cached), int(eng.ledger.seen - seen0)

    def _generate(self, sess: ServeSession, req: ChatRequest, grammar: Any, emit: Callable[[str], None],
                  cancelled: threading.Event) -> Result:
        from sinkchat.core.events import DoneEvent, EvictionEvent, GaugeEvent, TokenEvent
        from sinkchat.core.sampling import make_generator

        eng = self.engine
        budget = req.max_tokens or eng.sampling.max_tokens
        text = bool(req.tools) and req.tool_choice == "auto"  # the grammar: a call or plain text (`_constraint`)
        procs = [Constraint(eng, grammar, budget, text=text)] if grammar is not None else []
        if "seed" in req.sampling:
            eng.generator = make_generator(req.sampling["seed"])
        cfg = replace(eng.sampling, **{k: v for k, v in req.sampling.items() if k != "seed"})
        out, done, t0 = StopText(req.stop), None, time.perf_counter()
        calling = bool(req.tools) and req.tool_choice != "none"
        gen = eng.generate(req.max_tokens, req.stop, cfg, logits_processors=procs)

        def send(piece: str) -> None:  # a tool call's JSON is not streamed: its arguments are whole only at the end
            if piece and not (calling and out.text.lstrip().startswith("{")):
                emit(piece)

        try:
            for ev in gen:
                if isinstance(ev, TokenEvent) and ev.text:
                    send(out.add(ev.text))
                elif isinstance(ev, EvictionEvent):
                    sess.evictions += 1
                elif isinstance(ev, GaugeEvent):
                    sess.gauge = round(float(ev.share), 4)
                    recalled = ev.memory  # None with the memory off
                    sess.recalled = None if recalled is None else round(float(recalled), 4)
                elif isinstance(ev, DoneEvent):
                    done = ev
                if cancelled.is_set():
                    break
        finally:
            gen.close()  # a cancelled reply: what was generated stays, the cache consistent
            eng.conv.add_reply(eng.reply_text())  # the cache holds the stop string: the template text must too
        send(out.finish())
        text = out.text  # what the client gets, and so what the history holds (its echo then matches)
        res = Result(text, "length" if done is not None and done.reason == "length" and not out.hit else "stop",
                     completion_tokens=len(eng.last_reply_ids))
        if done is None:
            res.finish = "cancelled"
        calls: tuple[tuple[str, str], ...] = ()
        calls = self._calls(text) if calling and text.lstrip().startswith("{") and res.finish == "stop" else ()
        if calls:
            res.text, res.finish = "", "tool_calls"
            res.calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": n, "arguments": json.dumps(json.loads(a), ensure_ascii=False)}}
                         for n, a in calls]
        sess.history.append(Msg("assistant", res.text, calls))
        sess.marks[len(sess.history)] = mark(eng)
        if sess.log is not None:
            sess.log.turn("assistant", text, res.completion_tokens, time.perf_counter() - t0, reason=res.finish,
                          cache_len=eng.cache.length)
        return res

    @staticmethod
    def _calls(text: str) -> tuple[tuple[str, str], ...]:
        """The grammar made the reply one `{"name", "arguments"}` object; parsed into (name, canonical args)."""
        try:
            obj = json.loads(text)
            return ((str(obj["name"]), canonical_args(obj.get("arguments", {}), "reply")),)
        except (ValueError, KeyError, TypeError, ApiError):
            log.warning("a tool-call reply did not parse: %.80s", text)
            return ()
