"""Constrained tool calls (agent/constrain.py) on the bundled tokenizer with a tiny random model: every constrained
reply parses into a valid call or answer whatever the seed and temperature, the mask never forbids a valid call's
next token nor its end, Ctrl-C mid-reply leaves the processor reusable, and with `constrain=False` malformed replies
are still fed back as errors. Plus: a fresh cache region per task, and a copied example call is refused."""

from __future__ import annotations

import json
import logging
import sys

import llguidance  # noqa: F401 - a required dependency: a broken install fails these tests, never skips them
import pytest
import torch

from sinkchat.apps.agent.agent import Agent, build_default_tools
from sinkchat.apps.agent.constrain import LlguidanceMissing, ToolCallConstraint, build_constraint
from sinkchat.apps.agent.protocol import FEW_SHOT, AgentErrorEvent, ModelTextEvent, parse_reply
from sinkchat.apps.agent.tools.workspace import Workspace
from sinkchat.core.events import DoneEvent, TokenEvent

from fakes import ScriptedEngine, tiny_model


def make_engine(tok, temperature=1.0, seed=0, max_tokens=160, capacity=2048):
    from sinkchat.config import CacheConfig, SamplingConfig
    from sinkchat.core.engine import Engine

    return Engine(tiny_model(vocab_size=len(tok), max_pos=4096, seed=seed % 3), tok, CacheConfig(capacity=capacity),
                  SamplingConfig(temperature=temperature, max_tokens=max_tokens, seed=seed))


@pytest.fixture(scope="module")
def tok(bundled):
    return bundled.tokenizer


@pytest.fixture
def box(tmp_path):
    return build_default_tools(Workspace(tmp_path / "ws", create=True))


def constraint_for(eng, box, string_chars=12):
    vocab = max(int(eng.model.config.vocab_size), len(eng.tokenizer))
    return ToolCallConstraint(eng.tokenizer, list(box.tools.values()), vocab, sorted(eng.stop_ids),
                              string_chars=string_chars)


@pytest.mark.parametrize("seed", range(12))
def test_constrained_replies_always_parse(tok, box, seed):
    """A random model (it never writes JSON on its own) under the mask: each reply is a call of a known tool whose
    arguments validate, or a final answer, and it ends by itself (EOS), not at max_tokens."""
    temperature = [0.0, 0.7, 1.0, 1.5][seed % 4]
    eng = make_engine(tok, temperature, seed)
    con = constraint_for(eng, box)
    list(eng.add_message("user", "Task: do something useful"))
    for _ in range(3):
        con.begin(require_call=seed % 2 == 0)
        done = [e for e in eng.generate(stop=(), logits_processors=[con]) if isinstance(e, DoneEvent)][0]
        assert done.reason == "eos", done.text
        p = parse_reply(done.text)
        assert p.kind in ("call", "final"), done.text
        if p.kind == "call":
            box.validate(p.name, p.args)  # raises ToolError if the arguments do not match the schema
        else:
            assert seed % 2 == 1, "a final answer where a call was required"
        list(eng.add_message("user", "Tool result: ok"))


VALID = [
    '{"tool": "clock", "args": {}}',
    '{"tool": "calculator", "args": {"expression": "(3 + 4) * 2"}}',
    '{"tool": "read_file", "args": {"path": "data/sales.csv", "offset": 10}}',
    '{"tool": "write_file", "args": {"path": "a b.txt", "content": "line \\"one\\"\\nline two"}}',
    '{"tool": "search_text", "args": {"pattern": "ERROR", "path": ".", "regex": false}}',
    '{"tool": "notes", "args": {"action": "append", "text": "ünïcödé ✓"}}',
    '{"tool": "column_sum", "args": {"path": "sales.csv", "column": "amount"}}',
    '{"tool": "count_matches", "args": {"pattern": "a \\\\d", "path": "x.log"}}',
    '{"final": "The answer is 42."}',
]


