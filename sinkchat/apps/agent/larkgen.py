"""The tool-call grammar as llguidance Lark, written from the reply's JSON schema (grammar.py builds that schema).

Why not hand llguidance the JSON schema, as before: a file to write must be none of the workspace's files, and a
JSON-schema `pattern` has no complement, so the only way there was a regex spelling out the complement of the
listing (patterns.new_path_pattern): 37 KB and 36 ms to compile for 15 files, 384 KB and 470 ms for 200, paid on
every recompile (once a step now, as the grounded numbers change). Lark terminals take `A & ~B`: the same
constraint for 300 files compiles in ~5 ms. Measured mask cost per token is the same as the JSON schema's.

Every value is a terminal (a regex or a literal), never a nested `%json`: llguidance cannot start a nested grammar
where a sibling alternative starts with a lexeme (a write to a new path next to an overwrite of a named one), it
rejected every reply. The schema subset is what grammar.py emits: objects with fixed properties in order (required
and optional; separators ", " and ": ", no free whitespace, as the JSON compiler was told), const, enum, anyOf,
strings (minLength, maxLength, pattern, `x-exclude`: values it must not be), integers and numbers (`minimum` >= 0
keeps the sign off; other bounds are left to the tool, which checks them), booleans, free arrays and objects.
A string's `pattern` is applied to its JSON text between the quotes, so a pattern should not need a quote,
backslash or control character (the tools' and the grammar's own patterns never do).
"""

from __future__ import annotations

import json
from typing import Any

CHAR = r'(?:[^"\\\x00-\x1f\x7f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))'  # one character of a JSON string
INT = r"(?:0|[1-9][0-9]{0,17})"
META = set('\\.+*?()|[]{}^$#&-~/"')
FREE_JSON = r"""
jv: jobj | jarr | JSTR | JNUM | "true" | "false" | "null"
jobj: "{" (JSTR ": " jv (", " JSTR ": " jv)*)? "}"
jarr: "[" (jv (", " jv)*)? "]"
JSTR: /"(?:[^"\\\x00-\x1f\x7f]|\\(?:["\\\/bfnrt]|u[0-9a-fA-F]{4})){0,600}"/
JNUM: /-?(?:0|[1-9][0-9]{0,17})(?:\.[0-9]{1,17})?(?:[eE][+-]?[0-9]{1,3})?/
"""


def _escape(text: str) -> str:
    """`text` as a regex matching it literally (only the metacharacters escaped)."""
    return "".join("\\" + c if c in META else c for c in text)


def _lit(text: str) -> str:
    """A Lark literal matching exactly `text`."""
    return json.dumps(text, ensure_ascii=False)


def _rx(regex: str) -> str:
    """`regex` as a Lark /.../ literal: unescaped slashes escaped, anchors at its ends dropped."""
    if regex.startswith("^"):
        regex = regex[1:]
    if regex.endswith("$") and not regex.endswith("\\$"):
        regex = regex[:-1]
    out, i = [], 0
    while i < len(regex):
        ch = regex[i]
        if ch == "\\" and i + 1 < len(regex):
            out.append(regex[i:i + 2])
            i += 2
            continue
        out.append("\\/" if ch == "/" else ch)
        i += 1
    return "/" + "".join(out) + "/"


class LarkWriter:
    """Collects rules and terminals (terminals deduplicated by their definition) for one grammar."""

    def __init__(self) -> None:
        self.terminals: dict[str, str] = {}  # definition -> name
        self.free_json = False

    def terminal(self, definition: str) -> str:
        if definition not in self.terminals:
            self.terminals[definition] = f"T{len(self.terminals)}"
        return self.terminals[definition]

    def text(self, rules: list[str]) -> str:
        lines = rules + [f"{name}: {d}" for d, name in self.terminals.items()]
        return "\n".join(lines) + "\n" + (FREE_JSON if self.free_json else "")

    # -------------------------------------------------------------------------------------------- values
    def value(self, s: dict[str, Any]) -> str:
        """A Lark expression for one JSON value matching schema `s`."""
        if "const" in s:
            return _lit(json.dumps(s["const"], ensure_ascii=False))
        if "enum" in s:
            return "(" + " | ".join(_lit(json.dumps(v, ensure_ascii=False)) for v in s["enum"]) + ")"
        if "anyOf" in s:
            return "(" + " | ".join(self.value(a) for a in s["anyOf"]) + ")"
        t = s.get("type")
        if t == "object" and "properties" in s:
            return self.object(s)
        if t == "string":
            return self.string(s)
        if t in ("integer", "number"):
            sign = "" if isinstance(s.get("minimum"), (int, float)) and s["minimum"] >= 0 else "-?"
            frac = r"(?:\.[0-9]{1,17})?(?:[eE][+-]?[0-9]{1,3})?" if t == "number" else ""
            return self.terminal(_rx(sign + INT + frac))
        if t == "boolean":
            return '("true" | "false")'
        self.free_json = True
        return {"array": "jarr", "object": "jobj"}.get(str(t), "jv")

    def string(self, s: dict[str, Any]) -> str:
        lo, hi = int(s.get("minLength", 0)), s.get("maxLength")
        body = _rx(f'"{CHAR}{{{lo},{"" if hi is None else int(hi)}}}"')
        pattern = s.get("pattern")
        if pattern:
            inner = _rx(pattern)[1:-1]
            body = f'/"(?:{inner})"/ & {body}'
        exclude = [e for e in s.get("x-exclude", ()) if e]
        if exclude:  # the JSON text of none of these (each as json.dumps writes it)
            alts = "|".join(_escape(json.dumps(e, ensure_ascii=False)) for e in sorted(set(exclude)))
            body = f"{body} & ~{_rx(f'(?:{alts})')}"
        return self.terminal(body)

    def object(self, s: dict[str, Any]) -> str:
        props = list(s.get("properties", {}).items())
        required = set(s.get("required", ()))
        items = [(_lit(json.dumps(k, ensure_ascii=False) + ": "), self.value(v), k in required) for k, v in props]
        body = _members(items, first=True)
        return f'"{{" {body} "}}"' if body else '"{}"'


def _members(items: list[tuple[str, str, bool]], first: bool) -> str:
    """The members of an object, in order: required ones always, optional ones maybe; commas between."""
    if not items:
        return ""
    (key, value, required), rest = items[0], items[1:]
    this = ('' if first else '", " ') + f"{key} {value}"
    after = _members(rest, first=False)
    with_this = f"{this} {after}".strip()
    if required:
        return with_this
    without = _members(rest, first)
    if not without:
        return f"({with_this})?"
    return f"(({with_this}) | ({without}))" if not _all_optional(rest) else f"(({with_this}) | ({without})?)"


def _all_optional(items: list[tuple[str, str, bool]]) -> bool:
    return all(not req for _, _, req in items)


def reply_lark(alternatives: list[dict[str, Any]], wrap: tuple[str, str] = ("", ""), text: str | None = None) -> str:
    """The whole grammar: one of `alternatives` (object schemas), between the literal texts `wrap`; or (`text`, a
    Lark terminal definition) plain text instead of a call."""
    w = LarkWriter()
    names = []
    rules = []
    for i, alt in enumerate(alternatives):
        rules.append(f"a{i}: {w.value(alt)}")
        names.append(f"a{i}")
    pre, post = (_lit(x) if x else "" for x in wrap)
    call = f"{pre} ({' | '.join(names)}) {post}".strip()
    head = ["start: call | TEXT", f"call: {call}", f"TEXT: {text}"] if text else [f"start: {call}"]
    return w.text(head + rules)
