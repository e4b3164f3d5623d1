"""Training from Python (train/run.py, docs/python.md#training-from-python): `vitmask.train` and
`vitmask.finetune` are the code `vitmask train` and `vitmask finetune` run, so the same config and seed
give the same checkpoints bit for bit; their results; early stopping and callbacks through them and
through the command line (a stop: one line, exit 0; a callback that raised: one line, exit 1); bad
arguments refused in one line before anything is written; `import vitmask` still imports no torch.

Expectations are read from elsewhere: the checkpoints with torch.load, the steps the cadences name.
"""

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vitmask
from tests.conftest import ROOT, train_tiny, write_config
from vitmask.errors import UserError
from vitmask.train import run
from vitmask.train.callbacks import Callback, CallbackError, EarlyStopping
from vitmask.train.result import FinetuneResult, TrainResult

pytestmark = pytest.mark.usefixtures("one_thread")
SHORT = {"train": {"max_steps": 4, "eval_every": 2, "checkpoint_every": 2, "log_every": 2}}


@pytest.fixture
def run_cli(run_cli_in_process):
    return run_cli_in_process


def state(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = state(a)["model"], state(b)["model"]
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_the_cli_and_python_train_the_same_checkpoints(tmp_path, run_cli):
    cfg = write_config(tmp_path / "c.yaml", SHORT)
    res = run_cli("train", "--config", cfg, "--run-dir", tmp_path / "cli", "--device", "cpu")
    assert res.returncode == 0, res.stderr
    result = vitmask.train(cfg, run_dir=tmp_path / "py", device="cpu")
    assert_same_weights(tmp_path / "cli" / "last.pt", tmp_path / "py" / "last.pt")
    assert_same_weights(tmp_path / "cli" / "best.pt", tmp_path / "py" / "best.pt")
    assert isinstance(result, TrainResult) and result.run_dir == tmp_path / "py"
    assert result.step == 4 == state(result.last_checkpoint)["step"] and not result.stopped_early
    assert result.last_checkpoint == tmp_path / "py" / "last.pt"
    assert result.best_checkpoint == tmp_path / "py" / "best.pt"
    assert result.best_step == state(result.best_checkpoint)["step"] in (2, 4)
    # the final validation's numbers: those the checkpoint of the last step keeps, under the loggers' names
    kept = state(result.last_checkpoint)["val"]["raw"]
    assert result.final_metrics == {f"val/{k}": kept[k] for k in ("loss", "acc", "acc_nonempty", "bit_acc")}
    assert f"val acc {result.final_metrics['val/acc']:.4f}" in res.stdout  # the command's last line says the same


def test_python_composes_config_files_and_applies_overrides_last(tmp_path):
    base = write_config(tmp_path / "base.yaml", SHORT)
    (tmp_path / "mine.yaml").write_text("model: {depth: 1}\ntrain: {max_steps: 2}\n")
    result = vitmask.train([base, tmp_path / "mine.yaml"], ["train.lr=0.001"], tmp_path / "run", device="cpu")
    saved = state(result.last_checkpoint)["config"]
    assert saved["name"] == "mine" and saved["model"]["depth"] == 1 and saved["model"]["hidden_dim"] == 32
    assert saved["train"]["max_steps"] == 2 == result.step and saved["train"]["eval_every"] == 2
    assert saved["train"]["lr"] == 0.001


class StopAfter(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_validation_end(self, step, metrics):
        return f"seen enough at {step}" if step >= self.step else None


def test_python_callbacks_and_early_stopping_end_the_run_with_a_result(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", {"train": {**SHORT["train"], "max_steps": 10}})
    result = vitmask.train(cfg, run_dir=tmp_path / "a", device="cpu", callbacks=[StopAfter(4)])
    assert result.step == 4 and result.stopped_early and result.stop_reason == "seen enough at 4"
    assert state(tmp_path / "a" / "last.pt")["step"] == 4
    plateau = ["train.lr=1e-9", "train.max_steps=40"]
    stopping = EarlyStopping("val/loss", patience=2, min_delta=0.01)
    result = vitmask.train(cfg, plateau, tmp_path / "b", device="cpu", callbacks=[stopping])
    assert result.step == 6 and result.stop_reason.startswith("early stopping: val/loss")  # validations at 2, 4, 6
    assert stopping.best_step == 2 and stopping.waited == 2


def test_an_object_with_a_hook_is_a_callback_without_subclassing(tmp_path):
    """Callbacks are duck-typed: the check that refuses objects without any hook lets this one through."""

    class Seen:
        def __init__(self):
            self.steps = []

        def on_validation_end(self, step, metrics):
            self.steps.append(step)

    seen = Seen()
    cfg = write_config(tmp_path / "c.yaml", {"train": {**SHORT["train"], "max_steps": 4}})
    vitmask.train(cfg, run_dir=tmp_path / "run", device="cpu", callbacks=[seen])
    assert seen.steps == [2, 4]


def test_early_stopping_from_the_command_line_says_why_in_one_line_and_exits_0(tmp_path, run_cli):
    cfg = write_config(tmp_path / "c.yaml", SHORT)
    sets = ["train.max_steps=40", "train.lr=1e-9", "train.early_stop_patience=2", "train.early_stop_min_delta=0.01"]
    run = tmp_path / "run"
    res = run_cli(
        "train", "--config", cfg, "--run-dir", run, "--device", "cpu", *[a for s in sets for a in ("--set", s)]
    )
    assert res.returncode == 0, res.stderr
    lines = [line for line in res.stdout.splitlines() if line.startswith("stopped")]
    assert len(lines) == 1, res.stdout
    assert lines[0].startswith("stopped at step 6 of 40: early stopping: val/loss (lower is better) has not improved")
    assert lines[0].endswith(f"; checkpoint written to {run / 'last.pt'}")
    assert state(run / "last.pt")["step"] == 6 and (run / "best.pt").is_file()
    assert "done:" in res.stdout.splitlines()[-2]


def test_a_callback_that_raises_under_the_cli_is_one_line_and_exit_1(tmp_path, run_cli, monkeypatch):
    def broken(self, step, metrics):
        raise ConnectionError("tracker unreachable")

    monkeypatch.setattr(EarlyStopping, "on_validation_end", broken)
    cfg = write_config(tmp_path / "c.yaml", SHORT)
    run = tmp_path / "run"
    res = run_cli("train", "--config", cfg, "--run-dir", run, "--device", "cpu", "--set", "train.early_stop_patience=2")
    assert res.returncode == 1, (res.stdout, res.stderr)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr
    assert lines[0] == (
        "vitmask: error: callback EarlyStopping.on_validation_end raised ConnectionError: tracker unreachable at step "
        f"2; the run stopped; checkpoint written to {run / 'last.pt'}; resume with: vitmask train --run-dir {run} "
        "--resume auto"
    )
    assert state(run / "last.pt")["step"] == 2


def test_python_raises_the_callback_error_with_its_cause(tmp_path):
    class Broken(Callback):
        def on_step_end(self, step, metrics):
            raise ValueError(f"bad step {step}")

    cfg = write_config(tmp_path / "c.yaml", SHORT)
    with pytest.raises(
        CallbackError, match="^callback Broken.on_step_end raised ValueError: bad step 2 at step 2; "
    ) as e:
        vitmask.train(cfg, run_dir=tmp_path / "run", device="cpu", callbacks=[Broken()])
    assert isinstance(e.value.__cause__, ValueError) and state(tmp_path / "run" / "last.pt")["step"] == 2


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"config": 3}, "config must be a YAML file's path, a list of them, a Config or a dict, got int"),
        ({"config": ["a.yaml", 3]}, "a list of configs must hold YAML files' paths"),
        ({"overrides": "train.lr=0.1"}, "overrides must be a list of 'KEY=VALUE' strings"),
        ({"callbacks": [EarlyStopping]}, "callbacks takes callback objects, and got the class EarlyStopping"),
        ({"callbacks": EarlyStopping("val/loss")}, "callbacks must be a list of callback objects, got EarlyStopping"),
        ({"callbacks": [print]}, "callbacks[0], of type builtin_function_or_method, has none of the hooks"),
        ({"callbacks": [EarlyStopping("val/loss"), object()]}, "callbacks[1], of type object, has none of the hooks"),
        ({"device": 0}, "device must be 'auto', 'cpu', 'cuda', 'cuda:K' or a torch.device, got 0"),
        ({"resume": 5}, "resume must be a path (str or Path) or auto, got 5"),
        ({"run_dir": ""}, "run_dir must be a path (str or Path), got ''"),
        ({"overrides": ["train.lrr=0.1"]}, "did you mean 'train.lr'"),
    ],
)
def test_bad_arguments_are_one_line_before_anything_is_written(tmp_path, kwargs, needle, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = write_config(tmp_path / "c.yaml", SHORT)
    with pytest.raises(UserError) as e:
        vitmask.train(**{"config": cfg, "run_dir": tmp_path / "run", **kwargs})
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("pre"), {"train": {"max_steps": 6, "eval_every": 6}})


