"""Catching a diverged run: the first step whose loss is NaN or inf.

The training step records it on the device with no host sync (`record`); the trainer reads it
(`check`, one sync) on logging steps and before every checkpoint write, so no checkpoint is ever
written after a bad step and the error names the step where the loss first went bad.
"""

import torch

from vitmask.errors import UserError
from vitmask.runtime import distributed
from vitmask.runtime.distributed import World


class DivergenceWatch:
    def __init__(self, device: torch.device):
        self.first_bad_step = torch.zeros((), dtype=torch.long, device=device)  # 0 = none yet

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
