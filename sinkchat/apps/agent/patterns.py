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


def grounded_pattern(values: Iterable[str], other: str = rf'[^0-9"\\{_CTRL}]', first: str | None = None) -> str:
    """Text of at least one character in which every number is one of `values` (whole). `other`: the class of
    every other character; `first`: the class of a first character that is not a digit (default `other`)."""
    given = list(dict.fromkeys(v for v in values if v and len(v) <= VALUE_CHARS and NUMBER.fullmatch(v)))
    vals = sorted(given[:MAX_VALUES], key=lambda v: (-len(v), v))
    first = first or other
    if not vals:
        return f"{first}{other}*"
    num = "(?:" + "|".join(re.escape(v) for v in vals) + ")"
    # a number is always followed by a non-digit, except at the very end
    return f"(?:{first}|{num}{other})(?:{other}|{num}{other})*{num}?|{num}"


def answering_pattern(values: Iterable[str], other: str = rf'[^0-9"\\{_CTRL}]', first: str | None = None) -> str:
    """Like `grounded_pattern`, but holding at least one of `values`: the answer to a task that asks for a count
    or a total (verify.ASKS_NUMBER) cannot be a bare "done" under the grammar. `values` must not be empty."""
    given = list(dict.fromkeys(v for v in values if v and len(v) <= VALUE_CHARS and NUMBER.fullmatch(v)))
    vals = sorted(given[:MAX_VALUES], key=lambda v: (-len(v), v))
    if not vals:
        raise ValueError("answering_pattern needs a value to offer")
    first = first or other
    num = "(?:" + "|".join(re.escape(v) for v in vals) + ")"
    head = f"(?:{first}(?:{other}|{num}{other})*)?"  # text before the first number held (each number whole)
    return f"{head}{num}(?:{other}(?:{other}|{num}{other})*{num}?)?"
