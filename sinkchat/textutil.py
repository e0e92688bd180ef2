"""Text helpers shared by the Engine and the session log (pure Python, no torch)."""

from __future__ import annotations


def utf8_safe(text: str) -> str:
    """`text` with lone surrogates (undecodable input bytes read with surrogateescape) replaced by U+FFFD, so
    tokenizers and SQLite, which take only valid UTF-8, never raise on it."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
