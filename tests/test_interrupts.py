"""Ctrl-C that lands at the worst possible bytecode: between a cache mutation and the ledger's matching update.

A timer-driven SIGINT (see test_faults) hits these gaps only by chance; here the signal is raised exactly inside
them, so a regression fails every run."""

from __future__ import annotations

import os
import signal

import pytest

from fakes import CharTokenizer, tiny_model
from sinkchat.core.cache_policy import Ledger
from sinkchat.config import CacheConfig, SamplingConfig
from sinkchat.core.engine import Engine
from sinkchat.core.interrupts import deferred_sigint


def _sigint() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def _engine(word_tok) -> Engine:
    eng = Engine(tiny_model(), word_tok, CacheConfig(policy="sink", n_sink=4, capacity=32, evict_chunk=4),
                 SamplingConfig(temperature=0.0, max_tokens=100))
    list(eng.feed_ids(list(range(5, 35))))  # 30 of 32 slots
    return eng


def test_deferred_sigint_is_delivered_after_the_body():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_sigint():
            _sigint()
            done.append("body finished")
    assert done == ["body finished"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_interruptible_span_raises_at_once():
    with pytest.raises(KeyboardInterrupt):
        with deferred_sigint() as guard:
            with guard.interruptible():
                _sigint()
                pytest.fail("the interrupt should have been raised inside the span")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_sigint_between_cache_eviction_and_ledger_eviction(word_tok, monkeypatch):
    eng = _engine(word_tok)
    real = Ledger.evict

    def evict_then_interrupted(self, ev):
        _sigint()  # lands after the cache already shifted its keys
        return real(self, ev)

    monkeypatch.setattr(Ledger, "evict", evict_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        list(eng.feed_ids([40, 41, 42, 43]))  # needs room: evicts
    assert eng.ledger.evicted > 0
    assert eng.cache.length == len(eng.ledger)


def test_sigint_after_the_forward_before_the_ledger_records_it(word_tok, monkeypatch):
    eng = _engine(word_tok)
    real = Ledger.append
    n0 = len(eng.ledger)

    def append_interrupted(self, ids):
        _sigint()  # the forward pass has written K/V already
        return real(self, ids)

    monkeypatch.setattr(Ledger, "append", append_interrupted)
    with pytest.raises(KeyboardInterrupt):
        for _ in eng.generate(5):
            pass
    monkeypatch.setattr(Ledger, "append", real)
    assert eng.cache.length == len(eng.ledger) == n0 + 1  # the token was kept, and is recorded
    assert eng.last_reply_ids == eng.ledger.ids[-1:]  # the reply record agrees with the cache
    list(eng.feed_ids([7, 8]))
    assert eng.cache.length == len(eng.ledger)


def test_sigint_inside_the_model_call_rolls_back(word_tok):
    eng = _engine(word_tok)
    n0 = len(eng.ledger)
    handle = eng.model.model.layers[0].register_forward_hook(lambda *a: _sigint())
    try:
        with pytest.raises(KeyboardInterrupt):
            list(eng.feed_ids([50, 51]))
    finally:
        handle.remove()
    assert eng.cache.length == len(eng.ledger) == n0
    list(eng.feed_ids([50, 51]))
    assert eng.cache.length == len(eng.ledger) == n0 + 2


def _chat_engine(capacity: int = 256) -> Engine:
    model = tiny_model("llama", layers=2, max_pos=512)
    model.config.eos_token_id = 96
    return Engine(model, CharTokenizer(), CacheConfig(policy="sink", n_sink=4, capacity=capacity, evict_chunk=8),
                  SamplingConfig(temperature=0.0, max_tokens=6), prefill_chunk=4)


def _interrupt_on_forward(eng: Engine, n: int):
    """A hook that raises KeyboardInterrupt on the n-th forward from now (a mid-prefill Ctrl-C)."""
    calls = []

    def hook(*_):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt

    return eng.model.model.layers[0].register_forward_hook(hook)


def test_ctrl_c_while_a_message_is_fed_takes_it_back_whole():
    eng = _chat_engine()
    list(eng.chat("hello"))
    before = (eng.cache.length, eng.ledger.seen, list(eng.conv.messages), eng.conv.fed)
    handle = _interrupt_on_forward(eng, 3)  # the long message needs several 4-token chunks
    try:
        with pytest.raises(KeyboardInterrupt):
            list(eng.add_message("user", "a long message that is cut while it is being fed"))
    finally:
        handle.remove()
    assert eng.message_taken_back
    assert (eng.cache.length, eng.ledger.seen, eng.conv.messages, eng.conv.fed) == before
    # the next turn is exactly what it would have been had the cut message never been typed
    ref = _chat_engine()
    list(ref.chat("hello"))
    got = [e.token_id for e in eng.chat("again") if hasattr(e, "token_id")]
    want = [e.token_id for e in ref.chat("again") if hasattr(e, "token_id")]
    assert got == want and eng.ledger.ids == ref.ledger.ids


def test_a_message_that_already_evicted_stays_when_cut():
    eng = _chat_engine(capacity=24)
    list(eng.chat("hi"))
    n_messages = len(eng.conv.messages)
    handle = _interrupt_on_forward(eng, 8)
    try:
        with pytest.raises(KeyboardInterrupt):
            list(eng.add_message("user", "a message much longer than the whole cache of twenty-four tokens"))
    finally:
        handle.remove()
    assert eng.ledger.evicted > 0 and not eng.message_taken_back
    assert eng.cache.length == len(eng.ledger)
    assert len(eng.conv.messages) == n_messages + 1  # the message is kept in the record too


def test_sigterm_with_a_raising_handler_is_held_too():
    class Terminated(Exception):
        pass

    def on_term(signum, frame):
        raise Terminated

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        done = []
        with pytest.raises(Terminated):
            with deferred_sigint():
                os.kill(os.getpid(), signal.SIGTERM)
                done.append("body finished")
        assert done == ["body finished"]
        assert signal.getsignal(signal.SIGTERM) is on_term
    finally:
        signal.signal(signal.SIGTERM, old)


def test_chat_turns_sigterm_into_exit_143_and_puts_the_old_handler_back():
    """chat's SIGTERM: SystemExit(143) where it lands (so `finally` closes the session log), held by the Engine's
    deferred sections like Ctrl-C (the handler is a Python callable), the previous handler back afterwards."""
    from sinkchat.apps.chat.repl import _sigterm_exits

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        with _sigterm_exits():
            with deferred_sigint():  # a cache-and-ledger update: the signal waits for its end
                os.kill(os.getpid(), signal.SIGTERM)
                held = True
    assert e.value.code == 143 and held
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_sigterm_while_chat_closes_its_log_is_ignored():
    """The first SIGTERM ends chat; one more while the session log closes (a service manager repeating itself),
    or a first one after /bye, must not raise inside that close (the old handler was back by then, and the process
    died). chat_command closes the log as below; the second half is its /bye path."""
    from sinkchat.apps.chat.repl import _sigterm_exits

    closed = []
    with pytest.raises(SystemExit) as e:
        with _sigterm_exits() as closing:
            try:
                os.kill(os.getpid(), signal.SIGTERM)
            finally:
                closing()
                os.kill(os.getpid(), signal.SIGTERM)  # during the close
                closed.append("log closed")
    assert e.value.code == 143 and closed == ["log closed"]
    with _sigterm_exits() as closing:  # /bye: the loop ended by itself, then a SIGTERM lands in the close
        closing()
        os.kill(os.getpid(), signal.SIGTERM)
        closed.append("closed after /bye")
    assert closed[-1] == "closed after /bye"
