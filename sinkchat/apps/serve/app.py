"""The ASGI app (Starlette + sse-starlette): OpenAI-compatible routes over one Runner.

Generation is one at a time (one model, one set of kernels): requests wait in a single-thread executor, at most
`max_queue` of them beyond the one running; more get 429. Every error is OpenAI-shaped (`requests.ApiError`), an
unexpected one a 500 with one line, logged with its traceback on the server side only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from sinkchat.apps.serve.requests import ApiError, ChatRequest, bad, parse_chat, parse_completion
from sinkchat.apps.serve.runner import Result, Runner

log = logging.getLogger(__name__)

SESSION_HEADER = "x-session-id"


def error_response(e: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 429 else None  # the openai client waits this long, then retries
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


class Server:
    """What the routes share: the runner, the admission count, the served model's id, the API key."""

    def __init__(self, runner: Runner, model_id: str, api_key: str | None = None, max_queue: int = 8,
                 max_body: int = 4 << 20) -> None:
        self.runner, self.model_id, self.api_key = runner, model_id, api_key
        self.max_queue, self.max_body = max_queue, max_body
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sinkchat-gen")
        self.admitted = 0  # running + waiting (touched only on the event loop)
        self.created = int(time.time())
        self.stopping: Callable[[], bool] = lambda: False  # the HTTP server is shutting down (set by command.py)
        self.grace = STOP_GRACE

    async def _deadline(self, cancelled: threading.Event, halted: threading.Event) -> None:
        """Once shutdown starts, a request in flight has `grace` seconds to finish; then its reply is stopped at
        the next token (the session stays consistent) and answered as cut by length, so that the response is
        still complete (a streamed one with its final chunk and [DONE]) before the server stops waiting."""
        while not self.stopping():
            await asyncio.sleep(0.1)
        await asyncio.sleep(self.grace)
        halted.set()
        cancelled.set()

    # ---------------------------------------------------------------------------------------- checks
    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {self.api_key}":
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer ...)", "invalid_request_error",
                           code="invalid_api_key")

    async def body(self, request: Request) -> Any:
        self.check_auth(request)
        try:
            declared = int(request.headers.get("content-length", "0") or 0)
        except ValueError:
            declared = 0
        if declared > self.max_body:
            raise ApiError(413, f"the request body is over {self.max_body} bytes", code="request_too_large")
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > self.max_body:
                raise ApiError(413, f"the request body is over {self.max_body} bytes", code="request_too_large")
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise bad("the request body is not valid JSON") from None

    def check_model(self, req: ChatRequest) -> None:
        if req.model not in (self.model_id, "sinkchat"):
            raise ApiError(404, f"the model {req.model!r} does not exist; this server serves {self.model_id!r}",
                           param="model", code="model_not_found")

    async def session(self, request: Request) -> Response:
        """GET /v1/sessions/{id}: its figures; DELETE: the session goes (between requests: the generation thread)."""
        self.check_auth(request)
        sid = request.path_params["sid"]
        if request.method == "DELETE":
            gone = await asyncio.get_running_loop().run_in_executor(self.executor, self.runner.store.delete, sid)
            if not gone:
                raise ApiError(404, f"no session {sid!r}", code="session_not_found")
            return JSONResponse({"id": sid, "object": "session.deleted", "deleted": True})
        st = self.runner.store.status(sid)
        if st is None:
            raise ApiError(404, f"no session {sid!r}", code="session_not_found")
        return JSONResponse(st)

    # ---------------------------------------------------------------------------------------- running
    async def run(self, req: ChatRequest, sid: str | None, chat: bool, request: Request | None = None) -> Response:
        if self.admitted > self.max_queue:
            raise ApiError(429, f"the server is busy ({self.admitted} requests running or queued); retry later",
                           "rate_limit_error", code="queue_full")
        self.admitted += 1
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        cancelled = threading.Event()
        ready = loop.create_future()

        def put(item: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def on_ready() -> None:
            loop.call_soon_threadsafe(lambda: ready.done() or ready.set_result(True))

        halted = threading.Event()  # the shutdown's grace ran out (not the client going away)
        gone = threading.Event()  # the client went away: a prompt being fed stops too (the deadline lets it end)
        fut = loop.run_in_executor(self.executor, self.runner.chat, req, sid, put if req.stream else _noop,
                                   cancelled, on_ready, gone)
        watch = loop.create_task(self._deadline(cancelled, halted))
        client = loop.create_task(self._client_gone(request, req.stream, fut, ready, cancelled, gone))
        fut.add_done_callback(lambda f: self._release(f, queue, ready, watch, client))
        if not req.stream:
            try:
                res = await fut
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return JSONResponse(completion_body(halt(res, halted), req, self.model_id, chat))
        await asyncio.wait([ready, fut], return_when=asyncio.FIRST_COMPLETED)
        if fut.done() and fut.exception() is not None:
            raise fut.exception()  # type: ignore[misc]
        from sse_starlette.sse import EventSourceResponse

        return EventSourceResponse(self.events(req, chat, queue, fut, cancelled, halted), ping=15)

    async def _client_gone(self, request: Request | None, stream: bool, fut: Any, ready: Any,
                           cancelled: threading.Event, gone: threading.Event) -> None:
        """A client that goes away stops its request: a reply not streamed, or a stream's prompt still being fed
        (a disconnect 1.5 s into a 400-token reply still generated all of it, and the next request waited 8.9 s;
        a started stream is watched by sse-starlette, which ends the reply at the next token)."""
        while request is not None and not fut.done() and not (stream and ready.done()):
            if await request.is_disconnected():
                gone.set()
                cancelled.set()
                return
            await asyncio.sleep(0.2)

    def _release(self, fut: Any, queue: asyncio.Queue[Any], ready: Any, watch: Any, client: Any) -> None:
        self.admitted -= 1
        watch.cancel()
        client.cancel()
        queue.put_nowait(_END)
        if not ready.done():
            ready.set_result(False)

    async def events(self, req: ChatRequest, chat: bool, queue: asyncio.Queue[Any], fut: Any,
                     cancelled: threading.Event, halted: threading.Event) -> AsyncIterator[dict[str, str]]:
        """The SSE stream: a role chunk, content chunks as they come, the closing chunk, usage, [DONE]. A client
        that goes away cancels this generator: the reply stops at the next token."""
        cid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())
        chunk = _chunker(cid, created, self.model_id, chat)
        try:
            if chat:
                yield chunk({"role": "assistant", "content": ""}, None)
            while (item := await queue.get()) is not _END:
                yield chunk({"content": item} if chat else item, None)
            try:
                res: Result = halt(fut.result(), halted)
            except ApiError as e:
                yield {"data": json.dumps(e.body())}
                return
            except Exception as e:  # noqa: BLE001 - already streaming: one error event, the traceback in the log
                log.exception("generation failed")
                yield {"data": json.dumps(ApiError(500, f"generation failed: {type(e).__name__}", "server_error").body())}
                return
            if res.calls:
                yield chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(res.calls)]}, None)
            last = chunk({} if chat else "", res.finish)
            body = json.loads(last["data"])
            body["x_sinkchat"] = res.status
            yield {"data": json.dumps(body)}
            if req.include_usage:
                yield {"data": json.dumps({"id": cid, "object": body["object"], "created": created,
                                           "model": self.model_id, "choices": [], "usage": usage(res)})}
            yield {"data": "[DONE]"}
        finally:
            cancelled.set()


