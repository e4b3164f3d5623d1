"""vitmask sweep in this process (vitmask/sweep, docs/sweeps.md): trials as run dirs, pruning, --trials
as the study's total, the report, and bad input as one line.

Expectations come from elsewhere than the code under test: each trial's own files (its config.yaml
read by vitmask's loader, its metrics.csv, its last.pt read with torch.load), the study as Optuna
itself loads it from the SQLite file, and the steps the cadences name (eval_every 5, max_steps 10).
The processes' tests (a kill, two workers) are in test_sweep_workers.py.
"""

import csv
import os
import sys
from pathlib import Path

import optuna
import pytest
import torch
import yaml
from PIL import Image

import vitmask.sweep.study as study_module
from tests.conftest import assert_user_error, write_config
from vitmask.config import load_config
from vitmask.errors import UserError
from vitmask.sweep.objective import Objective, Surplus, TrialReporter
from vitmask.sweep.space import load_space
from vitmask.sweep.study import run_sweep

pytestmark = pytest.mark.usefixtures("one_thread")
TEN = {"max_steps": 10, "eval_every": 5, "checkpoint_every": 5, "log_every": 5}
SPACE = {
    "train.lr": {"type": "float", "low": 1.0e-3, "high": 1.0e-2, "log": True},
    "model.depth": {"type": "int", "low": 1, "high": 2},
}


def files(tmp_path: Path, space: dict | None = None, train: dict | None = None) -> tuple[Path, Path]:
    cfg = write_config(tmp_path / "tiny.yaml", {"train": {**TEN, **(train or {})}})
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(SPACE if space is None else space))
    return cfg, path


def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'sweep.db'}"


def stored(tmp_path: Path, name: str) -> list[optuna.trial.FrozenTrial]:
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    return optuna.load_study(study_name=name, storage=url(tmp_path)).trials


def validations(run_dir: Path) -> dict[int, float]:
    """The val/loss of each validation step, as the run's metrics.csv logged it."""
    with open(run_dir / "metrics.csv", newline="") as f:
        return {int(r["step"]): float(r["val/loss"]) for r in csv.DictReader(f) if r.get("val/loss")}


def step_of(path: Path) -> int:
    return int(torch.load(path, weights_only=True)["step"])


class PruneTrialOne(optuna.pruners.BasePruner):
    """Prunes trial 1 at its first report, never another."""

    def prune(self, study, trial) -> bool:
        return trial.number == 1


def test_each_trial_is_a_run_dir_and_a_pruned_trial_stops_after_its_first_validation(tmp_path):
    cfg, space = files(tmp_path)
    out, said = tmp_path / "out", []
    result = run_sweep(
        config=cfg,
        space=space,
        trials=3,
        storage=url(tmp_path),
        study="s",
        out=out,
        pruner=PruneTrialOne(),
        device="cpu",
        say=said.append,
    )
    trials = stored(tmp_path, "s")
    assert [t.state.name for t in trials] == ["COMPLETE", "PRUNED", "COMPLETE"]
    assert (result.finished, result.ran) == (3, [0, 1, 2])
    for t in trials:
        run_dir = out / f"trial-{t.number:04d}"
        assert t.user_attrs["run_dir"] == str(run_dir.resolve()) and t.user_attrs["number"] == t.number
        ran = load_config(run_dir / "config.yaml")  # the run's own config holds the trial's values
        assert (ran.train.lr, ran.model.depth) == (t.params["train.lr"], t.params["model.depth"])
        assert ran.name == f"s-trial-{t.number:04d}" and "csv" in ran.train.loggers
        assert t.user_attrs["config"] == yaml.safe_load((run_dir / "config.yaml").read_text())
        assert t.intermediate_values == validations(run_dir)  # every validation reported, as logged
    pruned = out / "trial-0001"
    assert validations(pruned).keys() == {5} and step_of(pruned / "last.pt") == 5
    assert not (pruned / "step_0000010.pt").exists() and trials[1].user_attrs["steps"] == 5
    for t in (trials[0], trials[2]):
        logged = validations(out / f"trial-{t.number:04d}")
        assert logged.keys() == {5, 10} and t.value == logged[10]  # the value: the last validation's
        assert step_of(out / f"trial-{t.number:04d}" / "last.pt") == 10
    assert any(line.startswith("trial 1 pruned at step 5") for line in said)


