"""`sinkchat serve` audit fixes, against real server processes as in tests/test_serve.py: `stop` strings left out of
the reply (chat, completions, streamed or not) and of the session's history; a session reloaded from disk that can
still go back to a common prefix; non-list `tools` / non-boolean `stream` refused with a 400; SIGTERM that lets a
streamed reply end with its final chunk and [DONE]."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from typing import Any

import httpx
import pytest

from test_serve import MODEL, post, served, start_server, stop, wait_busy  # noqa: F401 - served: a fixture

ASK = [{"role": "user", "content": "count to ten"}]


def stream_lines(url: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> list[str]:
    with httpx.Client(timeout=60) as c, c.stream("POST", url + path, json=body) as resp:
        assert resp.status_code == 200
        return [line for line in resp.iter_lines() if line.startswith("data: ")]


def chunks(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]


def a_stop(text: str) -> str:
    """A stop string in the middle of `text` (the tiny model's reply): two characters, not all whitespace."""
    for at in range(len(text) // 3, len(text) - 2):
        if text[at:at + 2].strip():
            return text[at:at + 2]
    pytest.skip(f"the tiny model's reply is too short for a stop string: {text!r}")


def test_stop_strings_are_left_out_of_chat_replies(served):
    url = served[0]
    whole = post(url, {"model": MODEL, "messages": ASK, "max_tokens": 24}).json()["choices"][0]["message"]["content"]
    s = a_stop(whole)
    want = whole[:whole.find(s)]
    r = post(url, {"model": MODEL, "messages": ASK, "max_tokens": 24, "stop": [s]}).json()
    assert r["choices"][0]["message"]["content"] == want and r["choices"][0]["finish_reason"] == "stop"
    got = chunks(stream_lines(url, {"model": MODEL, "messages": ASK, "max_tokens": 24, "stop": s, "stream": True}))
    deltas = [c["choices"][0]["delta"].get("content") or "" for c in got]
    assert "".join(deltas) == want and not any(s in d for d in deltas)
    assert got[-1]["choices"][0]["finish_reason"] == "stop"


def test_stop_strings_are_left_out_of_completions(served):
    url = served[0]
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 24}
    whole = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    s = a_stop(whole)
    want = whole[:whole.find(s)]
    r = httpx.post(url + "/v1/completions", json={**body, "stop": [s]}, timeout=60).json()
    assert r["choices"][0]["text"] == want and r["choices"][0]["finish_reason"] == "stop"
    got = chunks(stream_lines(url, {**body, "stop": [s], "stream": True}, "/v1/completions"))
    assert "".join(c["choices"][0]["text"] for c in got) == want


def test_a_stopped_reply_echoed_back_is_fed_incrementally(served):
    """The session's history holds the reply as the client got it (without the stop string): a client that sends
    it back extends the session, only its new message is fed."""
    url = served[0]
    whole = post(url, {"model": MODEL, "messages": ASK, "max_tokens": 24}).json()["choices"][0]["message"]["content"]
    s = a_stop(whole)
    r1 = post(url, {"model": MODEL, "messages": ASK, "max_tokens": 24, "stop": [s]}, "s-stop").json()
    assert r1["choices"][0]["message"]["content"] == whole[:whole.find(s)]
    msgs = ASK + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                  {"role": "user", "content": "and then?"}]
    r2 = post(url, {"model": MODEL, "messages": msgs}, "s-stop").json()
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == r1["usage"]["total_tokens"] > 0


def test_bad_field_types_are_400s_naming_the_field(served):
    url = served[0]
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [("tools", -1, "tools"), ("tools", 1.5, "tools"), ("tools", True, "tools"), ("tools", "x", "tools"),
             ("stream", 1, "stream"), ("stream", "auto", "stream"), ("stream", [1], "stream"),
             ("stream_options", "yes", "stream_options"), ("stream_options", {"include_usage": "y"},
                                                             "stream_options.include_usage"),
             ("tool_choice", {"type": "function", "function": "f"}, "tool_choice"), ("user", 5, "user"),
             ("n", True, "n"), ("messages", [{"role": "assistant", "content": "x", "tool_calls": 3},
                                             {"role": "user", "content": "y"}], "messages[0].tool_calls")]
    for key, value, param in cases:
        resp = post(url, {**ok, key: value})
        assert resp.status_code == 400, (key, value, resp.text)
        assert resp.json()["error"]["param"] == param, (key, value, resp.text)
    assert post(url, {**ok, "stream": False, "tools": None}).status_code == 200


