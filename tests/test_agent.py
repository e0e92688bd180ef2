"""The agent loop: a scripted fake engine (malformed, unknown, mistyped and hostile calls), the protocol parser, the
native-template path, conversation compaction, the real bundled model, and a 200-step run on a real Engine whose
cache stays within capacity while evictions happen."""

from __future__ import annotations

import json

import pytest

from sinkchat.apps.agent.agent import Agent, AgentCounts, build_default_tools
from sinkchat.apps.agent.tools.workspace import Workspace
from sinkchat.apps.agent.protocol import (
    FEW_SHOT, ModelTextEvent, StepEvent, TaskDoneEvent, ToolResultEvent, ToolsTokenizer, parse_reply,
)
from sinkchat.core.events import EvictionEvent, TokenEvent
from sinkchat.core.turns import Conversation

from fakes import ScriptedEngine as FakeEngine, emit_reply, tiny_model

SECRET = "OUTSIDE-SECRET-91c2"


def call(name, **args):
    return json.dumps({"tool": name, "args": args})


@pytest.fixture
def ws(tmp_path):
    (tmp_path / "secret.txt").write_text(SECRET)
    root = tmp_path / "ws"
    root.mkdir()
    (root / "rootlink").symlink_to("/")
    (root / "big.bin").write_bytes(b"\x00\x01" * (5 * 1024 * 1024))
    return root


def run_all(agent, task, max_steps):
    events = list(agent.run(task, max_steps))
    steps = [e for e in events if isinstance(e, StepEvent)]
    results = [e for e in events if isinstance(e, ToolResultEvent)]
    done = [e for e in events if isinstance(e, TaskDoneEvent)]
    return events, steps, results, done


def test_scripted_hostile_and_malformed_calls_never_crash(ws):
    script = [
        '{"tool": "clock", "args": {',  # unclosed
        '{"tool": "clock" "args": {}}',  # missing comma
        "Sure! I will now think about it.",  # no call at all
        call("launch_rockets", target="moon"),  # unknown tool
        call("calculator", expression=["1", "+"]),  # wrong type
        call("read_file", path="../secret.txt"),
        call("read_file", path="../../etc/passwd"),
        call("read_file", path="/etc/passwd"),
        call("read_file", path="rootlink/etc/passwd"),
        call("read_file", path="/dev/zero"),
        call("read_file", path="big.bin"),
        call("write_file", path="../pwned.txt", content="x"),
        "{'tool': 'calculator', 'args': {'expression': '6*7',},}",  # Python-style, trailing commas: accepted
        call("write_file", path="out.txt", content="42"),
        '{"final": "the answer is 42"}',
    ]
    eng = FakeEngine(script)
    agent = Agent(eng, build_default_tools(ws), ws, max_result_chars=300, few_shot=False)
    events, steps, results, done = run_all(agent, "do it", 20)
    assert len(steps) == len(script)
    assert len(results) == len(script) - 1  # every step but the final one got its result back
    assert done[0].reason == "final" and done[0].answer == "the answer is 42"
    fed = [c for r, c, _ in eng.fed[1:]]
    assert len(fed) == len(results) and all(f.startswith("Tool ") for f in fed)
    assert [r.text in f for r, f in zip(results, fed)] == [True] * len(fed)
    expect = ["incomplete JSON", "malformed JSON", "no tool call", "unknown tool 'launch_rockets'", "must be string",
              "refused", "refused", "refused", "refused", "refused", "binary file", "refused", "42", "wrote 2 bytes"]
    for want, f in zip(expect, fed):
        assert want in f, (want, f)
    assert not any(SECRET in f or "root:x:" in f for f in fed)
    assert (ws / "out.txt").read_text() == "42" and not (ws.parent / "pwned.txt").exists()
    assert agent.counts == AgentCounts(tasks=1, steps=15, calls_ok=3, calls_failed=8, unusable=3, finals=1)


