"""Issue 28, the agent never destroys a file: a path to write offers only paths that do not exist, replacing a file
needs `overwrite: true`, offered (and allowed) only for an existing file the task names as the one to write; every
write, overwrite and append is journaled with the previous content (crash-safe), and `sinkchat agent --undo [N]`
puts it back. And denials say who denied what."""

from __future__ import annotations

import json
import os

import pytest

from sinkchat.apps.agent.agent import Agent, build_default_tools
from sinkchat.apps.agent.protocol import AgentErrorEvent, Parsed, TaskDoneEvent, ToolResultEvent
from sinkchat.apps.agent.tools.journal import Journal, JournalError
from sinkchat.apps.agent.tools.workspace import Workspace

from fakes import ScriptedEngine
from test_agent_verify import accepts, call, final, scripted_real

NOTES = "meeting at noon\nbring the slides\n"
COPY_TASK = "Copy the first line of notes.txt into a new file first.txt."


@pytest.fixture
def ws(tmp_path):
    root = tmp_path / "ws"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "readme.md").write_text("Owner: Dana\n")
    (root / "notes.txt").write_text(NOTES)
    return root


def test_write_file_never_replaces_a_file_unless_told_to(ws):
    box = build_default_tools(ws)
    r = box.call("write_file", {"path": "notes.txt", "content": "gone"})
    assert not r.ok and "notes.txt exists" in r.text and (ws / "notes.txt").read_text() == NOTES
    r = box.call("write_file", {"path": "notes.txt ", "content": "gone"})  # resolve() would strip the space
    assert not r.ok and (ws / "notes.txt").read_text() == NOTES
    r = box.call("write_file", {"path": "notes.txt", "content": "new text", "overwrite": True})
    assert r.ok and r.text == "replaced notes.txt with 8 bytes" and (ws / "notes.txt").read_text() == "new text"
    r = box.call("write_file", {"path": "notes.txt", "content": "+", "append": True})  # on a line of its own
    assert r.ok and (ws / "notes.txt").read_text() == "new text\n+", r.text
    assert r.text == "appended 2 bytes to notes.txt (on a new line: it did not end with one)"
    r = box.call("write_file", {"path": "notes.txt", "content": " more", "append": True})  # it says where itself
    assert r.ok and (ws / "notes.txt").read_text() == "new text\n+ more" and r.text == "appended 5 bytes to notes.txt"


def test_the_copy_task_cannot_overwrite_its_source(ws):
    """Issue 28: "Copy the first line of notes.txt into a new file first.txt" produced
    `write_file {'path': 'notes.txt', ...}` and the user's input was overwritten."""
    eng = ScriptedEngine([call("write_file", path="notes.txt", content="Copy first line of notes.txt to first file"),
                          call("write_file", path="notes.txt", content="meeting at noon", overwrite=True),
                          call("read_file", path="notes.txt"),
                          call("write_file", path="first.txt", content="meeting at noon"), final("done")])
    agent = Agent(eng, build_default_tools(ws), ws, few_shot=False)
    events = list(agent.run(COPY_TASK, 6))
    results = [e for e in events if isinstance(e, ToolResultEvent)]
    assert [r.ok for r in results] == [False, False, True, True]
    assert "notes.txt exists" in results[0].text
    assert "only for a file this task names as the one to write" in results[1].text
    assert (ws / "notes.txt").read_text() == NOTES and (ws / "first.txt").read_text() == "meeting at noon"
    done = events[-1]
    assert isinstance(done, TaskDoneEvent) and done.verified


def test_a_wrong_copy_is_caught_against_the_source_file(ws):
    """The copy is checked against notes.txt itself: a read from offset 1 ("eeting at noon", measured on the
    bundled model) does not pass for its first line."""
    eng = ScriptedEngine([call("read_file", path="notes.txt", offset=1),
                          call("write_file", path="first.txt", content="eeting at noon")] + [final("done")] * 3)
    agent = Agent(eng, build_default_tools(ws), ws, few_shot=False)
    done = list(agent.run(COPY_TASK, 4))[-1]
    assert not done.verified and done.problem == "first.txt holds 'eeting at noon', which is not the first line of notes.txt"


