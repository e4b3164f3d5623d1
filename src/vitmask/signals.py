"""Stopping a run by signal: SIGINT (Ctrl-C) and SIGTERM end any phase within about a second.

A stop lands in one of two ways.

- Inside the training loop (`StopSignals`, trainer.fit), either signal is only recorded. The loop
  looks at `received` after every step (between steps: the step itself is never cut, and gains no
  host sync), and every long loop of the trainer's other phases (validation, the online probe, the
  reconstruction grid, the fine-tuned classifier's validation) calls `check_stop()` once per batch,
  which raises `errors.Stopped` when a signal has been recorded. The trainer abandons the phase,
  writes a checkpoint at the current step and raises `Interrupted`, which the CLI turns into one
  line on stderr and exit code 128 + the signal's number (130 for SIGINT, 143 for SIGTERM).
- Everywhere else in the CLI (start-up, data loading, eval, probe, sample, the fine-tuning
  baselines' probes), the CLI's handler raises `Stopped` at once, between two torch operations
  (cli/commands.py). The same long loops call `check_stop()` there too; it finds nothing recorded
  (the handler has raised already), so it costs a global read per batch.

`check_stop` is the one stop point of every long loop: a library caller that runs them inside its
own `StopSignals` gets the same per-batch stops.
"""

import contextlib
import os
import signal
import sys
import threading
from pathlib import Path

from vitmask.errors import Stopped

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOP_CODES = tuple(128 + s for s in STOP_SIGNALS)  # 130, 143: the exit codes of a stopped command

_recorded: int | None = None  # the signal a `StopSignals` recorded and no one has acted on yet


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
        cut: tuple[str, ...] = (),
    ):
        super().__init__(message)
        self.code = code
        self.signum, self.step, self.run_dir, self.checkpoint = signum, step, run_dir, checkpoint
        self.cut = cut  # the evaluations the stop left undone

    def resumed_with(self, verb: str) -> "Interrupted":
        """The same stop, its resume command naming `vitmask VERB` (a fine-tuning resumes with finetune)."""
        if self.signum is None:
            return self
        return interrupted(self.signum, self.step, self.run_dir, self.checkpoint, self.cut, verb)


class StopSignals:
    """A context manager: inside it, SIGINT and SIGTERM set `received` (the signal's number) and
    nothing else; `check_stop()` raises `Stopped` from then on. Outside the main thread, where
    Python cannot install handlers, it does nothing. Entering and leaving it forgets any earlier
    signal, so one stop never leaks into the next run of the same process."""

    def __init__(self):
        self.received: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopSignals":
        global _recorded
        _recorded = None
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._record) for s in STOP_SIGNALS}
        return self

    def _record(self, signum, frame) -> None:
        global _recorded
        self.received = _recorded = signum

    def __exit__(self, *exc) -> None:
        global _recorded
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
        _recorded = None


def resume_command(verb: str, run_dir: Path) -> str:
    """The command that continues the run in `run_dir` of `vitmask VERB` (train or finetune): its
    checkpoint holds the config, so the run dir alone is enough."""
    return f"vitmask {verb} --run-dir {run_dir} --resume auto"


def stop_requested() -> int | None:
    """The signal recorded inside a `StopSignals` and not yet acted on, or None: a global read."""
    return _recorded


def check_stop() -> None:
    """The stop point of a long loop, called once per batch: raise `errors.Stopped` when a stop
    signal has been recorded (see the module docstring), else return at once."""
    if _recorded is not None:
        raise Stopped(_recorded)


def interrupted(
    signum: int,
    step: int,
    run_dir: Path | None,
    checkpoint: Path | None,
    cut: tuple[str, ...] = (),
    verb: str = "train",
) -> Interrupted:
    """The error a run of `vitmask VERB` stopped by `signum` at `step` ends with: where its checkpoint
    is, how to resume, and which of the step's evaluations (`cut`: "validation", "probe") the stop
    left undone."""
    name = signal.Signals(signum).name
    left = f" with its {' and '.join(cut)} left to do" if cut else ""
    if run_dir is None:
        return Interrupted(f"stopped by {name} at step {step}{left}; no run dir, so nothing was saved", 128 + signum)
    redo = " (the resume does that first)" if cut else ""
    return Interrupted(
        f"stopped by {name} at step {step}{left}; checkpoint written to {checkpoint}; "
        f"resume with: {resume_command(verb, run_dir)}{redo}",
        128 + signum,
        signum,
        step,
        run_dir,
        checkpoint,
        cut,
    )


def end_stopped_process(code: int) -> None:
    """End the process at once after a stop, once the command has cleaned up (every `finally` has
    run, the lock is released, the last line is printed): flush stdout and stderr, then `os._exit`.

    Python's own exit would first tear down every module torch loaded and join its threads: 0.7 s
    for a tiny model on a busy 2-core machine (the line printed, then the wait), more under heavier
    load, all of it inside the grace period a cluster gives between SIGTERM and SIGKILL and none of
    it needed by a command that has stopped."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)


def early_stop(signum, frame):
    """The handler from process start until the CLI installs its own (cli/entry.py): one line, exit 128 + signum."""
    name = signal.Signals(signum).name
    try:
        sys.stderr.write(f"vitmask: stopped by {name} during start-up; nothing was written\n")
        sys.stderr.flush()
    finally:
        os._exit(128 + signum)


@contextlib.contextmanager
def signals_held():
    """Hold SIGINT and SIGTERM back (in the main thread, where Python runs their handlers) until the
    block ends: renames and removals that must not be cut in two. A held signal arrives right after."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
