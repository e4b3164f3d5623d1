"""Stopping a run by signal: SIGINT (Ctrl-C) and SIGTERM finish the current step instead of killing it.

While `StopSignals` is active, either signal only records itself; the training loop checks
`received` after every step, writes a checkpoint and raises `Interrupted`, which the CLI turns into
one line on stderr and exit code 128 + the signal's number (130 for SIGINT, 143 for SIGTERM).
"""

import os
import signal
import sys
import threading
from pathlib import Path

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """Training stopped by a signal after a checkpoint was written; `code` is the exit status."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class StopSignals:
    """A context manager: inside it, SIGINT and SIGTERM set `received` (the signal's number) and
    nothing else. Outside the main thread, where Python cannot install handlers, it does nothing."""

    def __init__(self):
        self.received: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._record) for s in STOP_SIGNALS}
        return self

    def _record(self, signum, frame) -> None:
        self.received = signum

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


def interrupted(signum: int, step: int, run_dir: Path | None, checkpoint: Path | None) -> Interrupted:
    """The error a run stopped by `signum` at `step` ends with: where its checkpoint is, how to resume."""
    name = signal.Signals(signum).name
    if run_dir is None:
        return Interrupted(f"stopped by {name} at step {step}; no run dir, so nothing was saved", 128 + signum)
    return Interrupted(
        f"stopped by {name} at step {step}; checkpoint written to {checkpoint}; "
        f"resume with: vitmask train --run-dir {run_dir} --resume auto",
        128 + signum,
    )


def early_stop(signum, frame):
    """The handler from process start until the CLI installs its own (cli/entry.py): one line, exit 128 + signum."""
    name = signal.Signals(signum).name
    try:
        sys.stderr.write(f"vitmask: stopped by {name} during start-up; nothing was written\n")
        sys.stderr.flush()
    finally:
        os._exit(128 + signum)
