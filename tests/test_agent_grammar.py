"""The tool-call grammar offers only values the tools accept (agent/grammar.py), read from each tool's `Arg`
declarations: file arguments name existing files, folder arguments existing folders, a CSV column is one of the
chosen file's (numeric) header names; and a constrained call always closes within the reply's token budget.

Why: the 1,000-task soak's calls were 100% schema-valid but only 51.8% ran ok (`list_dir` on a file, columns not in
the file, `.` given to file tools, 142 replies cut off mid-call)."""

from __future__ import annotations

import json
import random

import llguidance  # noqa: F401 - a required dependency: a broken install fails these tests, never skips them
import numpy as np
import pytest
import torch

from sinkchat.apps.agent.agent import build_default_tools
from sinkchat.apps.agent.constrain import MIN_FREE_TOKENS, ToolCallConstraint
from sinkchat.apps.agent.grammar import scan_workspace
from sinkchat.apps.agent.protocol import parse_reply
from sinkchat.apps.agent.tools.schema import Arg, ToolError, coerce, tool, tool_from_function
from sinkchat.apps.agent.tools.workspace import Workspace
from sinkchat.core.events import DoneEvent

from fakes import tiny_model


@pytest.fixture(scope="module")
def tok(bundled):
    return bundled.tokenizer


def constraint(tok, root, extra=(), **kw):
    box = build_default_tools(Workspace(root), extra=list(extra))
    return ToolCallConstraint(tok, list(box.tools.values()), len(tok), [2], workspace=root, **kw), box


def accepts(con, tok, text):
    """The whole reply `text` is allowed by the grammar (call or final) and complete."""
    con.begin()
    m = con.matcher.deep_copy()
    ids = tok.encode(text, add_special_tokens=False)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def call(name, **args):
    return json.dumps({"tool": name, "args": args})


def test_path_arguments_offer_what_the_tool_declares(tok, tmp_path):
    root = tmp_path / "ws"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "readme.md").write_text("x")
    (root / "a.txt").write_text("a")
    (root / "in_link").symlink_to(root / "a.txt")
    (root / "out_link").symlink_to(tmp_path)
    (tmp_path / "secret.txt").write_text("s")

    @tool(args={"where": Arg(path="dir")})
    def zap(where: str) -> str:  # a user tool: nothing in the grammar knows its name
        """Zap a folder."""
        return where

    con, _ = constraint(tok, root, [zap])
    for name, arg in (("read_file", "path"), ("count_lines", "path")):  # files only
        assert accepts(con, tok, call(name, **{arg: "a.txt"})) and accepts(con, tok, call(name, **{arg: "in_link"}))
        assert accepts(con, tok, call(name, **{arg: "docs/readme.md"}))
        for bad in (".", "docs", "out_link", "out_link/secret.txt", "b.txt", "../secret.txt"):
            assert not accepts(con, tok, call(name, **{arg: bad})), (name, bad)
    for name, arg in (("list_dir", "path"), ("zap", "where")):  # folders only
        assert accepts(con, tok, call(name, **{arg: "."})) and accepts(con, tok, call(name, **{arg: "docs"}))
        for bad in ("a.txt", "docs/readme.md", "in_link", "out_link", "nope"):
            assert not accepts(con, tok, call(name, **{arg: bad})), (name, bad)
    assert accepts(con, tok, call("search_text", pattern="x", path="."))  # either
    assert accepts(con, tok, call("search_text", pattern="x", path="a.txt"))
    assert not accepts(con, tok, call("search_text", pattern="x", path="out_link"))
    assert accepts(con, tok, call("write_file", path="new/dir/f.txt", content="hi"))  # a file to write: free
    for bad in (".", "../escape.txt", "/etc/x", "~/x"):
        assert not accepts(con, tok, call("write_file", path=bad, content="hi")), bad
    (root / "later.txt").write_text("now")  # the listing is re-read before each reply
    assert accepts(con, tok, call("read_file", path="later.txt"))


