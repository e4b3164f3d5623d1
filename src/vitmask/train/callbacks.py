"""Callbacks: code of your own that the trainer calls at fixed points of a run (docs/training.md#callbacks).

Subclass `Callback`, override the hooks you need (each is a no-op here), and pass instances to
`vitmask.train(..., callbacks=[...])` or `vitmask.finetune(...)`. The hooks, in the order a run calls them:

- `on_start(trainer)`: before the first step this process runs (a resumed run: the first after its
  checkpoint). `trainer` is the `Trainer`: `trainer.step`, `trainer.cfg`, `trainer.model`,
  `trainer.request_stop(reason)`.
- `on_step_end(step, metrics)`: after each logging step only (every `train.log_every` steps and the
  last), with the training window's numbers as the loggers get them (`train/loss`, `train/acc`,
  `train/lr`, `train/grad_norm`, `train/images_per_s`, ...). Not after every step: reading the
  window's numbers off the device is a host sync, which the step makes on logging steps alone.
- `on_validation_end(step, metrics)`: after each validation, with its numbers as logged: `val/loss`,
  `val/acc`, ... and, with an EMA of the weights (`train.ema_decay`), `val_ema/loss`, ...
- `on_checkpoint(path)`: after each checkpoint is written: `step_<step>.pt` (which `last.pt` then
  is) or `best.pt`; on rank 0 only, the rank that writes.
- `on_end(result)`: the run has ended by itself (`train.max_steps`, or a stop a callback asked for)
  and written its checkpoint; `result` is the `TrainResult` the call returns.

Stopping: `on_step_end`, `on_validation_end` and `on_checkpoint` may return a reason (a non-empty
str; any other true value stops with a reason naming the hook), or call `trainer.request_stop(reason)`.
The step finishes (its validation and checkpoint where due), last.pt is written, one line says
why, and the run ends normally: `result.stop_reason` is the reason, `vitmask train` exits 0.

Errors: a hook that raises stops the run the same way (the step finishes, no further hook runs,
last.pt is written), then `CallbackError` is raised, its message one line (which hook, the error,
the step, the checkpoint and how to resume), the hook's exception as its `__cause__`; the command
line prints that line and exits 1. One raised by `on_start` ends the run before its first step
(a fresh run leaves no run dir behind).

Under torchrun every rank runs the callbacks (their metrics are the same on every rank), and a
stop any rank asks for stops all. `EarlyStopping` is the callback behind the `train.early_stop_*`
keys. A callback with a `state_dict()` returning a dict (and `load_state_dict(state)`) has it kept
in every checkpoint and restored on resume, by its class name: `EarlyStopping` resumes exactly.

This module imports no torch.
"""

import math
from pathlib import Path
from typing import Any

from vitmask.errors import UserError
from vitmask.signals import resume_command

MODES = ("auto", "min", "max")


class Callback:
    """The hooks of a run, each doing nothing; subclass and override those you need
    (docs/python.md#callbacks: when each runs, how one stops the run, what an error does)."""

    def on_start(self, trainer: Any) -> None:
        """Before the first step this process runs (a resumed run: the first after its checkpoint).
        `trainer`: the `Trainer`, with `step`, `cfg`, `model` and `request_stop(reason)`."""
        pass

    def on_step_end(self, step: int, metrics: dict[str, float]) -> str | None:
        """After each logging step (every `train.log_every` steps and the last), with the training
        window's numbers as the loggers get them: `train/loss`, `train/acc`, `train/lr`, ... A
        non-empty str returned stops the run with it as the reason."""
        return None

    def on_validation_end(self, step: int, metrics: dict[str, float]) -> str | None:
        """After each validation, with its numbers as logged: `val/loss`, `val/acc`, ... (`val_ema/...`
        with an EMA of the weights). A non-empty str returned stops the run with it as the reason."""
        return None

    def on_checkpoint(self, path: Path) -> str | None:
        """After each checkpoint is written (on rank 0): `step_<step>.pt`, which `last.pt` then is, or
        `best.pt`. A non-empty str returned stops the run with it as the reason."""
        return None

    def on_end(self, result: Any) -> None:
        """Once the run has ended by itself and written its checkpoint, with the `TrainResult` (or
        `FinetuneResult`) the call returns."""
        pass

    def state_dict(self) -> dict | None:
        """What a checkpoint keeps of this callback (None: nothing)."""
        return None

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned, from a resumed run's checkpoint."""
        pass


HOOKS = ("on_start", "on_step_end", "on_validation_end", "on_checkpoint", "on_end")


def check_callbacks(callbacks) -> list:
    """`callbacks` as a list, each one a callback object: a `Callback`, or any object with at least one
    of the HOOKS as a method. One line for anything else (a class for its instance, a function, a
    logger), which would otherwise be called never, silently."""
    if isinstance(callbacks, (str, bytes)) or not hasattr(callbacks, "__iter__"):
        raise UserError(f"callbacks must be a list of callback objects, got {type(callbacks).__name__}")
    callbacks = list(callbacks)
    for i, cb in enumerate(callbacks):
        if isinstance(cb, type):
            raise UserError(f"callbacks takes callback objects, and got the class {cb.__name__}; pass {cb.__name__}()")
        if not isinstance(cb, Callback) and not any(callable(getattr(cb, name, None)) for name in HOOKS):
            raise UserError(
                f"callbacks[{i}], of type {type(cb).__name__}, has none of the hooks ({', '.join(HOOKS)}), so it "
                "would never be called; subclass vitmask.train.callbacks.Callback and override the hooks you need"
            )
    return callbacks


