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
    """Training stopped by a signal after a checkpoint was written; `code` is the exit status. It
    keeps what its message says (`interrupted`), so a verb can name itself in the resume command."""

    def __init__(
        self,
        message: str,
        code: int,
        signum: int | None = None,
        step: int | None = None,
        run_dir: Path | None = None,
        checkpoint: Path | None = None,
    ):
        super().__init__(message)
        self.code = code
        self.signum, self.step, self.run_dir, self.checkpoint = signum, step, run_dir, checkpoint

    def resumed_with(self, verb: str) -> "Interrupted":
        """The same stop, its resume command naming `vitmask VERB` (a fine-tuning resumes with finetune)."""
        if self.signum is None:
            return self
        return interrupted(self.signum, self.step, self.run_dir, self.checkpoint, verb)


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


def resume_command(verb: str, run_dir: Path) -> str:
    """The command that continues the run in `run_dir` of `vitmask VERB` (train or finetune): its
    checkpoint holds the config, so the run dir alone is enough."""
    return f"vitmask {verb} --run-dir {run_dir} --resume auto"


def interrupted(
    signum: int, step: int, run_dir: Path | None, checkpoint: Path | None, verb: str = "train"
) -> Interrupted:
    """The error a run of `vitmask VERB` stopped by `signum` at `step` ends with: where its checkpoint
    is, how to resume."""
    name = signal.Signals(signum).name
    if run_dir is None:
        return Interrupted(f"stopped by {name} at step {step}; no run dir, so nothing was saved", 128 + signum)
    return Interrupted(
        f"stopped by {name} at step {step}; checkpoint written to {checkpoint}; "
        f"resume with: {resume_command(verb, run_dir)}",
        128 + signum,
        signum,
        step,
        run_dir,
        checkpoint,
    )


def early_stop(signum, frame):
    """The handler from process start until the CLI installs its own (cli/entry.py): one line, exit 128 + signum."""
    name = signal.Signals(signum).name
    try:
        sys.stderr.write(f"vitmask: stopped by {name} during start-up; nothing was written\n")
        sys.stderr.flush()
    finally:
        os._exit(128 + signum)
