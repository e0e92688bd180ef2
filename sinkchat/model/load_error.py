"""`LoadError`: a user-facing loading failure (one line, no traceback); `loader.LoadError` is this class."""

from sinkchat.errors import UserError


class LoadError(UserError, RuntimeError):
    """A user-facing loading failure (one line, no traceback)."""
