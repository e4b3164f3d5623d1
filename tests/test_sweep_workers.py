"""vitmask sweep in processes of its own (docs/sweeps.md#resuming-and-sharing): a sweep killed with
SIGKILL in the middle of a trial (held at its first checkpoint, so the kill lands there every time)
goes on when the same command runs again, and two workers on one SQLite study share its trials.

Expectations come from the study as Optuna itself loads it from the SQLite file and from the run
dirs on disk (each finished trial's last.pt, read with torch.load, at train.max_steps)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import torch
import yaml

from tests.conftest import ROOT, write_config

pytestmark = pytest.mark.usefixtures("one_thread")
SPACE = {
    "train.lr": {"type": "float", "low": 1.0e-3, "high": 1.0e-2, "log": True},
    "model.depth": {"type": "int", "low": 1, "high": 2},
}


def command(tmp_path: Path, trials: int, steps: int) -> list[str]:
    cfg = write_config(
        tmp_path / "tiny.yaml",
        {"train": {"max_steps": steps, "eval_every": steps // 2, "checkpoint_every": steps // 2, "log_every": 5}},
    )
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(SPACE))
    return [
        "sweep", "--config", str(cfg), "--space", str(tmp_path / "space.yaml"), "--trials", str(trials),
        "--storage", f"sqlite:///{tmp_path / 'sweep.db'}", "--study", "w", "--out", str(tmp_path / "out"),
        "--pruner", "none", "--device", "cpu",
    ]  # fmt: skip


# `vitmask ARGS` with trial 0's run held at its first checkpoint: a callback added to each trial's
# callbacks touches the file named in argv[1] there and sleeps, so the trial is surely mid-run when killed.
HOLD_TRIAL_0 = """
import sys, time
from pathlib import Path
import vitmask.sweep.objective as objective
from vitmask.cli.commands import main
from vitmask.train.callbacks import Callback

class Hold(Callback):
    def on_checkpoint(self, path):
        if path.parent.name == "trial-0000":
            Path(sys.argv[1]).touch()
            time.sleep(600)

real_train = objective.train
objective.train = lambda *a, callbacks=(), **k: real_train(*a, callbacks=[*callbacks, Hold()], **k)
main(sys.argv[2:])
"""


def start(args: list[str], log: Path, held: Path | None = None) -> subprocess.Popen:
    """`vitmask ARGS` in a process of its own; with `held`, trial 0 held (HOLD_TRIAL_0) once `held` exists."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    head = ["-m", "vitmask"] if held is None else ["-c", HOLD_TRIAL_0, str(held)]
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, *head, *args], cwd=ROOT, env=env, stdout=f, stderr=f)


def trials_of(tmp_path: Path) -> list[optuna.trial.FrozenTrial]:
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        return optuna.load_study(study_name="w", storage=f"sqlite:///{tmp_path / 'sweep.db'}").trials
    except KeyError:  # not made yet
        return []


def step_of(path: Path) -> int:
    return int(torch.load(path, weights_only=True)["step"])


def check_finished(trials, steps: int, n: int) -> None:
    """`n` finished trials, each in a run dir of its own that trained to `steps`; no number twice."""
    finished = [t for t in trials if t.state.name in ("COMPLETE", "PRUNED")]
    assert len(finished) == n, [(t.number, t.state.name) for t in trials]
    assert len({t.number for t in trials}) == len(trials)
    dirs = [t.user_attrs["run_dir"] for t in finished]
    assert len(set(dirs)) == n
    for t in finished:
        assert Path(t.user_attrs["run_dir"]).name == f"trial-{t.number:04d}"
        assert step_of(Path(t.user_attrs["run_dir"]) / "last.pt") == steps
    assert not [t for t in trials if t.state.name in ("RUNNING", "WAITING")]


def test_a_sweep_killed_in_a_trial_goes_on_when_run_again(tmp_path, run_cli_in_process):
    args = command(tmp_path, trials=3, steps=40)
    held = tmp_path / "held"
    proc = start(args, tmp_path / "killed.log", held)
    deadline = time.monotonic() + 120
    try:
        while not held.exists():
            assert proc.poll() is None, (tmp_path / "killed.log").read_text()
            assert time.monotonic() < deadline, "the first trial never started"
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    killed = trials_of(tmp_path)
    assert [(t.number, t.state.name) for t in killed] == [(0, "RUNNING")]  # killed in the middle of trial 0

    res = run_cli_in_process(*args)
    assert res.returncode == 0, res.stderr
    trials = trials_of(tmp_path)
    check_finished(trials, 40, 3)
    first = trials[0]
    assert first.state.name == "FAIL" and "killed" in first.user_attrs["error"]
    retries = [t for t in trials if t.system_attrs.get("failed_trial") == 0]
    assert len(retries) == 1 and retries[0].state.name == "COMPLETE"
    assert retries[0].params == first.params  # the killed trial's values, run again once
    assert len(trials) == 4 and "trial 0 was left running by a process that is gone" in res.stdout


def test_two_workers_share_one_study_without_running_a_trial_twice(tmp_path):
    args = command(tmp_path, trials=4, steps=10)
    procs = [start(args, tmp_path / f"worker{i}.log") for i in range(2)]
    for p in procs:
        p.wait(timeout=300)
    for i, p in enumerate(procs):
        assert p.returncode == 0, (tmp_path / f"worker{i}.log").read_text()
    trials = trials_of(tmp_path)
    check_finished(trials, 10, 4)
    assert {t.user_attrs["worker"]["pid"] for t in trials} <= {p.pid for p in procs}
    for t in trials:  # a trial that is not finished was only one too many, started as the fourth was
        assert t.state.name == "COMPLETE" or t.user_attrs.get("surplus"), (t.number, t.state.name)
    for i in range(2):
        assert "study w: 4 of 4 trials finished" in (tmp_path / f"worker{i}.log").read_text()