def _random_workspace(rng, root):
    """CSV files with random headers, some columns numeric; plus a prose file and a binary one."""
    root.mkdir()
    truth = {}
    for i in range(rng.randint(1, 4)):
        names = rng.sample(["id", "amount", "temp", "region", "units", "price", "name", "day", "score"], rng.randint(1, 5))
        numeric = {n for n in names if rng.random() < 0.6}
        rows = [",".join(str(rng.randint(0, 99)) if n in numeric else rng.choice("abc") for n in names)
                for _ in range(rng.randint(1, 4))]
        path = f"t{i}.csv" if rng.random() < 0.7 else f"sub/t{i}.dat"
        (root / path).parent.mkdir(exist_ok=True)
        (root / path).write_text(",".join(names) + "\n" + "\n".join(rows) + "\n")
        truth[path] = (names, numeric)
    (root / "notes.txt").write_text("just prose here\nmore prose\n")
    (root / "blob.bin").write_bytes(bytes(range(256)))
    return truth


@pytest.mark.parametrize("seed", range(6))
def test_columns_are_the_chosen_files_numeric_header(tok, tmp_path, seed):
    rng = random.Random(seed)
    root = tmp_path / "ws"
    truth = _random_workspace(rng, root)
    con, box = constraint(tok, root)
    every = {n for names, _ in truth.values() for n in names}
    for path, (names, numeric) in truth.items():
        for col in every:
            ok = accepts(con, tok, call("column_sum", path=path, column=col))
            assert ok == (col in numeric), (path, col, names, numeric)
            if ok:
                assert box.call("column_sum", {"path": path, "column": col}).ok  # and the tool takes it
    for path in ("notes.txt", "blob.bin"):
        assert not accepts(con, tok, call("column_max", path=path, column="just prose here"))
    if not any(numeric for _, numeric in truth.values()):
        assert not any(accepts(con, tok, call("column_sum", path=p, column=c)) for p in truth for c in every)


def test_a_tool_with_no_possible_value_is_left_out(tok, tmp_path):
    root = tmp_path / "ws"
    root.mkdir()
    con, _ = constraint(tok, root)
    assert scan_workspace(root).files == ()
    assert not accepts(con, tok, call("read_file", path="."))
    assert accepts(con, tok, call("list_dir", path=".")) and accepts(con, tok, call("clock"))


def test_declarations_are_checked_and_ranges_enforced():
    with pytest.raises(ValueError, match="no argument"):
        tool_from_function(tool(args={"pth": Arg(path="file")})(lambda path: path))
    with pytest.raises(ValueError, match="must be one of"):
        Arg(path="folder")
    def count(n: int = 0) -> str:
        return str(n)

    t = tool_from_function(tool(args={"n": Arg(minimum=0, maximum=9)})(count))
    assert coerce(t.params[0], 9) == 9
    with pytest.raises(ToolError, match=r"must be in \[0, 9\]"):
        coerce(t.params[0], -1)


def test_every_builtin_path_argument_says_what_it_names(tmp_path):
    """A new built-in tool taking a path must declare it, or the grammar offers it free strings."""
    box = build_default_tools(Workspace(tmp_path), allow_shell=True)
    for t in box.tools.values():
        for p in t.params:
            if "path" in p.description.lower() or p.name == "path":
                assert p.arg.path is not None, (t.name, p.name)


def _engine(tok, temperature, seed, max_tokens):
    from sinkchat.config import CacheConfig, SamplingConfig
    from sinkchat.core.engine import Engine

    return Engine(tiny_model(vocab_size=len(tok), max_pos=4096, seed=seed % 3), tok, CacheConfig(capacity=4096),
                  SamplingConfig(temperature=temperature, max_tokens=max_tokens, seed=seed))


