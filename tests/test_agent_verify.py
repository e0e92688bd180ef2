"""Issue 28, the agent's answers: a final answer's numbers and names come from the task's tool results (the grammar
offers no other number; the check sends anything else back), a task that names a file to write is not done until
that file holds what it asks, and `sinkchat agent` exits 3 with one line when a task ended unverified."""

from __future__ import annotations

import json

import pytest

from sinkchat.apps.agent.agent import Agent, build_default_tools
from sinkchat.apps.agent.goals import write_goals
from sinkchat.apps.agent.protocol import FinalRejectedEvent, TaskDoneEvent
from sinkchat.apps.agent.tools.workspace import Workspace
from sinkchat.core.engine import Engine

from fakes import ScriptedEngine, emit_reply, tiny_model

SALES = "region,amount,units\nnorth,120,3\nsouth,75,2\neast,310,9\nwest,45,1\nnorth,90,4\nsouth,200,5\n"  # 840
CONFIG = '{"host": "example.com", "port": 8443, "debug": false}\n'
TOTAL_TASK = "Compute the total of the amount column in sales.csv and write that number to total.txt."


def call(name, **args):
    return json.dumps({"tool": name, "args": args})


def final(text):
    return json.dumps({"final": text})


@pytest.fixture
def ws(tmp_path):
    root = tmp_path / "ws"
    root.mkdir()
    (root / "sales.csv").write_text(SALES)
    (root / "config.json").write_text(CONFIG)
    (root / "notes.txt").write_text("meeting at noon\nbring the slides\n")
    return root


def run(agent, task, steps):
    events = list(agent.run(task, steps))
    done = [e for e in events if isinstance(e, TaskDoneEvent)]
    assert len(done) == 1
    return events, done[0]


class ScriptedReal(Engine):
    """A real Engine (tiny model, bundled tokenizer) whose replies come from `script`, fed through its cache; it
    takes logits processors, so the agent builds its real grammar constraint."""

    script: list[str] = []

    def generate(self, max_tokens=None, stop=(), sampling=None, logits_processors=None):
        text = self.script.pop(0) if self.script else final("out of script")
        yield from emit_reply(self, text)


def scripted_real(bundled, script):
    from sinkchat.config import CacheConfig, SamplingConfig

    eng = ScriptedReal(tiny_model(vocab_size=len(bundled.tokenizer), max_pos=4096), bundled.tokenizer,
                       CacheConfig(capacity=4096, pin="none"), SamplingConfig(temperature=0, max_tokens=64, seed=0))
    eng.script = list(script)
    return eng


@pytest.mark.parametrize("task,want", [
    (TOTAL_TASK, [("total.txt", "number", "")]),
    ("Write the text hello world to a file named hello.txt.", [("hello.txt", "exact", "hello world")]),
    ("Create a file done.txt containing exactly: ok", [("done.txt", "exact", "ok")]),
    ("Write a one-line summary file summary.txt that says: sales are up", [("summary.txt", "exact", "sales are up")]),
    ("Write the word 'apple' into the file file1.txt, then read the file back.", [("file1.txt", "exact", "apple")]),
    ("Read the launch code from docs/readme.md and write it to code.txt.", [("code.txt", "derived", "")]),
    ("Copy the first line of notes.txt into a new file first.txt.", [("first.txt", "copy", "")]),
    ("Replace the contents of notes.txt with the text all done", [("notes.txt", "exact", "all done")]),
    ("Write the number of lines in notes.txt to count.txt", [("count.txt", "number", "")]),  # notes.txt is read
    ("What port is set in config.json?", []),
    ("How many lines does notes.txt have?", []),
])
def test_the_files_a_task_asks_for_are_read_from_its_text(task, want):
    goals = write_goals(task, exists=lambda p: p in ("notes.txt", "config.json", "docs/readme.md"))
    assert [(g.path, g.kind, g.content) for g in goals] == want


def test_copy_goal_knows_its_source_and_line():
    (g,) = write_goals("Copy the first line of notes.txt into a new file first.txt.")
    assert (g.source, g.which, g.new) == ("notes.txt", "first", True)