def test_trials_counts_the_study_a_rerun_runs_what_is_missing_and_the_report_names_the_best(
    tmp_path, run_cli_in_process
):
    cfg, space = files(tmp_path)
    out = tmp_path / "out"
    run = ("sweep", "--config", cfg, "--space", space, "--storage", url(tmp_path), "--study", "r", "--out", out)
    run += ("--pruner", "none", "--device", "cpu")
    assert run_cli_in_process(*run, "--trials", 2).returncode == 0
    again = run_cli_in_process(*run, "--trials", 2)
    assert again.returncode == 0 and "this worker ran 0" in again.stdout
    assert len(stored(tmp_path, "r")) == 2 and not (out / "trial-0002").exists()
    assert run_cli_in_process(*run, "--trials", 3).returncode == 0
    assert [t.state.name for t in stored(tmp_path, "r")] == ["COMPLETE"] * 3

    res = run_cli_in_process("sweep", "--storage", url(tmp_path), "--study", "r", "--report", "--out", out)
    assert res.returncode == 0, res.stderr
    final = {n: validations(out / f"trial-{n:04d}")[10] for n in range(3)}  # from the runs' own logs
    best = min(final, key=final.get)
    lines = res.stdout.splitlines()
    assert lines[1].split()[:5] == ["rank", "trial", "state", "val/loss", "steps"]
    ranked = [int(line.split()[1]) for line in lines[2:5]]
    assert ranked == sorted(final, key=final.get) and lines[2].split()[0] == "1"
    with Image.open(out / "sweep.png") as png:
        assert png.format == "PNG" and png.width > png.height > 100
    assert load_config(out / "best.yaml") == load_config(out / f"trial-{best:04d}" / "config.yaml")
    assert f"trial {best}" in (out / "best.yaml").read_text().splitlines()[0]


def test_the_report_of_one_completed_trial_says_importances_need_two(tmp_path, run_cli_in_process):
    cfg, space = files(tmp_path)
    out = tmp_path / "out"
    args = ("--storage", url(tmp_path), "--study", "one", "--out", out)
    made = run_cli_in_process("sweep", "-c", cfg, "--space", space, "--trials", 1, *args, "--device", "cpu")
    assert made.returncode == 0
    res = run_cli_in_process("sweep", *args, "--report")
    assert res.returncode == 0
    assert res.stderr.strip() == (
        "vitmask: note: parameter importances need at least 2 completed trials; the study has 1"
    )
    assert (out / "sweep.png").stat().st_size > 0 and (out / "best.yaml").is_file()


def test_trials_that_fail_are_failed_in_the_study_and_three_in_a_row_stop_the_sweep(tmp_path):
    cfg, space = files(tmp_path)
    sets = ["data.source=npz", f"data.path={tmp_path / 'missing.npz'}"]
    with pytest.raises(UserError, match="3 trials in a row failed") as e:
        run_sweep(
            config=cfg, sets=sets, space=space, trials=5, storage=url(tmp_path), study="f", out=tmp_path / "out",
            say=lambda s: None,
        )  # fmt: skip
    assert "missing.npz" in str(e.value)
    trials = stored(tmp_path, "f")
    assert [t.state.name for t in trials] == ["FAIL"] * 3
    assert all("missing.npz does not exist" in t.user_attrs["error"] for t in trials)


def test_a_metric_missing_from_the_validations_stops_the_run_at_the_first_and_the_sweep(
    tmp_path, run_cli_in_process, monkeypatch
):
    """The check after a validation, behind the one made up front (switched off here to reach it)."""
    monkeypatch.setattr(study_module, "check_metric", lambda *a: None)
    cfg, space = files(tmp_path)
    out = tmp_path / "out"
    res = run_cli_in_process(
        "sweep", "-c", cfg, "--space", space, "--trials", 2, "--storage", url(tmp_path), "--study", "m",
        "--out", out, "--metric", "val/perplexity", "--direction", "minimize", "--device", "cpu",
    )  # fmt: skip
    assert_user_error(res, "--metric val/perplexity is not among the validation metrics of trial 0", "val/loss")
    assert [t.state.name for t in stored(tmp_path, "m")] == ["FAIL"]
    assert step_of(out / "trial-0000" / "last.pt") == 5  # stopped after its first validation


