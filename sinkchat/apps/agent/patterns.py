"""Regular expressions the tool-call grammar puts on strings (plain Rust-regex syntax, as llguidance reads them):

- `PATH`: a well-formed relative path to write: segments not starting with `.`, `~` or a space (so no `./`, `../`,
  hidden names or `~/`), no `//`, no trailing `/`, no quote, backslash or control character. The grammar
  (larkgen.py) intersects it with the complement of the workspace's listing, so a new path is never an existing one.
- `grounded_pattern(values)`: text in which every run of digits is one of `values`, whole (a number is never
  followed by another digit, so "18" cannot be spelled out of "1" and "8").
"""

from __future__ import annotations

import re
from typing import Iterable

_CTRL = r"\x00-\x1f"
FIRST = rf'[^\s/."\\~{_CTRL}]'  # a segment's first character
MIDDLE = rf'[^/"\\{_CTRL}]'  # any later character of a segment
TAIL = rf"{MIDDLE}*(?:/{FIRST}{MIDDLE}*)*"  # the rest of a path once inside a segment
PATH = rf"{FIRST}{TAIL}"
PATH_RE = re.compile(PATH)
NUMBER = re.compile(r"[0-9]+(?:\.[0-9]+)?")
MAX_VALUES = 200  # numbers offered to a final answer (the first ones given)
VALUE_CHARS = 32


_WITH_EXPONENT = re.compile(r"[0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")


def numbers_in(text: str) -> list[str]:
    """The numbers of `text` as written ("8443", "12.5"), in order; one in exponent form ("1.235e+04") is none of
    them: its mantissa "1.235" is not the value, and a small model copied just that."""
    return [m.group(0) for m in _WITH_EXPONENT.finditer(text) if NUMBER.fullmatch(m.group(0))]


def _offered(values: Iterable[str]) -> list[str]:
    """The numbers a pattern may spell: each once, at most VALUE_CHARS long, the first MAX_VALUES given, longest
    first (so an alternation matches "8443" whole, not its "84")."""
    given = list(dict.fromkeys(v for v in values if v and len(v) <= VALUE_CHARS and NUMBER.fullmatch(v)))
    return sorted(given[:MAX_VALUES], key=lambda v: (-len(v), v))


def grounded_pattern(values: Iterable[str], other: str = rf'[^0-9"\\{_CTRL}]', first: str | None = None) -> str:
    """Text of at least one character in which every number is one of `values` (whole). `other`: the class of
    every other character; `first`: the class of a first character that is not a digit (default `other`)."""
    vals = _offered(values)
    first = first or other
    if not vals:
        return f"{first}{other}*"
    num = "(?:" + "|".join(re.escape(v) for v in vals) + ")"
    # a number is always followed by a non-digit, except at the very end
    return f"(?:{first}|{num}{other})(?:{other}|{num}{other})*{num}?|{num}"


def answering_pattern(values: Iterable[str], required: Iterable[str], other: str = rf'[^0-9"\\{_CTRL}]',
                      first: str | None = None) -> str | None:
    """Like `grounded_pattern` (every number one of `values`), holding at least one of `required` (the numbers a
    count task's tools returned: verify.asks_count), so its answer cannot be a bare "done"; None where `required`
    offers none (over VALUE_CHARS, not a number: the plain grounded pattern applies)."""
    need, vals = _offered(required), _offered([*values, *required])
    if not need:
        return None
    first = first or other
    num = "(?:" + "|".join(re.escape(v) for v in vals) + ")"
    must = "(?:" + "|".join(re.escape(v) for v in need) + ")"
    head = f"(?:{first}(?:{other}|{num}{other})*)?"  # text before the number held (each number whole)
    return f"{head}{must}(?:{other}(?:{other}|{num}{other})*{num}?)?"


# a count of none, digit-free: "none", "No errors", "There are no matching lines", "zero"
NONE_ANSWER = rf"(?:[Tt]here (?:are|is|were|was) )?(?:[Nn]o|NO|[Nn]one|[Zz]ero|[Nn]othing)(?:[ ,.;:!][^0-9\"\\<{_CTRL}]*)?"
