"""The process entry point (`vitmask`, `python -m vitmask`): signals from the first moment, then the CLI.

Importing the CLI imports torch, which takes seconds. A SIGINT or SIGTERM in that window would
otherwise end in a long KeyboardInterrupt traceback (or, for SIGTERM, no word at all). Until the
CLI installs its own handlers, a signal prints one line and exits 130 (SIGINT) or 143 (SIGTERM):
nothing has been read or written yet, so there is nothing to clean up. Once the command is over,
the CLI ignores both signals (`commands._signals_raise_stopped`), so one during the interpreter's
shut-down cannot turn a finished command into a silent death by signal.
"""

import signal

from vitmask.signals import early_stop


def main() -> None:
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, early_stop)
    from vitmask.cli.commands import main as cli_main

    cli_main()
