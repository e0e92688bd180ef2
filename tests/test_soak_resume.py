"""`sinkchat soak resume DIR`: a run stopped mid-step goes on from its last checkpoint exactly as if it had never
stopped (the same replies, facts, probes, cache, memory and counts as an uninterrupted run), its clock counting soak
time only; the records of the work done again set aside; a finished run, a run without a checkpoint and a damaged
checkpoint refused in one line. Through the command line, on a tiny model with a real recall memory."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from sinkchat.apps.soak import checkpoint
from sinkchat.apps.soak.command import soak_command
from sinkchat.apps.soak.records import load_run
from sinkchat.apps.soak.scenario_chat import ChatScenario
from sinkchat.apps.soak.series import past_warmup, slope_per_hour

ARGS = ["--scenario", "chat", "--steps", "8", "--sample-every", "0.5", "--checkpoint-every", "0.001s",
        "--memory", "on", "--max-tokens", "6"]


@pytest.fixture
def engines(tmp_path, monkeypatch):
    """`start` gives the soak command a fresh tiny engine (the same weights each time, sampling at temperature 0.8
    so the sampler's state matters); the engines made are listed."""
    from fakes import CharTokenizer, tiny_model
    from sinkchat.config import CacheConfig, MemoryConfig, SamplingConfig
    from sinkchat.core.engine import Engine
    from sinkchat.memory.recall import RecallMemory
    from sinkchat.model.spec import ModelSpec

    made: list = []

    def start(settings, *a, **k):
        model = tiny_model(max_pos=4096)
        mem = RecallMemory.for_spec(MemoryConfig("on", 1, 8, 2, 64), ModelSpec.from_model(model),
                                    tmp_path / f"mem{len(made)}")
        eng = Engine(model, CharTokenizer(), CacheConfig(policy="sink", n_sink=4, capacity=192),
                     SamplingConfig(temperature=0.8, max_tokens=6, repetition_penalty=1.0, seed=3), memory=mem)
        made.append(eng)
        return SimpleNamespace(engine=eng)

    monkeypatch.setattr("sinkchat.apps.soak.command.start", start)
    monkeypatch.setattr("sinkchat.apps.soak.scenarios.chat_prompts", lambda: [f"Say {w}." for w in "one two three four five six seven eight nine ten".split()])
    return made


def _records(d: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def _stop_in_step(monkeypatch, at: int) -> None:
    """Ctrl-C inside step `at` (1-based), after its message was fed: the cache has moved past the checkpoint."""
    inner, calls = ChatScenario.step, [0]

    def step(self, engine):
        calls[0] += 1
        gen = inner(self, engine)
        yield next(gen)
        if calls[0] == at:
            yield from (ev for ev, _ in zip(gen, range(3)))
            raise KeyboardInterrupt
        yield from gen

    monkeypatch.setattr(ChatScenario, "step", step)


def _state(eng) -> tuple:
    mem = eng.memory
    blocks = sorted((b, list(mem.store.token_ids(b))) for b in mem.store.where)
    return (list(eng.ledger.ids), list(eng.ledger.abs_index), eng.ledger.seen, eng.ledger.evicted,
            [dict(m) for m in eng.conv.messages], mem.tokens, mem.forgotten, blocks)


def test_a_resumed_run_ends_as_an_uninterrupted_one(tmp_path, engines, monkeypatch):
    ref = tmp_path / "ref"
    CliRunner().invoke(soak_command, ARGS + ["--out", str(ref)], catch_exceptions=False)
    want = _state(engines[-1])
    run = tmp_path / "run"
    with monkeypatch.context() as m:
        _stop_in_step(m, 6)
        r = CliRunner().invoke(soak_command, ARGS + ["--out", str(run)], catch_exceptions=False)
    assert r.exit_code in (3, 4) and "INCOMPLETE  ran as planned" in r.output, r.output  # stopped before its end
    assert _records(run, "end")[-1]["reason"] == "interrupted"
    with monkeypatch.context() as m:
        _stop_in_step(m, 2)  # the resumed process stopped in its second step: resumed again
        r = CliRunner().invoke(soak_command, ["resume", str(run)], catch_exceptions=False)
    assert "resuming" in r.output and _records(run, "end")[-1]["reason"] == "interrupted"
    r = CliRunner().invoke(soak_command, ["resume", str(run)], catch_exceptions=False)
    assert "resuming" in r.output
    assert _state(engines[-1]) == want  # cache, ledger, conversation, memory: as if never stopped
    got, ref_probes = _records(run, "probe"), _records(ref, "probe")
    assert [(p["topic"], p["value"], p["answer"], p["where"]) for p in got] == \
        [(p["topic"], p["value"], p["answer"], p["where"]) for p in ref_probes]
    end, ref_end = _records(run, "end"), _records(ref, "end")
    assert len(end) == 1 and end[0]["reason"] == "steps"  # the interrupted end record was set aside
    for k in ("steps", "tokens", "jobs", "jobs_ok", "attempts", "recall_planted", "recall_memory", "recall_window"):
        assert end[0][k] == ref_end[0][k], k
    discarded = [json.loads(x) for x in (run / "metrics.discarded.jsonl").read_text().splitlines()]
    assert [d.get("reason") for d in discarded if d["kind"] == "end"] == ["interrupted", "interrupted"]
    header, samples, _ = load_run(run)
    res = header["resumes"]
    assert [r["segment"] for r in res] == [1, 2] and sum(r["discarded_records"] for r in res) == len(discarded)
    assert {s["segment"] for s in samples} == {0, 1, 2}
    for r in res:
        assert min(s["elapsed"] for s in samples if s["segment"] == r["segment"]) >= r["elapsed"]  # clock goes on
    assert "**resumed**: 2 times from a checkpoint" in (run / "report.md").read_text()


def test_a_finished_run_and_a_run_without_checkpoints_are_not_resumed(tmp_path, engines):
    done = tmp_path / "done"
    CliRunner().invoke(soak_command, ARGS + ["--out", str(done)], catch_exceptions=False)
    r = CliRunner().invoke(soak_command, ["resume", str(done)])
    assert r.exit_code == 1 and "already ran to its planned end (steps)" in r.output
    bare = tmp_path / "bare"
    CliRunner().invoke(soak_command, ARGS[:-6] + ["--checkpoint-every", "0", "--steps", "2", "--out", str(bare)],
                       catch_exceptions=False)
    assert not (bare / "checkpoint").exists()
    (bare / "metrics.jsonl").write_text((bare / "metrics.jsonl").read_text().replace('"reason": "steps"',
                                                                                    '"reason": "terminated"'))
    r = CliRunner().invoke(soak_command, ["resume", str(bare)])
    assert r.exit_code == 1 and "has no soak checkpoint" in r.output and "Traceback" not in r.output


def test_a_damaged_checkpoint_is_refused_and_left_alone(tmp_path, engines, monkeypatch):
    run = tmp_path / "run"
    with monkeypatch.context() as m:
        _stop_in_step(m, 3)
        CliRunner().invoke(soak_command, ARGS + ["--out", str(run)], catch_exceptions=False)
    folder, _ = checkpoint.load(run)
    snap = folder / "engine.safetensors"
    data = bytearray(snap.read_bytes())
    data[len(data) // 2] ^= 0xFF
    snap.write_bytes(bytes(data))
    before = (run / "metrics.jsonl").read_bytes()
    r = CliRunner().invoke(soak_command, ["resume", str(run)])
    assert r.exit_code == 1 and "checkpoint cannot be read" in r.output and "Traceback" not in r.output
    assert (run / "metrics.jsonl").read_bytes() == before  # nothing cut, nothing written


def test_a_checkpoint_in_progress_leaves_the_last_one_in_force(tmp_path, monkeypatch):
    """A kill while checkpoint n+1 is written: `current` still names n, and the torn n+1 is removed next time."""
    root = tmp_path / "checkpoint"
    (root / "000001").mkdir(parents=True)
    (root / "current").write_text('{"seq": 1}')
    (root / "000002").mkdir()  # torn: no pointer names it
    assert checkpoint.current_seq(tmp_path) == 1
    (root / "current").write_text('{"seq": ')  # a torn pointer (never written so: it is renamed into place)
    assert checkpoint.current_seq(tmp_path) is None


def test_the_rss_slope_of_a_resumed_run_compares_samples_of_one_process():
    """Each process starts its RSS afresh: a restart is no leak, and two flat processes at different levels are flat;
    a leak inside each process is still one."""
    flat = [(t, 400.0 if t < 3600 else 300.0) for t in range(0, 7200, 60)]
    groups = [0 if t < 3600 else 1 for t, _ in flat]
    assert slope_per_hour(flat) < 0  # pooled, the restart reads as memory given back...
    assert slope_per_hour(flat, groups=groups) == 0  # ...within each process there is no trend
    leak = [(t, v + 50 * (t % 3600) / 3600) for t, v in flat]
    assert slope_per_hour(leak, groups=groups) == pytest.approx(50)


def test_each_process_warms_up_again():
    samples = [{"elapsed": t, "segment": 0 if t < 1000 else 1} for t in range(0, 2000, 50)]
    kept = [s["elapsed"] for s in past_warmup(samples, 200)]
    assert kept == [t for t in range(200, 1000, 50)] + [t for t in range(1200, 2000, 50)]


def _continue(scen, draw, n: int = 6) -> list:
    return [draw(scen) for _ in range(n)]


@pytest.mark.parametrize("name", ["agent", "chat", "summarize"])
def test_each_scenario_goes_on_where_its_state_was_saved(tmp_path, name):
    """A scenario rebuilt from its saved state (through JSON, as a checkpoint keeps it) draws what the original would
    have drawn next: the same tasks, turns or log lines."""
    from sinkchat.apps.soak.scenario_agent import AgentScenario
    from sinkchat.apps.soak.scenario_summarize import SummarizeScenario
    from test_soak_agent import SoakEngine

    make, draw = {
        "agent": (lambda: AgentScenario(SoakEngine([]), tmp_path / "ws", seed=5), lambda s: s.next_task()),
        "chat": (lambda: ChatScenario([f"p{i}" for i in range(20)], seed=5),
                 lambda s: (s.next_message(), setattr(s, "last_reply", f"r{s.turn}"))[0]),
        "summarize": (lambda: SummarizeScenario(seed=5), lambda s: (s.next_line(), dict(s.levels))),
    }[name]
    a = make()
    _continue(a, draw, 7)
    saved = json.loads(json.dumps(a.state()))
    b = make()
    b.load_state(saved)
    assert _continue(b, draw) == _continue(a, draw)


def test_the_agents_task_checkpoint_survives_a_resume(tmp_path):
    """Where every agent task starts (TaskCheckpoint): kept, so a resumed agent rewinds to the same slots rather
    than taking a new checkpoint after the last task."""
    from sinkchat.apps.soak.scenario_agent import AgentScenario
    from test_soak_agent import SoakEngine

    a = AgentScenario(SoakEngine([]), tmp_path / "ws")
    a.agent.checkpoint.state = (37, 36, [{"role": "user", "content": "x"}], "<fed>", object())
    a.agent.checkpoint.taken, a.agent.primed, a.agent._examples_held = 2, True, 4
    b = AgentScenario(SoakEngine([]), tmp_path / "ws")
    b.load_state(json.loads(json.dumps(a.state())))
    assert b.agent.checkpoint.state[:4] == a.agent.checkpoint.state[:4] and b.agent.checkpoint.taken == 2
    assert (b.agent.primed, b.agent._examples_held) == (True, 4)


def test_one_process_at_a_time_runs_a_directory(tmp_path):
    """The run's lock: a second resume (or a new run with the same --out) is refused while the first holds it,
    and free again once that process is gone, however it ended (the kernel drops a dead process's lock)."""
    import subprocess
    import sys

    code = ("import sys, time; from pathlib import Path; from sinkchat.apps.soak.checkpoint import lock_run; "
            "f = lock_run(Path(sys.argv[1])); print('held', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(checkpoint.CheckpointError, match=f"is being run by sinkchat process {child.pid}"):
            checkpoint.lock_run(tmp_path)
    finally:
        child.kill()
        child.wait()
    assert checkpoint.lock_run(tmp_path) is not None  # killed -9: free


def test_the_stopped_processes_stores_are_removed_only_if_they_are_stores(tmp_path):
    """Every process of a run names its store in DIR/.stores; a resume removes the others' (each killed process's,
    the one before the last checkpoint or not), never a folder holding anything but segment files."""
    def engine(root):
        return SimpleNamespace(memory=SimpleNamespace(store=SimpleNamespace(root=root)))

    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid no process has now
    first, second, other, mine = (tmp_path / n for n in (f"20261203-040400-{gone.pid}-0a1b2c", "second", "other",
                                                         "mine"))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    live = tmp_path / f"20261203-040400-{child.pid}"  # a copy of a run resumed beside the original: its live store
    live2 = tmp_path / f"20261203-040400-{child.pid}-0a1b2c"  # ...or the store it restored
    for d in (first, second, other, mine, live, live2):
        d.mkdir()
    for d in (first, live, live2):
        (d / "seg-000001.mem").write_bytes(b"x")  # second: killed before any eviction, empty
    (other / "notes.txt").write_text("keep")
    for d in (first, second, other, mine, live, live2):
        checkpoint.note_store(tmp_path, engine(d))
    try:
        checkpoint.remove_dead_stores(tmp_path, engine(mine))
    finally:
        child.kill()
        child.wait()
    assert not first.exists() and not second.exists() and (other / "notes.txt").exists() and mine.exists()
    assert (live / "seg-000001.mem").exists() and (live2 / "seg-000001.mem").exists()
    assert (tmp_path / ".stores").read_text() == f"{mine}\n"


def test_the_session_log_goes_on_from_the_checkpoints_tokens(tmp_path, engines, monkeypatch):
    """`sinkchat logs` counts the run as its report does (the work done again not twice), in the same session;
    under another data dir (a session of that id is another run's) a new session is opened instead."""
    from sinkchat.store import transcript
    from sinkchat.store.transcript import get_session, list_sessions

    monkeypatch.setenv("SINKCHAT_HOME", str(tmp_path / "home"))
    run = tmp_path / "run"
    with monkeypatch.context() as m:
        _stop_in_step(m, 6)
        CliRunner().invoke(soak_command, ARGS + ["--out", str(run)], catch_exceptions=False)
    CliRunner().invoke(soak_command, ["resume", str(run)], catch_exceptions=False)
    (end,) = _records(run, "end")
    (sid,) = [x.id for x in list_sessions("soak", 10)]
    assert get_session(sid).tokens == end["tokens"]
    # each turn once, as in the uninterrupted run: what was logged after the checkpoint is taken out, then redone
    (resume,) = [e for e in transcript.events(sid) if e.kind == "resume"]
    m = re.search(r"; (\d+) turns? logged after it (?:was|were) taken out of this log", resume.text)
    assert m and int(m.group(1)) > 0, resume.text
    monkeypatch.setenv("SINKCHAT_HOME", str(tmp_path / "ref-home"))
    CliRunner().invoke(soak_command, ARGS + ["--out", str(tmp_path / "ref")], catch_exceptions=False)
    (ref,) = list_sessions("soak", 10)
    monkeypatch.setenv("SINKCHAT_HOME", str(tmp_path / "home"))
    def said(s, home):
        return [(t.seq, t.role, t.text) for t in transcript.turns(s, Path(home) / "sinkchat.db")]
    got = said(sid, tmp_path / "home")
    assert len(got) >= 16 and got == said(ref.id, tmp_path / "ref-home")  # 8 steps, a message and a reply each
    monkeypatch.setenv("SINKCHAT_HOME", str(tmp_path / "elsewhere"))
    run2 = tmp_path / "run2"
    with monkeypatch.context() as m:
        _stop_in_step(m, 4)
        CliRunner().invoke(soak_command, ARGS + ["--out", str(run2)], catch_exceptions=False)
    monkeypatch.setenv("SINKCHAT_HOME", str(tmp_path / "third"))
    CliRunner().invoke(soak_command, ["--scenario", "chat", "--steps", "1", "--checkpoint-every", "0s", "--out",
                                      str(tmp_path / "other"), "--max-tokens", "2"], catch_exceptions=False)
    (other,) = list_sessions("soak", 10)  # session 1 here is another run
    r = CliRunner().invoke(soak_command, ["resume", str(run2)], catch_exceptions=False)
    assert "cannot be continued (that id names another session here); a new one is opened" in r.output
    assert get_session(other.id).tokens == other.tokens  # not appended to


def test_a_copy_of_a_run_resumed_after_the_original_does_not_touch_its_session_log(tmp_path, engines, monkeypatch):
    """`cp -a run copy`, resume the original to its end, then the copy: the copy opens a session of its own (it
    took the original's turns after the checkpoint out of the log, and wrote its own into it). Its records name
    the process that held the log last (these runs share one pid), but a folder that is not the copy's."""
    import shutil

    from sinkchat.store import transcript
    from sinkchat.store.transcript import list_sessions

    monkeypatch.setenv("SINKCHAT_HOME", str(tmp_path / "home"))
    run, copy = tmp_path / "run", tmp_path / "copy"
    with monkeypatch.context() as m:
        _stop_in_step(m, 6)
        CliRunner().invoke(soak_command, ARGS + ["--out", str(run)], catch_exceptions=False)
    shutil.copytree(run, copy, symlinks=True)  # its records name the original's process, and the original folder
    CliRunner().invoke(soak_command, ["resume", str(run)], catch_exceptions=False)
    (sid,) = [x.id for x in list_sessions("soak", 10)]
    before = [(t.seq, t.text) for t in transcript.turns(sid)]
    r = CliRunner().invoke(soak_command, ["resume", str(copy)], catch_exceptions=False)
    assert "which did not run this folder, continued it" in r.output and "a new one is opened" in r.output
    assert [(t.seq, t.text) for t in transcript.turns(sid)] == before
    assert len(list_sessions("soak", 10)) == 2
    new = max(x.id for x in list_sessions("soak", 10))
    (ev,) = [e for e in transcript.events(new) if e.kind == "resume"]
    assert "done again in this new log" in ev.text, ev.text


def test_a_file_stream_goes_on_where_its_checkpoint_stood(tmp_path):
    """The stream's reader state (lap, byte offset, undecoded bytes of a split character, text not yet cut, tokens
    read but not fed) through JSON: the rebuilt stream feeds the same blocks, across a lap; stdin is not resumable."""
    from fakes import CharTokenizer, tiny_model
    from sinkchat.apps.soak import scenario_stream
    from sinkchat.apps.soak.scenario_stream import StreamScenario
    from sinkchat.config import CacheConfig, SamplingConfig
    from sinkchat.core.engine import Engine

    text = tmp_path / "in.txt"
    text.write_text("héllo wörld, a stream that loops " * 7)
    eng = Engine(tiny_model(max_pos=4096), CharTokenizer(), CacheConfig(policy="sink", n_sink=4, capacity=64),
                 SamplingConfig(temperature=0))
    old = scenario_stream.READ_BYTES
    scenario_stream.READ_BYTES = 4  # reads that split "é" and "ö" across two (35 bytes a line: shifting)
    try:
        def read(s, n):  # the text the reader gives (the tiny tokenizer maps every non-ASCII character alike)
            return [s._next_piece() for _ in range(n)]

        split = 0
        for n in range(40):  # checkpoints at many points: some of them inside a split character
            a = StreamScenario(eng, str(text), block=9)
            read(a, n)
            a.ids.extend(range(n % 5))  # tokens read but not yet fed
            saved = json.loads(json.dumps(a.state()))
            split += saved["pending"] != ""
            b = StreamScenario(eng, str(text), block=9)
            b.load_state(saved)
            assert (list(b.ids), read(b, 60)) == (list(a.ids), read(a, 60)) and a.lap >= 1, n  # round the file
        assert split  # the case the decoder's state is for was met
    finally:
        scenario_stream.READ_BYTES = old
    assert not StreamScenario(eng, "-").resumable


def _agent_engines(monkeypatch, tmp_path, capacity: int) -> list:
    """`start` gives a tiny engine big enough for the agent's system prompt in characters."""
    from fakes import CharTokenizer, tiny_model
    from sinkchat.config import CacheConfig, MemoryConfig, SamplingConfig
    from sinkchat.core.engine import Engine
    from sinkchat.memory.recall import RecallMemory
    from sinkchat.model.spec import ModelSpec

    made: list = []

    def start(settings, *a, **k):
        model = tiny_model(max_pos=16384)
        mem = RecallMemory.for_spec(MemoryConfig("on", 1, 8, 2, 64), ModelSpec.from_model(model),
                                    tmp_path / f"mem{len(made)}")
        made.append(Engine(model, CharTokenizer(), CacheConfig(policy="sink", n_sink=4, capacity=capacity),
                           SamplingConfig(temperature=0.8, max_tokens=8, repetition_penalty=1.0, seed=3), memory=mem))
        return SimpleNamespace(engine=made[-1])

    monkeypatch.setattr("sinkchat.apps.soak.command.start", start)
    return made


AGENT = ["--scenario", "agent", "--sample-every", "0.5", "--checkpoint-every", "0.001s", "--memory", "on",
         "--max-tokens", "8"]


def test_a_resumed_agent_takes_its_prompt_its_workspace_and_its_task_checkpoint(tmp_path, monkeypatch):
    """The agent's wiring on resume (fast: the steps only write a file and move the task checkpoint): the scenario is
    built on the fresh conversation (so the agent takes its system prompt, as the first process's did), the workspace
    is the checkpoint's (a file written after it is gone), and the task checkpoint is the saved one."""
    from sinkchat.apps.soak.scenario_agent import AgentScenario
    from sinkchat.apps.soak.steps import Outcome

    engines = _agent_engines(monkeypatch, tmp_path, 2600)
    seen: list = []

    def step(self, engine):
        n = len(list(self.workspace.iterdir()))
        seen.append((self.agent.own_system, engine.conv.system is not None, self.agent.checkpoint.state and
                     self.agent.checkpoint.state[0], sorted(p.name for p in self.workspace.iterdir())))
        (self.workspace / f"step{n}.txt").write_text(str(n))
        self.agent.checkpoint.state = (n, n, [], "", None)
        if n == 3:
            raise KeyboardInterrupt  # after writing: the file is work after the checkpoint
        yield Outcome(True, "ok")

    monkeypatch.setattr(AgentScenario, "step", step)
    run = tmp_path / "run"
    CliRunner().invoke(soak_command, AGENT + ["--steps", "5", "--out", str(run)], catch_exceptions=False)
    assert seen[-1][3] == ["step0.txt", "step1.txt", "step2.txt"]
    CliRunner().invoke(soak_command, ["resume", str(run)], catch_exceptions=False)
    own, has_system, at, files = seen[4]  # the resumed process's first step
    assert own and has_system and at == 2 and files == ["step0.txt", "step1.txt", "step2.txt"]


@pytest.mark.slow
def test_a_resumed_agent_soak_ends_as_an_uninterrupted_one(tmp_path, monkeypatch):
    """The real agent loop (tiny model, the recall memory on): Ctrl-C'd inside its third task and resumed, it ends
    with the same cache, conversation, memory, workspace and judged tasks as a run that was never stopped."""
    engines = _agent_engines(monkeypatch, tmp_path, 2600)
    ref = tmp_path / "ref"
    CliRunner().invoke(soak_command, AGENT + ["--steps", "4", "--out", str(ref)], catch_exceptions=False)
    want = _state(engines[-1]), sorted((p.name, p.read_bytes()) for p in (ref / "workspace").iterdir())
    from sinkchat.apps.soak.scenario_agent import AgentScenario

    run = tmp_path / "run"
    with monkeypatch.context() as m:
        inner, calls = AgentScenario.step, [0]

        def step(self, engine):
            calls[0] += 1
            for i, ev in enumerate(inner(self, engine)):
                if calls[0] == 3 and i == 40:
                    raise KeyboardInterrupt
                yield ev

        m.setattr(AgentScenario, "step", step)
        CliRunner().invoke(soak_command, AGENT + ["--steps", "4", "--out", str(run)], catch_exceptions=False)
    CliRunner().invoke(soak_command, ["resume", str(run)], catch_exceptions=False)
    got = _state(engines[-1]), sorted((p.name, p.read_bytes()) for p in (run / "workspace").iterdir())
    assert got == want
    strip = lambda rs: [{k: v for k, v in r.items() if k != "elapsed"} for r in rs]  # noqa: E731
    assert strip(_records(run, "job")) == strip(_records(ref, "job"))
    assert _records(run, "end")[0]["jobs_ok"] == _records(ref, "end")[0]["jobs_ok"]


def test_a_checkpoint_naming_a_live_writer_is_not_resumed_beside_it(tmp_path):
    """Checkpoints written before the lock name their writer: refused while it runs, resumable once it is gone."""
    import subprocess
    import sys

    from sinkchat.store import procs

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        me = procs.identify(child.pid)
        state = {"process": {"pid": me.pid, "started": me.started, "host": me.host}}
        with pytest.raises(checkpoint.CheckpointError, match=f"being run by process {child.pid}"):
            checkpoint.check_writer(tmp_path, state)
    finally:
        child.kill()
        child.wait()
    checkpoint.check_writer(tmp_path, state)
    checkpoint.check_writer(tmp_path, {})  # a checkpoint that names no writer (the lock covers it)


def test_a_checkpoints_workspace_copy_is_on_disk_before_the_pointer_names_it(tmp_path, monkeypatch):
    """Every regular file and folder of the copy fsynced (shutil does not: a power cut could leave them empty);
    a symlink or a fifo in the workspace neither followed nor blocking."""
    import os

    from sinkchat.store import atomic

    ws = tmp_path / "ws"
    (ws / "a").mkdir(parents=True)
    (ws / "a" / "x.txt").write_text("hi")
    (ws / "y.txt").write_text("yo")
    os.symlink("y.txt", ws / "link")
    os.mkfifo(ws / "fifo")
    synced, real = [], os.fsync
    monkeypatch.setattr(atomic.os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    atomic.fsync_tree(ws)
    assert sorted(Path(p).relative_to(ws).as_posix() for p in synced) == [".", "a", "a/x.txt", "y.txt"]