@pytest.mark.parametrize("text", VALID)
def test_mask_never_forbids_a_valid_call_or_its_end(tok, box, text):
    import torch

    from sinkchat.core.tokens import stop_ids

    eos = sorted(stop_ids(tok, tiny_model(vocab_size=len(tok))))
    con = ToolCallConstraint(tok, list(box.tools.values()), len(tok), eos)
    con.begin()
    ids = tok.encode(text, add_special_tokens=False)
    recent: list[int] = [1, 2, 3]
    for t in ids:
        out = con(recent, torch.zeros(len(tok)))
        assert torch.isfinite(out[t]), (text, tok.decode([t]))
        recent.append(t)
    out = con(recent, torch.zeros(len(tok)))
    allowed = torch.isfinite(out).nonzero().flatten().tolist()
    assert allowed and set(allowed) <= set(eos), [tok.decode([a]) for a in allowed[:5]]  # the end is forced
    assert con.complete


def test_ctrl_c_mid_reply_leaves_the_constraint_reusable(tok, tmp_path):
    eng = make_engine(tok, 1.0, 5)
    agent = Agent(eng, build_default_tools(Workspace(tmp_path / "ws", create=True)), tmp_path / "ws")
    assert agent.constraint is not None
    gen = agent.run("first task", 3)
    n = 0
    for ev in gen:
        n += isinstance(ev, TokenEvent)
        if n == 4:
            break
    gen.close()  # what Ctrl-C does to the loop: the reply stops after 4 tokens
    texts = [e.text for e in agent.run("second task", 2) if isinstance(e, ModelTextEvent)]
    assert texts and all(parse_reply(t).kind in ("call", "final") for t in texts), texts


def test_unconstrained_recovery_still_works(tok, tmp_path):
    """--no-constrain: the random model's garbage is fed back as errors, the loop goes on to max_steps."""
    eng = make_engine(tok, 1.0, 1, max_tokens=8)
    agent = Agent(eng, build_default_tools(Workspace(tmp_path / "ws", create=True)), tmp_path / "ws", constrain=False)
    assert agent.constraint is None
    events = list(agent.run("do it", 4))
    assert sum(isinstance(e, ModelTextEvent) for e in events) == 4
    assert agent.counts.unusable + agent.counts.calls_failed >= 3
    fed = [m["content"] for m in eng.conv.messages if m["role"] == "user"]
    assert sum(c.startswith("Tool error") for c in fed) >= 3


def test_scripted_engine_without_processors_runs_unconstrained(tmp_path, caplog):
    """Where the constraint cannot work the run goes on unconstrained, and a WARNING (stderr under the CLI's
    logging) says so, naming the flag it is then equivalent to; it was an info line nobody saw."""
    eng = ScriptedEngine(['{"tool": "clock" "args": {}}', '{"tool": "clock", "args": {}}', '{"final": "noon"}'])
    with caplog.at_level(logging.WARNING, logger="sinkchat.apps.agent.constrain"):
        agent = Agent(eng, build_default_tools(Workspace(tmp_path / "ws", create=True)), tmp_path / "ws")
    said = [r for r in caplog.records if r.name == "sinkchat.apps.agent.constrain"]
    assert [r.levelno for r in said] == [logging.WARNING] and "--no-constrain" in said[0].getMessage()
    assert agent.constraint is None and build_constraint(eng, [], False) is None
    list(agent.run("time?", 5))
    assert agent.counts.unusable == 1 and agent.counts.calls_ok == 1 and agent.counts.finals == 1


def test_each_task_starts_from_the_same_cache(tok, tmp_path):
    """Carry-over fix: the second task sees the system prompt and examples, not the first task's turns."""
    eng = make_engine(tok, 1.0, 2, max_tokens=40)
    agent = Agent(eng, build_default_tools(Workspace(tmp_path / "ws", create=True)), tmp_path / "ws")
    list(agent.run("task one", 2))
    base = agent.checkpoint.length
    list(agent.run("task two", 1))
    assert [m["content"][:13] for m in eng.conv.messages].count("Task: task tw") == 1
    assert not any(m["content"].startswith("Task: task one") for m in eng.conv.messages)
    assert eng.conv.messages[len(FEW_SHOT)]["content"].startswith("Task: task two")
    assert eng.cache.length == len(eng.ledger.ids) > base


def test_a_copied_example_call_is_refused(tmp_path):
    root = tmp_path / "ws"
    copied = next(t for r, t in FEW_SHOT if r == "assistant" and "write_file" in t)
    eng = ScriptedEngine([copied, '{"final": "ok"}'])
    agent = Agent(eng, build_default_tools(Workspace(root, create=True)), root)
    events = list(agent.run("say hi", 3))
    assert any(isinstance(e, AgentErrorEvent) and "example" in e.message for e in events)
    assert not any(root.iterdir())  # nothing written into the user's workspace
    assert json.loads(copied)["tool"] == "write_file"


