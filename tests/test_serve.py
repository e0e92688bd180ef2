"""`sinkchat serve` (issue 31 items 1-4) against a real server process (uvicorn on a free port) on a tiny random model
with the bundled tokenizer and chat template: the official `openai` client (chat, streaming, a tools round trip,
json_schema), langchain-openai's bind_tools, raw HTTP for the error shapes, sessions that extend / diverge / stay
apart, a second server continuing a session the first served, and fuzzed bodies that always get an OpenAI answer."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from fakes import save_tiny_chat_model

MODEL = "model"  # the id /v1/models lists: the model folder's name
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                                 "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                                 "units": {"type": "array", "items": {"enum": ["c", "f"]},
                                                           "maxItems": 2}},
                                                 "required": ["city", "days"], "additionalProperties": False}}}


def start_server(model: Path, home: Path, *extra: str) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "SINKCHAT_HOME": str(home), "SINKCHAT_DECODER": "native", "SINKCHAT_THREADS": "1"}
    cmd = [sys.executable, "-m", "sinkchat", "serve", "--model", str(model), "--quant", "none", "--cache", "512",
           "--temperature", "0", "--max-tokens", "8", "--port", "0", *extra]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    deadline, seen = time.time() + 120, []
    while time.time() < deadline:
        line = proc.stderr.readline()  # type: ignore[union-attr]
        seen.append(line)
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            return proc, m.group(1)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError("server did not start:\n" + "".join(seen)[-3000:])


def stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    base = tmp_path_factory.mktemp("serve")
    model = save_tiny_chat_model(base / MODEL)
    home = base / "home"
    proc, url = start_server(model, home, "--max-queue", "1")
    yield url, model, home
    stop(proc)


@pytest.fixture(scope="module")
def client(served: tuple[str, Path, Path]) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def post(url: str, body: Any, session: str | None = None, raw: bytes | None = None) -> httpx.Response:
    headers = {"X-Session-Id": session} if session else {}
    if raw is not None:
        return httpx.post(url + "/v1/chat/completions", content=raw, headers=headers, timeout=60)
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def test_chat_session_feeds_only_new_messages(client):
    h = {"X-Session-Id": "s-extend"}
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    r1 = client.chat.completions.create(model=MODEL, messages=msgs, extra_headers=h)
    assert r1.choices[0].finish_reason == "length" and r1.usage.completion_tokens == 8
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "more"}]
    r2 = client.chat.completions.create(model=MODEL, messages=msgs, extra_headers=h)
    # the session held exactly the first prompt and reply: only "more" was fed
    assert r2.usage.prompt_tokens_details.cached_tokens == r1.usage.total_tokens
    assert r2.usage.prompt_tokens > r1.usage.total_tokens
    st = r2.model_extra["x_sinkchat"]
    assert st["id"] == "s-extend" and st["messages"] == 4 and st["cache_len"] == r2.usage.total_tokens
    assert isinstance(st["sink_share"], float) and 0.0 < st["sink_share"] < 1.0  # the sink gauge, measured
    assert "recalled_share" not in st  # the memory is off: no share on recalled blocks to give
    # a request that diverges (the last reply dropped, another question) goes back to the common prefix
    r3 = client.chat.completions.create(model=MODEL, messages=msgs[:2] + [{"role": "assistant", "content": "x"},
                                                                         {"role": "user", "content": "y"}],
                                        extra_headers=h)
    assert r3.usage.prompt_tokens_details.cached_tokens < r1.usage.total_tokens
    assert r3.model_extra["x_sinkchat"]["messages"] == 4


def test_streaming_matches_non_streaming(client):
    msgs = [{"role": "user", "content": "count to three"}]
    whole = client.chat.completions.create(model=MODEL, messages=msgs).choices[0].message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole and len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_tools_round_trip(client):
    h = {"X-Session-Id": "s-tools"}
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Rome for 2 days?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], tool_choice="required",
                                       max_tokens=60, extra_headers=h)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and args["city"] in ("Paris", "Rome", "Oslo")
    assert 1 <= args["days"] <= 7 and set(args) <= {"city", "days", "units"}
    msgs += [choice.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24C"}]
    r2 = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], tool_choice="none",
                                        extra_headers=h)
    assert r2.choices[0].finish_reason == "length" and r2.choices[0].message.content
    # only the tool result was fed: the session held the prompt and the call
    assert r2.usage.prompt_tokens_details.cached_tokens == r.usage.total_tokens
    msgs += [{"role": "assistant", "content": r2.choices[0].message.content}, {"role": "user", "content": "Oslo?"}]
    r3 = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], max_tokens=60,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                        extra_headers=h)
    assert r3.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert r3.usage.prompt_tokens_details.cached_tokens == r2.usage.total_tokens


def test_json_schema_response_format(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "json please"}],
                                       max_tokens=40, response_format={"type": "json_schema",
                                                                       "json_schema": {"name": "x", "schema": schema}})
    data = json.loads(r.choices[0].message.content)
    assert set(data) == {"ok", "n"} and isinstance(data["ok"], bool) and 0 <= data["n"] <= 9
    assert r.choices[0].finish_reason == "stop"


def test_langchain_bind_tools(served):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def lookup_port(service: str) -> str:
        """The port a service listens on."""
        return "8443"

    llm = ChatOpenAI(base_url=served[0] + "/v1", api_key="unused", model=MODEL, max_tokens=40, max_retries=0)
    msg = llm.bind_tools([lookup_port], tool_choice="lookup_port").invoke("which port does nginx use?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "lookup_port"
    assert isinstance(msg.tool_calls[0]["args"]["service"], str)


def test_two_sessions_never_share_a_cache(served):
    url = served[0]
    ask = [{"role": "user", "content": "tell me a story"}]
    alone = post(url, {"model": MODEL, "messages": ask}).json()
    a1 = post(url, {"model": MODEL, "messages": [{"role": "user", "content": "alpha " * 40}]}, "iso-a").json()
    b1 = post(url, {"model": MODEL, "messages": ask}, "iso-b").json()
    # B's first turn starts from an empty cache and says what a stateless request says, A's 40 words elsewhere
    assert b1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert b1["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
    sa, sb = (httpx.get(f"{url}/v1/sessions/{s}").json() for s in ("iso-a", "iso-b"))
    assert sa["cache_len"] == a1["usage"]["total_tokens"] and sb["cache_len"] == b1["usage"]["total_tokens"]
    # A goes on from its own cache after B ran: what it holds is exactly its first turn
    a_msgs = [{"role": "user", "content": "alpha " * 40},
              {"role": "assistant", "content": a1["choices"][0]["message"]["content"]}, *ask]
    a2 = post(url, {"model": MODEL, "messages": a_msgs}, "iso-a").json()
    assert a2["usage"]["prompt_tokens_details"]["cached_tokens"] == a1["usage"]["total_tokens"]
    assert a2["x_sinkchat"]["cache_len"] == a2["usage"]["total_tokens"]
    assert httpx.get(f"{url}/v1/sessions/nobody").status_code == 404
    # each session is in the SQLite session log, as chats are (`sinkchat logs`)
    env = {**os.environ, "SINKCHAT_HOME": str(served[2])}
    listing = subprocess.run([sys.executable, "-m", "sinkchat", "logs"], env=env, capture_output=True, text=True)
    assert listing.returncode == 0 and " serve " in listing.stdout, listing.stdout + listing.stderr
    ids = [int(line.split()[0]) for line in listing.stdout.splitlines()[1:] if " serve " in line]
    stories = [subprocess.run([sys.executable, "-m", "sinkchat", "logs", "show", str(i)], env=env,
                              capture_output=True, text=True).stdout for i in ids]
    assert sum("alpha alpha" in story for story in stories) == 1


def test_error_shapes(served):
    url = served[0]
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        (post(url, None, raw=b"{not json"), 400, None),
        (post(url, {**ok, "model": "gpt-9"}), 404, "model_not_found"),
        (post(url, {"model": MODEL}), 400, None),
        (post(url, {**ok, "temperature": "hot"}), 400, None),
        (post(url, {**ok, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}),
         400, "invalid_schema"),
        (post(url, {**ok, "messages": [{"role": "assistant", "content": "x"}]}), 400, None),
        (post(url, ok, "bad id!"), 400, "invalid_session_id"),
        (httpx.get(url + "/v1/nothing"), 404, "not_found"),
        (httpx.post(url + "/v1/chat/completions", content=b"x" * (5 << 20)), 413, "request_too_large"),
    ]
    for resp, status, code in cases:
        assert resp.status_code == status, resp.text
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["code"] == code


def test_diverged_after_eviction_is_409(served):
    url = served[0]
    long = [{"role": "user", "content": "word " * 700}]  # past the 512-token cache: the start is evicted
    r = post(url, {"model": MODEL, "messages": long}, "s-evicted").json()
    assert r["x_sinkchat"]["evicted"] > 0
    other = [{"role": "user", "content": "something else"}]
    resp = post(url, {"model": MODEL, "messages": other}, "s-evicted")
    assert resp.status_code == 409 and resp.json()["error"]["code"] == "session_diverged"
    follow = long + [{"role": "assistant", "content": r["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "go on"}]
    again = post(url, {"model": MODEL, "messages": follow}, "s-evicted")
    assert again.status_code == 200 and again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_completions_and_models(served):
    url = served[0]
    models = httpx.get(url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    one = httpx.get(url + f"/v1/models/{MODEL}")  # the openai client's models.retrieve (it was a 404: no route)
    assert one.status_code == 200 and one.json()["id"] == MODEL and one.json()["object"] == "model"
    assert httpx.get(url + "/v1/models/gpt-4o").json()["error"]["code"] == "model_not_found"
    for msg in ({"role": "user"}, {"role": "user", "content": None}):  # OpenAI: a 400 (was a 200)
        r0 = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": [msg]})
        assert r0.status_code == 400 and "content is required" in r0.json()["error"]["message"], r0.text
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Once upon", "max_tokens": 3}).json()
    assert r["object"] == "text_completion" and r["usage"]["completion_tokens"] == 3
    ask = {"model": MODEL, "prompt": "Once upon", "max_tokens": 1}
    for extra, param in (({"n": 3}, "n"), ({"best_of": 2}, "best_of"), ({"echo": True}, "echo"),
                         ({"logprobs": 2}, "logprobs"), ({"suffix": "end"}, "suffix")):  # were silently ignored
        r1 = httpx.post(url + "/v1/completions", json={**ask, **extra})
        assert r1.status_code == 400 and r1.json()["error"]["param"] == param, r1.text
    ok = {**ask, "n": 1, "best_of": 1, "echo": False, "logprobs": None, "suffix": None}  # what clients send unset
    assert httpx.post(url + "/v1/completions", json=ok).status_code == 200


def test_second_server_continues_a_session_and_drains_on_sigterm(served, tmp_path):
    """A session served by the first server is continued by a second one on the same store (and so by a server
    restarted after kill -9: the store is written through before each answer). SIGTERM lets the request in flight
    finish, and the session it wrote is whole."""
    url, model, home = served
    msgs = [{"role": "user", "content": "remember: blue"}]
    r1 = post(url, {"model": MODEL, "messages": msgs}, "s-shared").json()
    proc, url2 = start_server(model, home)
    try:
        msgs += [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "which colour?"}]
        box: dict[str, Any] = {}
        # 120 tokens: a reply still running at the signal (300 ran past the 8 s grace on a box at load 7)
        t = threading.Thread(target=lambda: box.update(r=post(url2, {"model": MODEL, "messages": msgs,
                                                                     "max_tokens": 120}, "s-shared")))
        t.start()
        wait_busy(url2)
        proc.send_signal(signal.SIGTERM)
        t.join(30)
        assert proc.wait(15) == 128 + signal.SIGTERM  # drained, then ended as `sinkchat chat` ends on SIGTERM
        assert "stopped by SIGTERM" in proc.stderr.read()  # type: ignore[union-attr]  # said, not silent
        r2 = box["r"].json()
        assert r2["usage"]["completion_tokens"] == 120  # finished, not cut
        assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == r1["usage"]["total_tokens"]
        assert r2["x_sinkchat"]["requests"] == 2
    finally:
        stop(proc)
    msgs += [{"role": "assistant", "content": r2["choices"][0]["message"]["content"]},
             {"role": "user", "content": "sure?"}]
    r3 = post(url, {"model": MODEL, "messages": msgs}, "s-shared").json()  # the first server loads the newer file
    assert r3["x_sinkchat"]["requests"] == 3
    assert r3["usage"]["prompt_tokens_details"]["cached_tokens"] == r2["usage"]["total_tokens"]


def test_a_stateless_request_reports_its_own_cache(served):
    """A user audit: a request without X-Session-Id said `"cache_len": 0, "seen": 0` in its x_sinkchat (read after
    its throwaway cache was let go)."""
    r = post(served[0], {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}]}).json()
    st = r["x_sinkchat"]
    assert st["id"] is None and st["cache_len"] == st["seen"] == r["usage"]["total_tokens"] > 0


def wait_busy(url: str, timeout: float = 30) -> None:
    """Until the server reports a request running (GET /health answers beside a generation)."""
    deadline = time.time() + timeout
    while httpx.get(url + "/health").json()["queue"] == 0:
        assert time.time() < deadline, "no request started"
        time.sleep(0.02)


def test_queue_limit_and_disconnect(served):
    """One generation at a time: with --max-queue 1, a third request while one runs and one waits gets 429. A
    client that goes away mid-stream stops its generation, and the session stays usable."""
    url = served[0]
    long = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 5000, "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/chat/completions", json=long,
                                                headers={"X-Session-Id": "s-cut"}) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")  # the stream has started: the generation runs
        box: dict[str, Any] = {}
        waiting = threading.Thread(target=lambda: box.update(r=post(url, {"model": MODEL, "messages": [
            {"role": "user", "content": "queued"}]})))
        waiting.start()
        deadline = time.time() + 30
        while httpx.get(url + "/health").json()["queue"] < 2:
            assert time.time() < deadline
            time.sleep(0.02)
        third = post(url, {"model": MODEL, "messages": [{"role": "user", "content": "third"}]})
        assert third.status_code == 429 and third.json()["error"]["code"] == "queue_full"
        assert third.headers.get("retry-after") == "1"
    # the client is gone: the stream stopped well before 5000 tokens, and the queued request got its answer
    waiting.join(60)
    assert box["r"].status_code == 200
    st = httpx.get(url + "/v1/sessions/s-cut").json()
    assert 0 < st["seen"] < 5000
    follow = post(url, {"model": MODEL, "messages": [{"role": "user", "content": "go"}]}, "s-cut")
    assert follow.status_code == 200 and follow.json()["x_sinkchat"]["requests"] == 2


def test_fuzzed_bodies_get_openai_answers(served):
    from hypothesis import HealthCheck, given, settings, strategies as st

    url = served[0]
    leaf = st.none() | st.booleans() | st.integers(-5, 5000) | st.floats(allow_nan=True) | st.text(max_size=12)
    values = st.recursive(leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c,
                                                                                        max_size=3), max_leaves=8)
    keys = st.sampled_from(["model", "messages", "tools", "tool_choice", "response_format", "temperature", "top_p",
                            "stop", "seed", "max_tokens", "stream", "n", "x"])
    hi = [{"role": "user", "content": "hi"}]
    bodies = st.fixed_dictionaries({"model": st.just(MODEL) | st.text(max_size=5),
                                    "messages": st.just(hi) | values,
                                    "max_tokens": st.just(2)}) | st.dictionaries(keys, values, max_size=5)
    # a valid request but for one field of any JSON type (a non-list `tools` was a 500, a non-boolean `stream`
    # was taken as true and answered with SSE)
    typed = st.sampled_from(["tools", "tool_choice", "response_format", "stream", "stream_options", "stop", "n",
                             "user"])
    one_off = st.tuples(typed, values).map(lambda kv: {"model": MODEL, "messages": hi, kv[0]: kv[1]})

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(bodies | one_off)
    def check(body: Any) -> None:
        if isinstance(body, dict):  # a real stream (true) would not be JSON: anything else must be a 400
            body = {**body, "max_tokens": 2, **({"stream": False} if body.get("stream") is True else {})}
        resp = post(url, None, raw=json.dumps(body).encode())  # NaN / Infinity as Python writes them
        data = resp.json()
        assert resp.status_code in (200, 400, 404, 409), resp.text
        assert ("choices" in data) if resp.status_code == 200 else set(data["error"]) >= {"message", "type", "code"}

    check()
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_api_key_and_host_guard():
    """--api-key: every /v1 route wants the Bearer key (401, OpenAI-shaped); binding beyond localhost without a key
    is refused before anything loads."""
    from starlette.testclient import TestClient

    from sinkchat.apps.serve.app import Server, build_app

    c = TestClient(build_app(Server(None, MODEL, api_key="k")))  # type: ignore[arg-type] - no request reaches it
    for resp in (c.get("/v1/models"), c.get("/v1/models", headers={"Authorization": "Bearer nope"}),
                 c.post("/v1/chat/completions", json={"model": MODEL, "messages": []})):
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    assert c.get("/v1/models", headers={"Authorization": "Bearer k"}).json()["data"][0]["id"] == MODEL
    assert c.get("/health").status_code == 200  # a load balancer's probe needs no key
    out = subprocess.run([sys.executable, "-m", "sinkchat", "serve", "--host", "0.0.0.0"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "give --api-key" in out.stderr and "Traceback" not in out.stderr


def test_a_port_in_use_is_one_line_before_the_model_loads(served, tmp_path):
    """A user audit: a port already in use was found after the model loaded (`sinkchat serve: model ...` printed),
    then uvicorn's `ERROR: [Errno 98]`, exit 3."""
    import socket

    _, model, _ = served
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        env = {**os.environ, "SINKCHAT_HOME": str(tmp_path / "home")}
        out = subprocess.run([sys.executable, "-m", "sinkchat", "serve", "--model", str(model), "--quant", "none",
                              "--port", str(port)], capture_output=True, text=True, timeout=120, env=env)
    finally:
        busy.close()
    assert out.returncode == 2, out.stderr
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in out.stderr, out.stderr
    assert "sinkchat serve: model" not in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow  # two real servers on the bundled model, ~13 s idle; the CLI's memory through a kill -9: test_memory_persist / test_resume