def test_max_steps_ends_the_task_and_closes_the_turn(ws):
    eng = FakeEngine([call("clock")] * 10)
    agent = Agent(eng, build_default_tools(ws), ws, few_shot=False)
    _, steps, results, done = run_all(agent, "loop", 4)
    assert len(steps) == 4 and len(results) == 4 and done[0].reason == "max_steps"
    assert [g for _, _, g in eng.fed] == [True, True, True, True, False]  # the last result has no open header
    list(agent.run("next", 1))  # a second task continues the same conversation (prefix-stable)
    assert eng.fed[-2][1].startswith("Task: next")
    assert agent.counts.tasks == 2 and agent.counts.steps == 5


def test_generation_stops_after_a_complete_call(ws):
    eng = FakeEngine([call("clock") + "\nTool result (clock): 1999-01-01 invented by the model", '{"final": "ok"}'])
    agent = Agent(eng, build_default_tools(ws), ws, few_shot=False)
    events, _, results, _ = run_all(agent, "time?", 3)
    texts = [e for e in events if isinstance(e, ModelTextEvent)]
    assert texts[0].reason == "call" and "1999" not in texts[0].text
    assert eng.conv.messages[1]["role"] == "assistant" and eng.conv.messages[1]["content"].rstrip().endswith("}")
    assert "1999" not in results[0].text


def test_examples_call_only_the_tools_offered(ws):
    """With `--no-builtin-tools --mcp ...` every example turn called a built-in tool the run did not have (a new
    user's audit): examples that call a tool not offered are left out, the rest keep their order."""
    from sinkchat.apps.agent.protocol import EXAMPLES, examples_for
    from sinkchat.apps.agent.tools.toolbox import Toolbox

    def add(a: float, b: float) -> str:
        """Add two numbers."""
        return str(a + b)

    box = Toolbox()
    box.add(add, ws)
    eng = FakeEngine(['{"final": "3"}'])
    list(Agent(eng, box, ws).run("add 1 and 2", 2))
    assert eng.fed[0][1].startswith("Task: add 1 and 2")  # no example: none calls only `add`
    calc = [ex for ex in EXAMPLES if all('"tool"' not in t or '"calculator"' in t for r, t in ex if r == "assistant")]
    assert calc and examples_for("What is 3 times 4?", ["calculator", "add"]) == [t for ex in calc for t in ex]
    assert examples_for(None) == FEW_SHOT


def test_few_shot_exchange_is_fed_once_before_the_first_task(ws):
    eng = FakeEngine(['{"final": "a"}', '{"final": "b"}'])
    agent = Agent(eng, build_default_tools(ws), ws)
    list(agent.run("one", 2))
    list(agent.run("two", 2))
    assert [(r, c) for r, c, _ in eng.fed[: len(FEW_SHOT)]] == FEW_SHOT
    assert [c for _, c, _ in eng.fed[len(FEW_SHOT):]][0].startswith("Task: one")
    from sinkchat.apps.agent.protocol import EXAMPLES

    # the examples' tasks (re-fed before each task, most similar last) + the two real ones
    assert sum(c.startswith("Task:") for _, c, _ in eng.fed) == len(EXAMPLES) + 2


def test_side_effects_need_approval(ws):
    asked = []
    eng = FakeEngine([call("write_file", path="a.txt", content="x"), call("notes", action="read"), call("clock"),
                      '{"final": "done"}'])
    agent = Agent(eng, build_default_tools(ws), ws, few_shot=False, approve=lambda n, a: asked.append(n) or False)
    _, _, results, _ = run_all(agent, "t", 5)
    assert asked == ["write_file"]  # reading notes and the clock need no approval
    assert "denied" in results[0].text and not (ws / "a.txt").exists()
    assert results[1].ok and results[2].ok