_END = object()
STOP_GRACE = 8.0  # seconds a request may still run after SIGTERM: within uvicorn's 10 s, time left to answer


def halt(res: Result, halted: threading.Event) -> Result:
    """A reply stopped by the shutdown's deadline is reported as cut by length: a finish_reason clients know."""
    if halted.is_set() and res.finish == "cancelled":
        res.finish = "length"
    return res


def _noop(_: str) -> None:
    return None


def _chunker(cid: str, created: int, model: str, chat: bool) -> Callable[[Any, str | None], dict[str, str]]:
    def chunk(delta: Any, finish: str | None) -> dict[str, str]:
        choice = {"index": 0, "delta": delta} if chat else {"index": 0, "text": delta, "logprobs": None}
        return {"data": json.dumps({"id": cid, "object": "chat.completion.chunk" if chat else "text_completion",
                                    "created": created, "model": model,
                                    "choices": [{**choice, "finish_reason": finish}]})}
    return chunk


def usage(res: Result) -> dict[str, Any]:
    return {"prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
            "total_tokens": res.prompt_tokens + res.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": res.cached_tokens}}


def completion_body(res: Result, req: ChatRequest, model: str, chat: bool) -> dict[str, Any]:
    created = int(time.time())
    if not chat:
        return {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": created,
                "model": model, "choices": [{"index": 0, "text": res.text, "logprobs": None,
                                             "finish_reason": res.finish}],
                "usage": usage(res), "x_sinkchat": res.status}
    msg: dict[str, Any] = {"role": "assistant", "content": res.text if not res.calls else None}
    if res.calls:
        msg["tool_calls"] = res.calls
    return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": created,
            "model": model, "choices": [{"index": 0, "message": msg, "logprobs": None, "finish_reason": res.finish}],
            "usage": usage(res), "x_sinkchat": res.status}


