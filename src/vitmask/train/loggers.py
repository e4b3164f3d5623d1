"""Metric loggers. The trainer calls `log(metrics, step)` and `close()`, and knows nothing else.

`TensorBoardLogger` writes event files to the run dir; `NullLogger` drops everything (tests, and
ranks other than 0 under torchrun). Besides scalars there are images (`log_image`) and one hparams
session (`log_hparams`: the config with the final metrics, for comparing runs side by side).
"""

from pathlib import Path

import torch


class NullLogger:
    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_image(self, tag: str, image: torch.Tensor, step: int) -> None:
        pass

    def log_hparams(self, hparams: dict, metrics: dict[str, float], step: int = 0) -> None:
        pass

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