@pytest.mark.parametrize("text,kind,name", [
    ('{"tool": "clock", "args": {}}', "call", "clock"),
    ('Let me check.\n```json\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n```', "call", "calculator"),
    ('<tool_call>\n{"name": "list_dir", "arguments": "{\\"path\\": \\".\\"}"}\n</tool_call>', "call", "list_dir"),
    ('{"function": {"name": "clock", "arguments": {}}}', "call", "clock"),
    ("It's here: {'tool': 'notes', 'args': {'action': 'read', 'x': True}}", "call", "notes"),
    ('{"final": "done"}', "final", ""),
    ('{"tool": "final_answer", "args": {"answer": "7"}}', "final", ""),
    ("Final answer: 7", "final", ""),
    ('{"tool": "clock", "args": {}', "error", ""),
    ('{"tool": clock}', "error", ""),
    ('{"thought": "hmm"}', "error", ""),
    ('{"tool": 5}', "error", ""),
    ("just words, no braces", "none", ""),
    ("", "none", ""),
    ("{" * 5000, "error", ""),
])
def test_parse_reply(text, kind, name):
    p = parse_reply(text)
    assert p.kind == kind, p
    assert p.name == name
    if kind == "error":
        assert p.error


def test_native_template_gets_tool_schemas_and_tool_role(ws):
    eng = FakeEngine(['<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>',
                      "The answer is 42."], chat_template="{% if tools %}{{ tools }}{% endif %}")
    agent = Agent(eng, build_default_tools(ws), ws, few_shot=False)
    assert agent.native and isinstance(eng.conv.tokenizer, ToolsTokenizer)
    _, steps, results, done = run_all(agent, "6 times 7?", 5)
    names = [t["function"]["name"] for t in eng.tokenizer.tools_seen[-1]]
    assert "calculator" in names and "read_file" in names
    assert eng.fed[1] == ("tool", "42", True)
    assert done[0].reason == "final" and done[0].answer == "The answer is 42." and len(steps) == 2


def test_compaction_keeps_the_next_delta_identical(bundled, tmp_path):
    """After compaction the conversation bookkeeping is small, and the text fed (closing + next message) is exactly
    what the full history would have produced."""
    tok = bundled.tokenizer
    full = Conversation(tok, "SYS")
    eng = FakeEngine([])
    eng.conv = Conversation(tok, "SYS")
    for i in range(40):
        for conv in (full, eng.conv):
            conv.delta_for("user", f"Tool result (clock): {i}")
            conv.add_reply('{"tool": "clock", "args": {}}' + ("<|im_end|>" if i % 2 else ""))
    agent = Agent(eng, build_default_tools(Workspace(tmp_path / "ws", create=True)))
    assert not agent.own_system and eng.conv.system == "SYS"
    list(agent._compact())
    assert len(eng.conv.messages) == 0 and len(eng.conv.fed) < 100
    closing = "".join(eng.raw)
    assert closing == "\n"  # the last reply ended with <|im_end|> but not its newline
    assert closing + eng.conv.delta_for("user", "next") == full.delta_for("user", "next")


@pytest.mark.slow  # the bundled model's agent turns, ~16 s idle; the agent CLI on it: test_soak's bundled agent soak
def test_real_model_structural(bundled, tmp_path):
    """The bundled model on a simple task: the loop ends within max_steps and every step's result is fed back
    (what the model says is not asserted)."""
    from sinkchat.config import CacheConfig, SamplingConfig
    from sinkchat.core.engine import Engine

    eng = Engine(bundled.model, bundled.tokenizer, CacheConfig(capacity=1024),
                 SamplingConfig(temperature=0, max_tokens=32, seed=0))
    agent = Agent(eng, build_default_tools(Workspace(tmp_path / "ws", create=True)), tmp_path / "ws")
    events, steps, results, done = run_all(agent, "What time is it? Use the clock tool.", 3)
    assert len(done) == 1 and 1 <= len(steps) <= 3
    finished = done[0].reason == "final"
    assert len(results) == len(steps) - (1 if finished else 0)
    start = next(i for i, m in enumerate(eng.conv.messages) if m["content"].startswith("Task: What time"))
    assert start == len(FEW_SHOT)  # the demonstrated exchange came first
    fed_results = [m["content"] for m in eng.conv.messages[start:] if m["role"] == "user" and m["content"].startswith("Tool ")]
    assert len(fed_results) == len(results)
    assert all(r.text in f for r, f in zip(results, fed_results))
    assert eng.cache.length == len(eng.ledger.ids) <= 1024
    assert sum(isinstance(e, TokenEvent) for e in events) >= len(steps)


