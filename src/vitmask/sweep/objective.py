"""One trial of a sweep: a normal training run, its validations reported to Optuna.

Trial N trains in `<out>/trial-NNNN` (`run_dir_of`) through `vitmask.train`, as `vitmask train
--config ... --set ... --run-dir <out>/trial-NNNN` would: config.yaml, checkpoints, TensorBoard and
metrics.csv there (csv is added to the trial's `train.loggers`). Its config is the sweep's (config
files and `--set`s), then the trial's values of the space's keys, its `name` `<study>-trial-NNNN`.

The trial's user attributes in the study: `number` and `worker` (the process that runs it: host,
boot, pid, the process's start and the trial's number, which study.py reads to tell a killed
trial), set first, a surplus trial's too; `run_dir` (absolute), `config` (the whole config, as
the run's config.yaml has it once written), and at its end `steps` (the step it reached) and
`stop_reason`, or `error` (one line) for a trial that failed.

`TrialReporter`, a training callback, reports each validation's metric (`trial.report(value,
step)`) and asks the pruner (`trial.should_prune()`): a pruned trial's run stops after that step
with its last.pt, and the trial ends PRUNED (`optuna.TrialPruned`). The trial's value is the
metric at the run's last validation (the one last.pt holds).

What ends a trial, and how:
- a value: COMPLETE;
- the pruner: PRUNED;
- bad values for its run (a config the keys' values only refuse together, a run that diverged, a
  run dir already taken) or a non-finite metric: FAIL with its one line (`TrialFailed`), the sweep
  goes on (study.py stops it after FAILURES_IN_A_ROW of them);
- the metric absent from the run's validations: FAIL, and the sweep stops (`MetricMissing`, a
  `UserError`): no trial can have it;
- a signal or a kill: see study.py.
"""

import contextlib
import json
import math
import os
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import optuna
import yaml

from vitmask.config import ConfigSource, load_config
from vitmask.errors import UserError
from vitmask.sweep.space import Space, overrides
from vitmask.train.callbacks import Callback
from vitmask.train.run import train

PRUNABLE_STATES = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)


class TrialFailed(Exception):
    """A trial that failed for its own values: FAIL in the study, and the sweep goes on."""


class Surplus(Exception):
    """A trial started while enough others were finished or running: FAIL, marked `surplus`."""


class MetricMissing(UserError):
    """The sweep's metric is not among the run's validation metrics: no trial can report it."""


def run_dir_of(out: Path, number: int) -> Path:
    return Path(out) / f"trial-{number:04d}"


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def process_start(pid: int) -> str | None:
    """When the process `pid` started (clock ticks since boot, /proc/PID/stat's 22nd field), or None
    where /proc does not say: with the pid, it names one process even after its pid is reused."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()  # the command's name, in parentheses, may hold spaces
    return fields[19] if len(fields) > 19 else None


def this_worker(trial: int | None = None) -> dict[str, Any]:
    """This process, as the `worker` attribute of trial number `trial` records it (the number tells the
    attribute of a retried trial, copied from the trial it retries, from one its own worker set)."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "boot": _boot_id(), "pid": pid, "start": process_start(pid), "trial": trial}


class TrialReporter(Callback):
    """Each validation's `metric` to the trial, and a stop when the pruner prunes (module docstring)."""

    def __init__(self, trial: "optuna.Trial", metric: str, pruner: str):
        self.trial, self.metric, self.pruner = trial, metric, pruner
        self.reported: set[int] = set()
        self.pruned: tuple[int, float] | None = None  # the step and value the pruner stopped it at
        self.missing: list[str] | None = None  # the validation's names, where the metric is not one

    def on_validation_end(self, step: int, metrics: dict[str, float]) -> str | None:
        if self.metric not in metrics:
            self.missing = list(metrics)
            return f"the sweep's metric {self.metric} is not among this run's validation metrics"
        value = float(metrics[self.metric])
        if step not in self.reported:  # a step is reported once (Optuna ignores a second value)
            self.trial.report(value, step)
            self.reported.add(step)
        if self.trial.should_prune():
            self.pruned = (step, value)
            return f"pruned by the sweep's {self.pruner} pruner at step {step} ({self.metric} {value:.6g})"
        return None


def param_text(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_value_text(v)}" for k, v in params.items())


