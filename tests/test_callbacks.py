"""Callbacks and early stopping on the trainer's loop (train/callbacks.py): each hook at its points with
the numbers the loggers get, a stop asked for (returned or through `request_stop`) ending the run after
its step with last.pt written and one line, a hook that raises ending it the same way with a one-line
CallbackError, and early stopping by the config's keys or as a callback, resumed exactly.

Expectations come from elsewhere than the code under test: the numbers a RecordingLogger was given, the
steps the cadences name (log_every, eval_every), the checkpoints on disk read with torch.load, and the
early-stopping rule worked out by hand over a recorded sequence of validation losses.
"""

import math
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY, RecordingLogger
from vitmask.config import config_from_dict
from vitmask.data.batches import load_splits
from vitmask.errors import UserError
from vitmask.train.callbacks import Callback, CallbackError, EarlyStopping
from vitmask.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")
TEN = {"max_steps": 10, "eval_every": 5, "checkpoint_every": 5, "log_every": 5}


def config(train: dict | None = None, **top):
    return config_from_dict({**TINY, **top, "train": {**TINY["train"], **TEN, **(train or {})}})


def trainer(cfg, *callbacks, logger=None) -> Trainer:
    t = Trainer(cfg, load_splits(cfg), CPU, logger=logger)
    t.callbacks += list(callbacks)
    return t


def step_of(path: Path) -> int:
    return int(torch.load(path, weights_only=True)["step"])


class Recorder(Callback):
    def __init__(self):
        self.events: list[tuple] = []

    def on_start(self, trainer):
        self.events.append(("start", trainer.step))

    def on_step_end(self, step, metrics):
        self.events.append(("step", step, dict(metrics)))

    def on_validation_end(self, step, metrics):
        self.events.append(("validation", step, dict(metrics)))

    def on_checkpoint(self, path):
        self.events.append(("checkpoint", Path(path).name))

    def on_end(self, result):
        self.events.append(("end", result))


def test_each_hook_runs_at_its_points_with_the_numbers_the_loggers_get(tmp_path):
    logger, rec = RecordingLogger(), Recorder()
    t = trainer(config({"max_steps": 12, "log_every": 4, "eval_every": 6, "checkpoint_every": 6}), rec, logger=logger)
    t.fit(tmp_path, progress=False)
    kinds = [e[0] for e in rec.events]
    assert kinds[0] == "start" and rec.events[0][1] == 0 and kinds[-1] == "end"
    # on_step_end on the logging steps only (4, 8, 12), with what the logger got for them
    logged_train = [(s, m) for s, m in logger.rows if "train/loss" in m]
    assert [(e[1], e[2]) for e in rec.events if e[0] == "step"] == logged_train
    assert [s for s, _ in logged_train] == [4, 8, 12]
    # on_validation_end at 6 and 12, with the validation's scalars as logged
    logged_val = [(s, m) for s, m in logger.rows if "val/loss" in m]
    assert [(e[1], e[2]) for e in rec.events if e[0] == "validation"] == logged_val
    assert [s for s, _ in logged_val] == [6, 12]
    # on_checkpoint for each file written: best.pt where the validation loss fell, the step files
    names = [e[1] for e in rec.events if e[0] == "checkpoint"]
    assert [n for n in names if n.startswith("step_")] == ["step_0000006.pt", "step_0000012.pt"]
    assert "best.pt" in names and (tmp_path / "best.pt").is_file()
    result = rec.events[-1][1]
    assert result is t.result and result.step == 12 and not result.stopped_early
    assert result.stop_reason == "train.max_steps reached"
    assert result.final_metrics == logged_val[-1][1]
    best_step = min(logged_val, key=lambda sm: sm[1]["val/loss"])[0]
    assert result.best_step == best_step == step_of(tmp_path / "best.pt")
    assert result.best_metrics == dict(logged_val)[best_step]
    assert result.last_checkpoint == tmp_path / "last.pt" and result.best_checkpoint == tmp_path / "best.pt"


class StopAt(Callback):
    """Asks for a stop on the logging step `step`, by returning a reason or through the trainer."""

    def __init__(self, step: int, through_trainer: bool = False):
        self.step, self.through_trainer, self.trainer = step, through_trainer, None

    def on_start(self, trainer):
        self.trainer = trainer

    def on_step_end(self, step, metrics):
        if step != self.step:
            return None
        if self.through_trainer:
            self.trainer.request_stop("enough  said")
            return None
        return f"loss {metrics['train/loss']:.3f} is low enough"


