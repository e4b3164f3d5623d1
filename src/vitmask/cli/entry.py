"""The process entry point (`vitmask`, `python -m vitmask`): signals from the first moment, then the CLI.

Until the CLI installs its own handlers (`commands.main`, once the parser is imported), a SIGINT or
SIGTERM prints one line and exits 130 (SIGINT) or 143 (SIGTERM): nothing has been read or written
yet, so there is nothing to clean up. Once the command is over, the CLI ignores both signals
(`commands._signals_raise_stopped`), so one during the interpreter's shut-down cannot turn a
finished command into a silent death by signal. A command stopped by a signal (exit 130 or 143)
ends the process as soon as its line is printed and its clean-up done, without the interpreter's
tear-down of torch (`signals.end_stopped_process`).

Parsing and `--help` never import torch; each command imports it before it runs
(`commands._library_first`). Before that, OpenMP's waiting threads are set to spin briefly
(runtime/openmp.py), so a training beside another CPU-bound process keeps its share of the CPU.
"""

import signal

from vitmask.runtime.openmp import share_cpus_fairly
from vitmask.signals import STOP_CODES, early_stop, end_stopped_process


def main() -> None:
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, early_stop)
    share_cpus_fairly()  # before torch is imported: libgomp reads it once
    from vitmask.cli.commands import main as cli_main

    try:
        cli_main()
    except SystemExit as e:
        if e.code in STOP_CODES:  # stopped by SIGINT / SIGTERM: its one line is out, its clean-up done
            end_stopped_process(e.code)
        raise