def _value_text(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else json.dumps(v) if v is None or isinstance(v, bool) else str(v)


class Objective:
    """The function `study.optimize` calls with each trial (the module docstring)."""

    def __init__(
        self,
        *,
        study_name: str,
        trials: int,
        config: ConfigSource,
        sets: Sequence[str],
        space: Space,
        metric: str,
        pruner: str,
        out: Path,
        device: str,
        say: Callable[[str], None] = print,
    ):
        self.study_name, self.trials, self.config, self.sets = study_name, trials, config, list(sets)
        self.space, self.metric, self.pruner, self.out, self.device, self.say = space, metric, pruner, out, device, say
        self.current: optuna.Trial | None = None  # the trial this process runs or ran last
        self.failure: str | None = None  # its one line, where it failed for its own values
        self.surplus = False  # it was one too many (Surplus)
        self.guard: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext  # around the run

    def trial_sets(self, number: int, values: dict[str, Any], loggers: Sequence[str]) -> list[str]:
        """The trial's `--set`s: the sweep's, its name, csv among its loggers, its values of the space."""
        name = f"{self.study_name}-trial-{number:04d}"
        logs = [*loggers, *(["csv"] if "csv" not in loggers else [])]
        return [*self.sets, f"name={json.dumps(name)}", f"train.loggers={json.dumps(logs)}", *overrides(values)]

    def __call__(self, trial: "optuna.Trial") -> float:
        self.current, self.failure, self.surplus = trial, None, False
        number = trial.number
        trial.set_user_attr("number", number)
        trial.set_user_attr("worker", this_worker(number))  # every trial names its process, a surplus one too
        self._refuse_surplus(trial)
        values = self.space.suggest(trial)
        run_dir = run_dir_of(self.out, number)
        trial.set_user_attr("run_dir", str(run_dir.resolve()))
        for key in ("error", "steps", "stop_reason"):  # a retried trial starts with its original's attributes
            if key in trial.user_attrs:
                trial.set_user_attr(key, None)
        self.say(f"trial {number}: {param_text(values)} in {run_dir}")
        try:
            base = load_config(self.config, self.sets)
            sets = self.trial_sets(number, values, base.train.loggers)
            cfg = load_config(self.config, sets)
        except UserError as e:
            raise self._failed(trial, f"its config is refused: {str(e).removeprefix('config: ')}") from None
        trial.set_user_attr("config", json.loads(json.dumps(cfg.to_dict())))
        reporter = TrialReporter(trial, self.metric, self.pruner)
        try:
            with self.guard():
                result = train(self.config, sets, run_dir, callbacks=[reporter], device=self.device)
        except UserError as e:
            raise self._failed(trial, str(e)) from None
        self._keep_config(trial, run_dir)
        trial.set_user_attr("steps", result.step)
        trial.set_user_attr("stop_reason", result.stop_reason)
        if reporter.missing is not None:
            trial.set_user_attr("error", f"no {self.metric} in its validations")
            raise self._missing(number, reporter.missing)
        if reporter.pruned is not None:
            step, value = reporter.pruned
            self.say(f"trial {number} pruned at step {step}: {self.metric} {value:.6g}")
            raise optuna.TrialPruned(f"pruned at step {step}")
        value = result.final_metrics.get(self.metric)
        if value is None:
            raise self._missing(number, result.final_metrics)
        if not math.isfinite(value):
            raise self._failed(trial, f"{self.metric} is {value} at step {result.step}")
        self.say(f"trial {number} complete at step {result.step}: {self.metric} {value:.6g}")
        return float(value)

    def _refuse_surplus(self, trial: "optuna.Trial") -> None:
        """Fail a trial that another worker's trial made one too many: `trials` trials of lower numbers
        are finished, running or waiting (two workers asked for a trial at once; trial numbers are
        handed out in order, so the one of the higher number gives way)."""
        states = (*PRUNABLE_STATES, optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.WAITING)
        before = [t for t in trial.study.get_trials(deepcopy=False, states=states) if t.number < trial.number]
        if len(before) >= self.trials:
            self.surplus = True
            trial.set_user_attr("surplus", True)
            trial.set_user_attr("error", f"the study had its {self.trials} trials when it started")
            raise Surplus(f"trial {trial.number} is one too many: the study has its {self.trials} trials")

    def _missing(self, number: int, logged) -> MetricMissing:
        """The sweep's metric is none of `logged`, the names trial `number`'s validations logged."""
        return MetricMissing(
            f"--metric {self.metric} is not among the validation metrics of trial {number}'s run "
            f"({', '.join(logged)}); pass one of them"
        )

    def _failed(self, trial: "optuna.Trial", why: str) -> TrialFailed:
        line = " ".join(why.split())
        trial.set_user_attr("error", line)
        self.failure = f"trial {trial.number} failed: {line}"
        return TrialFailed(self.failure)

    def _keep_config(self, trial: "optuna.Trial", run_dir: Path) -> None:
        """The run's own config.yaml as the trial's `config` (a pack's header may have set keys), where written."""
        try:
            written = yaml.safe_load((run_dir / "config.yaml").read_text())
        except (OSError, yaml.YAMLError):
            return
        if isinstance(written, dict):
            trial.set_user_attr("config", written)