def test_a_new_path_is_never_an_existing_one(bundled, ws):
    from sinkchat.apps.agent.verify import TaskCheck

    tok = bundled.tokenizer
    agent = Agent(scripted_real(bundled, []), build_default_tools(ws), ws)
    con = agent.constraint

    def w(path, **kw):
        return call("write_file", path=path, content="meeting at noon", **kw)

    for path in ("notes.txt", "docs/readme.md", "docs", "docs/../notes.txt", "./notes.txt", "notes.txt/", " notes.txt"):
        assert not accepts(con, tok, w(path)), path
        assert not accepts(con, tok, w(path, overwrite=True)), path
    for path in ("first.txt", "notes.txt2", "notes.tx", "docs/new.md", "a b.txt"):
        assert accepts(con, tok, w(path)), path
    check = TaskCheck(COPY_TASK, agent.workspace)  # the copy task: notes.txt is a source, never a target
    con.set_task(check.context())
    assert not accepts(con, tok, w("first.txt"))  # nothing read yet: nothing to copy
    check.observe(agent.tools.tools["read_file"], {"path": "notes.txt"}, True, NOTES)
    con.set_task(check.context())
    assert accepts(con, tok, w("first.txt"))
    for bad in (w("notes.txt"), w("notes.txt", overwrite=True), w("other.txt"),
                call("write_file", path="first.txt", content="bring the slides")):
        assert not accepts(con, tok, bad), bad
    check = TaskCheck("Replace the contents of notes.txt with the text all done", agent.workspace)
    con.set_task(check.context())
    assert accepts(con, tok, call("write_file", path="notes.txt", content="all done", overwrite=True))
    assert not accepts(con, tok, call("write_file", path="notes.txt", content="all done"))
    assert not accepts(con, tok, call("write_file", path="notes.txt", content="all done", append=True))


def entries(ws):
    return [(e.op, e.path, e.previous) for e in Workspace(ws).journal.entries()]


def test_every_change_is_journaled_and_undo_puts_it_back_newest_first(ws, sinkchat_home):
    box = build_default_tools(ws)
    for name, args in [("write_file", {"path": "a.txt", "content": "one"}),
                       ("write_file", {"path": "notes.txt", "content": "two", "overwrite": True}),
                       ("write_file", {"path": "notes.txt", "content": "+3", "append": True}),
                       ("notes", {"action": "append", "text": "remember"})]:
        assert box.call(name, args).ok
    noted = (ws / "NOTES.md").read_bytes()
    assert box.call("notes", {"action": "clear"}).ok
    assert entries(ws) == [("write", "a.txt", None), ("overwrite", "notes.txt", NOTES.encode()),
                           ("append", "notes.txt", b"two"), ("write", "NOTES.md", None), ("overwrite", "NOTES.md", noted)]
    journal = Workspace(ws).journal
    assert journal.dir.parent == sinkchat_home / "agent-journal"  # the user data dir, not the workspace
    assert (journal.dir / "workspace.txt").read_text() == f"{ws.resolve()}\n"
    assert not any(p.name.startswith(".") for p in ws.rglob("*"))  # nothing hidden left in the workspace
    lines = list(journal.undo(2))
    assert lines[0].startswith("restored NOTES.md") and lines[1].startswith("removed NOTES.md")
    assert not (ws / "NOTES.md").exists()
    assert len(list(journal.undo(10))) == 3
    assert (ws / "notes.txt").read_text() == NOTES and not (ws / "a.txt").exists() and entries(ws) == []