def test_the_cli_and_python_finetune_the_same_classifier(pretrained, tmp_path, run_cli):
    import json

    cfg = write_config(tmp_path / "ft.yaml", SHORT)
    args = ["finetune", "--checkpoint", pretrained, "--config", cfg, "--device", "cpu", "--no-baselines", "--json"]
    res = run_cli(*args, "--run-dir", tmp_path / "cli")
    assert res.returncode == 0, res.stderr
    result = vitmask.finetune(str(pretrained), cfg, run_dir=tmp_path / "py", device="cpu", baselines=False)
    assert_same_weights(tmp_path / "cli" / "last.pt", tmp_path / "py" / "last.pt")
    assert isinstance(result, FinetuneResult) and result.step == 4 and result.pretrained == str(pretrained)
    report = json.loads(res.stdout.splitlines()[-1])
    assert report["finetuned"] == result.test_accuracy and report["steps"] == result.step == 4
    assert result.report() == {**report, "run_dir": str(tmp_path / "py")}
    assert result.from_scratch is None and result.linear_probe is None
    assert set(result.final_metrics) == {"val/loss", "val/acc"} and state(result.last_checkpoint)["task"] == "finetune"


def test_finetune_early_stopping_by_the_config_keys(pretrained, tmp_path):
    cfg = write_config(tmp_path / "ft.yaml", SHORT)
    sets = ["train.max_steps=40", "train.lr=1e-9", "train.early_stop_patience=1", "train.early_stop_metric=val/acc"]
    sets.append("train.early_stop_min_delta=0.5")  # no accuracy rises by half
    result = vitmask.finetune(pretrained, cfg, sets, tmp_path / "run", device="cpu", baselines=False)
    assert result.step == 4 and result.stopped_early  # validations at 2 (the best) and 4 (no better)
    assert result.stop_reason.startswith("early stopping: val/acc (higher is better) has not improved by more than 0.5")


def test_vitmask_train_is_the_package_and_import_vitmask_imports_no_torch():
    probe = (
        "import sys, vitmask\n"
        "import vitmask.train.callbacks\n"
        "assert callable(vitmask.train) and vitmask.train is sys.modules['vitmask.train']\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    res = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert list(inspect.signature(vitmask.train).parameters)[:3] == ["config", "overrides", "run_dir"]
    assert inspect.signature(vitmask.train) == inspect.signature(run.train)