class CallbackError(Exception):
    """A callback's hook raised; the run stopped after its step with its checkpoint written. The
    message is one line; `__cause__` is the hook's exception."""

    def __init__(self, message: str, hook: str, step: int, checkpoint: Path | None):
        super().__init__(message)
        self.hook, self.step, self.checkpoint = hook, step, checkpoint


def callback_error(
    hook: str, error: BaseException, step: int, run_dir: Path | None, checkpoint: Path | None, started: bool, verb: str
) -> CallbackError:
    """The one-line CallbackError of `hook` ("EarlyStopping.on_validation_end") raising `error` at `step`."""
    what = " ".join(f"{type(error).__name__}: {error}".split()).rstrip(":")
    if not started:
        after = "the run stopped before its first step"
    elif checkpoint is None:
        after = "the run stopped; no run dir, so nothing was saved"
    else:
        after = f"the run stopped; checkpoint written to {checkpoint}; resume with: {resume_command(verb, run_dir)}"
    return CallbackError(f"callback {hook} raised {what} at step {step}; {after}", hook, step, checkpoint)


def improvement_mode(metric: str, mode: str) -> str:
    """min or max: `mode`, or for auto, max for an accuracy (a name with acc in it), min otherwise."""
    if mode != "auto":
        return mode
    return "max" if "acc" in metric.rpartition("/")[2] else "min"


class EarlyStopping(Callback):
    """Stop when `metric` (a validation's: `val/loss`, `val/acc`, `val_ema/loss`, ...) has gone
    `patience` validations in a row without improving on its best by more than `min_delta`. `mode`:
    min (lower is better), max, or auto (max for an accuracy, min otherwise). A NaN never improves.

    The run's best.pt is unchanged by it: the checkpoint of the lowest validation loss (the EMA's
    with an EMA), which for `val/loss` is the validation early stopping measures from."""

    def __init__(self, metric: str = "val/loss", mode: str = "auto", patience: int = 3, min_delta: float = 0.0):
        if not isinstance(metric, str) or "/" not in metric:
            raise UserError(
                f"EarlyStopping: metric must be a validation metric's name such as 'val/loss', got {metric!r}"
            )
        if mode not in MODES:
            raise UserError(f"EarlyStopping: mode must be one of {', '.join(MODES)}, got {mode!r}")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise UserError(f"EarlyStopping: patience must be an integer >= 1 (validations), got {patience!r}")
        if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float)) or not 0 <= min_delta < math.inf:
            raise UserError(f"EarlyStopping: min_delta must be a finite number >= 0, got {min_delta!r}")
        self.metric, self.patience, self.min_delta = metric, patience, float(min_delta)
        self.mode = improvement_mode(metric, mode)
        self.best: float | None = None  # the best value so far, and the step of its validation
        self.best_step: int | None = None
        self.waited = 0  # validations since the best without an improvement

    @classmethod
    def from_config(cls, train) -> "EarlyStopping | None":
        """The config's early stopping (the `train.early_stop_*` keys), or None where it is off."""
        if train.early_stop_patience == 0:
            return None
        return cls(
            train.early_stop_metric, train.early_stop_mode, train.early_stop_patience, train.early_stop_min_delta
        )

    def improves(self, value: float) -> bool:
        """Whether `value` beats the best so far by more than `min_delta` in the direction of `mode`
        (the first value always does; a NaN never does)."""
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        return value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta

    def on_validation_end(self, step: int, metrics: dict[str, float]) -> str | None:
        if self.metric not in metrics:
            raise UserError(
                f"EarlyStopping: this run's validations have no {self.metric}; watch one of {', '.join(metrics)}"
            )
        value = float(metrics[self.metric])
        if self.improves(value):
            self.best, self.best_step, self.waited = value, step, 0
            return None
        self.waited += 1
        if self.waited < self.patience:
            return None
        best = "none yet (every value NaN)" if self.best is None else f"{self.best:.6g} at step {self.best_step}"
        by = f"by more than {self.min_delta:g} " if self.min_delta else ""
        return (
            f"early stopping: {self.metric} ({'lower' if self.mode == 'min' else 'higher'} is better) has not "
            f"improved {by}on its best, {best}, in {self.waited} validations (patience {self.patience})"
        )

    def state_dict(self) -> dict:
        return {"metric": self.metric, "best": self.best, "best_step": self.best_step, "waited": self.waited}

    def load_state_dict(self, state: dict) -> None:
        if state.get("metric") != self.metric:  # it watched another metric: start afresh on this one
            return
        self.best, self.best_step, self.waited = state["best"], state["best_step"], int(state["waited"])
