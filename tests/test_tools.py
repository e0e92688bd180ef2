"""Agent tools: confinement with hostile inputs, read/size caps, argument validation, timeouts, schema."""

from __future__ import annotations

import datetime as dt
import os
import stat
from pathlib import Path

import pytest

from sinkchat.apps.agent.tools import (
    ToolError, Toolbox, Workspace, build_default_tools, cap_text, load_tools_module, parse_docstring, tool,
    tool_from_function,
)

SECRET = "TOP-SECRET-OUTSIDE-7f3a"


@pytest.fixture
def env(tmp_path: Path):
    """A workspace full of traps, next to a secret file outside it."""
    (tmp_path / "secret.txt").write_text(SECRET)
    root = tmp_path / "ws"
    root.mkdir()
    (root / "hello.txt").write_text("hello world\nsecond line\n")
    (root / "sub").mkdir()
    (root / "sub" / "inner.txt").write_text("inner needle\n")
    os.symlink("/", root / "rootlink")
    os.symlink(tmp_path / "secret.txt", root / "secretlink")
    os.symlink(tmp_path, root / "outdir")
    os.symlink("/dev/zero", root / "zerolink")
    os.symlink("hello.txt", root / "innerlink")  # inside -> inside: allowed
    os.mkfifo(root / "fifo")
    with open(root / "big.log", "wb") as f:
        f.write(b"line of log text\n" * (10 * 1024 * 1024 // 17 + 1))
    (root / "blob.bin").write_bytes(bytes(range(256)) * 8)
    ws = Workspace(root)
    return ws, build_default_tools(ws, allow_shell=True, max_result_chars=2000), tmp_path


HOSTILE = ["../secret.txt", "../../etc/passwd", "/etc/passwd", "rootlink/etc/passwd", "secretlink", "outdir/secret.txt",
           "/dev/zero", "zerolink", "fifo", "~/.bashrc", "sub/../../secret.txt", str(Path("/proc/self/environ"))]


@pytest.mark.parametrize("path", HOSTILE)
def test_read_file_refuses_hostile_paths(env, path):
    ws, box, _ = env
    r = box.call("read_file", {"path": path})
    assert not r.ok
    assert "refused" in r.text or "not found" in r.text
    assert SECRET not in r.text and "root:" not in r.text


@pytest.mark.parametrize("path", ["../evil.txt", "/tmp/evil-sinkchat.txt", "outdir/evil.txt", "rootlink/tmp/evil2.txt",
                                  "secretlink", "zerolink", "fifo", "sub"])
def test_write_file_refuses_hostile_paths(env, path):
    ws, box, tmp = env
    r = box.call("write_file", {"path": path, "content": "pwned"})
    assert not r.ok, r.text
    assert (tmp / "secret.txt").read_text() == SECRET
    assert not (tmp / "evil.txt").exists() and not Path("/tmp/evil-sinkchat.txt").exists()
    assert not Path("/tmp/evil2.txt").exists()


@pytest.mark.parametrize("path", ["..", "/", "rootlink", "outdir", "/etc", "fifo"])
def test_list_dir_refuses_hostile_paths(env, path):
    _, box, _ = env
    r = box.call("list_dir", {"path": path})
    assert not r.ok
    assert "secret.txt" not in r.text


def test_list_dir_shows_links_without_following(env):
    _, box, _ = env
    r = box.call("list_dir", {})
    assert r.ok
    assert "rootlink -> / (symlink)" in r.text and "fifo (fifo)" in r.text and "sub/" in r.text


def test_search_never_leaves_the_workspace(env):
    ws, box, _ = env
    r = box.call("search_text", {"pattern": "SECRET"})
    assert r.ok and "no matches" in r.text  # the symlinks to / and to the parent are not followed
    assert not box.call("search_text", {"pattern": "SECRET", "path": "outdir"}).ok
    hit = box.call("search_text", {"pattern": "NEEDLE"})
    assert "sub/inner.txt:1: inner needle" in hit.text
    assert not box.call("search_text", {"pattern": "(", "regex": True}).ok


def test_reads_inside_allowed_and_big_file_truncated(env):
    ws, box, _ = env
    assert box.call("read_file", {"path": "innerlink"}).text.startswith("hello world")
    assert box.call("read_file", {"path": str(ws.root / "hello.txt")}).ok  # absolute inside: fine
    r = box.call("read_file", {"path": "big.log"})
    assert r.ok and r.truncated and "truncated" in r.text
    assert len(r.text) < 2100
    size = (ws.root / "big.log").stat().st_size
    assert size >= 10 * 1024 * 1024
    page = box.call("read_file", {"path": "big.log", "offset": size - 17})
    assert page.text.startswith("line of log text") and f"of {size}" in page.text


def test_binary_file_is_summarized_not_dumped(env):
    _, box, _ = env
    r = box.call("read_file", {"path": "blob.bin"})
    assert r.ok and r.text.startswith("binary file, 2048 bytes") and "00 01 02 03" in r.text


def test_write_then_read_and_append(env):
    ws, box, _ = env
    assert box.call("write_file", {"path": "new/deep/a.txt", "content": "one"}).ok
    assert box.call("write_file", {"path": "new/deep/a.txt", "content": " two", "append": "true"}).ok
    assert (ws.root / "new/deep/a.txt").read_text() == "one two"


def test_notes_survive_and_are_confined(env):
    ws, box, tmp = env
    assert box.call("notes", {}).text == "(no notes yet)"
    assert box.call("notes", {"action": "append", "text": "the answer is 42"}).ok
    assert "the answer is 42" in box.call("notes", {"action": "read"}).text
    assert not box.call("notes", {"action": "append"}).ok
    assert not box.call("notes", {"action": "shred"}).ok
    assert box.tools["notes"].has_side_effects({"action": "append"})
    assert not box.tools["notes"].has_side_effects({"action": "read"})
    (ws.root / "NOTES.md").unlink()
    os.symlink(tmp / "secret.txt", ws.root / "NOTES.md")
    r = box.call("notes", {"action": "append", "text": "x"})
    assert not r.ok and (tmp / "secret.txt").read_text() == SECRET
    assert SECRET not in box.call("notes", {}).text


def test_device_file_inside_workspace_refused(env):
    ws, box, _ = env
    try:
        os.mknod(ws.root / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except (PermissionError, OSError):
        pytest.skip("cannot create a device node here")
    assert "character device" in box.call("read_file", {"path": "null"}).text
    assert not box.call("write_file", {"path": "null", "content": "x"}).ok


def test_shell_timeout_cap_and_cwd(env):
    ws, box, _ = env
    assert "shell" not in build_default_tools(ws, allow_shell=False)
    r = box.call("shell", {"command": "pwd"})
    assert r.ok and str(ws.root) in r.text
    r = box.call("shell", {"command": "sleep 30", "timeout": 1})
    assert "timed out after 1 s" in r.text
    r = box.call("shell", {"command": "yes"})
    assert "output passed" in r.text and len(r.text) <= 2100


def test_calculator_is_safe():
    box = build_default_tools(Workspace(Path(os.environ["SINKCHAT_HOME"]) / "calc-ws", create=True))
    ok = {"2*(3+4)": "14", "2^10": "1024", "sqrt(16)": "4", "7/2": "3.5", "-3 % 5": "2", "round(pi, 2)": "3.14"}
    for expr, want in ok.items():
        r = box.call("calculator", {"expression": expr})
        assert r.ok and r.text == want, (expr, r.text)
    for bad in ["__import__('os').system('id')", "().__class__", "open('/etc/passwd')", "9**9**9", "1/0", "x + 1",
                "factorial(100000)", "10**5000 * 10**6000", "[1,2]", ""]:
        r = box.call("calculator", {"expression": bad})
        assert not r.ok and r.text.startswith("error"), bad


def test_clock_is_iso():
    r = build_default_tools(Workspace(Path(os.environ["SINKCHAT_HOME"]) / "clock-ws", create=True)).call("clock", {})
    when = dt.datetime.fromisoformat(r.text.split(" ")[0])
    assert abs((when - dt.datetime.now().astimezone()).total_seconds()) < 3600


def test_validation_errors_are_messages(env):
    _, box, _ = env
    cases = [("nope", {}, "unknown tool"), ("read_file", {"path": ["a"]}, "must be string"),
             ("read_file", {"path": "hello.txt", "offset": "abc"}, "must be integer"),
             ("read_file", {}, "needs argument 'path'"), ("read_file", {"pth": "x"}, "no argument"),
             ("write_file", ["x"], "must be a JSON object"), (None, {}, "unknown tool"),
             ("write_file", {"path": "a", "content": "b", "append": "maybe"}, "must be boolean")]
    for name, args, want in cases:
        r = box.call(name, args)
        assert not r.ok and want in r.text, (name, args, r.text)
    assert box.call("read_file", {"path": "hello.txt", "offset": "6"}).text.startswith("world")  # "6" -> 6
    assert box.call("calculator", "1+1").text == "2"  # bare value for a one-argument tool


def test_schema_from_signature_and_docstring(env):
    _, box, _ = env
    s = box.tools["read_file"].schema()["function"]
    assert s["name"] == "read_file" and "workspace" not in s["parameters"]["properties"]
    assert s["parameters"]["required"] == ["path"]
    assert s["parameters"]["properties"]["offset"]["type"] == "integer"
    assert "relative to the workspace" in s["parameters"]["properties"]["path"]["description"]
    assert box.tools["notes"].schema()["function"]["parameters"]["properties"]["action"]["enum"] == ["read", "append", "clear"]
    desc, args = parse_docstring("Do a thing.\n\nMore.\n\nArgs:\n    a: first\n      continued\n    b (int): second\nReturns:\n    x")
    assert desc == "Do a thing." and args == {"a": "first continued", "b": "second"}


def test_tool_timeout_and_crash_become_results():
    import time

    @tool(timeout=0.2)
    def slow(seconds: float = 5.0) -> str:
        """Sleep."""
        time.sleep(seconds)
        return "done"

    def boom() -> str:
        """Crash."""
        raise RuntimeError("kaput")

    box = Toolbox([tool_from_function(slow), tool_from_function(boom)])
    r = box.call("slow", {})
    assert not r.ok and "timed out after 0.2 s" in r.text
    r = box.call("boom", {})
    assert not r.ok and "RuntimeError: kaput" in r.text


def test_cap_text_marks_truncation():
    text, cut = cap_text("x" * 50, 10)
    assert cut and text.startswith("x" * 10) and "showing 10 of 50 chars" in text
    assert cap_text("short", 10) == ("short", False)


def test_load_tools_module(tmp_path):
    p = tmp_path / "mytools.py"
    p.write_text("def shout(text: str) -> str:\n    '''Upper-case a text.'''\n    return text.upper()\n"
                 "def _hidden():\n    pass\n")
    fns = load_tools_module(p)
    assert [f.__name__ for f in fns] == ["shout"]
    box = build_default_tools(Workspace(tmp_path / "ws", create=True), extra=fns)
    assert box.call("shout", {"text": "hi"}).text == "HI"
    bad = tmp_path / "bad.py"
    bad.write_text("import does_not_exist_xyz\n")
    with pytest.raises(ValueError, match="error while importing"):
        load_tools_module(bad)
    with pytest.raises(ValueError, match="not found"):
        load_tools_module(tmp_path / "missing.py")


def test_workspace_resolve_rejects_nul_and_types(tmp_path):
    ws = Workspace(tmp_path / "w", create=True)
    with pytest.raises(ToolError, match="NUL"):
        ws.resolve("a\x00b")
    with pytest.raises(ToolError, match="must be a string"):
        ws.resolve(5)  # type: ignore[arg-type]
    assert ws.resolve(".", kind="dir") == ws.root


def test_a_sibling_folder_sharing_the_workspace_prefix_is_outside(tmp_path):
    """`/ws2` beside `/ws` starts with the same characters but is outside the jail: reached through `..` or a link,
    every tool refuses it (a prefix check without the separator would let it through)."""
    (tmp_path / "ws2").mkdir()
    (tmp_path / "ws2" / "secret.txt").write_text(SECRET)
    ws = Workspace(tmp_path / "ws", create=True)
    os.symlink(tmp_path / "ws2", ws.root / "to_sib")
    os.symlink(tmp_path / "ws2" / "secret.txt", ws.root / "sib_file")
    box = build_default_tools(ws)
    for path in ("../ws2/secret.txt", "to_sib/secret.txt", "sib_file", str(tmp_path / "ws2" / "secret.txt")):
        with pytest.raises(ToolError, match="refused"):
            ws.resolve(path)
        r = box.call("read_file", {"path": path})
        assert not r.ok and SECRET not in r.text, path
    assert not box.call("list_dir", {"path": "to_sib"}).ok
    assert not box.call("write_file", {"path": "to_sib/new.txt", "content": "x"}).ok
    assert sorted(p.name for p in (tmp_path / "ws2").iterdir()) == ["secret.txt"]


def test_the_tools_package_has_no_import_circle_even_for_type_hints():
    """tests/test_layout.py skips `if TYPE_CHECKING:` imports (they never run); here they count too, so the
    schema <-> workspace circle (schema typed its injected workspace by importing it) cannot come back."""
    import ast

    import sinkchat.apps.agent.tools as pkg

    graph: dict[str, set[str]] = {}
    for path in Path(pkg.__file__).parent.glob("*.py"):
        deps = graph.setdefault(path.stem, set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sinkchat.apps.agent.tools."):
                deps.add(node.module.rsplit(".", 1)[1])
    assert "workspace" in graph["file_stats"] and "schema" in graph["workspace"]  # the walk sees real imports

    def reach(start: str) -> set[str]:
        seen, todo = set(), list(graph[start])
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo += graph.get(n, ())
        return seen

    assert [m for m in graph if m != "__init__" and m in reach(m)] == []


# ------------------------------------------------------------------------------------------------ stopping timed-out calls
def _gone(pid: int, wait: float = 3.0) -> bool:
    """True once `pid` no longer runs (exited, or a zombie nobody has reaped yet)."""
    import time

    import psutil

    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_timed_out_python_tool_is_stopped_with_its_children(tmp_path):
    """A Python tool past its timeout must stop working (and the process it started must die), not keep running in
    an abandoned thread."""
    import subprocess
    import threading
    import time

    beat, helper = tmp_path / "beat", tmp_path / "helper.pid"

    @tool(timeout=1.0)
    def busy() -> str:
        """Work forever, with a helper process."""
        p = subprocess.Popen(["sleep", "60"])
        helper.write_text(str(p.pid))
        while True:
            with open(beat, "a") as f:
                f.write("x")
            time.sleep(0.02)

    r = Toolbox([tool_from_function(busy)]).call("busy", {})
    assert not r.ok and "timed out after 1 s" in r.text
    size = beat.stat().st_size
    time.sleep(0.3)
    assert beat.stat().st_size == size, "the tool kept running after its timeout"
    assert _gone(int(helper.read_text())), "the tool's child process outlived the call"
    assert not [t for t in threading.enumerate() if t.name.startswith("tool-")]


def test_shell_call_leaves_nothing_running(env):
    ws, box, _ = env
    # a background job the command started does not outlive the call
    r = box.call("shell", {"command": "sleep 60 > /dev/null 2>&1 & echo $! > bg.pid"})
    assert r.ok, r.text
    assert _gone(int((ws.root / "bg.pid").read_text()))
    # the call's own limit cut below the command's timeout: the command is killed, not abandoned
    box.tools["shell"].timeout = 0.5
    r = box.call("shell", {"command": "echo $$ > sh.pid; exec sleep 60", "timeout": 30})
    assert not r.ok and "timed out after 0.5 s" in r.text
    assert _gone(int((ws.root / "sh.pid").read_text()))


def test_in_process_tool_cannot_be_stopped_so_it_is_refused_until_it_ends():
    """`isolate=False` tools run in a thread (they may keep state in memory): a timed-out one cannot be stopped, so
    the model is told so and further calls are refused while it runs: at most one stuck thread per tool."""
    import threading
    import time

    release, state = threading.Event(), []

    @tool(timeout=0.2, isolate=False)
    def stuck() -> str:
        """Block until released."""
        release.wait(10)
        state.append("ran")
        return "late"

    box = Toolbox([tool_from_function(stuck)])
    r = box.call("stuck", {})
    assert not r.ok and "timed out after 0.2 s" in r.text and "cannot be stopped" in r.text
    r = box.call("stuck", {})
    assert not r.ok and "still running" in r.text and r.seconds < 0.1
    release.set()
    deadline = time.monotonic() + 5
    while [t for t in threading.enumerate() if t.name == "tool-stuck"] and time.monotonic() < deadline:
        time.sleep(0.02)
    r = box.call("stuck", {})
    assert r.ok and r.text == "late" and state == ["ran", "ran"]  # in-process: its state is the caller's


def test_isolated_tool_errors_and_results_come_back(tmp_path):
    @tool(timeout=5)
    def echo(text: str, fail: str = "") -> str:
        """Echo, or fail."""
        if fail == "tool":
            raise ToolError("bad input")
        if fail == "exit":
            import os

            os._exit(3)
        return text * 2

    box = Toolbox([tool_from_function(echo)])
    assert box.call("echo", {"text": "ab\ud800"}).text == "ab\ud800ab\ud800"
    assert box.call("echo", {"text": "x", "fail": "tool"}).text == "error: bad input"
    r = box.call("echo", {"text": "x", "fail": "exit"})
    assert not r.ok and "without a result" in r.text and "3" in r.text


def test_workspace_is_never_created_by_accident(tmp_path):
    from sinkchat.apps.agent.tools.workspace import WorkspaceError

    with pytest.raises(WorkspaceError, match="does not exist"):
        Workspace(tmp_path / "typo" / "ws")
    with pytest.raises(WorkspaceError, match="does not exist"):
        build_default_tools(tmp_path / "typo" / "ws")
    assert not (tmp_path / "typo").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(WorkspaceError, match="not a folder"):
        Workspace(tmp_path / "file", create=True)
    assert Workspace(tmp_path / "made" / "ws", create=True).root == (tmp_path / "made" / "ws").resolve()


def test_counting_and_column_tools(env):
    """count_lines / count_words / count_matches / column_* answer with one number (what a 135M model copies right),
    through the same workspace jail as read_file."""
    ws, box, _ = env
    (ws.root / "t.csv").write_text("name,Amount,note\na,10,x\nb,2.5,y\nc,,z\nd,-4,w\n")
    assert box.call("count_lines", {"path": "hello.txt"}).text == "2"
    assert box.call("count_words", {"path": "hello.txt"}).text == "4"
    assert box.call("count_matches", {"pattern": "LINE", "path": "hello.txt"}).text == "1"
    assert box.call("count_matches", {"pattern": "(", "path": "hello.txt"}).text == "0"  # literal text, not a regex
    assert box.call("column_sum", {"path": "t.csv", "column": "amount"}).text == "8.5"
    assert box.call("column_max", {"path": "t.csv", "column": "Amount"}).text == "10"
    assert box.call("column_min", {"path": "t.csv", "column": "amount"}).text == "-4"
    assert box.tools["column_max"].description == "The largest (maximum) value of a column of a CSV file."
    assert [p.description for p in box.tools["column_min"].params] == [
        "CSV file path relative to the workspace", "the column name"]
    r = box.call("column_sum", {"path": "t.csv", "column": "price"})
    assert not r.ok and "name,Amount,note" in r.text
    assert not box.call("column_sum", {"path": "t.csv", "column": "note"}).ok  # no numbers
    # exact, never "1.235e+04" (a model copied "1.235"); thousands separators read; a cell that is no number said
    (ws.root / "s.csv").write_text('id,amount\n1,10000.50\n2,2345.25\n3,"1,030.10"\n4,0.1\n5,0.2\n')
    assert box.call("column_sum", {"path": "s.csv", "column": "amount"}).text == "13376.15"
    (ws.root / "u.csv").write_text("id,amount\n1,19.75\n2,n/a\n3,0.25\n")
    assert box.call("column_sum", {"path": "u.csv", "column": "amount"}).text == \
        "20 (over 2 of 3 rows; skipped, not a number: row 2)"
    assert not box.call("count_lines", {"path": "blob.bin"}).ok
    for path in ("../secret.txt", "secretlink", "rootlink/etc/passwd", "fifo", "zerolink"):
        r = box.call("count_lines", {"path": path})
        assert not r.ok and SECRET not in r.text, path
