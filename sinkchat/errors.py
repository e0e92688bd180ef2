"""The one base class for user-facing errors: a user mistake or an unusable input (a bad flag, a missing file, a
model sinkchat cannot run, a full context). The bootstrap maps every `UserError` to a one-line message and its
`exit_code`, with no traceback; anything else is a bug and keeps its traceback. A pure leaf: imports nothing."""

from __future__ import annotations


class UserError(Exception):
    """Shown to the user as one line (`str(error)`), exit status `exit_code`."""

    exit_code = 1


class UsageError(UserError):
    """A bad setting or flag value: exit 2, like click's own usage errors."""

    exit_code = 2
