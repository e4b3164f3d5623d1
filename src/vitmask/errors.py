"""User-facing errors.

A `UserError` is a problem with what the user asked for (a path, a config value, a checkpoint),
not a bug. The CLI prints its message as one line on stderr and exits with code 2; everything
else is left to raise normally so that real bugs keep their tracebacks.
"""


class UserError(Exception):
    """Bad input. The message names the problem and, where there is one, the fix."""
