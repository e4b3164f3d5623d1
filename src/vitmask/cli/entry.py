"""The process entry point (`vitmask`, `python -m vitmask`): signals from the first moment, then the CLI.

Importing the CLI imports torch, which takes seconds. A SIGINT or SIGTERM in that window would
otherwise end in a long KeyboardInterrupt traceback (or, for SIGTERM, no word at all). Until the
CLI installs its own handlers, a signal prints one line and exits 130 (SIGINT) or 143 (SIGTERM):
nothing has been read or written yet, so there is nothing to clean up. Once the command is over,
the CLI ignores both signals (`commands._signals_raise_stopped`), so one during the interpreter's
shut-down cannot turn a finished command into a silent death by signal. A command stopped by a
signal (exit 130 or 143) ends the process as soon as its line is printed and its clean-up done,
without the interpreter's tear-down of torch (`signals.end_stopped_process`).

Before torch is imported, OpenMP's waiting threads are set to spin briefly (runtime/openmp.py), so a
training beside another CPU-bound process keeps its share of the CPU.

Importing torch also needs a writable temporary directory (its compile caches find one at import).
On a full disk, or one where no file can be written, that import fails before any command runs:
one line on stderr and exit code 2, as for any other bad start.
"""

import signal
import sys

from vitmask.runtime.openmp import share_cpus_fairly
from vitmask.signals import STOP_CODES, early_stop, end_stopped_process


def main() -> None:
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, early_stop)
    share_cpus_fairly()  # before torch is imported: libgomp reads it once
    try:
        from vitmask.cli.commands import main as cli_main
    except OSError as e:  # torch's import found no usable temporary directory: a full disk, a read-only /tmp
        from vitmask.outputs import reason

        sys.stderr.write(
            f"vitmask: cannot start: {reason(e)} while importing torch (it needs a writable temporary "
            "directory); free disk space, or set TMPDIR to a writable folder with room, and run again\n"
        )
        sys.exit(2)
    try:
        cli_main()
    except SystemExit as e:
        if e.code in STOP_CODES:  # stopped by SIGINT / SIGTERM: its one line is out, its clean-up done
            end_stopped_process(e.code)
        raise
