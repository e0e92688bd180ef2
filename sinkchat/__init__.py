"""sinkchat: a terminal chat, log summarizer and agent REPL on one 4-bit model and one attention-sink KV cache.

`sinkchat.load(...)` (the Python API, `sinkchat.api`) is imported on first use: `import sinkchat` stays light (no
torch, no click), which the CLI's `--help` and the layout test rely on."""

from typing import Any

__version__ = "0.1.0"
__all__ = ["load", "Session", "__version__"]


def __getattr__(name: str) -> Any:
    """`sinkchat.load` / `sinkchat.Session`, imported lazily from `sinkchat.api` (PEP 562)."""
    if name in ("load", "Session"):
        from sinkchat import api  # the one upward import, lazy: tests/test_layout.py names it as the exception

        return getattr(api, name)
    raise AttributeError(f"module 'sinkchat' has no attribute {name!r}")