@pytest.mark.parametrize("through_trainer", [False, True])
def test_a_stop_asked_for_ends_the_run_after_its_step_with_last_pt_and_one_line(tmp_path, capsys, through_trainer):
    rec = Recorder()
    t = trainer(config({"log_every": 2}), StopAt(4, through_trainer), rec)
    t.fit(tmp_path, progress=False)
    out = capsys.readouterr().out
    assert t.step == 4 and step_of(tmp_path / "last.pt") == 4  # off the checkpoint cadence (5): written for the stop
    assert not (tmp_path / "step_0000005.pt").exists()
    lines = [line for line in out.splitlines() if line.startswith("stopped")]
    reason = "enough said" if through_trainer else "is low enough"
    assert len(lines) == 1 and lines[0].startswith("stopped at step 4 of 10: ") and reason in lines[0]
    assert lines[0].endswith(f"; checkpoint written to {tmp_path / 'last.pt'}")
    result = t.result
    assert result.stopped_early and result.step == 4 and reason in result.stop_reason
    assert rec.events[-1] == ("end", result)
    assert ("checkpoint", "step_0000004.pt") in rec.events  # the stop's checkpoint, like any other


class Boom(Callback):
    def __init__(self, hook: str, step: int = 0):
        self.hook, self.step = hook, step

    def on_start(self, trainer):
        if self.hook == "on_start":
            raise RuntimeError("no  GPU\nfor you")

    def on_step_end(self, step, metrics):
        if self.hook == "on_step_end" and step == self.step:
            raise ValueError("boom")

    def on_end(self, result):
        if self.hook == "on_end":
            raise KeyError("upload")


def test_a_hook_that_raises_stops_the_run_with_last_pt_and_a_one_line_error(tmp_path):
    rec = Recorder()
    t = trainer(config({"log_every": 2}), Boom("on_step_end", 6), rec)
    with pytest.raises(CallbackError) as caught:
        t.fit(tmp_path, progress=False)
    err = caught.value
    assert "\n" not in str(err)
    assert str(err).startswith("callback Boom.on_step_end raised ValueError: boom at step 6; the run stopped;")
    assert f"checkpoint written to {tmp_path / 'last.pt'}" in str(err)
    assert f"vitmask train --run-dir {tmp_path} --resume auto" in str(err)
    assert isinstance(err.__cause__, ValueError) and err.step == 6
    assert step_of(tmp_path / "last.pt") == 6
    assert [e[1] for e in rec.events if e[0] == "step"] == [2, 4]  # Boom raised first at 6: no hook after it
    assert [e[1] for e in rec.events if e[0] == "validation"] == [5] and rec.events[-1][0] != "end"
    assert t.result is None


def test_a_hook_that_raises_at_the_start_ends_the_run_before_its_first_step(tmp_path):
    t = trainer(config(), Boom("on_start"))
    with pytest.raises(CallbackError, match=r"^callback Boom.on_start raised RuntimeError: no GPU for you at step 0; "):
        t.fit(tmp_path, progress=False)
    assert t.step == 0 and not (tmp_path / "last.pt").exists()


def test_a_hook_that_raises_at_the_end_is_reported_after_the_run_is_saved(tmp_path):
    t = trainer(config(), Boom("on_end"))
    with pytest.raises(CallbackError, match="callback Boom.on_end raised KeyError: 'upload' at step 10"):
        t.fit(tmp_path, progress=False)
    assert t.result.step == 10 and step_of(tmp_path / "last.pt") == 10


# ---- early stopping ---------------------------------------------------------------------------------------
def stops_at(values: list[float], patience: int, min_delta: float, mode: str) -> tuple[int | None, float | None]:
    """The index of the validation at which the rule stops, and the best then, worked out here: a value
    improves when it is below (min) or above (max) the best so far by more than min_delta, and becomes the
    best; `patience` in a row that do not, stop."""
    best, waited = None, 0
    for i, v in enumerate(values):
        better = best is None or (v < best - min_delta if mode == "min" else v > best + min_delta)
        if not math.isnan(v) and better:
            best, waited = v, 0
        else:
            waited += 1
            if waited == patience:
                return i, best
    return None, best


@pytest.mark.parametrize(
    "metric,mode,values",
    [
        ("val/loss", "auto", [1.0, 0.9, 0.85, 0.86, 0.849, 0.84, 0.83, 0.9]),
        ("val/acc", "auto", [0.5, 0.6, 0.6, 0.65, 0.64, 0.66, 0.66, 0.6]),
        ("val/loss", "max", [1.0, 1.2, 1.1, 1.25, 1.3, 1.3, 1.3, 1.3]),
        ("val/loss", "min", [math.nan, math.nan, 1.0, 0.5, 0.5, 0.5, 0.5, 0.5]),
    ],
)
def test_early_stopping_stops_where_the_rule_says(metric, mode, values):
    patience, delta = 2, 0.02
    want_mode = mode if mode != "auto" else ("max" if "acc" in metric else "min")
    want, best = stops_at(values, patience, delta, want_mode)
    stopping = EarlyStopping(metric, mode, patience, delta)
    got = next((i for i, v in enumerate(values) if stopping.on_validation_end(i, {metric: v, "other": 0.0})), None)
    assert got == want is not None
    assert stopping.best == best and stopping.waited == patience