def test_an_answer_the_tools_did_not_give_is_sent_back(ws):
    """Issue 28: a port lookup read `"port": 8443` and answered `18`. The answer is sent back with what is wrong;
    the grounded one ends the task, verified."""
    eng = ScriptedEngine([call("read_file", path="config.json"), final("18"), final("the port is 8443")])
    agent = Agent(eng, build_default_tools(ws), ws, few_shot=False)
    events, done = run(agent, "What port is set in config.json?", 5)
    (rejected,) = [e for e in events if isinstance(e, FinalRejectedEvent)]
    assert rejected.answer == "18" and "18" in rejected.problems[0]
    fed = eng.fed[-1][1]
    assert fed.startswith("Tool error (final): not done yet: your answer says 18, which no tool result")
    assert (done.reason, done.answer, done.verified, done.steps) == ("final", "the port is 8443", True, 3)


def test_an_invented_name_is_sent_back(ws):
    eng = ScriptedEngine([call("read_file", path="config.json"), final("The host is evil.org"),
                          final("The host is example.com")])
    agent = Agent(eng, build_default_tools(ws), ws, few_shot=False)
    events, done = run(agent, "Which host is set in config.json?", 5)
    assert [e.answer for e in events if isinstance(e, FinalRejectedEvent)] == ["The host is evil.org"]
    assert done.verified and done.answer == "The host is example.com"


def test_a_write_task_is_not_done_until_the_file_holds_the_number(ws):
    """Issue 28: "... write that number to total.txt" ended `answer: 860`, exit 0, no file."""
    eng = ScriptedEngine([call("column_sum", path="sales.csv", column="amount"), final("840"),
                          call("write_file", path="total.txt", content="840"), final("840")])
    agent = Agent(eng, build_default_tools(ws), ws, few_shot=False)
    events, done = run(agent, TOTAL_TASK, 6)
    (rejected,) = [e for e in events if isinstance(e, FinalRejectedEvent)]
    assert rejected.problems == ("total.txt does not exist yet; write it with write_file",)
    assert (ws / "total.txt").read_text() == "840"
    assert (done.reason, done.verified, done.steps, done.problem) == ("final", True, 4, "")


def test_a_wrong_number_in_the_file_ends_the_task_unverified(ws):
    eng = ScriptedEngine([call("column_sum", path="sales.csv", column="amount"),
                          call("write_file", path="total.txt", content="860")] + [final("840")] * 4)
    agent = Agent(eng, build_default_tools(ws), ws, few_shot=False)
    events, done = run(agent, TOTAL_TASK, 4)
    assert sum(isinstance(e, FinalRejectedEvent) for e in events) == 1  # not on the last step
    assert done.reason == "final" and not done.verified
    assert done.problem == "total.txt holds 860, which no tool result of this task contains"


def test_no_final_answer_is_unverified_and_says_what_is_missing(ws):
    eng = ScriptedEngine([call("column_sum", path="sales.csv", column="amount")] * 3)
    agent = Agent(eng, build_default_tools(ws), ws, few_shot=False)
    _, done = run(agent, TOTAL_TASK, 3)
    assert done.reason == "max_steps" and not done.verified
    assert done.problem == "no final answer; total.txt does not exist yet; write it with write_file"


def accepts(con, tok, text, require_call=False):
    con.begin(require_call=require_call)
    m = con.matcher.deep_copy()
    ids = tok.encode(text, add_special_tokens=False)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def test_the_final_answer_grammar_offers_only_numbers_the_tools_returned(bundled, ws):
    tok = bundled.tokenizer
    eng = scripted_real(bundled, [call("read_file", path="config.json"), final("8443")])
    agent = Agent(eng, build_default_tools(ws), ws)
    con = agent.constraint
    assert con is not None
    _, done = run(agent, "What port is set in config.json?", 3)
    assert done.verified and done.answer == "8443"
    assert con.task.values == ("8443",)  # what the read returned, nothing else
    for text, ok in [(final("8443"), True), (final("the port is 8443."), True), (final("18"), False),
                     (final("84431"), False), (final("port 844"), False), (final("example.com"), True)]:
        assert accepts(con, tok, text) == ok, text