def test_a_half_written_journal_entry_never_corrupts_undo(ws, monkeypatch):
    box = build_default_tools(ws)
    assert box.call("write_file", {"path": "notes.txt", "content": "x", "overwrite": True}).ok
    journal = Workspace(ws).journal
    (journal.dir / "00000007.json").write_text('{"v": 1, "seq": 7, "op": "overwr')  # a torn entry
    (journal.dir / ".tmp-99-deadbeef").write_text("{")  # a temporary file a crash left
    assert [e.op for e in journal.entries()] == ["overwrite"]
    # a crash while recording: the tool must change nothing
    monkeypatch.setattr(os, "link", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    r = box.call("write_file", {"path": "notes.txt", "content": "y", "overwrite": True})
    assert not r.ok and "undo journal" in r.text and (ws / "notes.txt").read_text() == "x"
    monkeypatch.undo()
    assert [line.split(" (")[0] for line in journal.undo(5)] == ["restored notes.txt"]
    assert (ws / "notes.txt").read_text() == NOTES


@pytest.mark.parametrize("args", [{"path": "new.txt"}, {"path": "notes.txt", "append": True},
                                  {"path": "notes.txt", "overwrite": True}], ids=["new", "append", "overwrite"])
def test_a_write_stopped_midway_leaves_the_workspace_as_it_was(ws, monkeypatch, args):
    """The call's timeout (or the user's Ctrl-C) SIGTERMs the tool's process half-way through its write: no
    half-written file (a new one absent, an existing one unchanged), no temporary file, and undo still works (a
    partial file made undo refuse: "changed after the agent's write")."""
    import time

    from sinkchat.apps.agent.tools import write_file as wf

    real = wf.write_all

    def half_then_hang(fd, data):
        real(fd, data[: len(data) // 2])
        time.sleep(30)

    box = build_default_tools(ws)
    assert box.call("write_file", {"path": "first.txt", "content": "meeting at noon"}).ok
    monkeypatch.setattr(wf, "write_all", half_then_hang)
    box.tools["write_file"].timeout = 0.5
    before = {p.name: p.read_bytes() for p in ws.rglob("*") if p.is_file()}
    r = box.call("write_file", {**args, "content": "x" * 100_000})
    assert not r.ok and "timed out" in r.text
    assert {p.name: p.read_bytes() for p in ws.rglob("*") if p.is_file()} == before  # no partial or temp file
    journal = Workspace(ws).journal
    monkeypatch.undo()  # (the autouse data dir too: the journal is taken first)
    lines = list(journal.undo(5))
    assert lines[-1].startswith("removed first.txt") and not (ws / "first.txt").exists(), lines
    assert (ws / "notes.txt").read_text() == NOTES and not (ws / "new.txt").exists()


def test_a_full_disk_while_writing_changes_nothing_and_leaves_no_entry(ws, monkeypatch):
    from sinkchat.apps.agent.tools import write_file as wf

    def full(fd, data):
        os.write(fd, data[:3])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(wf, "write_all", full)
    box = build_default_tools(ws)
    for args in ({"path": "new.txt"}, {"path": "notes.txt", "append": True}):
        r = box.call("write_file", {**args, "content": "some text"})
        assert not r.ok and "No space left on device" in r.text, r.text
    assert sorted(p.name for p in ws.rglob("*")) == ["docs", "notes.txt", "readme.md"]
    assert (ws / "notes.txt").read_text() == NOTES and entries(ws) == []


def test_an_append_stays_in_place_and_a_long_name_is_written(ws):
    """An append is made to the same file (its hard links see it, its mode stays, a read-only file is refused), as
    O_APPEND did before writes became whole-or-nothing; a name near NAME_MAX is written (a temporary name built
    from it would not fit)."""
    box = build_default_tools(ws)
    os.link(ws / "notes.txt", ws / "alias.txt")
    os.chmod(ws / "notes.txt", 0o640)
    assert box.call("write_file", {"path": "notes.txt", "content": "+1", "append": True}).ok
    assert (ws / "alias.txt").read_text() == NOTES + "+1" and (ws / "notes.txt").stat().st_mode & 0o777 == 0o640
    os.chmod(ws / "notes.txt", 0o444)
    if os.geteuid() != 0:  # root writes a read-only file regardless
        r = box.call("write_file", {"path": "notes.txt", "content": "+2", "append": True})
        assert not r.ok and (ws / "notes.txt").read_text() == NOTES + "+1"
    long = "n" * 250 + ".txt"
    r = box.call("write_file", {"path": long, "content": "long"})
    assert r.ok, r.text
    assert (ws / long).read_text() == "long" and not [p for p in ws.iterdir() if p.name.startswith(".")]


def test_undo_never_destroys_a_later_edit_and_can_be_run_again(ws, monkeypatch):
    box = build_default_tools(ws)
    assert box.call("write_file", {"path": "notes.txt", "content": "agent", "overwrite": True}).ok
    (ws / "notes.txt").write_text("the user's edit")
    journal = Workspace(ws).journal
    with pytest.raises(JournalError, match="notes.txt changed after the agent's overwrite"):
        list(journal.undo())
    assert (ws / "notes.txt").read_text() == "the user's edit" and len(journal.entries()) == 1
    (ws / "notes.txt").write_text("agent")
    from pathlib import Path

    real_unlink = Path.unlink
    monkeypatch.setattr(Path, "unlink", lambda self, missing_ok=False: (_ for _ in ()).throw(OSError(5, "I/O error"))
                        if self.suffix == ".json" else real_unlink(self, missing_ok))
    with pytest.raises(JournalError):  # restored, then the crash: the entry is still there
        list(journal.undo())
    monkeypatch.undo()
    assert (ws / "notes.txt").read_text() == NOTES and len(journal.entries()) == 1
    (line,) = journal.undo()  # run again: nothing to write, the entry goes
    assert line.startswith("notes.txt was already as before the agent's overwrite at ")
    assert journal.entries() == [] and (ws / "notes.txt").read_text() == NOTES


def cli(args, monkeypatch):
    from click.testing import CliRunner

    import sinkchat.apps.agent.command as agent_mod

    monkeypatch.setattr("sinkchat.api.open_engine", lambda *a, **k: pytest.fail("--undo must not load the model"))
    return CliRunner().invoke(agent_mod.agent_command, args)


def test_cli_undo_restores_the_last_n_changes_and_says_what(ws, monkeypatch):
    box = build_default_tools(ws)
    assert box.call("write_file", {"path": "notes.txt", "content": "v2", "overwrite": True}).ok
    assert box.call("write_file", {"path": "first.txt", "content": "x"}).ok
    assert box.call("write_file", {"path": "notes.txt", "content": "v3", "overwrite": True}).ok
    res = cli(["--undo", "--workspace", str(ws)], monkeypatch)
    assert res.exit_code == 0 and res.output.startswith("undo: restored notes.txt (2 bytes) as it was before"), res.output
    assert (ws / "notes.txt").read_text() == "v2"
    res = cli(["--undo", "5", "--workspace", str(ws)], monkeypatch)
    assert res.exit_code == 0, res.output
    assert [ln.split(" (")[0] for ln in res.output.splitlines()] == [
        "undo: removed first.txt", "undo: restored notes.txt", "undo: only 2 change(s) were journaled; all undone"]
    assert (ws / "notes.txt").read_text() == NOTES and not (ws / "first.txt").exists()
    res = cli(["--undo", "--workspace", str(ws)], monkeypatch)
    assert res.exit_code == 1 and "nothing to undo" in res.output
    res = cli(["--undo"], monkeypatch)
    assert res.exit_code == 2 and "--undo needs --workspace" in res.output


def test_a_policy_denial_says_who_denied_and_the_tool_is_no_longer_offered(bundled, tmp_path):
    """Issue 28: `--allow-shell` without a terminal answered every shell call "the user denied this shell call; try
    something else" though no user was asked, and the model retried 10 times."""
    from sinkchat.apps.agent.command import make_approver

    root = tmp_path / "ws"
    root.mkdir()
    approve = make_approver("never-shell", interactive=False, explicit=False)
    eng = ScriptedEngine([call("shell", command="ls")] * 2 + [final("the shell calls were not allowed")])
    agent = Agent(eng, build_default_tools(root, allow_shell=True), root, few_shot=False, approve=approve)
    events = list(agent.run("Use the shell tool to run: ls", 5))
    why = "shell calls are off without a terminal: --approve auto allows them"
    assert [e.message for e in events if isinstance(e, AgentErrorEvent)] == [f"shell denied: {why}"] * 2
    fed = [c.splitlines()[0] for r, c, _ in eng.fed[1:3]]  # then the protocol reminder (unconstrained)
    assert fed == [f"Tool error (shell): {why}. shell is refused every time in this run: do not call it again"] * 2
    assert not any("user denied" in c for _, c, _ in eng.fed)
    agent = Agent(scripted_real(bundled, []), build_default_tools(root, allow_shell=True), root, approve=approve)
    assert accepts(agent.constraint, bundled.tokenizer, call("shell", command="ls"))
    list(agent._act(1, Parsed("call", name="shell", args={"command": "ls"})))
    assert "shell" not in [t.name for t in agent.constraint.tools]
    assert not accepts(agent.constraint, bundled.tokenizer, call("shell", command="ls"))


def test_a_user_denial_still_says_the_user_denied(tmp_path, monkeypatch):
    import click

    from sinkchat.apps.agent.command import make_approver

    monkeypatch.setattr(click, "confirm", lambda *a, **k: False)
    root = tmp_path / "ws"
    root.mkdir()
    eng = ScriptedEngine([call("write_file", path="a.txt", content="x"), final("ok")])
    agent = Agent(eng, build_default_tools(root), root, few_shot=False, approve=make_approver("ask", True))
    list(agent.run("Write x to a.txt", 3))
    assert eng.fed[1][1].splitlines()[0] == "Tool error (write_file): the user denied this write_file call; try something else"


def test_cli_allow_shell_without_a_terminal_says_so_and_does_not_offer_it(bundled, tmp_path, monkeypatch):
    from click.testing import CliRunner

    import sinkchat.apps.agent.command as agent_mod

    monkeypatch.setattr("sinkchat.api.open_engine", lambda *a, **k: scripted_real(bundled, [call("clock"), final("noon")]))
    res = CliRunner().invoke(agent_mod.agent_command, ["What time is it?", "--allow-shell", "--workspace", str(tmp_path),
                                                       "--no-log"])
    lines = res.output.splitlines()
    assert "note: shell calls are off without a terminal: --approve auto allows them; the shell tool is not offered" in lines
    tools_line = next(ln for ln in lines if ln.startswith("workspace: ")).split("tools: ")[1]
    assert "shell" not in tools_line and "clock" in tools_line
    res = CliRunner().invoke(agent_mod.agent_command, ["What time is it?", "--allow-shell", "--approve", "auto",
                                                       "--workspace", str(tmp_path), "--no-log"])
    assert "shell calls are off" not in res.output and "shell" in next(
        ln for ln in res.output.splitlines() if ln.startswith("workspace: ")).split("tools: ")[1]


# ---- review fixes --------------------------------------------------------------------------------------------------
def _bytes_dir(parent, name: bytes):
    path = os.path.join(os.fsencode(parent), name)
    os.mkdir(path)
    return os.fsdecode(path)


def test_a_workspace_or_file_name_that_is_not_utf8_does_not_crash(tmp_path):
    from pathlib import Path

    from sinkchat.apps.agent.grammar import scan_workspace

    root = Path(_bytes_dir(tmp_path, b"ws\xff"))
    (root / "ok.txt").write_text("x")
    open(os.path.join(os.fsencode(root), b"bad\xfe.txt"), "w").close()
    _bytes_dir(root, b"dir\xfe")
    box = build_default_tools(Workspace(root, journal_dir=tmp_path / "journal"))
    r = box.call("write_file", {"path": "new.txt", "content": "hi"})
    assert r.ok, r.text
    assert (tmp_path / "journal" / "workspace.txt").read_bytes() == os.fsencode(root) + b"\n"
    view = scan_workspace(root)
    assert "ok.txt" in view.files and all(p.isascii() for p in view.files + view.dirs)


def test_notes_never_change_a_users_own_notes_file(tmp_path):
    root = tmp_path / "ws"
    root.mkdir()
    (root / "NOTES.md").write_text("my own notes\n")
    box = build_default_tools(Workspace(root, journal_dir=tmp_path / "journal"))
    for args in ({"action": "clear"}, {"action": "append", "text": "x"}):
        r = box.call("notes", args)
        assert not r.ok and "the user's file" in r.text, r.text
    assert (root / "NOTES.md").read_text() == "my own notes\n"
    assert "my own notes" in box.call("notes", {}).text
    (root / "NOTES.md").unlink()  # the agent's own notes may be appended to and cleared
    assert box.call("notes", {"action": "append", "text": "a"}).ok
    assert box.call("notes", {"action": "append", "text": "b"}).ok and box.call("notes", {"action": "clear"}).ok


def test_the_journal_is_capped_and_undo_reads_only_what_it_restores(tmp_path, monkeypatch):
    import sinkchat.apps.agent.tools.journal as journal_mod

    root = tmp_path / "ws"
    root.mkdir()
    j = Journal(root, tmp_path / "journal")
    monkeypatch.setattr(journal_mod, "MAX_ENTRIES", 5)
    for i in range(8):
        j.record(root / f"f{i}.txt", "write", b"x")
        (root / f"f{i}.txt").write_bytes(b"x")
    assert [e.path for e in j.entries()] == [f"f{i}.txt" for i in range(3, 8)]
    monkeypatch.setattr(journal_mod, "MAX_JOURNAL_BYTES", 1)  # only the newest entry is kept
    j.record(root / "g.txt", "write", b"y")
    assert [e.path for e in j.entries()] == ["g.txt"]
    (root / "g.txt").write_bytes(b"y")
    decoded = []
    real_entry = journal_mod._entry
    monkeypatch.setattr(journal_mod, "_entry", lambda body, f: (decoded.append(f), real_entry(body, f))[1])
    monkeypatch.setattr(journal_mod, "MAX_JOURNAL_BYTES", 1 << 30)
    j.record(root / "h.txt", "write", b"z")
    (root / "h.txt").write_bytes(b"z")
    decoded.clear()
    assert len(list(j.undo(1))) == 1 and len(decoded) == 1 and not (root / "h.txt").exists()


def test_write_file_never_truncates_a_file_that_appeared_and_overwrites_by_rename(ws, monkeypatch):
    import sinkchat.apps.agent.tools.write_file as write_mod

    box = build_default_tools(ws)
    os.link(ws / "notes.txt", ws / "alias.txt")  # a second name for the same inode
    r = box.call("write_file", {"path": "notes.txt", "content": "new", "overwrite": True})
    assert r.ok and (ws / "notes.txt").read_text() == "new"
    assert (ws / "alias.txt").read_text() == NOTES  # replaced by rename, not rewritten in place
    (ws / "late.txt").write_text("the user's")
    real_lexists = os.path.lexists
    monkeypatch.setattr(write_mod.os.path, "lexists", lambda p: False if str(p).endswith("late.txt")
                        else real_lexists(p))  # late.txt appears between the check and the open
    r = box.call("write_file", {"path": "late.txt", "content": "gone"})
    assert not r.ok and (ws / "late.txt").read_text() == "the user's"
    assert [e.path for e in Journal(ws.resolve()).entries()] == ["notes.txt"]  # no entry for the failed write


def test_append_to_a_missing_file_creates_it(ws):
    r = build_default_tools(ws).call("write_file", {"path": "log.txt", "content": "x", "append": True})
    assert r.ok and (ws / "log.txt").read_text() == "x"