def test_sessions_keep_their_own_recall_memory_through_a_kill_9(tmp_path):
    """--memory on: each session evicts into a memory of its own (its figures add up: evicted == held + forgotten),
    a stateless request's memory goes with it, and a server killed -9 and restarted continues a session with its
    memory as it was written through."""
    model = save_tiny_chat_model(tmp_path / MODEL)
    home = tmp_path / "home"
    mem = ("--memory", "on", "--memory-block", "8", "--cache", "64")
    proc, url = start_server(model, home, *mem)
    try:
        a = [{"role": "user", "content": "alpha " * 60}]
        b = [{"role": "user", "content": "beta gamma " * 50}]
        ra, rb = post(url, {"model": MODEL, "messages": a}, "m-a").json(), post(url, {"model": MODEL, "messages": b},
                                                                                "m-b").json()
        post(url, {"model": MODEL, "messages": a})  # stateless
        fa, fb = (httpx.get(f"{url}/v1/sessions/{s}").json() for s in ("m-a", "m-b"))
        for f in (fa, fb):
            assert f["evicted"] > 0 and f["memory"]["tokens"] + f["memory"]["forgotten"] == f["evicted"]
        assert fa["memory"] != fb["memory"]
        assert len([d for d in (home / "memory").iterdir()]) == 3  # the idle one, m-a's and m-b's; not the stateless
    finally:
        proc.kill()
        proc.wait(15)
    proc, url = start_server(model, home, *mem)
    try:
        a += [{"role": "assistant", "content": ra["choices"][0]["message"]["content"]},
              {"role": "user", "content": "and?"}]
        r2 = post(url, {"model": MODEL, "messages": a}, "m-a").json()
        assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == ra["usage"]["total_tokens"]
        m2 = r2["x_sinkchat"]["memory"]
        assert m2["tokens"] >= fa["memory"]["tokens"] > 0  # brought back from its snapshot, then grown
        assert m2["tokens"] + m2["forgotten"] == r2["x_sinkchat"]["evicted"]
        share = r2["x_sinkchat"]["recalled_share"]  # the gauge's share on the recalled blocks, measured in the reply
        assert isinstance(share, float) and 0.0 < share < 1.0 - r2["x_sinkchat"]["sink_share"]
    finally:
        stop(proc)