@pytest.mark.slow  # two real servers, ~16 s idle
def test_going_back_after_a_session_is_reloaded(served, tmp_path):
    """A session dropped from RAM (--max-sessions 1, another session used) and one after a restart still go back
    to the common prefix when the last user turn is edited: cached_tokens is the shared prefix, no 409."""
    _, model, _ = served
    home = tmp_path / "home"
    proc, url = start_server(model, home, "--max-sessions", "1")
    try:
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
        r1 = post(url, {"model": MODEL, "messages": msgs}, "r-a").json()
        msgs += [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "first question"}]
        r2 = post(url, {"model": MODEL, "messages": msgs}, "r-a").json()
        assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == r1["usage"]["total_tokens"]
        post(url, {"model": MODEL, "messages": [{"role": "user", "content": "other"}]}, "r-b")
        assert httpx.get(url + "/v1/sessions/r-a").json()["in_ram"] is False
        edited = msgs[:-1] + [{"role": "user", "content": "second question"}]
        r3 = post(url, {"model": MODEL, "messages": edited}, "r-a")
        assert r3.status_code == 200, r3.text
        assert r3.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == r1["usage"]["total_tokens"]
    finally:
        stop(proc)
    proc, url = start_server(model, home)  # a restart: the session comes from its file
    try:
        again = post(url, {"model": MODEL, "messages": msgs}, "r-a")  # the first edit back: diverges again
        assert again.status_code == 200, again.text
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == r1["usage"]["total_tokens"]
        same = post(url, {"model": MODEL, "messages": msgs}, "r-a").json()  # a regenerate right after
        assert same["usage"]["prompt_tokens_details"]["cached_tokens"] > r1["usage"]["total_tokens"]
    finally:
        stop(proc)


def _stream_through_sigterm(url: str, proc: Any, body: dict[str, Any]) -> tuple[list[str], float]:
    """Start a streamed reply, SIGTERM the server once it runs; the stream's data lines and how long it ran on."""
    box: dict[str, Any] = {"lines": []}

    def run() -> None:
        try:
            with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/chat/completions", json=body,
                                                        headers={"X-Session-Id": "s-term"}) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        box["lines"].append(line)
        except httpx.HTTPError as e:  # a stream cut short: what came before it is what the test looks at
            box["lines"].append(f"cut: {e!r}")
        box["end"] = time.time()

    t = threading.Thread(target=run)
    t.start()
    wait_busy(url)
    time.sleep(0.3)
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    t.join(40)
    assert proc.wait(20) == 128 + signal.SIGTERM
    return box["lines"], box["end"] - sent


@pytest.mark.slow  # waits out the 8 s cutoff on a real server, ~26 s idle; the drain on SIGTERM: test_serve's second-server test
def test_sigterm_lets_a_stream_finish_or_ends_it_properly(served):
    _, model, home = served
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "stream": True,
            "stream_options": {"include_usage": True}}
    proc, url = start_server(model, home)
    try:
        lines, _ = _stream_through_sigterm(url, proc, {**body, "max_tokens": 300})
    finally:
        stop(proc)
    assert lines[-1] == "data: [DONE]"
    got = chunks(lines)
    assert [c["choices"][0]["finish_reason"] for c in got if c["choices"]][-1] == "length"
    assert got[-1]["usage"]["completion_tokens"] == 300  # finished, not cut
    proc, url = start_server(model, home)
    try:  # a reply that would outlast the grace: stopped in time, still with its final chunk and [DONE]
        lines, took = _stream_through_sigterm(url, proc, {**body, "max_tokens": 1 << 20})
    finally:
        stop(proc)
    assert lines[-1] == "data: [DONE]" and took < 10.5
    got = chunks(lines)
    assert [c["choices"][0]["finish_reason"] for c in got if c["choices"]][-1] == "length"
    assert 0 < got[-1]["usage"]["completion_tokens"] < 1 << 20


def test_a_refused_request_leaves_its_session_as_it_was(served):
    """A user audit: a 400 for a system prompt too large to pin (cache 512) wiped the session it was sent to
    (cache_len 0, 0 messages), and its history was then fed again from scratch."""
    url = served[0]
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    r1 = post(url, {"model": MODEL, "messages": msgs}, "keep").json()
    before = httpx.get(url + "/v1/sessions/keep").json()
    big = [{"role": "system", "content": "rule " * 900}, {"role": "user", "content": "hello"}]
    r = post(url, {"model": MODEL, "messages": big}, "keep")
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    after = httpx.get(url + "/v1/sessions/keep").json()
    assert {k: after[k] for k in ("cache_len", "messages", "seen")} == {k: before[k] for k in
                                                                         ("cache_len", "messages", "seen")}
    msgs += [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]}, {"role": "user", "content": "x"}]
    r2 = post(url, {"model": MODEL, "messages": msgs}, "keep").json()
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == r1["usage"]["total_tokens"]
    first = post(url, {"model": MODEL, "messages": big}, "never")  # a new session refused at its first request
    assert first.status_code == 400
    assert httpx.get(url + "/v1/sessions/never").status_code == 404  # not left behind, empty (a user audit)


