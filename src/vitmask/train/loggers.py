"""Metric loggers. The trainer's reporter calls `log(metrics, step)`, `log_image`, `log_hparams`,
`log_checkpoint` and `close()`, and knows nothing else.

`train.loggers` names the loggers of a run (`build_loggers`; docs/training.md#loggers):

- `tensorboard` (the default): event files in the run dir, with the reconstruction grids and one
  hparams session (the config beside the final metrics, to compare runs side by side);
- `csv`: metrics.csv in the run dir, `jsonl`: metrics.jsonl in the run dir: one row per step that
  logged anything (the training window's numbers, and on validation steps the validation's
  beside them), written when the next such step comes and at every checkpoint; standard library
  only, read by `csv.DictReader`, `json.loads` per line, or pandas (`read_csv`, `read_json(lines=True)`).
  A resumed run first drops the rows past its checkpoint's step, which the run it continues logged
  after that checkpoint and will log again;
- `wandb`: Weights & Biases (the wandb extra): one W&B run per vitmask run (its id is the run's id, so
  a resume continues it), the config, every scalar by step, the reconstruction grids, the final
  metrics and the checkpoints' paths in its summary (`checkpoint/last`, `checkpoint/best`); W&B's
  own settings apply (WANDB_PROJECT, default `vitmask`; WANDB_MODE=offline; WANDB_DIR);
- `mlflow`: MLflow (the mlflow extra), through `MlflowClient` on MLflow's tracking URI
  (MLFLOW_TRACKING_URI; MLflow's default otherwise), in the experiment MLFLOW_EXPERIMENT_NAME
  (default `vitmask`): one MLflow run per vitmask run (tagged `vitmask.run_id`, so a resume continues
  it), the config as params (as the run started) and as the artifact config.yaml, every scalar by
  step, the checkpoints' paths as tags (`checkpoint/last`, `checkpoint/best`). No pictures.

A missing extra is one line naming the pip command (`check_extras`, before the run dir is made).
`NullLogger` drops everything (ranks other than 0 under torchrun, runs without a run dir).
"""

import contextlib
import csv
import importlib
import importlib.util
import json
import math
import os
import time
from pathlib import Path

import torch

from vitmask.config import Config, dump_config, flatten_config
from vitmask.errors import UserError
from vitmask.outputs import write_error

EXTRAS = {"wandb": "wandb", "mlflow": "mlflow"}  # logger -> the module its extra installs
CSV_NAME, JSONL_NAME = "metrics.csv", "metrics.jsonl"


class NullLogger:
    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_image(self, tag: str, image: torch.Tensor, step: int) -> None:
        pass

    def log_hparams(self, hparams: dict, metrics: dict[str, float], step: int = 0) -> None:
        pass

    def log_checkpoint(self, kind: str, path: Path) -> None:
        """A checkpoint was written: `kind` last (step_<step>.pt, which last.pt is) or best (best.pt)."""

    def close(self) -> None:
        pass


