"""The tool-call grammar: JSON schemas (and a Lark grammar for native templates) built from what each tool declares.

Why per-argument values: with a grammar that only checked types, every call was schema-valid but most failed in the
tool. The 1,000-task agent soak measured 598 of 1,155 calls (51.8%) valid and ran ok: 152 `list_dir` on a file, 237
CSV columns not in the file, `.` given to file tools, and 142 replies cut off before the call closed. So each argument
offers only what its tool accepts, read from the tool's own declaration (`Arg` in tools/schema.py), never from a tool
name here:

- `Arg(path="file")`: one of the workspace's existing regular files; `"dir"`: one of its folders (`.` included);
  `"any"`: either; `"new"` (a file to write): a well-formed relative path (patterns.PATH) that is none of the
  workspace's files or folders, short; issue 28: "Copy the first line of notes.txt into a new file first.txt"
  became `write_file notes.txt`, overwriting the user's input. In a task that names the files to write
  (`TaskContext.targets`, from agent/goals.py) the path is one of those, its `Arg(content_of=)` text what the
  task asks for (the given text; a number or a copied line from the tool results), and an existing target is
  written only with an `Arg(overwrites="path")` argument (write_file's `overwrite`, `append`) `true`.
  Symlinks count as what they point to, and only when that stays inside the workspace (a link out is not offered:
  the tool would refuse it).
- `Arg(column_of="path")`: the call becomes an anyOf over the CSV files, each with `path` const and the column an enum
  of that file's header (`numeric`: only columns holding a number in the rows read). A file whose header cannot be
  read (binary, not UTF-8, no column, no numeric column) is left out, not given free strings: the tool could only
  fail on it, and free strings are what the model filled with invented names. No such file: the tool is left out
  of the grammar (it cannot be called successfully); the prompt still lists it.
- `Arg(max_chars=, min_chars=)`: a string's length; paths get PATH_CHARS, undeclared strings STRING_CHARS (measured
  in a 2-minute soak: `calculator` called with an empty expression).
- `Arg(minimum=, maximum=)`: a number's range.

The final answer (`{"final": ...}`) is grounded (`TaskContext.values`): every number in it is one of the numbers the
task's tool results held (patterns.grounded_pattern); issue 28: a port lookup read `"port": 8443` and answered
`18`, a sum task answered `860` without having computed anything.

A workspace bigger than MAX_PATHS entries gets free (short) path strings and free column strings: the grammar would
grow with it. Header reads are capped (HEADER_BYTES, MAX_COLUMNS, MAX_CSV_FILES) and cached by (path, mtime, size).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sinkchat.apps.agent.larkgen import reply_lark
from sinkchat.apps.agent.patterns import NONE_ANSWER, PATH, answering_pattern, grounded_pattern
from sinkchat.apps.agent.tools.schema import Param, Tool
from sinkchat.textutil import is_utf8

log = logging.getLogger(__name__)

STRING_CHARS = 600  # cap on a content string (write_file's text, a note): a small model in a string can loop
PATH_CHARS = 96  # a path the grammar cannot enumerate (a file to write, a big workspace)
COLUMN_CHARS = 48  # a column name the grammar cannot enumerate
FINAL_CHARS = 400
MAX_PATHS = 300  # a bigger workspace gets free-form paths (the grammar would grow with it)
MAX_CSV_FILES = 40  # files whose headers become column enums; past this, free column strings
MAX_COLUMNS = 64  # columns offered per file (the first ones)
HEADER_BYTES = 16 * 1024  # read of each CSV candidate: its header and enough rows to see which columns hold numbers
SEPARATORS = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


@dataclass(frozen=True)
class WorkspaceView:
    """What the grammar offers from one workspace listing: existing files and folders, and the CSV headers."""

    files: tuple[str, ...]
    dirs: tuple[str, ...]
    columns: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = field(default_factory=dict)  # all, numeric

    def paths(self, kind: str) -> list[str]:
        return list(self.files if kind == "file" else self.dirs if kind == "dir" else self.dirs + self.files)


@dataclass(frozen=True)
class TargetFile:
    """A file the task asks to be written (agent/goals.py) and what may be written to it."""

    path: str
    content: str | None = ""  # the text's JSON schema, as JSON ("": the tool's own; None: nothing to offer yet)
    append: bool = False  # the task asks to add to its end: offered through an `appends` argument


@dataclass(frozen=True)
class TaskContext:
    """What the grammar takes from the task at hand: `targets`, the files it asks to be written (then a call of a
    tool with a `path="new"` argument writes one of them, with the asked-for content, and replaces an existing one
    only through its `overwrites` argument); `values`, the numbers its tool results held so far (a final answer's
    numbers must be among them; None: not grounded, as before a task starts)."""

    targets: tuple[TargetFile, ...] = ()
    values: tuple[str, ...] | None = None
    answer_numbers: tuple[str, ...] | None = None  # the answer is a count: one of these (tool-returned) numbers

    def answer_pattern(self, other: str | None = None, first: str | None = None) -> str | None:
        """The final answer's regex body: grounded in `values`; for a count task (`answer_numbers`, verify.py) also
        holding one of the numbers the tools returned, or saying there are none ("none", "No errors"), where a
        tool returned one; None: not grounded."""
        if self.values is None:
            return None
        kw = {k: v for k, v in (("other", other), ("first", first)) if v is not None}
        body = grounded_pattern(self.values, **kw)
        held = answering_pattern(self.values, self.answer_numbers or (), **kw)
        return body if held is None else f"{held}|{NONE_ANSWER}"


_HEADERS: dict[tuple[str, int, int], tuple[tuple[str, ...], tuple[str, ...]] | None] = {}



def scan_workspace(root: Path | None, limit: int = MAX_PATHS) -> WorkspaceView | None:
    """The files and folders under `root` as the tools would resolve them, or None (no root, or past `limit`)."""
    if root is None:
        return None
    real_root = os.path.realpath(root)
    files: list[str] = []
    dirs = ["."]
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        # a name that is no UTF-8 cannot be put in a grammar (llguidance raises), nor written by the model: skipped
        dirnames[:] = sorted(d for d in dirnames if is_utf8(d))
        rel = os.path.relpath(dirpath, root)
        for name in dirnames + sorted(f for f in filenames if is_utf8(f)):
            path = name if rel == "." else f"{rel}/{name}"
            real = os.path.realpath(os.path.join(dirpath, name))
            if real != real_root and not real.startswith(real_root + os.sep):
                continue  # a link out of the workspace: the tools refuse it
            try:
                st = os.stat(real)
            except OSError:
                continue
            (files if stat.S_ISREG(st.st_mode) else dirs if stat.S_ISDIR(st.st_mode) else []).append(path)
            if len(files) + len(dirs) > limit:
                return None
    columns = {}
    for path in files:
        cols = _header(os.path.join(root, path))
        if cols is not None and (len(cols[0]) > 1 or cols[1]):  # one text column, no number: prose, not a table
            columns[path] = cols
            if len(columns) >= MAX_CSV_FILES:
                break
    return WorkspaceView(tuple(files), tuple(dirs), columns)


def _header(path: str) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(columns, numeric columns) of a CSV file as the column tools read it (csv.DictReader, names compared
    stripped), or None when it has no usable header. Cached by (path, mtime, size)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (path, st.st_mtime_ns, st.st_size)
    if key not in _HEADERS:
        if len(_HEADERS) > 4096:
            _HEADERS.clear()
        _HEADERS[key] = _read_header(path)
    return _HEADERS[key]


def _read_header(path: str) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    try:
        with open(path, "rb") as f:
            data = f.read(HEADER_BYTES)
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if "\x00" in text or not text.strip():
        return None
    if len(data) == HEADER_BYTES and "\n" in text:
        text = text[:text.rindex("\n")]  # no half row
    try:
        rows = list(csv.reader(io.StringIO(text)))
    except csv.Error:
        return None
    if not rows:
        return None
    names: list[str] = []
    for h in rows[0]:
        h = h.strip()
        if h and h not in names and len(h) <= COLUMN_CHARS and '"' not in h and "\\" not in h:
            names.append(h)
    names = names[:MAX_COLUMNS]
    index = {h.strip(): i for i, h in enumerate(rows[0])}
    numeric = tuple(n for n in names if any(_is_number(r[index[n]]) for r in rows[1:] if len(r) > index[n]))
    return (tuple(names), numeric) if names else None


def _is_number(s: str) -> bool:
    try:
        float(s.strip())
        return True
    except ValueError:
        return False


def value_schema(p: Param, view: WorkspaceView | None, string_chars: int = STRING_CHARS) -> dict[str, Any] | None:
    """One argument's schema (no description: it constrains nothing and grows the grammar), or None when no value
    can be offered (a file argument in a workspace with no file)."""
    s = {k: v for k, v in p.json_schema().items() if k != "description"}
    a = p.arg
    if s.get("type") != "string" or "enum" in s:
        return s
    if a.path in ("file", "dir", "any") and view is not None:
        paths = view.paths(a.path)
        return {"enum": paths} if paths else None
    cap = min(a.max_chars or (PATH_CHARS if a.path else COLUMN_CHARS if a.column_of else string_chars), string_chars)
    if a.path == "new":  # x-exclude: larkgen keeps these out (a JSON schema cannot say "not one of")
        return {"type": "string", "pattern": f"^{PATH}$", "maxLength": cap,
                "x-exclude": list(view.files + view.dirs) if view is not None else []}
    if a.pattern:
        return {"type": "string", "pattern": a.pattern}
    s["maxLength"] = cap
    if a.min_chars:
        s["minLength"] = min(a.min_chars, cap)
    return s


def args_schemas(t: Tool, view: WorkspaceView | None = None, string_chars: int = STRING_CHARS,
                 ctx: TaskContext | None = None) -> list[dict[str, Any]]:
    """The schemas of one tool's arguments, strict (known keys only, required ones present): one, or one per CSV
    file when an argument is a column of another; none when a required argument has no possible value. A tool that
    writes (a `path="new"` argument) in a task that names its files to write: one per target (`_targets`)."""
    props: dict[str, Any] = {}
    required = [p.name for p in t.params if p.required]
    for p in t.params:
        if p.arg.overwrites:
            continue  # only in the alternatives below
        s = value_schema(p, view, string_chars)
        if s is None:
            if p.required:
                return []
            required = [r for r in required if r != p.name]
            continue
        props[p.name] = s
    base = {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    new_path = next((p.name for p in t.params if p.arg.path == "new" and p.name in props), None)
    if new_path is not None and ctx is not None and ctx.targets:
        return _targets(t, base, new_path, view, ctx.targets)
    col = next((p for p in t.params if p.arg.column_of and p.name in props), None)
    if col is None or view is None:
        return [base]
    src = col.arg.column_of
    out = []
    for path, (names, numeric) in view.columns.items():
        cols = numeric if col.arg.numeric else names
        if cols and (src not in props or "enum" not in props[src] or path in props[src]["enum"]):
            out.append({**base, "properties": {**props, src: {"const": path}, col.name: {"enum": list(cols)}},
                        "required": sorted(set(required) | {src}, key=list(props).index)})
    return out


def _targets(t: Tool, base: dict[str, Any], path: str, view: WorkspaceView | None,
             targets: tuple[TargetFile, ...]) -> list[dict[str, Any]]:
    """A write in a task that names its files: the path is one of them and the content what the task asks for (the
    constraint the check in goals.py applies afterwards); a file that exists is replaced only with an `overwrites`
    argument true (an `appends` one for a task that adds to it). ("a new file F" that exists when the task
    begins is no target at all: agent/verify.py blocks it.)"""
    content = next((p.name for p in t.params if p.arg.content_of == path), None)
    out = []
    for tf in targets:
        if tf.content is None or (view is not None and tf.path in view.dirs):
            continue
        props = {**base["properties"], path: {"const": tf.path}}
        if content and tf.content:
            props[content] = json.loads(tf.content)
        exists = None if view is None else tf.path in view.files  # None: a listing too big to read
        if not exists:
            out.append({**base, "properties": props})
        if exists is False:
            continue
        out += [{**base, "properties": {**props, p.name: {"const": True}}, "required": [*base["required"], p.name]}
                for p in t.params if p.arg.overwrites == path and p.arg.appends == tf.append]
    return out


def final_schema(ctx: TaskContext | None = None) -> dict[str, Any]:
    """The final answer's string: grounded in the task's tool results when `ctx.values` is set."""
    s: dict[str, Any] = {"type": "string", "minLength": 1, "maxLength": FINAL_CHARS}
    body = ctx.answer_pattern() if ctx is not None else None
    if body is not None:
        s["pattern"] = f"^(?:{body})$"
    return s


def json_protocol_schema(tools: list[Tool], string_chars: int = STRING_CHARS, final: bool = True,
                         view: WorkspaceView | None = None, ctx: TaskContext | None = None) -> dict[str, Any]:
    """One reply of the JSON protocol (prompts/agent.txt): a call of a known tool, or (`final`) the final answer.
    As a JSON schema (what the closing reserve is sized from); `json_protocol_lark` is what the matcher runs."""
    calls = [{"type": "object", "properties": {"tool": {"const": t.name}, "args": a},
              "required": ["tool", "args"], "additionalProperties": False}
             for t in tools for a in args_schemas(t, view, string_chars, ctx)]
    answer = {"type": "object", "properties": {"final": final_schema(ctx)},
              "required": ["final"], "additionalProperties": False}
    return {"anyOf": [*calls, answer] if final else calls, "x-guidance": SEPARATORS}


def json_protocol_lark(schema: dict[str, Any]) -> str:
    """The grammar of a `json_protocol_schema` reply (see larkgen.py for why Lark)."""
    return reply_lark(schema["anyOf"])


def native_protocol_lark(tools: list[Tool], string_chars: int = STRING_CHARS, view: WorkspaceView | None = None,
                         ctx: TaskContext | None = None) -> str:
    """One reply of a template with tool support (Hermes/Qwen style): `<tool_call>{json}</tool_call>` or plain
    text that does not start like a call (grounded like a JSON-protocol final answer)."""
    calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": a},
              "required": ["name", "arguments"], "additionalProperties": False}
             for t in tools for a in args_schemas(t, view, string_chars, ctx)]
    text = "/[^<{\\s][^<]{0,%d}/" % (FINAL_CHARS * 2)
    grounded = ctx.answer_pattern(other="[^<0-9]", first="[^<{\\s0-9]") if ctx is not None else None
    if grounded is not None:
        text = f"/{grounded}/ & {text}"
    return reply_lark(calls, ("<tool_call>\n", "\n</tool_call>"), text)


def shortest_calls(schema: dict[str, Any]) -> list[str]:
    """For each alternative of a JSON-protocol reply schema, the text of its shortest complete reply with every
    enum at its longest value: what is left to write at most, once a call has started, if every free string is
    closed at once. The constraint sizes its closing reserve from the longest of these (in tokens)."""
    return [json.dumps(_minimal(alt), separators=(", ", ": "), ensure_ascii=False) for alt in schema["anyOf"]]


def _minimal(s: dict[str, Any]) -> Any:
    if "const" in s:
        return s["const"]
    if "enum" in s:
        return max(s["enum"], key=lambda v: len(json.dumps(v, ensure_ascii=False)))
    t = s.get("type")
    if t == "object":
        return {k: _minimal(v) for k, v in s.get("properties", {}).items() if k in s.get("required", [])}
    if t == "string":
        return "x" * int(s.get("minLength", 0) or (1 if "pattern" in s else 0))
    if t in ("integer", "number"):
        return s.get("minimum", 0) if isinstance(s.get("minimum"), (int, float)) else 0
    return {"boolean": False, "array": []}.get(str(t), None)