def _never_close(tok):
    """A logits processor that pushes down every token holding `"`, `}` or the end, pushes up `}` and `]` alone."""
    import torch

    texts = [tok.decode([i]) for i in range(len(tok))]
    bias = torch.tensor([-1e4 if ('"' in t or i in (0, 1, 2)) else 0.0 for i, t in enumerate(texts)])
    for i, t in enumerate(texts):
        if t and set(t) <= set("}]"):
            bias[i] = 1e4
    return lambda recent, logits: logits + bias[: logits.shape[-1]].to(logits.dtype)


@pytest.mark.parametrize("seed", range(8))
def test_a_call_always_closes_within_the_budget(tok, tmp_path, seed):
    """A random model (it loops inside strings) at the smallest budget the constraint allows: every reply is a
    complete call or answer that the tool validates, within the budget, ended by EOS."""
    root = tmp_path / "ws"
    _random_workspace(random.Random(seed), root)
    con, box = constraint(tok, root)
    eng = _engine(tok, [1.0, 1.5][seed % 2], seed, 8)
    con.begin(budget=1)
    budget = con.budget
    assert budget == con.reserve + MIN_FREE_TOKENS
    list(eng.add_message("user", "Task: do something useful"))
    never_close = _never_close(tok)  # the worst model: it never ends a string or an object by itself
    for i in range(4):
        con.begin(require_call=i % 2 == 0, budget=1)
        procs = [never_close, con] if seed % 4 < 2 else [con]
        done = [e for e in eng.generate(con.budget, stop=(), logits_processors=procs) if isinstance(e, DoneEvent)][0]
        assert done.reason == "eos" and done.tokens <= budget, (done.reason, done.tokens, budget, done.text)
        p = parse_reply(done.text)
        assert p.kind in ("call", "final"), done.text
        if p.kind == "call":
            box.validate(p.name, p.args)
        list(eng.add_message("user", "Tool result: ok"))


def test_short_arguments_are_bounded_and_not_empty(tok, tmp_path):
    root = tmp_path / "ws"
    root.mkdir()
    (root / "a.txt").write_text("a")
    con, _ = constraint(tok, root)
    assert not accepts(con, tok, call("calculator", expression=""))  # the tool only fails on it
    assert accepts(con, tok, call("calculator", expression="1+1"))
    assert not accepts(con, tok, call("search_text", pattern=""))
    assert not accepts(con, tok, call("search_text", pattern="x" * 65))
    assert accepts(con, tok, call("write_file", path="b.txt", content="x" * 500))  # content stays long


def test_the_calculator_is_offered_arithmetic_only(tok, tmp_path):
    """Every calculator call that failed in the 60-task soak was text that is not arithmetic; the grammar now offers
    numbers, operators, parentheses and the tool's own names, and every such call the tool evaluates."""
    from sinkchat.apps.agent.tools.calculator import calculator

    root = tmp_path / "ws"
    root.mkdir()
    con, _ = constraint(tok, root)
    for bad in (", ", "29 + 88, 2 * 2", "falcon.savename", " 1", "x" * 3, "1 + " * 40):
        assert not accepts(con, tok, call("calculator", expression=bad)), bad
    for good in ("(3 + 4) * 2 ** 3", "sqrt(2) * pi", "1015 / 7", ".5 * 2", "round(10 / 3)", "2^10"):
        assert accepts(con, tok, call("calculator", expression=good)), good
        calculator(good)  # the tool takes it (a ToolError would fail the test)


@pytest.fixture(scope="module")
def pieces(tok):
    """Each token's text, and the ids of each text (for a model that writes one chosen text, piece by piece)."""
    texts = [tok.decode([i]) for i in range(len(tok))]
    by_text: dict[str, list[int]] = {}
    for i, t in enumerate(texts):
        if t and i > 2:
            by_text.setdefault(t, []).append(i)
    return texts, by_text


