"""A chat transcript as a JSON file (`/save FILE.json`, `--load FILE.json`): system prompt, messages and settings.

Unlike a snapshot it holds no KV cache, so it survives a model change and is replayed (re-encoded) into a fresh
cache. Kept here, apart from the chat commands, because it is storage: building, writing and checking the file needs
no engine or UI. Written atomically, so a crash never leaves half a transcript.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sinkchat.config import CacheConfig, ConfigError, SamplingConfig

TRANSCRIPT_FORMAT = "sinkchat-transcript"


@dataclass(frozen=True)
class TranscriptFile:
    """A checked transcript: the messages to replay, and the settings it was saved with (only reported)."""

    system: str | None
    messages: list[dict[str, str]]
    cache: dict[str, Any]
    sampling: SamplingConfig


def transcript_data(engine: Any) -> dict[str, Any]:
    """What `/save FILE.json` writes for this engine's conversation."""
    return {"format": TRANSCRIPT_FORMAT, "version": 1, "system": engine.conv.system,
            "messages": [dict(m) for m in engine.conv.messages],
            "settings": {"cache": asdict(engine.cache_cfg), "sampling": asdict(engine.sampling)}}


def parse_transcript(data: Any, max_positions: int) -> TranscriptFile:
    """Check a decoded transcript; ConfigError (one line) for anything that is not one of ours."""
    if not isinstance(data, dict) or data.get("format") != TRANSCRIPT_FORMAT:
        raise ConfigError("not a sinkchat transcript (missing \"format\": \"sinkchat-transcript\")")
    msgs = data.get("messages")
    if not isinstance(msgs, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in msgs):
        raise ConfigError("transcript messages must be a list of {role, content} strings")
    system = data.get("system")
    if system is not None and not isinstance(system, str):
        raise ConfigError("transcript system prompt must be a string or null")
    settings = data.get("settings") or {}
    try:
        cache = {k: v for k, v in (settings.get("cache") or {}).items() if k in ("policy", "n_sink", "capacity")}
        CacheConfig(**cache).resolved(max_positions)
        sampling = SamplingConfig(**(settings.get("sampling") or {}))
    except (TypeError, AttributeError) as e:  # a list where an object belongs, an unknown key
        raise ConfigError(f"bad transcript settings: {e}") from None
    return TranscriptFile(system, [{"role": m["role"], "content": m["content"]} for m in msgs], cache, sampling)


def is_transcript_file(arg: str) -> bool:
    """A JSON transcript (vs. a snapshot name or .safetensors file): by its suffix, else by its first byte."""
    p = Path(arg).expanduser()
    if p.suffix.lower() == ".json":
        return True
    try:
        with open(p, "rb") as f:
            return f.read(1) in (b"{", b"[")
    except OSError:
        return False