class HalfScripted:
    """Mixin: every other reply is a scripted tool call fed through the REAL cache (the tiny random model cannot
    call tools), the others are sampled from the model; both go through the same eviction path."""

    SCRIPT = [call("clock"), call("calculator", expression="2+2"), call("notes", action="append", text="step"),
              call("write_file", path="log.txt", content="x" * 50, append=True), call("read_file", path="log.txt"),
              call("list_dir"), call("read_file", path="../../etc/passwd"), '{"tool": "clock", "args": {']

    def generate(self, max_tokens=None, stop=(), sampling=None):
        self.n_gen = getattr(self, "n_gen", 0) + 1
        if self.n_gen % 2:
            yield from super().generate(max_tokens, stop, sampling)
            return
        text = self.SCRIPT[(self.n_gen // 2) % len(self.SCRIPT)]
        yield from emit_reply(self, text)


@pytest.mark.slow  # 200 agent steps, ~15 s idle; the cache bound over an agent run: test_soak's bundled agent soak
def test_two_hundred_steps_stay_within_capacity(bundled, tmp_path):
    from sinkchat.config import CacheConfig, SamplingConfig
    from sinkchat.core.engine import Engine


    class Eng(HalfScripted, Engine):
        pass

    tok = bundled.tokenizer
    model = tiny_model(vocab_size=len(tok), max_pos=4096)
    eng = Eng(model, tok, CacheConfig(capacity=128, n_sink=4, evict_chunk=16, pin="none"),  # the tools' prompt > 128
              SamplingConfig(temperature=1.0, max_tokens=6, seed=1))
    agent = Agent(eng, build_default_tools(Workspace(tmp_path / "ws", create=True)), tmp_path / "ws", max_result_chars=200)
    evictions, max_len, n = 0, 0, 0
    for ev in agent.run("keep working, and append lines to log.txt", 200):  # names log.txt: appends allowed
        n += 1
        if isinstance(ev, EvictionEvent):
            evictions += 1
        cl = getattr(ev, "cache_len", None)
        if cl is not None:
            max_len = max(max_len, cl)
        if isinstance(ev, (StepEvent, ToolResultEvent)):
            assert eng.cache.length <= 128 and len(eng.ledger.ids) == eng.cache.length
    c = agent.counts
    assert c.steps == 200 and c.calls_ok + c.calls_failed + c.unusable + c.finals == 200
    assert c.calls_ok >= 60 and c.unusable >= 10  # scripted calls worked; random model text was fed back as errors
    assert evictions > 50 and eng.ledger.evicted > 10 * 128
    assert max_len <= 128 and eng.cache.length <= 128
    assert eng.ledger.holds_stream_start()  # the sinks still hold the very first tokens
    from sinkchat.apps.agent.protocol import FEW_SHOT

    # bookkeeping stays bounded too (the examples are held until the first compaction; 200 steps unbounded: ~400)
    assert len(eng.conv.messages) <= agent.keep_messages + len(FEW_SHOT) + 4
    assert (tmp_path / "ws" / "NOTES.md").read_text().count("step") >= 10


def test_cli_runs_with_plain_output(bundled, tmp_path, monkeypatch):
    """The command end to end (tiny random model, so it is quick): plain lines, status line, summary."""
    from click.testing import CliRunner

    import sinkchat.apps.agent.command as agent_mod
    from sinkchat.core.engine import Engine
    from sinkchat.config import CacheConfig, SamplingConfig

    def fake_open(settings, system=None, progress=None):
        return Engine(tiny_model(vocab_size=len(bundled.tokenizer)), bundled.tokenizer, CacheConfig(capacity=96, pin="none"),
                      SamplingConfig(temperature=1.0, max_tokens=4, seed=0))

    monkeypatch.setattr("sinkchat.api.open_engine", fake_open)
    res = CliRunner().invoke(agent_mod.agent_command, ["Do a thing", "--max-steps", "3", "--workspace",
                                                       str(tmp_path / "w"), "--create-workspace", "--approve", "auto"])
    unverified = "✗ task NOT verified: " in res.output  # a random model's answer is rarely grounded
    assert res.exit_code == (3 if unverified else 0), res.output
    assert f"agent: 1 task(s), {int(unverified)} unverified" in res.output
    # max_tokens=4 no longer cuts every reply: the constraint raises a reply's budget until a call can close, so
    # the random model may answer before step 3
    n = res.output.count("── step ")
    assert 1 <= n <= 3 and "kv " in res.output and ("(max_steps)" in res.output or "(final)" in res.output)
    assert f"unverified, {n} step(s)" in res.output
    from sinkchat.store import transcript  # the run is in the session log: the task, each reply, each tool call

    s = transcript.latest_session("agent")
    assert s is not None and s.ended
    turns, data = transcript.turns(s.id), transcript.export(s.id)
    assert turns[0].role == "user" and turns[0].text == "Do a thing"
    assert [t.role for t in turns[1:]] == ["assistant"] * n
    calls = [line for line in res.output.splitlines() if line.startswith("→ ")]
    assert len(data["tool_calls"]) == len(calls)  # every attempted call (a random model makes few), none invented
    bad = CliRunner().invoke(agent_mod.agent_command, ["x", "--tools-module", str(tmp_path / "nope.py")])
    assert bad.exit_code == 2 and "tools module not found" in bad.output and "Traceback" not in bad.output


def test_agent_log_maps_events_to_rows():
    from types import SimpleNamespace

    from sinkchat.apps.agent.protocol import (
        AgentErrorEvent, ModelTextEvent, StepEvent, TaskDoneEvent, ToolCallEvent, ToolResultEvent,
    )
    from sinkchat.core.events import EvictionEvent
    from sinkchat.apps.agent.log import AgentLog

    rows = []

    class Rec:
        def __getattr__(self, name):
            return lambda *a, **k: rows.append((name, a))

    eng = SimpleNamespace(cache=SimpleNamespace(length=10), ledger=SimpleNamespace(seen=50, evicted=40))
    log = AgentLog(Rec(), eng)
    for ev in [StepEvent(1, "find it"), ModelTextEvent(1, '{"tool": "ls"}', "call", 5), ToolCallEvent(1, "ls", {}),
               ToolResultEvent(1, "ls", True, "a.txt", 5, False, 0.1), EvictionEvent(8, 4, 12, "x", "sink", 30),
               StepEvent(2, "find it"), ModelTextEvent(2, "rambling", "length", 9), AgentErrorEvent(2, "no call"),
               ToolResultEvent(2, "", False, "your reply has no tool call", 27, False, 0.0),
               TaskDoneEvent("find it", 2, "max_steps")]:
        log(ev)
    kinds = [r[0] for r in rows]
    assert kinds == ["turn", "turn", "tool_call", "eviction", "turn", "event", "metrics", "flush"]
    assert rows[0][1][:2] == ("user", "find it") and rows[2][1] == ("ls", {}, "a.txt", True)


def test_cli_missing_workspace_is_a_one_line_error_unless_asked(tmp_path, monkeypatch):
    """`--workspace DIR` with a mistyped DIR must not become a new folder tree: exit 2, one line, nothing created,
    the model never loaded; --create-workspace creates it (and --help says so)."""
    from click.testing import CliRunner

    import sinkchat.apps.agent.command as agent_mod

    monkeypatch.setattr("sinkchat.api.open_engine", lambda *a, **k: pytest.fail("the model must not load"))
    missing = tmp_path / "typo" / "ws"
    res = CliRunner().invoke(agent_mod.agent_command, ["x", "--workspace", str(missing), "--no-log"])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert res.output.strip().splitlines() == [f"Error: workspace {missing} does not exist (pass --create-workspace "
                                               "to create it)"]
    assert not (tmp_path / "typo").exists()
    (tmp_path / "afile").write_text("x")
    res = CliRunner().invoke(agent_mod.agent_command, ["x", "--workspace", str(tmp_path / "afile"), "--no-log"])
    assert res.exit_code == 2 and "is a file" in res.output  # click's own check of --workspace
    assert "--create-workspace" in CliRunner().invoke(agent_mod.agent_command, ["--help"]).output
    made = agent_mod.open_workspace(str(missing), create=True)
    assert made.root == missing.resolve() and missing.is_dir()