def test_an_unreadable_session_is_a_409_that_says_why_and_can_be_deleted(served):
    """A damaged session file made its id answer `500 internal error: SnapshotError` to every request, with no
    way out but deleting the file by hand; there was no DELETE route."""
    url, _, home = served
    root = home / "serve" / "sessions"
    root.mkdir(parents=True, exist_ok=True)
    (root / "broken.safetensors").write_bytes(b"garbage\n")
    hi = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    for r in (post(url, hi, "broken"), httpx.get(url + "/v1/sessions/broken")):
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert err["code"] == "session_unreadable" and "DELETE /v1/sessions/broken" in err["message"], err
    assert post(url, hi, "other").status_code == 200  # the engine was left in order
    d = httpx.delete(url + "/v1/sessions/broken")
    assert d.status_code == 200 and d.json()["deleted"] is True and not (root / "broken.safetensors").exists()
    assert post(url, hi, "broken").status_code == 200  # a new session under the same id
    assert (root / "broken.safetensors").is_file()
    assert httpx.delete(url + "/v1/sessions/broken").status_code == 200
    assert httpx.get(url + "/v1/sessions/broken").status_code == 404
    assert not (root / "broken.safetensors").exists()
    assert httpx.delete(url + "/v1/sessions/nobody").status_code == 404


def test_regenerating_the_last_reply_works_once_the_cache_is_full(served):
    """A user audit: with the cache full, the reply's first token evicts the oldest tokens, so every regeneration
    (the same messages sent again without the last reply) from turn 4 on was a 409 `session_diverged`, though
    the user's message was all still in the cache. Now the session goes back to right after that message and
    answers again, any number of times; going back past an evicted token is still a 409."""
    url = served[0]
    msgs: list[dict[str, Any]] = []
    evicted = 0
    for turn in range(12):
        msgs.append({"role": "user", "content": f"turn {turn}: " + "tell me more about the sea " * 6})
        r = post(url, {"model": MODEL, "messages": msgs}, "regen").json()
        msgs.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
        evicted = r["x_sinkchat"]["evicted"]
        if evicted and turn >= 4:
            break
    assert evicted > 0, "the cache never filled"
    asked = msgs[:-1]  # regenerate: the history without the last reply
    for _ in range(2):
        again = post(url, {"model": MODEL, "messages": asked}, "regen")
        assert again.status_code == 200, again.text
        body = again.json()
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == r["usage"]["prompt_tokens"]
        assert body["usage"]["prompt_tokens"] == r["usage"]["prompt_tokens"]  # nothing fed again but one token
        st = httpx.get(url + "/v1/sessions/regen").json()
        assert st["messages"] == len(asked) + 1 and st["cache_len"] <= st["capacity"]
    edited = msgs[:-2] + [{"role": "user", "content": "a different last question"}]  # edit the last turn
    assert post(url, {"model": MODEL, "messages": edited}, "regen").status_code == 200
    first = msgs[:1] + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
    gone = post(url, {"model": MODEL, "messages": first}, "regen")  # back past evicted tokens
    assert gone.status_code == 409 and "goes back to message 1 of" in gone.json()["error"]["message"], gone.text
    anew = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "hello"}]
    fresh = post(url, {"model": MODEL, "messages": anew}, "regen")  # a new system prompt: the conversation over
    assert fresh.status_code == 200, fresh.text
    st = httpx.get(url + "/v1/sessions/regen").json()
    assert st["messages"] == 2 and fresh.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_client_that_gives_up_on_a_reply_not_streamed_stops_it(served):
    """A user audit: a client that disconnected 1.5 s into a non-streamed 400-token request still had all of it
    generated, and the next request waited behind it (8.9 s). The reply now stops at the next token: the session
    saw far fewer than the 20,000 tokens asked for (uncancelled, it would see them all)."""
    url = served[0]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go on and on"}], "max_tokens": 20000}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 1 s and closes the connection
        httpx.post(url + "/v1/chat/completions", json=body, headers={"X-Session-Id": "gave-up"}, timeout=1.0)
    deadline = time.time() + 120
    while httpx.get(url + "/health").json()["queue"] and time.time() < deadline:
        time.sleep(0.05)
    st = httpx.get(url + "/v1/sessions/gave-up").json()
    assert 0 < st["seen"] < 20000, st
    assert post(url, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).status_code == 200  # served
    # (not in "gave-up": a cut reply that evicted makes another first message a 409 there, as it should)


def test_a_text_reply_under_tool_choice_auto_is_not_forced_to_closers(served):
    """`tool_choice: "auto"` allows a call or plain text; the last tokens of a reply are held to closing tokens so
    that a call is whole at max_tokens, and that once held a text reply too: "The weather in Paris"]]]]]]]]]]]]]]]"
    (a new user's audit, bundled model, max_tokens 20). A text reply is left alone; a call still closes."""
    from test_serve import WEATHER

    url, texts = served[0], []
    for seed in range(6):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                "tools": [WEATHER], "max_tokens": 24, "temperature": 1.0, "seed": seed}
        r = post(url, body)
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        if not msg.get("tool_calls") and not (msg.get("content") or "").startswith("{"):
            texts.append(msg["content"])
    assert texts  # the tiny random model writes text for most seeds
    for text in texts:
        assert not re.search(r'["\]}]{8,}$', text), text  # 16 tokens of closers ended every one before
