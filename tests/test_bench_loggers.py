"""scripts/bench_loggers.py: the step times it reads from the loop's calls of train_step, a short run
of it on a tiny config (one row per logger set, with numbers, and the loggers really writing), and a
bad argument as one line."""

import csv
import importlib.util
import json
import re

import pytest

from tests.conftest import ROOT, write_config

pytestmark = pytest.mark.usefixtures("one_thread")


def load_script():
    spec = importlib.util.spec_from_file_location("bench_loggers", ROOT / "scripts" / "bench_loggers.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


bench = load_script()
SMALL = ["--set", "data.num_train=256", "--set", "data.num_val=32", "--set", "data.num_test=16"]


def test_each_step_lasts_from_its_call_of_train_step_to_the_next():
    # (steps done when train_step was called, seconds): step k runs from the call after k - 1 steps
    calls = [(0, 0.0), (1, 1.0), (2, 3.0), (3, 3.5), (5, 9.0), (6, 10.0), (7, 14.0)]
    plain, logging = bench.step_times(calls, log_every=2, warmup=1)
    # step 1 is warm-up; 2 (a logging step) 2.0 s; 3 0.5 s; 4 and 5 have no call between them (3 -> 5),
    # so neither is timed; 6 (logging) 1.0 s; 7 4.0 s; 8, begun at the last call, has no end
    assert plain == [0.5, 4.0] and logging == [2.0, 1.0]
    assert bench.step_times(calls, log_every=3, warmup=0) == ([1.0, 2.0, 4.0], [0.5, 1.0])


def test_the_sets_are_the_baseline_then_those_named():
    assert bench.logger_sets(["csv,jsonl", " tensorboard ", "csv, jsonl"]) == [(), ("csv", "jsonl"), ("tensorboard",)]
    default = bench.logger_sets(None)
    assert default[:4] == [(), ("tensorboard",), ("csv", "jsonl"), ("tensorboard", "csv", "jsonl")]
    assert set(default[4:]) <= {("mlflow",), ("wandb",)}


def test_a_short_run_prints_one_row_per_logger_set_and_the_loggers_write(tmp_path, capsys):
    config = write_config(tmp_path / "tiny.yaml")
    runs = tmp_path / "runs"
    argv = ["--config", str(config), *SMALL, "--steps", "4", "--warmup", "1", "--log-every", "2"]
    assert bench.cli([*argv, "--loggers", "csv,jsonl", "--run-root", str(runs)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{config}: 4 timed steps a run (after 1), train.log_every 2")
    assert out[1].split() == ["loggers", "non-logging", "ms", "vs", "baseline", "logging", "ms", "vs", "baseline"] + [
        "steps",
        "timed",
    ]
    rows = {line.split("  ")[0].strip(): line for line in out[2:]}
    assert list(rows) == ["[]", "[csv, jsonl]"] and len(out) == 4
    number = r"(\d+\.\d\d)"
    base = re.fullmatch(rf"\[\]\s+{number}\s+-\s+{number}\s+-\s+2 \+ 2", rows["[]"])
    timed = re.fullmatch(
        rf"\[csv, jsonl\]\s+{number}\s+([+-]\d+\.\d\d)\s+{number}\s+([+-]\d+\.\d\d)\s+2 \+ 2", rows["[csv, jsonl]"]
    )
    assert base and timed, out
    plain, logging = float(base[1]), float(base[2])
    assert plain > 0 and logging > 0
    assert float(timed[2]) == pytest.approx(float(timed[1]) - plain, abs=0.011)  # the differences: from the baseline
    assert float(timed[4]) == pytest.approx(float(timed[3]) - logging, abs=0.011)
    # the runs logged where their sets say: rows at the logging steps 2, 4 and the last, 6
    assert not (runs / "round1-none" / "metrics.csv").exists() and not (runs / "round1-none" / "metrics.jsonl").exists()
    with open(runs / "round1-csv-jsonl" / "metrics.csv", newline="") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [2, 4, 6]
    lines = (runs / "round1-csv-jsonl" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [2, 4, 6]


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--steps", "four"], "argument --steps: invalid int value: 'four'"),
        (["--log-every", "1"], "--log-every must be from 2 to --steps (40), got 1"),
        (["--steps", "3", "--log-every", "5"], "--log-every must be from 2 to --steps (3), got 5"),
        (["--loggers", "csv,parquet"], "unknown: parquet"),
        (["--set", "train.no_such_key=1"], "train.no_such_key"),
        (["--rounds"], "argument --rounds: expected one argument"),
    ],
)
def test_a_bad_argument_is_one_line_and_runs_nothing(tmp_path, capsys, argv, words):
    runs = tmp_path / "runs"
    assert bench.cli([*argv, "--run-root", str(runs)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("bench_loggers: error: ") and captured.err.count("\n") == 1, captured.err
    assert words in captured.err
    assert not runs.exists()
