"""Reporting a training run: the numbers the trainer hands over become console lines, TensorBoard
scalars and images, and the hparams table. The trainer computes; the reporter formats and writes.

- Training windows (`train`): the masked-patch metrics of the window (metrics.SCALARS: loss, acc,
  acc_nonempty, bit_acc) as `train/<name>`, plus `train/lr`, `train/grad_norm`,
  `train/images_per_s` (timed here, from one window to the next) and on CUDA `train/peak_mem_gib`;
  on the console one line per window, or the loss beside a progress bar on a terminal.
- Evaluations (`validation`): `val/<name>` for the same metrics, the reconstruction grid as
  `val/reconstruction`, and one console line with the majority-class accuracy beside them.
- The EMA's evaluations (`validation_ema`, with `train.ema_decay`): `val_ema/<name>` for the same
  metrics on the EMA weights, and one console line.
- Online probes (`probe`, every `train.probe_every` steps): `probe/knn_acc` and `probe/linear_acc`
  as probe.OnlineProbe gives them, and one console line.
- At the end (`hparams`): every config key as `section.key` beside `hparam/val_<name>` and
  `hparam/best_val_loss`, to compare runs side by side; a run started with `--init` adds `init`,
  the path of its initial weights.
- Checkpoints (`checkpoint`): their paths to the loggers that keep them (W&B, MLflow; loggers.py).
- A stop a callback asked for (`stopped`): its one console line.

`train`, `validation` and `validation_ema` return the scalars they log (on every rank): what the
callbacks' hooks get. Only rank 0 reports (`main`); the other ranks' reporters stay silent.
"""

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from vitmask import outputs
from vitmask.config import Config
from vitmask.evaluate.metrics import SCALARS
from vitmask.progress import clock
from vitmask.train.loggers import NullLogger, flat_hparams


