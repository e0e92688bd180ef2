"""OpenAI request bodies checked and normalized, and OpenAI-shaped errors.

Every bad request is an `ApiError` with the status and the `{"error": {"message", "type", "param", "code"}}` body
OpenAI sends, raised before the engine is touched; the app turns anything else into a 500 of the same shape, so a
client never sees a traceback. Messages are normalized to `Msg` (role, text, tool calls with parsed arguments) so
that a client's echo of a reply compares equal to what the session holds even when its JSON is re-serialized
(langchain re-dumps `arguments`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CHOICES = ("auto", "none", "required")
MAX_STOP = 4


class ApiError(Exception):
    """An OpenAI-shaped error: HTTP `status`, `message` for people, `type` / `code` / `param` for programs."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class Msg:
    """One message as the session compares and feeds it."""

    role: str
    text: str
    calls: tuple[tuple[str, str], ...] = ()  # (name, arguments as canonical JSON)
    call_id: str | None = None  # a tool result's tool_call_id


@dataclass
class ChatRequest:
    model: str
    system: str | None
    messages: list[Msg]
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str = "auto"  # auto | none | required | a function name
    schema: dict[str, Any] | None = None  # response_format json_object / json_schema
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # temperature, top_p, seed
    stop: tuple[str, ...] = ()
    raw_prompt: str | None = None  # /v1/completions: text fed as it is


def _text(content: Any, where: str) -> str:
    """A message's content: a string, null, or a list of text parts (images are refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{where}: only text content parts are supported", where)
            out.append(part["text"])
        return "".join(out)
    raise bad(f"{where}: content must be a string or a list of text parts", where)


def canonical_args(args: Any, where: str) -> str:
    """Tool-call arguments as canonical JSON (a client may send them as a string or, loosely, as an object)."""
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise bad(f"{where}: arguments are not valid JSON", where) from None
    return json.dumps(args, sort_keys=True, ensure_ascii=False)


def _message(m: Any, i: int) -> Msg:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(f"{where} must be an object", where)
    role = m.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role must be one of {', '.join(ROLES)}", f"{where}.role")
    role = "system" if role == "developer" else role
    calls: list[tuple[str, str]] = []
    raw_calls = m.get("tool_calls")
    if raw_calls is not None and not isinstance(raw_calls, list):
        raise bad(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    for j, c in enumerate(raw_calls or []) if role == "assistant" else ():
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"{where}.tool_calls[{j}] needs function.name", f"{where}.tool_calls")
        calls.append((fn["name"], canonical_args(fn.get("arguments", "{}"), f"{where}.tool_calls[{j}]")))
    call_id = m.get("tool_call_id")
    if role == "tool" and not isinstance(call_id, str):
        raise bad(f"{where}: a tool message needs tool_call_id", f"{where}.tool_call_id")
    if m.get("content") is None and not (role == "assistant" and calls):  # as OpenAI: only a tool-calling
        raise bad(f"{where}.content is required for a {role} message", f"{where}.content")  # assistant turn has none
    return Msg(role, _text(m.get("content"), f"{where}.content"), tuple(calls), call_id if role == "tool" else None)


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise bad("tools must be a list of {'type': 'function', 'function': {...}} objects", "tools")
    tools = []
    for i, t in enumerate(raw or []):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", f"tools[{i}]")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise bad(f"tools[{i}].function.parameters must be a JSON schema object", f"tools[{i}]")
        tools.append({"name": fn["name"], "description": str(fn.get("description") or ""), "parameters": params})
    choice = body.get("tool_choice", "auto" if tools else "none")
    if isinstance(choice, dict):
        fn = choice.get("function")
        choice = fn.get("name") if isinstance(fn, dict) else None
        if choice not in [t["name"] for t in tools]:
            raise bad("tool_choice names no function of tools", "tool_choice")
    elif choice not in TOOL_CHOICES:
        raise bad("tool_choice must be auto, none, required or {'type': 'function', 'function': {'name': ...}}",
                  "tool_choice")
    if choice == "required" and not tools:
        raise bad("tool_choice 'required' needs tools", "tool_choice")
    return tools, str(choice)


def _schema(body: dict[str, Any]) -> dict[str, Any] | None:
    rf = body.get("response_format")
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise bad("response_format.json_schema.schema must be a JSON schema object", "response_format")
        return schema
    raise bad("response_format.type must be text, json_object or json_schema", "response_format")


def _number(body: dict[str, Any], key: str, lo: float, hi: float, integer: bool = False) -> Any:
    v = body.get(key)
    if v is None:
        return None
    ok = isinstance(v, int) if integer else isinstance(v, (int, float)) and math.isfinite(v)
    if isinstance(v, bool) or not ok or not lo <= v <= hi:
        raise bad(f"{key} must be {'an integer' if integer else 'a number'} in [{lo}, {hi}]", key)
    return v


def _common(body: dict[str, Any], req: ChatRequest) -> None:
    """The sampling fields both endpoints take."""
    req.max_tokens = _number(body, "max_completion_tokens", 1, 1 << 20, True) or _number(body, "max_tokens", 1, 1 << 20, True)
    for key, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 1e-9, 1.0)):
        v = _number(body, key, lo, hi)
        if v is not None:
            req.sampling[key] = float(v)
    seed = _number(body, "seed", -(1 << 63), (1 << 63) - 1, True)
    if seed is not None:
        req.sampling["seed"] = int(seed)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else [] if stop is None else None
    if stops is None or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise bad(f"stop must be a string or a list of at most {MAX_STOP} non-empty strings", "stop")
    req.stop = tuple(stops)
    req.stream = _flag(body, "stream", "stream")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise bad("stream_options must be an object", "stream_options")
    req.include_usage = _flag(so or {}, "include_usage", "stream_options.include_usage")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad("user must be a string", "user")


def _flag(body: dict[str, Any], key: str, param: str) -> bool:
    """A boolean field: true, false or absent / null. Anything else is refused, not read as truthy: `"stream":
    "false"` taken as true would answer with an SSE stream the client cannot parse."""
    v = body.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(f"{param} must be a boolean", param)
    return v


def _check_body(body: Any) -> None:
    """What every completion body must be: a JSON object naming its model (ApiError(400) otherwise)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    if not isinstance(body.get("model"), str):
        raise bad("model is required (a string; see GET /v1/models)", "model")