def _wilful(con, pieces, target, budget, reference=None):
    """Generate under `con` as the slowest stubborn model would: each step the shortest allowed token that continues
    `target` (a target that never ends: it does not close by itself), else the first allowed token. Returns the
    text, whether it ended with EOS within `budget`, and per step whether `con` masked more than `reference` (the
    same grammar with no budget) allowed."""
    texts, by_text = pieces
    ids: list[int] = []
    out, shaped = "", []
    for _ in range(budget):
        allowed = torch.isfinite(con(ids, torch.zeros(len(texts)))).numpy()
        if reference is not None:
            shaped.append(bool((torch.isfinite(reference(ids, torch.zeros(len(texts)))).numpy() != allowed).any()))
        rest = target[len(out):] if target.startswith(out) else ""
        ends = [rest[:k] for k in range(1, min(len(rest), 16) + 1)]
        cand = [i for t in ends for i in by_text.get(t, []) if allowed[i]]
        nxt = cand[0] if cand else int(np.flatnonzero(allowed)[0])
        ids.append(nxt)
        if nxt == 2:
            return out, True, shaped
        out += texts[nxt]
    return out, False, shaped


def test_the_closing_reserve_fits_the_longest_path_a_call_can_name(tok, pieces, tmp_path):
    """The reserve is sized from each enum's LONGEST value: a stubborn model reading the one 120-character file of a
    workspace (beside a short one) at the smallest budget still closes its call. Sized from the shortest value the
    budget was 59 and the reply was cut mid-path at 59 of 59 tokens."""
    root = tmp_path / "ws"
    root.mkdir()
    long = ("quarterly_sales_report_for_the_northern_region_" * 3)[:116] + ".txt"
    assert len(long) == 120
    (root / long).write_text("x")
    (root / "a.txt").write_text("a")
    con, box = constraint(tok, root)
    con.begin(budget=1)
    target = call("read_file", path=long)
    text, ended, _ = _wilful(con, pieces, target + " " * 200, con.budget)  # the model would go on: it is closed
    assert ended and text == target, (con.budget, con.reserve, text)
    box.validate("read_file", parse_reply(text).args)


def test_the_closing_starts_exactly_where_the_reserve_says(tok, pieces, tmp_path):
    """A stubborn model writing a long file content: every token before `budget - reserve` is the grammar's own
    mask, the closing shapes the mask from that token on (not one later: the reserve would be one short; not
    earlier: a token of free text lost), and the call still closes within the budget."""
    root = tmp_path / "ws"
    root.mkdir()
    con, _ = constraint(tok, root)
    free, _ = constraint(tok, root)
    free.begin()
    con.begin(budget=con.reserve + 80)  # 80 free tokens: the closing starts inside the content string
    assert con.closing_at == con.budget - con.reserve == 80
    text, ended, shaped = _wilful(con, pieces, call("write_file", path="b.txt", content="x" * 500), con.budget,
                                  reference=free)
    start = con.budget - con.reserve
    assert ended and len(shaped) <= con.budget, text
    assert shaped.index(True) == start and not any(shaped[:start]), shaped
    assert parse_reply(text).args["path"] == "b.txt" and text.startswith(call("write_file", path="b.txt")[:-2])


def test_a_sibling_folder_sharing_the_workspace_prefix_is_never_offered(tok, tmp_path):
    """`/ws2` beside `/ws`: its name starts with the workspace's, but it is outside; links to it (a folder, a file)
    are neither listed nor accepted by the grammar (a prefix check without the separator would offer them)."""
    root, sibling = tmp_path / "ws", tmp_path / "ws2"
    (sibling / "inner").mkdir(parents=True)
    (sibling / "secret.txt").write_text("s")
    root.mkdir()
    (root / "a.txt").write_text("a")
    (root / "to_sib").symlink_to(sibling)
    (root / "sib_file").symlink_to(sibling / "secret.txt")
    view = scan_workspace(root)
    assert view.files == ("a.txt",) and view.dirs == (".",), view
    con, _ = constraint(tok, root)
    assert accepts(con, tok, call("read_file", path="a.txt"))
    for name, path in (("read_file", "sib_file"), ("read_file", "to_sib/secret.txt"), ("list_dir", "to_sib"),
                       ("list_dir", "to_sib/inner")):
        assert not accepts(con, tok, call(name, path=path)), (name, path)
