"""What a task asks to be written, read from its text, and whether the workspace holds it: a task that names a file
to write is not done until that file exists with the asked-for content.

Why: "Compute the total ... and write that number to total.txt" ended `task ended after 2 step(s) (final); answer:
860`, exit 0, and no file (issue 28); the benchmark's five read-compute-write tasks all ended the same way.

A target is a file name (with an extension) after "to", "into", "as" or "in", "file [named]", or "overwrite /
replace / update / fill [the contents of]", in a task with a write verb before it (write, save, put, store, copy,
record, create, add, append, output, export, dump, make, overwrite, replace, update, fill). A file that exists when
the task starts is a target only with explicit wording in its own clause (overwrite, replace, update, fill, append,
"add ... to F", "write ... into F"); otherwise it is read ("Write the number of lines in fruits.txt to count.txt",
"... comparing it to todo.txt"). An extension holds a letter ("rounded to 0.01"). The content asked for is one of:

- exact: quoted, or "the text/word/line X to F", "containing (exactly)[:] X", "that says[:] X", "with the text X";
  the file must hold it (whitespace runs compared as one space; an append target must end with it);
- number: "the number/count/total/sum/result/...": the file must hold a number, and its numbers must come from
  the task's tool results;
- copy: the verb is "copy": the file's text must be what a tool returned for the file the task copies from (the
  other file it names, if any), its first or last line when the task says so;
- derived ("write it to F"): the file must not be empty, and its numbers must come from the tool results.

"a new file F": the target must not be overwritten even if it exists (then it cannot be written: unverifiable).
A target outside the workspace can never be written: the task ends unverified, without asking the model again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# the extension holds a letter: "rounded to 0.01" or "Add 2 to 1.5" name no file
FILE = r"[\w][\w\-./]*\.(?=[A-Za-z0-9]{1,8}(?![A-Za-z0-9]))[A-Za-z0-9]*[A-Za-z][A-Za-z0-9]*"
WRITE_VERB = re.compile(r"\b(?:write|save|put|store|copy|record|create|add|append|output|export|dump|make|overwrite|"
                        r"replace|update|fill)\b", re.I)
TARGET = re.compile(
    rf"\b(?P<prep>to|into|as|in)\s+(?:(?:a|the|an)\s+)?(?P<new>new\s+)?(?:(?:text\s+)?file\s+)?(?:(?:named|called)\s+)?"
    rf"[\"'`]?(?P<path>\.{{0,2}}/?{FILE})|"
    rf"\bfile\s+(?:(?:named|called)\s+)?[\"'`]?(?P<path2>{FILE})|"
    rf"\b(?:overwrite|replace|update|fill)\s+(?:(?:the\s+)?(?:contents?|text)\s+(?:of|in)\s+)?(?:the\s+)?(?:file\s+)?"
    rf"[\"'`]?(?P<path3>{FILE})", re.I)
# wording that names an existing file as the one to write, in the clause that ends with its name
EXPLICIT = re.compile(r"\b(?:overwrite|replace|update|fill|append)\b", re.I)
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
NEW_BEFORE = re.compile(r"\bnew\s+(?:text\s+)?file\s+(?:(?:named|called)\s+)?[\"'`]?$", re.I)
NUMBER_WORDS = re.compile(r"\b(?:number|count|total|sum|result|maximum|minimum|max|min|largest|smallest|average|"
                          r"product|difference|amount)\b", re.I)
EXACT = [  # tried in order on the task text; {path} is the target's escaped name, group c the content
    r"[\"'](?P<c>[^\"']+)[\"']\s+(?:to|into|in)\s+(?:(?:a|the)\s+)?(?:new\s+)?(?:file\s+)?"
    r"(?:(?:named|called)\s+)?{path}",
    r"\bthe\s+(?:text|word|words|line|phrase|string|sentence)\s+(?P<c>.+?)\s+(?:to|into|in)\s+(?:(?:a|the)\s+)?"
    r"(?:new\s+)?(?:file\s+)?(?:(?:named|called)\s+)?{path}",
    r"{path}\b.*?\bcontaining(?:\s+exactly)?\s*:?\s*(?P<c>.+)$",
    r"{path}\b.*?\b(?:that|which)\s+(?:says|reads|contains)\s*:?\s*(?P<c>.+)$",
    r"{path}\b.*?\bwith\s+(?:the\s+)?(?:text|content|contents|words?|line)\s*:?\s*(?P<c>.+)$",
]


@dataclass(frozen=True)
class WriteGoal:
    path: str  # as the task names it, relative to the workspace
    kind: str  # "exact" | "number" | "copy" | "derived"
    content: str = ""  # for "exact"
    append: bool = False
    new: bool = False  # the task says "a new file": never overwrite it
    source: str = ""  # copy: the file copied from ("" = any tool result)
    which: str = ""  # copy: "first" or "last" line ("" = a line or the whole text)


def write_goals(task: str, exists: Callable[[str], bool] = lambda p: False) -> list[WriteGoal]:
    """The files `task` asks to be written, in order (`exists(path)`: whether the workspace has it now).

    A file that exists already is a target only when its own clause (the text since the previous file named after
    "to", "into", ...) says so explicitly (overwrite, replace, update, fill, append, "add ... to F", "write ...
    into F"): in "Write a summary of notes.txt to summary.txt, comparing it to todo.txt" todo.txt is a source, and
    a target may be overwritten (refuse_overwrite, the grammar), so a loose "to" must not expose a user's file."""
    verb = WRITE_VERB.search(task)
    if verb is None:
        return []
    found: list[tuple[str, bool, int, int]] = []  # path, new, start and end of its mention
    prev_end = verb.start()
    for m in TARGET.finditer(task, verb.start()):
        group = next(g for g in ("path", "path2", "path3") if m.group(g))
        path = m.group(group).rstrip(".")
        clause, prev_end = task[prev_end:m.end()], m.end()
        if any(path == f[0] for f in found):
            continue
        new = bool(m.group("new")) if group == "path" else bool(NEW_BEFORE.search(task[:m.start(group)]))
        if exists(path) and not new and not _explicit(clause, group, (m.group("prep") or "").lower()):
            continue  # "the lines in fruits.txt", "comparing it to todo.txt": a source
        found.append((path, new, m.start(), m.end()))
    goals = []
    for i, (path, new, start, end) in enumerate(found):
        before = task[found[i - 1][3] if i else 0:end]  # this target's own clause, up to its name
        after = task[start:found[i + 1][2] if i + 1 < len(found) else len(task)]
        goals.append(_goal(task, path, new, before, after))
    return goals


def _explicit(clause: str, group: str, prep: str) -> bool:
    """Whether `clause` (ending with a file's name) asks to change that existing file."""
    if group == "path3" or EXPLICIT.search(clause):
        return True
    return bool((prep == "to" and re.search(r"\badd\b", clause, re.I))
                or (prep == "into" and re.search(r"\bwrite\b", clause, re.I)))


def _goal(task: str, path: str, new: bool, before: str, after: str) -> WriteGoal:
    """The goal for `path`; its exact content is looked for only in its own clause (`before`: since the previous
    target, up to its name; `after`: from its name to the next target), so "the word yes to a.txt and the word no
    to b.txt" gives b.txt "no", not "yes to a.txt and the word no"."""
    esc = re.escape(path)
    append = re.search(rf"\b(?:append|add)\b[^.]*?\bto\s+(?:the\s+)?(?:file\s+)?{esc}", before, re.I)
    for i, pat in enumerate(EXACT):
        m = re.search(pat.format(path=esc), before if i < 2 else after, re.I)
        if m:
            text = m.group("c") if i == 0 else SENTENCE_END.split(m.group("c"), 1)[0]
            text = text.strip().rstrip(".").strip().strip("\"'`")
            if text:
                return WriteGoal(path, "exact", text, bool(append), new)
    clause = task[:task.find(path)]
    if re.search(r"\bcopy\b", clause, re.I):
        source = next((f.rstrip(".") for f in re.findall(FILE, clause) if f.rstrip(".") != path), "")
        which = re.search(r"\b(first|last)\s+line\b", clause, re.I)
        return WriteGoal(path, "copy", "", bool(append), new, source, which.group(1).lower() if which else "")
    kind = "number" if NUMBER_WORDS.search(clause[clause.rfind("write") if "write" in clause else 0:]) else "derived"
    return WriteGoal(path, kind, "", bool(append), new)


def check_goal(goal: WriteGoal, root: Path, grounded: Callable[[str], list[str]],
               pieces: Callable[[WriteGoal], list[str]]) -> str | None:
    """What is still missing for `goal` in the workspace at `root`, or None when it is met. `grounded(text)`: the
    numbers and names of `text` that no tool result of the task holds; `pieces(goal)`: the texts a copy may be
    (its source's, read by code, when the task names one in the workspace)."""
    p = root / goal.path
    try:
        body = p.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return f"{goal.path} does not exist yet; write it with write_file"
    except OSError as e:
        return f"{goal.path} cannot be read ({e.strerror})"
    text = " ".join(body.split())
    if goal.kind == "exact":
        want = " ".join(goal.content.split())
        ok = text.endswith(want) if goal.append else text == want
        return None if ok else f"{goal.path} holds {_short(text)}, but the task asks for {_short(want)}"
    if not text:
        return f"{goal.path} is empty"
    if goal.kind == "number" and not re.search(r"[0-9]", text):
        return f"{goal.path} holds {_short(text)}, which is no number"
    if goal.kind == "copy" and text not in {" ".join(p.split()) for p in pieces(goal)}:
        what = f"the {goal.which} line of " if goal.which else ""
        return f"{goal.path} holds {_short(text)}, which is not {what}{goal.source or 'what the tools read'}"
    bad = grounded(body)
    if bad:
        return f"{goal.path} holds {', '.join(bad[:3])}, which no tool result of this task contains"
    return None


def _short(text: str, n: int = 40) -> str:
    return repr(text if len(text) <= n else text[: n - 1] + "…")