def parse_chat(body: Any) -> ChatRequest:
    """A /v1/chat/completions body -> ChatRequest, or ApiError(400) naming the field."""
    _check_body(body)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages must be a non-empty list", "messages")
    msgs = [_message(m, i) for i, m in enumerate(raw)]
    lead = 0
    while lead < len(msgs) and msgs[lead].role == "system":
        lead += 1
    system = "\n\n".join(m.text for m in msgs[:lead]) if lead else None
    rest = msgs[lead:]
    if not rest or rest[-1].role == "assistant":
        raise bad("the last message must be a user, tool or system message (one to answer)", "messages")
    _one_choice(body)
    tools, choice = _tools(body)
    req = ChatRequest(body["model"], system, rest, tools, choice, _schema(body))
    if req.schema is not None and choice not in ("none", "auto"):
        raise bad("response_format and a required tool call cannot both constrain one reply", "response_format")
    _common(body, req)
    return req


def parse_completion(body: Any) -> ChatRequest:
    """A /v1/completions body (one string prompt) -> ChatRequest with `raw_prompt`."""
    _check_body(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise bad("prompt must be a non-empty string", "prompt")
    _one_choice(body, "best_of")
    for key, off in (("echo", False), ("suffix", ""), ("logprobs", 0)):  # were ignored while a chat request's n
        if body.get(key) not in (None, off):  # was refused: the client would get less than it asked for
            raise bad(f"{key} is not supported", key)
    req = ChatRequest(body["model"], None, [], raw_prompt=prompt)
    _common(body, req)
    return req


def _one_choice(body: dict[str, Any], *more: str) -> None:
    """`n` (and `best_of` for completions) other than 1 are refused: one choice per request."""
    for key in ("n", *more):
        v = body.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v != 1):
            raise bad(f"{key} must be 1: one choice per request", key)