def test_the_grammar_asks_a_count_task_for_a_number(bundled, ws):
    """A count task whose answer is the reply: under the grammar the answer holds a number a tool returned (the
    bundled model answered `done` four times in a row without it); a question without a count does not need one."""
    tok = bundled.tokenizer
    eng = scripted_real(bundled, [call("count_lines", path="notes.txt"), final("2")])
    agent = Agent(eng, build_default_tools(ws), ws)
    con = agent.constraint
    _, done = run(agent, "Count the lines of notes.txt", 3)
    assert done.verified and done.answer == "2" and con.task.answer_numbers == ("2",)
    for text, ok in [(final("2"), True), (final("notes.txt has 2 lines"), True), (final("done"), False),
                     (final("it has some lines"), False), (final("3"), False), (final("No lines"), True),
                     (final("none"), True)]:  # a count of none needs no number
        assert accepts(con, tok, text) == ok, text
    eng = scripted_real(bundled, [call("read_file", path="config.json"), final("example.com")])
    agent = Agent(eng, build_default_tools(ws), ws)
    run(agent, "Which host is set in config.json?", 3)
    assert agent.constraint.task.answer_numbers is None and accepts(agent.constraint, tok, final("example.com"))


def test_a_write_task_grammar_writes_only_its_file_with_a_number_the_tools_gave(bundled, ws):
    """write_file is offered only once a tool gave a number, only for total.txt and only with such a number; while
    total.txt is missing a call is required (no final answer offered)."""
    from sinkchat.apps.agent.verify import TaskCheck

    tok = bundled.tokenizer
    eng = scripted_real(bundled, [call("column_sum", path="sales.csv", column="amount"),
                                  call("write_file", path="total.txt", content="840"), final("840")])
    agent = Agent(eng, build_default_tools(ws), ws)
    con = agent.constraint
    check = TaskCheck(TOTAL_TASK, agent.workspace)
    con.set_task(check.context())
    assert not accepts(con, tok, call("write_file", path="total.txt", content="840"))  # no number from a tool yet
    check.grounding.add("840")  # what column_sum returns
    con.set_task(check.context())
    assert accepts(con, tok, call("write_file", path="total.txt", content="840"))
    for bad in (call("write_file", path="total.txt", content="860"), call("write_file", path="sum.txt", content="840"),
                call("write_file", path="total.txt", content="the total is 840")):
        assert not accepts(con, tok, bad), bad
    assert not accepts(con, tok, final("840"), require_call=True)
    begun = []
    con_begin = con.begin
    con.begin = lambda require_call=False, budget=None: (begun.append(require_call), con_begin(require_call, budget))[1]
    _, done = run(agent, TOTAL_TASK, 5)
    assert done.verified and (ws / "total.txt").read_text() == "840"
    assert begun == [True, True, False]  # a final answer is offered only once total.txt holds the number


def cli(monkeypatch, bundled, script, args):
    from click.testing import CliRunner

    import sinkchat.apps.agent.command as agent_mod

    monkeypatch.setattr("sinkchat.api.open_engine", lambda *a, **k: scripted_real(bundled, script))
    return CliRunner().invoke(agent_mod.agent_command, args)


def test_cli_exits_3_with_one_line_when_a_task_ends_unverified(monkeypatch, bundled, ws):
    args = [TOTAL_TASK, "--workspace", str(ws), "--max-steps", "3", "--no-constrain", "--no-log"]
    res = cli(monkeypatch, bundled, [call("column_sum", path="sales.csv", column="amount")] + [final("840")] * 3, args)
    assert res.exit_code == 3, res.output
    lines = [ln for ln in res.output.splitlines() if "NOT verified" in ln]
    assert lines == ["✗ task NOT verified: total.txt does not exist yet; write it with write_file"]
    assert "agent: 1 task(s), 1 unverified" in res.output
    ok = cli(monkeypatch, bundled, [call("column_sum", path="sales.csv", column="amount"),
                                    call("write_file", path="total.txt", content="840"), final("840")], args)
    assert ok.exit_code == 0 and "NOT verified" not in ok.output, ok.output
    from click.testing import CliRunner

    import sinkchat.apps.agent.command as agent_mod

    assert "3 a task ended unverified" in " ".join(CliRunner().invoke(agent_mod.agent_command, ["--help"]).output.split())