def test_the_reporter_reports_each_validation_once_and_stops_where_the_metric_is_absent():
    class Trial:
        def __init__(self):
            self.reports = []

        def report(self, value, step):
            self.reports.append((step, value))

        def should_prune(self):
            return False

    trial = Trial()
    reporter = TrialReporter(trial, "val/acc", "median")
    assert reporter.on_validation_end(5, {"val/loss": 1.5, "val/acc": 0.25}) is None
    assert reporter.on_validation_end(5, {"val/loss": 1.5, "val/acc": 0.25}) is None
    assert trial.reports == [(5, 0.25)]
    stop = reporter.on_validation_end(10, {"val/loss": 1.0})
    assert "val/acc is not among" in stop and reporter.missing == ["val/loss"] and trial.reports == [(5, 0.25)]


def test_a_trial_started_when_the_study_has_its_trials_gives_way_and_names_its_process(tmp_path):
    """Two workers asked for a trial at once: with trials 0 and 1 running (another worker's, made here
    with `ask`) and 2 trials wanted, trial 2 fails as surplus before it trains, its process recorded."""
    cfg, space = files(tmp_path)
    study = optuna.create_study(storage=url(tmp_path), study_name="s")
    held = [study.ask(), study.ask()]
    objective = Objective(
        study_name="s", trials=2, config=cfg, sets=[], space=load_space(space), metric="val/loss", pruner="none",
        out=tmp_path / "out", device="cpu", say=lambda s: None,
    )  # fmt: skip
    third = study.ask()
    with pytest.raises(Surplus, match="trial 2 is one too many: the study has its 2 trials"):
        objective(third)
    assert objective.surplus and [t.number for t in held] == [0, 1]
    stored_third = stored(tmp_path, "s")[2]
    assert stored_third.user_attrs["surplus"] is True
    assert stored_third.user_attrs["worker"]["pid"] == os.getpid()
    assert stored_third.user_attrs["worker"]["trial"] == 2
    assert not (tmp_path / "out").exists()  # nothing trained


# ---- bad input: one line, exit 2 --------------------------------------------------------------------------
def sweep_args(tmp_path, space: dict | None = None, *more) -> tuple:
    cfg, path = files(tmp_path, space)
    out = ("--out", tmp_path / "out")
    return ("sweep", "-c", cfg, "--space", path, "--trials", 1, "--study", "b", *out, "--device", "cpu", *more)


@pytest.mark.parametrize(
    ("space", "needles"),
    [
        ({"train.lrr": {"type": "float", "low": 0.001, "high": 0.01}}, ["unknown key 'train.lrr'", "'train.lr'"]),
        ({}, ["is empty", "train.lr: {type: float"]),
        ({"train": {"lr": {"type": "float"}}}, ["train is a config section"]),
        ({"model.pos": {"type": "categorical", "choices": ["learned", "rope3d"]}}, ["rope3d", "did you mean 'rope2d'"]),
        ({"model.depth": {"type": "int", "low": 0, "high": 2}}, ["model.depth = 0 is refused"]),
        ({"train.lr": {"type": "float", "low": 0.01, "high": 0.001}}, ["low (0.01) is above high (0.001)"]),
        ({"train.lr": {"type": "flaot", "low": 0.001, "high": 0.01}}, ["did you mean 'float'"]),
    ],
)
def test_a_bad_space_is_one_line(tmp_path, run_cli_in_process, space, needles):
    res = run_cli_in_process(*sweep_args(tmp_path, space, "--storage", url(tmp_path)))
    assert_user_error(res, *needles)
    assert not (tmp_path / "sweep.db").exists()  # refused before the storage is opened


def test_an_out_where_no_run_dir_can_be_made_is_one_line_before_any_trial(tmp_path, run_cli_in_process, monkeypatch):
    cfg, space = files(tmp_path)
    (tmp_path / "a-file").write_text("not a folder")
    for out, needle in (
        (tmp_path / "a-file", "is a file, not a folder"),
        (tmp_path / "a-file" / "sweep", "cannot be made (a part of the path is a file, not a folder)"),
    ):
        res = run_cli_in_process(
            "sweep", "-c", cfg, "--space", space, "--trials", 1, "--storage", url(tmp_path), "--study", "o",
            "--out", out, "--device", "cpu",
        )  # fmt: skip
        assert_user_error(res, f"--out {out} ", needle)
    assert not (tmp_path / "sweep.db").exists()  # refused before the storage is opened: no study, no trial
    new = tmp_path / "new" / "sweep"
    from vitmask.sweep.study import check_out

    check_out(new)
    assert not (tmp_path / "new").exists()  # the folders made to find out are removed again
    monkeypatch.setattr(study_module.os, "access", lambda path, mode: False)  # as for a user without write access
    with pytest.raises(UserError, match=r"is not writable \(permission denied\)"):
        check_out(new)
    assert not (tmp_path / "new").exists()


