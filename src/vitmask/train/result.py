"""What a finished run returns: `vitmask.train(...)` a `TrainResult`, `vitmask.finetune(...)` a
`FinetuneResult`; the `on_end` hook of a callback gets the same object. Plain data, no torch."""

from dataclasses import dataclass, field
from pathlib import Path

MAX_STEPS = "train.max_steps reached"  # the stop reason of a run that trained to its end


@dataclass(frozen=True)
class TrainResult:
    """A run that ended by itself: at `train.max_steps`, or stopped by a callback (early stopping).

    Metric names are the loggers': `val/loss`, `val/acc`, ... and `val_ema/...` with an EMA."""

    run_dir: Path | None
    """Where it wrote (None: a run without a run dir, which writes nothing)."""
    step: int
    """The step it reached."""
    stop_reason: str
    """Why it ended, in one line: `train.max_steps reached`, or the reason a callback gave."""
    stopped_early: bool
    """True when it ended before train.max_steps (a callback or early stopping asked it to)."""
    final_metrics: dict[str, float] = field(default_factory=dict)
    """The last validation's numbers."""
    best_metrics: dict[str, float] = field(default_factory=dict)
    """The numbers of the validation best.pt holds: the lowest validation loss (the EMA's with an EMA)."""
    best_step: int | None = None
    """The step of that validation."""
    best_checkpoint: Path | None = None
    """best.pt, where the run dir has one."""
    last_checkpoint: Path | None = None
    """last.pt, the checkpoint of the step reached (None without a run dir)."""


@dataclass(frozen=True)
class FinetuneResult(TrainResult):
    """A fine-tuning: the run's fields, then its test accuracy and the baselines'."""

    test_accuracy: float = float("nan")
    """The classifier's accuracy on the test split (its EMA's with an EMA), as `vitmask eval` scores it."""
    test_images: int = 0
    """How many test images that accuracy is over."""
    pretrained: str | None = None
    """The pretrained checkpoint or export it started from."""
    from_scratch: float | None = None
    """The same classifier from a random init at the same budget (with `baselines`)."""
    linear_probe: float | None = None
    """The linear probe of the pretrained model with the same pooling (with `baselines`)."""

    def report(self) -> dict:
        """The numbers `vitmask finetune --json` prints."""
        out = {
            "run_dir": str(self.run_dir),
            "checkpoint": self.pretrained,
            "steps": self.step,
            "stop_reason": self.stop_reason,
            "test_images": self.test_images,
            "finetuned": self.test_accuracy,
        }
        if self.from_scratch is not None:
            out["from_scratch"] = self.from_scratch
        if self.linear_probe is not None:
            out["linear_probe"] = self.linear_probe
        return out
