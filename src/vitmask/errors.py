"""User-facing errors and warnings, and the stop of a process by a signal.

A `UserError` is a problem with what the user asked for (a path, a config value, a checkpoint),
not a bug. The CLI prints its message as one line on stderr and exits with code 2; everything
else is left to raise normally so that real bugs keep their tracebacks. `warn` prints one line
that does not stop anything; `note` one line that says what was decided for the user (a value
taken from a pack's header over the config's, say).

`Stopped` is raised by the CLI's SIGINT/SIGTERM handler outside the training loop (start-up, data
loading, evaluation), and by `signals.check_stop`, the per-batch stop point of every long loop,
once a signal has been recorded inside the training loop (the trainer turns it into a checkpoint
and `signals.Interrupted`). It is a `BaseException`, like `KeyboardInterrupt`, so no `except
Exception` swallows it, while every `finally` (lock release, clean-up of a half-made run dir)
still runs.
"""

import os
import sys


def warn(msg: str) -> None:
    """One line on stderr that does not stop the run (from rank 0 only, under torchrun)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"vitmask: warning: {msg}", file=sys.stderr)


def note(msg: str) -> None:
    """One line on stderr saying what was decided for the user (from rank 0 only, under torchrun)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"vitmask: note: {msg}", file=sys.stderr)


class UserError(Exception):
    """Bad input. The message names the problem and, where there is one, the fix."""


class Stopped(BaseException):
    """The process got SIGINT or SIGTERM and the work under way is abandoned; `code` is 128 + the
    signal number."""

    def __init__(self, signum: int):
        import signal

        self.signum = signum
        self.code = 128 + signum
        self.name = signal.Signals(signum).name
        super().__init__(f"stopped by {self.name}")