class TensorBoardLogger(NullLogger):
    def __init__(self, run_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def log_image(self, tag: str, image: torch.Tensor, step: int) -> None:
        """image: (3, H, W) float in [0, 1]."""
        self.writer.add_image(tag, image, step)
        self.writer.flush()

    def log_hparams(self, hparams: dict, metrics: dict[str, float], step: int = 0) -> None:
        """One hparams session for the run: its config beside its final metrics, at the last `step`."""
        self.writer.add_hparams(hparams, metrics, run_name=".", global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _StepRows(NullLogger):
    """One row per step that logged anything: the metrics of one step gathered, written when a later
    step logs, at a checkpoint and at `close`. On opening, the rows past `start_step` are dropped."""

    def __init__(self, path: Path, start_step: int = 0):
        self.path = Path(path)
        self.step: int | None = None  # the step whose row is being gathered
        self.row: dict[str, float] = {}
        kept = [r for r in self._read() if r.get("step") is not None and r["step"] <= start_step]
        self.columns = ["step", *dict.fromkeys(k for r in kept for k in r if k != "step")]
        if kept or self.path.exists():
            self._rewrite(kept)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if step != self.step:
            self._write_row()
            self.step = step
        self.row.update({k: float(v) for k, v in metrics.items()})

    def log_checkpoint(self, kind: str, path: Path) -> None:
        self._write_row()

    def close(self) -> None:
        self._write_row()

    def _write_row(self) -> None:
        if self.step is None or not self.row:
            return
        row, self.row = {"step": self.step, **self.row}, {}
        new = [k for k in row if k not in self.columns]
        try:
            if new:  # a column no row had: the file again, with it
                self.columns += new
                self._rewrite([*self._read(), row])
            else:
                with open(self.path, "a", newline="") as f:
                    f.write(self._format([row]))
        except OSError as e:
            raise write_error(e, self.path, "metrics file") from None

    def _rewrite(self, rows: list[dict]) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "w", newline="") as f:
                f.write(self._header() + self._format(rows))
            os.replace(tmp, self.path)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise write_error(e, self.path, "metrics file") from None

    def _read(self) -> list[dict]:
        raise NotImplementedError

    def _header(self) -> str:
        return ""

    def _format(self, rows: list[dict]) -> str:
        raise NotImplementedError


class CSVLogger(_StepRows):
    """metrics.csv: a header row (`step`, then each metric's name in the order first logged), then one
    row per step; a metric a row does not have is an empty cell, a non-finite value `nan` or `inf`."""

    def __init__(self, run_dir: str | Path, start_step: int = 0):
        super().__init__(Path(run_dir) / CSV_NAME, start_step)

    def _read(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, newline="") as f:
            rows = []
            for r in csv.DictReader(f):
                with contextlib.suppress(TypeError, ValueError):  # a row cut short by a crash is dropped
                    rows.append({k: int(v) if k == "step" else float(v) for k, v in r.items() if v not in ("", None)})
            return rows

    def _header(self) -> str:
        return ",".join(self.columns) + "\n"

    def _format(self, rows: list[dict]) -> str:
        return "".join(",".join(_csv_cell(r.get(k)) for k in self.columns) + "\n" for r in rows)


def _csv_cell(value) -> str:
    if value is None:
        return ""
    return str(value) if isinstance(value, int) else repr(float(value))


class JSONLinesLogger(_StepRows):
    """metrics.jsonl: one JSON object per step, `{"step": 25, "train/loss": 0.31, ...}`; a non-finite
    value is null (strict JSON)."""

    def __init__(self, run_dir: str | Path, start_step: int = 0):
        super().__init__(Path(run_dir) / JSONL_NAME, start_step)

    def _read(self) -> list[dict]:
        if not self.path.exists():
            return []
        rows = []
        for line in self.path.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line cut short by a crash is dropped
                row = json.loads(line)
                if isinstance(row, dict) and isinstance(row.get("step"), int):
                    rows.append({k: math.nan if v is None else v for k, v in row.items()})
        return rows

    def _format(self, rows: list[dict]) -> str:
        return "".join(json.dumps({k: _json_value(v) for k, v in r.items()}) + "\n" for r in rows)


def _json_value(value):
    return value if isinstance(value, int) or math.isfinite(value) else None


def _import_extra(logger: str):
    """The module of a logger's extra, or one line naming the pip command to install it."""
    name = EXTRAS[logger]
    try:
        return importlib.import_module(name)
    except ImportError:
        raise missing_extra(logger) from None


def missing_extra(logger: str) -> UserError:
    return UserError(
        f"train.loggers has {logger}, which needs the {logger} extra, and {EXTRAS[logger]} is not installed; "
        f"run: pip install 'vitmask[{logger}]' (in a checkout: pip install -e '.[{logger}]'), "
        f"or drop {logger} from train.loggers"
    )


def check_extras(cfg: Config) -> None:
    """Refuse (one line) a logger of `train.loggers` whose extra is not installed, before anything is written."""
    for logger in cfg.train.loggers:
        if logger not in EXTRAS:
            continue
        try:
            found = importlib.util.find_spec(EXTRAS[logger]) is not None
        except (ImportError, ValueError):  # a module set to None in sys.modules, a broken package
            found = False
        if not found:
            raise missing_extra(logger)


def flat_hparams(cfg: Config) -> dict[str, int | float | str | bool]:
    """Every config key as `section.key` (top-level keys as they are), in values TensorBoard, W&B and
    MLflow take: scalars and strings; lists (ranges) and None become text."""
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in flatten_config(cfg).items()}


