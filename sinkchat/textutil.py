"""Text helpers shared by the Engine and the session log (pure Python, no torch)."""

from __future__ import annotations


def is_utf8(text: str) -> bool:
    """Whether `text` encodes as UTF-8: it holds no lone surrogate (an undecodable byte read with surrogateescape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def utf8_safe(text: str) -> str:
    """`text` with lone surrogates (undecodable input bytes read with surrogateescape) replaced by U+FFFD, so
    tokenizers and SQLite, which take only valid UTF-8, never raise on it."""
    if is_utf8(text):
        return text
    return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def count(n: int) -> str:
    """A figure with thousands separators: 52,123."""
    return f"{n:,}"


def plural(n: int, word: str, many: str | None = None) -> str:
    """`1 block`, `2 blocks`, `0 replies` (`many`: the plural when it is not `word` + s), figure separated."""
    return f"{count(n)} {word if n == 1 else many or word + 's'}"