def test_early_stopping_refuses_bad_arguments_and_a_metric_the_run_does_not_have():
    for kwargs in ({"metric": "loss"}, {"mode": "lowest"}, {"patience": 0}, {"min_delta": -1.0}, {"patience": True}):
        with pytest.raises(UserError, match="^EarlyStopping: "):
            EarlyStopping(**kwargs)
    with pytest.raises(UserError, match="this run's validations have no val/top5; watch one of val/loss, val/acc"):
        EarlyStopping("val/top5").on_validation_end(2, {"val/loss": 1.0, "val/acc": 0.5})


PLATEAU = {"lr": 1e-9, "max_steps": 40, "eval_every": 2, "checkpoint_every": 4, "log_every": 2}


def plateau_config(patience: int, **train):
    """At lr 1e-9 the validation loss stays put: no validation improves on the first by 0.01."""
    return config({**PLATEAU, "early_stop_patience": patience, "early_stop_min_delta": 0.01, **train})


def test_the_config_keys_stop_a_plateaued_run_and_keep_best_pt(tmp_path, capsys):
    rec = Recorder()
    t = trainer(plateau_config(3), rec)
    t.fit(tmp_path, progress=False)
    losses = [e[2]["val/loss"] for e in rec.events if e[0] == "validation"]
    steps = [e[1] for e in rec.events if e[0] == "validation"]
    at, _ = stops_at(losses, 3, 0.01, "min")
    assert at == 3 and t.step == steps[at] == 8  # validations at 2, 4, 6, 8: none 0.01 below the first
    assert step_of(tmp_path / "last.pt") == 8 and t.result.stopped_early
    assert t.result.stop_reason.startswith("early stopping: val/loss (lower is better) has not improved by more than")
    assert "in 3 validations (patience 3)" in t.result.stop_reason
    best = min(range(len(losses)), key=lambda i: (losses[i], i))  # best.pt: the lowest loss, the first of equals
    assert step_of(tmp_path / "best.pt") == steps[best] == t.result.best_step
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("stopped")]
    assert line == [f"stopped at step 8 of 40: {t.result.stop_reason}; checkpoint written to {tmp_path / 'last.pt'}"]


def test_early_stopping_resumes_exactly(tmp_path):
    """Stopped by its cadence at step 6 (two validations without improvement), the resumed run stops at
    step 8 as the unbroken one does: its count of validations without improvement is in the checkpoint."""
    for name in ("whole", "broken"):
        (tmp_path / name).mkdir()
    whole = trainer(plateau_config(3))
    whole.fit(tmp_path / "whole", progress=False)
    first = trainer(plateau_config(3, max_steps=6))
    first.fit(tmp_path / "broken", progress=False)
    assert torch.load(tmp_path / "broken" / "last.pt", weights_only=True)["callbacks"]["EarlyStopping"]["waited"] == 2
    resumed = trainer(plateau_config(3))
    resumed.load_state_dict(torch.load(tmp_path / "broken" / "last.pt", weights_only=True))
    resumed.fit(tmp_path / "broken", progress=False)
    assert whole.step == resumed.step == 8
    assert resumed.result.stop_reason == whole.result.stop_reason


def test_early_stopping_off_by_default_and_its_metric_checked_against_the_run():
    assert config().train.early_stop_patience == 0
    assert trainer(config()).callbacks == []
    with pytest.raises(UserError, match="train.ema_decay is 0"):
        config({"early_stop_patience": 2, "early_stop_metric": "val_ema/loss"})
    t = trainer(config({"early_stop_patience": 2, "early_stop_metric": "val_ema/acc", "ema_decay": 0.9}))
    assert isinstance(t.callbacks[0], EarlyStopping) and t.callbacks[0].mode == "max"


def test_a_fine_tuning_refuses_a_metric_its_validations_do_not_have():
    from vitmask.data.batches import load_labelled_splits
    from vitmask.train.finetune import FinetuneTrainer

    cfg = config({"early_stop_patience": 2, "early_stop_metric": "val/acc_nonempty"})
    with pytest.raises(
        UserError, match="val/acc_nonempty is not a metric of this run's validations; use one of val/loss, val/acc$"
    ):
        FinetuneTrainer(cfg, load_labelled_splits(cfg), CPU)
