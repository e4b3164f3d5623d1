"""Catching a diverged run: the first step whose loss is NaN or inf, and a gradient norm that blows up.

The training step records a non-finite loss on the device with no host sync (`record`); the trainer
reads it (`check`, one sync) on logging steps and before every checkpoint write, so no checkpoint is
ever written after a bad step and the error names the step where the loss first went bad.

A run can also go wrong with a finite loss: on a GPU, a compiled step with a wrong gradient kept a
normal-looking loss while its gradient norm grew from below 1 to 2e7 (docs/gpu.md). Adam divides
the gradient by its own scale, so such a run trains on and logs nothing alarming. `grad_norm` reads
each log window's mean gradient norm (already on the host there) against the first window that ends
after warm-up (`train.warmup_steps`): above GROWTH times it, a warning once; above it for PERSIST
windows in a row, a stop with one line. A healthy run's norm rises a few times over its first
thousands of steps and falls as the loss does, far from a thousandfold.
"""

import math

import torch

from vitmask.errors import UserError, warn
from vitmask.runtime import distributed
from vitmask.runtime.distributed import World

GROWTH = 1000.0  # a window's mean gradient norm over this many times the reference window's is a blow-up
PERSIST = 3  # log windows in a row above it that stop the run


class DivergenceWatch:
    def __init__(self, device: torch.device, warmup_steps: int = 0):
        self.first_bad_step = torch.zeros((), dtype=torch.long, device=device)  # 0 = none yet
        self.warmup_steps = warmup_steps
        self.reference: tuple[int, float] | None = None  # (step, mean grad norm) of the first window after warm-up
        self.windows_over = 0  # log windows in a row above GROWTH x the reference
        self.warned = False

    def record(self, loss: torch.Tensor, step: int) -> None:
        """Remember `step` if its loss (a device scalar) is not finite and no earlier step was bad."""
        bad = (self.first_bad_step == 0) & ~torch.isfinite(loss)
        self.first_bad_step = torch.where(bad, step, self.first_bad_step)

    def check(self, world: World) -> None:
        """Raise a UserError naming the first step with a non-finite loss on any rank, if there was one."""
        bad = int(distributed.all_max(self.first_bad_step.clone(), world))
        if bad:
            raise UserError(
                f"training diverged: the loss is NaN or inf at step {bad}; no checkpoint was written after it; "
                "lower train.lr, set train.grad_clip, or use train.precision=fp32"
            )

    def grad_norm(self, step: int, mean_norm: float, loss: float) -> None:
        """A log window ending at `step`, its mean gradient norm and loss (host floats, the same on every
        rank): warn once when the norm passes GROWTH x the reference window's; raise a UserError when it
        stays there PERSIST windows in a row."""
        if step <= self.warmup_steps:
            return
        if self.reference is None:
            if math.isfinite(mean_norm) and mean_norm > 0:
                self.reference = (step, mean_norm)
            return
        ref_step, ref = self.reference
        if not (mean_norm <= GROWTH * ref):  # NaN and inf count as over
            self.windows_over += 1
        else:
            self.windows_over = 0
            return
        what = (
            f"the mean gradient norm is {mean_norm:.3g} at step {step}, over {GROWTH:.0f}x the {ref:.3g} of "
            f"the window to step {ref_step}, while the loss reads {loss:.4g}"
        )
        if self.windows_over >= PERSIST:
            raise UserError(
                f"training is blowing up: {what}, for {PERSIST} log windows in a row; lower train.lr or set "
                "train.grad_clip; with train.compile, read the compile check's line (docs/gpu.md)"
            )
        if not self.warned:
            self.warned = True
            warn(f"{what}; the run stops if this lasts {PERSIST} log windows in a row")

    def state_dict(self) -> dict:
        return {"reference": list(self.reference) if self.reference is not None else None}

    def load_state_dict(self, state: dict) -> None:
        ref = state.get("reference")
        self.reference = (int(ref[0]), float(ref[1])) if isinstance(ref, list) and len(ref) == 2 else None
