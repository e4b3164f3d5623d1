"""The process entry point (`vitmask`, `python -m vitmask`): signals from the first moment, then the CLI.

Importing the CLI imports torch, which takes seconds. A SIGINT or SIGTERM in that window would
otherwise end in a long KeyboardInterrupt traceback (or, for SIGTERM, no word at all). Until the
CLI installs its own handlers, a signal prints one line and exits 130 (SIGINT) or 143 (SIGTERM):
nothing has been read or written yet, so there is nothing to clean up. Once the command is over,
a signal during the interpreter's shut-down ends the process with the command's own exit code.
"""

import os
import signal
import sys


def _early_stop(signum, frame):
    name = signal.Signals(signum).name
    try:
        sys.stderr.write(f"vitmask: stopped by {name} during start-up; nothing was written\n")
        sys.stderr.flush()
    finally:
        os._exit(128 + signum)


def main() -> None:
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _early_stop)
    from vitmask.cli import main as cli_main

    try:
        cli_main()
    except SystemExit as e:  # the command is over: a signal now only ends the process, with its code
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, lambda signum, frame, code=code: _exit_quietly(code))
        raise


def _exit_quietly(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)