# ---- review fixes: goals and grounding ---------------------------------------------------------------------------
def test_an_existing_file_after_a_loose_to_is_a_source_not_a_target(ws):
    """A file that exists when the task starts is written only when its own clause says so: "comparing it to
    todo.txt" must not let the agent overwrite the user's todo.txt."""
    from sinkchat.apps.agent.verify import TaskCheck

    (ws / "todo.txt").write_text("buy milk\n")
    task = "Write a summary of notes.txt to summary.txt, comparing it to todo.txt"
    check = TaskCheck(task, Workspace(ws))
    assert [g.path for g in check.goals] == ["summary.txt"]
    tool = build_default_tools(ws).tools["write_file"]
    assert check.refuse_overwrite(tool, {"path": "todo.txt", "content": "x", "overwrite": True})
    assert all("todo.txt" not in t.path for t in check.context().targets)
    ex = lambda p: p == "todo.txt"  # noqa: E731
    for explicit in ("Append the line done to todo.txt", "Write the word done into todo.txt",
                     "Overwrite todo.txt with the text done", "Add the line done to todo.txt"):
        assert [g.path for g in write_goals(explicit, ex)] == ["todo.txt"], explicit


@pytest.mark.parametrize("task", ["Write the result of 10 / 3, rounded to 0.01, to r.txt", "Add 2 to 1.5"])
def test_a_number_is_no_file_name(task):
    assert "0.01" not in [g.path for g in write_goals(task)] and "1.5" not in [g.path for g in write_goals(task)]


def test_the_numbers_of_the_task_text_are_grounded(ws):
    """"Write 42 to answer.txt" could never verify: 42 came from no tool."""
    eng = ScriptedEngine([call("write_file", path="answer.txt", content="42"), final("wrote 42")])
    agent = Agent(eng, build_default_tools(ws), ws, few_shot=False)
    _, done = run(agent, "Write 42 to answer.txt", 4)
    assert done.verified and (ws / "answer.txt").read_text() == "42"
    eng = ScriptedEngine([call("calculator", expression="17 + 25"), final("17 + 25 = 42")])
    _, done = run(Agent(eng, build_default_tools(ws), ws, few_shot=False), "What is 17 + 25?", 4)
    assert done.verified, done.problem


@pytest.mark.parametrize("task,want", [
    ("Create a file hello.txt containing: Hello, world. Then tell me its size in bytes.",
     [("hello.txt", "Hello, world")]),
    ("Write the word yes to a.txt and the word no to b.txt", [("a.txt", "yes"), ("b.txt", "no")]),
])
def test_exact_content_is_read_from_the_targets_own_clause(task, want):
    assert [(g.path, g.content) for g in write_goals(task)] == want


def test_cli_ctrl_c_exits_130_and_says_how_many_tasks_ended_unverified(monkeypatch, bundled, ws):
    import sinkchat.apps.agent.command as agent_mod

    def tasks(*_a):
        yield TOTAL_TASK
        raise KeyboardInterrupt

    monkeypatch.setattr(agent_mod, "task_source", tasks)
    args = [TOTAL_TASK, "--workspace", str(ws), "--max-steps", "2", "--no-constrain", "--no-log"]
    res = cli(monkeypatch, bundled, [final("840")] * 2, args)
    assert res.exit_code == 130, res.output
    assert "interrupted; 1 task(s) ended unverified before it" in res.output
    assert "agent: 1 task(s), 1 unverified" in res.output


def test_a_number_in_exponent_form_grounds_no_part_of_it():
    from sinkchat.apps.agent.patterns import numbers_in

    assert numbers_in("sum 1.235e+04 over 12 rows, port 8443, ratio 2.5E-3") == ["12", "8443"]


def test_done_is_no_answer_to_a_task_that_asks_for_something(ws):
    """A user audit: "Count the lines of notes.txt" read 2 from the tool, answered `done`, and ended verified,
    exit 0. An acknowledgment is sent back; the count ends the task, verified."""
    eng = ScriptedEngine([call("count_lines", path="notes.txt"), final("done"), final("notes.txt has 2 lines")])
    events, done = run(Agent(eng, build_default_tools(ws), ws, few_shot=False), "Count the lines of notes.txt", 5)
    (rejected,) = [e for e in events if isinstance(e, FinalRejectedEvent)]
    assert rejected.answer == "done" and "only says" in rejected.problems[0]
    assert (done.answer, done.verified) == ("notes.txt has 2 lines", True)