class Reporter:
    def __init__(self, cfg: Config, logger=None, device: torch.device | None = None, main: bool = True):
        self.cfg = cfg
        self.logger = logger or NullLogger()
        self.device = device or torch.device("cpu")
        self.main = main
        self.scalars = SCALARS  # the training metrics logged (a classifier's task logs fewer)
        self.progress = False
        self.bar = tqdm(disable=True)
        self.stdout_closed = False  # the reader of stdout went away (`vitmask train | head`)
        self._window_start = time.perf_counter()

    def start(self, step: int, progress: bool | None = None) -> None:
        """The loop starts at `step`: a progress bar when `progress` (default: stdout is a terminal)."""
        self.progress = sys.stdout.isatty() and self.main if progress is None else progress
        train = self.cfg.train
        self.bar = tqdm(total=train.max_steps, initial=step, disable=not self.progress, file=sys.stdout, desc="train")
        self._window_start = time.perf_counter()

    def advance(self) -> None:
        """One step done."""
        self.bar.update(1)

    def end(self) -> None:
        """The loop is over (or stopped): close the progress bar."""
        self.bar.close()

    def train(self, step: int, metrics: dict[str, float], grad_norm: float, lr: float, images: int) -> dict[str, float]:
        """A training window: `metrics` as MaskedPatchMetrics.read gives them, the mean gradient norm,
        the lr of the last step and the images trained on since the last window. Returns the scalars."""
        now = time.perf_counter()
        seconds = max(now - self._window_start, 1e-9)  # the window's steps and whatever ran between them
        scalars = {f"train/{k}": metrics[k] for k in self.scalars}
        scalars["train/lr"] = lr
        scalars["train/grad_norm"] = grad_norm
        scalars["train/images_per_s"] = images / seconds
        if self.device.type == "cuda":
            scalars["train/peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self._window_start = now
        if not self.main:
            return scalars
        self.logger.log(scalars, step)
        if self.progress:
            self.bar.set_postfix(loss=f"{scalars['train/loss']:.4f}")
            return scalars
        self._say(
            f"step {step}/{self.cfg.train.max_steps}  loss {scalars['train/loss']:.5f}"
            f"  acc {scalars['train/acc']:.4f}  lr {lr:.3e}  grad norm {grad_norm:.3f}"
            f"  {scalars['train/images_per_s']:.0f} img/s  ETA {self._eta(step, images, seconds)}"
        )
        return scalars

    def _eta(self, step: int, images: int, seconds: float) -> str:
        """When the run will be done, at this window's rate (validations and probes in it included)."""
        steps = images / self.cfg.data.batch_size
        left = self.cfg.train.max_steps - step
        return clock(round(left * seconds / steps)) if steps > 0 else "?"

    def validation(self, step: int, val: dict, grid: Callable[[], torch.Tensor]) -> dict[str, float]:
        """An evaluation: `val` as `evaluate` gives it; `grid` draws the reconstruction grid (rank 0 only).
        Returns the scalars."""
        scalars = {f"val/{k}": val[k] for k in SCALARS}
        if not self.main:
            return scalars
        self.logger.log(scalars, step)
        self.logger.log_image("val/reconstruction", grid(), step)
        line = (
            f"step {step}/{self.cfg.train.max_steps}  val loss {val['loss']:.4f}  acc {val['acc']:.4f}"
            f"  non-empty acc {val['acc_nonempty']:.4f}  (majority {val['majority_acc']:.4f})"
        )
        self._say(line)
        return scalars

    def validation_ema(self, step: int, val: dict) -> dict[str, float]:
        """An evaluation of the EMA weights, on the same masks as `validation`'s. Returns the scalars."""
        scalars = {f"val_ema/{k}": val[k] for k in SCALARS if k in val}
        if not self.main:
            return scalars
        self.logger.log(scalars, step)
        self._say(
            f"step {step}/{self.cfg.train.max_steps}  EMA val loss {val['loss']:.4f}  acc {val['acc']:.4f}"
            + (f"  non-empty acc {val['acc_nonempty']:.4f}" if "acc_nonempty" in val else "")
        )
        return scalars

    def probe(self, step: int, accuracies: dict[str, float]) -> None:
        """An online probe: `accuracies` as probe.OnlineProbe gives them ({"probe/knn_acc", "probe/linear_acc"})."""
        if not self.main:
            return
        self.logger.log(accuracies, step)
        line = (
            f"step {step}/{self.cfg.train.max_steps}  probe on val: k-NN acc {accuracies['probe/knn_acc']:.4f}"
            f"  linear acc {accuracies['probe/linear_acc']:.4f}"
        )
        self._say(line)

    def compile_check(self, check, run_dir=None) -> None:
        """The compiled step's check against eager (compile_check.CompileCheck): its line on the console
        and appended to `compile_check.txt` in the run dir, its figures as `compile_check/*` scalars."""
        if not self.main:
            return
        self.logger.log(check.scalars(), check.parity.step)
        self._say(check.line())
        if run_dir is not None:
            with open(Path(run_dir) / "compile_check.txt", "a") as f:
                f.write(check.line() + "\n")

    def checkpoint(self, kind: str, path: Path) -> None:
        """A checkpoint written (`kind` last or best) to the loggers that keep its path; a logger
        without `log_checkpoint` is passed over."""
        if self.main and hasattr(self.logger, "log_checkpoint"):
            self.logger.log_checkpoint(kind, path)

    def stopped(self, line: str) -> None:
        """The line of a run that a callback stopped."""
        if self.main:
            self._say(line)

    def _say(self, line: str) -> None:
        """One console line. If stdout's reader has gone, say nothing more (stdout -> /dev/null, so the
        interpreter's last flush is quiet) and set `stdout_closed`: the trainer stops as for a signal."""
        if self.stdout_closed:
            return
        try:
            self.bar.write(line, file=sys.stdout)
            sys.stdout.flush()
        except BrokenPipeError:
            self.stdout_closed = True
            outputs.mute_stdout()

    def hparams(self, val: dict, best_val_loss: float, step: int, init: dict | None = None) -> None:
        """The run's config beside its final validation metrics, once, at the last step; a run started
        from given weights (`init`, the trainer's record of them) also has their path as `init`."""
        if not self.main:
            return
        metrics = {f"hparam/val_{k}": val[k] for k in SCALARS if k in val}
        metrics["hparam/best_val_loss"] = best_val_loss
        hparams = flat_hparams(self.cfg)
        if init is not None:
            hparams["init"] = str(init.get("path"))
        self.logger.log_hparams(hparams, metrics, step)

    def close(self) -> None:
        self.logger.close()
