"""User-facing errors: one line that names the field, the value, why, and the fix; exit code 2.

Anything a user can cause (a bad job file, a typo in a flag, a missing dataset column) raises
`UserError`. The CLI prints its message and exits with code 2, without a traceback. Every other
exception is a bug in gpufleet, and a traceback is the right answer to a bug.
"""

from __future__ import annotations

EXIT_USER_ERROR = 2


class UserError(Exception):
    """An error the user can fix. `str(err)` is the whole message, ready to print."""

    def __init__(self, message: str, *, field: str | None = None, fix: str | None = None):
        self.field = field
        self.message = message
        self.fix = fix
        text = message if field is None or message.startswith(field) else f"{field}: {message}"
        if fix:  # "... it would fit. Fix: ...": the message ends its sentence before the fix
            end = "" if text.rstrip().endswith((".", "!", "?", ":")) else "."
            text = f"{text.rstrip()}{end} Fix: {fix}"
        super().__init__(text)