def test_a_count_task_ends_unverified_on_an_answer_without_a_number(ws):
    eng = ScriptedEngine([call("count_lines", path="notes.txt")] + [final("the file has some lines")] * 4)
    _, done = run(Agent(eng, build_default_tools(ws), ws, few_shot=False), "How many lines does notes.txt have?", 4)
    assert not done.verified and "holds no number" in done.problem


@pytest.mark.parametrize("task,answer", [
    ("Write the text hello world to a file named hello.txt.", "done"),  # the file is the result
    ("Which host is set in config.json?", "example.com"),
    ("Does config.json set debug?", "no"),
    ("Count the lines of notes.txt", "2"),
    ("Do the cleanup in the workspace", "done"),  # an imperative, not a question: "done" answers it
])
def test_an_answer_that_says_what_was_asked_is_not_sent_back(ws, task, answer):
    from sinkchat.apps.agent.verify import TaskCheck

    check = TaskCheck(task, Workspace(ws))
    read = build_default_tools(ws).tools["read_file"]
    check.observe(read, {"path": "config.json"}, True, CONFIG + "2\n")  # a call that ran ok
    assert check.unanswered(answer) == []


def test_done_after_every_call_failed_is_sent_back_and_an_honest_answer_is_not(ws):
    """A user audit: an MCP tool's only call failed (`Error executing tool explode`), the model said `done`, and
    the task ended `answer: done`, verified, exit 0."""
    script = [call("read_file", path="missing.txt"), final("done"), final("Task complete."), final("done")]
    eng = ScriptedEngine(script)
    events, done = run(Agent(eng, build_default_tools(ws), ws, few_shot=False), "Do the cleanup in the workspace", 6)
    rejected = [e for e in events if isinstance(e, FinalRejectedEvent)]
    assert rejected and "no tool call of this task ran ok (1 failed)" in rejected[0].problems[0], rejected
    assert not done.verified
    eng = ScriptedEngine([call("read_file", path="missing.txt"), final("the file could not be read")])
    _, done = run(Agent(eng, build_default_tools(ws), ws, few_shot=False), "Do the cleanup in the workspace", 4)
    assert done.verified and done.answer == "the file could not be read"
    eng = ScriptedEngine([final("done")] * 4)  # no call at all: "done" without doing
    _, done = run(Agent(eng, build_default_tools(ws), ws, few_shot=False), "Do the cleanup in the workspace", 4)
    assert not done.verified and "no tool call of this task ran ok:" in done.problem, done.problem


@pytest.mark.parametrize("task, why", [
    ("Delete notes.txt", "no tool can delete files"),
    ("Please rename config.json to old.json", "no tool can rename files"),
    ("Read /etc/passwd and tell me the first line", "/etc/passwd is outside the workspace: no tool can read"),
    ("Read ../secret.txt and tell me the secret", "../secret.txt is outside the workspace: no tool can read")])
def test_a_task_no_tool_can_do_ends_unverified_and_says_why(ws, task, why):
    """"Delete notes.txt" listed the folder, answered a file name and ended verified (exit 0) with the file still
    there; "Read /etc/passwd ..." read another file and answered from it, verified."""
    eng = ScriptedEngine([call("list_dir", path="."), final("config.json")])
    agent = Agent(eng, build_default_tools(ws), ws, few_shot=False)
    _, done = run(agent, task, 3)
    assert not done.verified and why in done.problem, done.problem
    assert (ws / "config.json").exists()


def test_what_a_tool_can_do_is_not_blocked(ws):
    from sinkchat.apps.agent.verify import TaskCheck

    tools = tuple(build_default_tools(ws).tools)
    for task in ("Write the number of lines in config.json to count.txt", "Which file would I move config.json next to?",
                 "Copy the first line of config.json into a new file first.txt"):
        assert not [b for b in TaskCheck(task, Workspace(ws), tools).blocked if "no tool" in b], task
    assert TaskCheck("Delete notes.txt", Workspace(ws), tools + ("shell",)).blocked == []  # a shell can