def test_read_paths_are_limited_to_the_workspace_listing(tok, box, tmp_path):
    """With a workspace, the path of a read-only tool must be an existing entry (the bundled model mangled paths it
    copied); write_file keeps free paths; the listing is re-read before each reply."""
    import torch

    root = tmp_path / "ws"
    (root / "docs").mkdir()
    (root / "docs" / "readme.md").write_text("x")
    con = ToolCallConstraint(tok, list(box.tools.values()), len(tok), [2], workspace=root)

    def allowed(text):
        con.begin()
        recent = [1]
        for t in tok.encode(text, add_special_tokens=False):
            if not torch.isfinite(con(recent, torch.zeros(len(tok)))[t]):
                return False
            recent.append(t)
        return True

    assert allowed('{"tool": "read_file", "args": {"path": "docs/readme.md"}}')
    assert not allowed('{"tool": "read_file", "args": {"path": "docs.md"}}')
    assert not allowed('{"tool": "read_file", "args": {"path": "../secret.txt"}}')
    assert allowed('{"tool": "write_file", "args": {"path": "new/dir/file.txt", "content": "hi"}}')
    assert not allowed('{"tool": "count_lines", "args": {"path": "later.txt"}}')
    (root / "later.txt").write_text("now it exists")
    assert allowed('{"tool": "count_lines", "args": {"path": "later.txt"}}')


def test_a_token_the_grammar_refuses_ends_the_reply(tok, box, caplog):
    """A sampled token the matcher refuses (a tokenizer llguidance reads differently) used to switch the mask off:
    on a mis-tokenizing Gemma file the reply then ran 512 tokens unconstrained. Now only the end tokens remain."""
    eng = make_engine(tok)
    con = constraint_for(eng, box)
    con.begin()
    logits = torch.randn(1, con.vocab)
    first = con([], logits)
    bad = tok.encode("x", add_special_tokens=False)[0]  # a reply cannot start with x
    assert torch.isinf(first[0, bad])
    out = con([bad], logits)
    allowed = torch.isfinite(out[0]).nonzero().flatten().tolist()
    assert allowed and set(allowed) <= set(eng.stop_ids)
    assert sum("ending this reply" in r.getMessage() for r in caplog.records) == 1


def _hide_llguidance(monkeypatch):
    """A broken install: `import llguidance` raises ImportError."""
    for name in [m for m in sys.modules if m == "llguidance" or m.startswith("llguidance.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "llguidance.hf", None)


def test_a_missing_llguidance_is_an_error_not_a_silent_unconstrained_run(tok, box, tmp_path, monkeypatch):
    """llguidance is required: without it the agent refuses to start with one line naming the fix (reinstall, or
    --no-constrain), rather than running unconstrained (0 valid calls in a 54-step soak) with an info log line."""
    eng = make_engine(tok, max_tokens=8)
    _hide_llguidance(monkeypatch)
    with pytest.raises(LlguidanceMissing) as e:
        Agent(eng, box, tmp_path / "ws")
    msg = str(e.value)
    assert "\n" not in msg and "--no-constrain" in msg and "reinstall" in msg and e.value.exit_code == 1
    assert Agent(eng, box, tmp_path / "ws", constrain=False).constraint is None  # the flag it names works without it


def test_cli_without_llguidance_says_so_in_one_error_line(tok, tmp_path, monkeypatch):
    from click.testing import CliRunner

    import sinkchat.apps.agent.command as agent_mod

    root = tmp_path / "ws"
    root.mkdir()
    monkeypatch.setattr("sinkchat.api.open_engine", lambda *a, **k: make_engine(tok, max_tokens=8))
    _hide_llguidance(monkeypatch)
    args = ["what time is it?", "--workspace", str(root), "--max-steps", "1", "--no-log"]
    res = CliRunner().invoke(agent_mod.agent_command, args)
    assert res.exit_code == 1, res.output
    errors = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and "llguidance" in errors[0] and "--no-constrain" in errors[0], res.output
    res = CliRunner().invoke(agent_mod.agent_command, args + ["--no-constrain"])
    assert res.exit_code == 3 and "Error:" not in res.output and "unconstrained" in res.output, res.output