class WandbLogger(NullLogger):
    """Weights & Biases: see the module docstring. Its console capture is off (the run's lines stay
    vitmask's own)."""

    def __init__(self, cfg: Config, run_id: str | None):
        wandb = self.wandb = _import_extra("wandb")
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "vitmask",
            # the environment as it is now: W&B reads its variables once a process, so a second run in one
            # process (a sweep, a notebook) would write where the first one did
            dir=os.environ.get("WANDB_DIR") or None,
            mode=os.environ.get("WANDB_MODE") or None,
            name=cfg.name,
            id=run_id,
            resume="allow",
            config=cfg.to_dict(),
            settings=wandb.Settings(console="off"),
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_image(self, tag: str, image: torch.Tensor, step: int) -> None:
        picture = (image.detach().float().clamp(0, 1).permute(1, 2, 0) * 255).round().byte().cpu().numpy()
        self.run.log({tag: self.wandb.Image(picture)}, step=step)

    def log_hparams(self, hparams: dict, metrics: dict[str, float], step: int = 0) -> None:
        self.run.summary.update(dict(metrics))

    def log_checkpoint(self, kind: str, path: Path) -> None:
        self.run.summary[f"checkpoint/{kind}"] = str(path)

    def close(self) -> None:
        self.run.finish()


class MLflowLogger(NullLogger):
    """MLflow: see the module docstring."""

    def __init__(self, cfg: Config, run_id: str | None, run_dir: Path):
        mlflow = _import_extra("mlflow")
        from mlflow.entities import Metric, Param

        self.Metric = Metric
        self.client = mlflow.MlflowClient()
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "vitmask"
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        found = []
        if run_id is not None:
            found = self.client.search_runs([experiment_id], filter_string=f"tags.`vitmask.run_id` = '{run_id}'")
        if found:  # a resumed run: the MLflow run it began
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            return
        tags = {"vitmask.run_dir": str(run_dir), **({"vitmask.run_id": run_id} if run_id else {})}
        self.run_id = self.client.create_run(experiment_id, tags=tags, run_name=cfg.name).info.run_id
        params = [Param(k, str(v)) for k, v in flat_hparams(cfg).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])
        self.client.log_text(self.run_id, dump_config(cfg), "config.yaml")

    def log(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self.Metric(k, float(v), now, step) for k, v in metrics.items()])

    def log_hparams(self, hparams: dict, metrics: dict[str, float], step: int = 0) -> None:
        self.log(metrics, step)

    def log_checkpoint(self, kind: str, path: Path) -> None:
        self.client.set_tag(self.run_id, f"checkpoint/{kind}", str(path))

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Loggers(NullLogger):
    """Several loggers as one: each call goes to each; `close` closes every one, then raises the first error."""

    def __init__(self, loggers: list):
        self.loggers = loggers

    def log(self, metrics: dict[str, float], step: int) -> None:
        for logger in self.loggers:
            logger.log(metrics, step)

    def log_image(self, tag: str, image: torch.Tensor, step: int) -> None:
        for logger in self.loggers:
            logger.log_image(tag, image, step)

    def log_hparams(self, hparams: dict, metrics: dict[str, float], step: int = 0) -> None:
        for logger in self.loggers:
            logger.log_hparams(hparams, metrics, step)

    def log_checkpoint(self, kind: str, path: Path) -> None:
        for logger in self.loggers:
            logger.log_checkpoint(kind, path)

    def close(self) -> None:
        first = None
        for logger in self.loggers:
            try:
                logger.close()
            except Exception as e:  # the others are closed all the same
                first = first or e
        if first is not None:
            raise first


def build_loggers(cfg: Config, run_dir: Path, run_id: str | None = None, start_step: int = 0) -> NullLogger:
    """The loggers `train.loggers` names, writing to `run_dir` (those that write there) from `start_step`
    (a resumed run's checkpoint step). The classes are read from this module at call time."""
    made: list = []
    try:
        for name in cfg.train.loggers:
            if name == "tensorboard":
                made.append(TensorBoardLogger(run_dir))
            elif name == "csv":
                made.append(CSVLogger(run_dir, start_step))
            elif name == "jsonl":
                made.append(JSONLinesLogger(run_dir, start_step))
            elif name == "wandb":
                made.append(WandbLogger(cfg, run_id))
            elif name == "mlflow":
                made.append(MLflowLogger(cfg, run_id, run_dir))
    except BaseException:
        with contextlib.suppress(Exception):
            Loggers(made).close()
        raise
    return made[0] if len(made) == 1 else Loggers(made)