def test_a_storage_that_cannot_be_opened_is_one_line(tmp_path, run_cli_in_process):
    (tmp_path / "afile").write_text("")
    for storage, needle in [
        (f"sqlite:///{tmp_path / 'afile' / 'x.db'}", "cannot open --storage"),
        ("postgresql://user:secret@nohost/db", "cannot open --storage postgresql://user:***@nohost/db"),
        ("not a url", "is not a database URL"),
        ("sqlite:///:memory:", "in-memory database"),
    ]:
        res = run_cli_in_process(*sweep_args(tmp_path, None, "--storage", storage))
        assert_user_error(res, needle)
        assert "secret" not in res.stderr
    res = run_cli_in_process("sweep", "--storage", f"sqlite:///{tmp_path / 'none.db'}", "--study", "x", "--report")
    assert_user_error(res, "no database at --storage")
    assert not (tmp_path / "none.db").exists()


def test_a_study_made_otherwise_is_refused_in_one_line(tmp_path, run_cli_in_process):
    made = run_cli_in_process(*sweep_args(tmp_path, None, "--storage", url(tmp_path)))
    assert made.returncode == 0
    other = {"train.lr": SPACE["train.lr"]}
    assert_user_error(
        run_cli_in_process(*sweep_args(tmp_path, other, "--storage", url(tmp_path))),
        "study b in sqlite:///",
        "another space (it has model.depth, which this space does not)",
    )
    assert_user_error(
        run_cli_in_process(*sweep_args(tmp_path, None, "--storage", url(tmp_path), "--metric", "val/acc")),
        "optimises val/loss (minimize), and this command asks for val/acc (maximize)",
    )
    assert_user_error(
        run_cli_in_process(*sweep_args(tmp_path, None, "--storage", url(tmp_path), "--set", "train.max_steps=20")),
        "another config (train.max_steps: 10 there, 20 here)",
    )
    assert_user_error(
        run_cli_in_process("sweep", "--storage", url(tmp_path), "--study", "c", "--report"),
        "no study c in",
        "its studies: b",
    )
    assert len(stored(tmp_path, "b")) == 1  # nothing ran


@pytest.mark.parametrize(
    ("metric", "needles"),
    [
        ("val/los", ["--metric val/los is never logged", "did you mean 'val/loss'"]),
        ("train/loss", ["never logged by these runs, whose validations log val/loss, val/acc"]),
        ("val_ema/loss", ["the EMA's, and train.ema_decay is 0"]),
    ],
)
def test_a_metric_the_runs_never_log_is_one_line(tmp_path, run_cli_in_process, metric, needles):
    res = run_cli_in_process(*sweep_args(tmp_path, None, "--storage", url(tmp_path), "--metric", metric))
    assert_user_error(res, *needles)
    assert not (tmp_path / "sweep.db").exists()


def test_without_the_sweep_extra_it_names_the_install_command(tmp_path, run_cli_in_process, monkeypatch):
    monkeypatch.setitem(sys.modules, "optuna", None)  # an import of optuna fails, as where it is not installed
    res = run_cli_in_process(*sweep_args(tmp_path, None, "--storage", url(tmp_path)))
    assert_user_error(res, "needs the sweep extra, and optuna is not installed", "pip install 'vitmask[sweep]'")
    monkeypatch.setitem(sys.modules, "optuna", optuna)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    res = run_cli_in_process("sweep", "--storage", url(tmp_path), "--study", "b", "--report")
    assert_user_error(res, "matplotlib is not installed", "pip install 'vitmask[sweep]'")


def test_options_that_do_not_go_together_are_one_line(tmp_path, run_cli_in_process):
    cfg, space = files(tmp_path)
    base = ("sweep", "--storage", url(tmp_path), "--study", "b")
    assert_user_error(run_cli_in_process(*base, "--report", "--trials", 3), "--report", "takes no --trials")
    assert_user_error(run_cli_in_process(*base, "-c", cfg), "needs --space and --trials")
    assert_user_error(run_cli_in_process(*sweep_args(tmp_path, None, "--storage", url(tmp_path), "--pruner", "medain")),
                      "did you mean 'median'")  # fmt: skip
    assert_user_error(
        run_cli_in_process(*sweep_args(tmp_path, None, "--storage", url(tmp_path), "--set", "train.lr=0.1")),
        "train.lr is set by --set and searched by space",
    )
