"""The test suite's own time budget: `--suite-budget SECONDS` fails a run whose wall time passes it.

`make test` passes `--suite-budget 420` (docs/contributing.md: the suite takes about 260 s on
a quiet 2-core machine). When the whole run, from collection to the last report, takes longer, the
run fails after its summary with one line that names the total and the slowest test files, so a
suite that grows slow is a red CI run and not a slow drift. The line is printed either way, so CI
logs show the total and where it went. Under pytest-xdist it runs in the controller, from every
worker's reports.
"""

import time
from collections import defaultdict

import pytest

SLOWEST_FILES = 5


def pytest_addoption(parser):
    parser.addoption(
        "--suite-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="fail the run when the suite's wall time passes SECONDS, naming the slowest test files",
    )


class SuiteBudget:
    def __init__(self, budget: float):
        self.budget = budget
        self.started = time.monotonic()
        self.per_file: dict[str, float] = defaultdict(float)
        self.session = None

    def pytest_sessionstart(self, session):
        self.session = session

    def pytest_runtest_logreport(self, report):
        self.per_file[report.nodeid.split("::")[0]] += report.duration  # setup, call and teardown

    def line(self, seconds: float) -> str:
        slowest = sorted(self.per_file.items(), key=lambda kv: -kv[1])[:SLOWEST_FILES]
        files = ", ".join(f"{name} {secs:.0f} s" for name, secs in slowest)
        verdict = "over" if seconds > self.budget else "within"
        return f"suite time {seconds:.0f} s, {verdict} its budget of {self.budget:.0f} s; slowest files: {files}"

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter, exitstatus, config):
        seconds = time.monotonic() - self.started
        terminalreporter.write_line(self.line(seconds))
        if seconds > self.budget and self.session is not None:
            self.session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config):
    budget = config.getoption("--suite-budget")
    if budget is not None and not hasattr(config, "workerinput"):  # the controller, or a run without workers
        config.pluginmanager.register(SuiteBudget(budget), "suite-budget")
