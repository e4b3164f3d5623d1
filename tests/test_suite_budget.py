"""The suite's time budget (tests/suite_budget.py): a run over `--suite-budget` fails with one line
naming its total and slowest files; a run within it passes and prints the same line."""

import pytest

from tests.conftest import ROOT

pytest_plugins = ["pytester"]

SLOW = "import time\n\ndef test_slow():\n    time.sleep(0.6)\n"
FAST = "def test_fast():\n    pass\n"


@pytest.mark.parametrize(("budget", "code", "verdict"), [(0.3, 1, "over"), (60, 0, "within")])
def test_a_run_over_its_budget_fails_naming_the_slowest_files(pytester, monkeypatch, budget, code, verdict):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the plugin is tests.suite_budget, in this checkout
    pytester.makepyfile(test_slow_file=SLOW, test_fast_file=FAST)
    res = pytester.runpytest_subprocess("-p", "tests.suite_budget", f"--suite-budget={budget}")
    assert res.ret == code
    lines = [ln for ln in res.outlines if ln.startswith("suite time ")]
    assert len(lines) == 1
    assert (
        f", {verdict} its budget of {budget:.0f} s; slowest files: test_slow_file.py 1 s, test_fast_file.py 0 s"
        in (lines[0])
    )
    res.assert_outcomes(passed=2)