def build_app(server: Server) -> Starlette:
    """The routes: /v1/chat/completions, /v1/completions, /v1/models, /v1/sessions/{id} (GET, DELETE), /health."""

    async def chat_completions(request: Request) -> Response:
        req = parse_chat(await server.body(request))
        server.check_model(req)
        return await server.run(req, request.headers.get(SESSION_HEADER) or None, True, request)

    async def completions(request: Request) -> Response:
        req = parse_completion(await server.body(request))
        server.check_model(req)
        return await server.run(req, None, False, request)

    async def models(request: Request) -> Response:
        server.check_auth(request)
        return JSONResponse({"object": "list", "data": [{"id": server.model_id, "object": "model",
                                                          "created": server.created, "owned_by": "sinkchat"}]})

    async def model(request: Request) -> Response:
        server.check_auth(request)
        mid = request.path_params["mid"]
        if mid not in (server.model_id, "sinkchat"):
            raise ApiError(404, f"the model {mid!r} does not exist; this server serves {server.model_id!r}",
                           param="model", code="model_not_found")
        return JSONResponse({"id": server.model_id, "object": "model", "created": server.created,
                             "owned_by": "sinkchat"})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": server.model_id, "queue": server.admitted})

    async def api_error(request: Request, e: Exception) -> Response:
        return error_response(e if isinstance(e, ApiError) else ApiError(500, "internal error", "server_error"))

    async def http_error(request: Request, e: Exception) -> Response:
        status = getattr(e, "status_code", 500)
        text = {404: f"no route {request.method} {request.url.path}", 405: f"{request.method} is not allowed on "
                f"{request.url.path}"}.get(status, str(getattr(e, "detail", "error")))
        return error_response(ApiError(status, text, code="not_found" if status == 404 else None))

    async def crash(request: Request, e: Exception) -> Response:
        log.error("%s %s failed", request.method, request.url.path, exc_info=e)
        return error_response(ApiError(500, f"internal error: {type(e).__name__}", "server_error"))

    routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/v1/models/{mid:path}", model, methods=["GET"]),
              Route("/v1/sessions/{sid}", server.session, methods=["GET", "DELETE"]),
              Route("/health", health, methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={ApiError: api_error, HTTPException: http_error,
                                                        Exception: crash})
