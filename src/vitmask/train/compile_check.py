"""The compiled step checks itself: its first step in a process, against eager, on the run's own batch.

With `train.compile`, nothing but a measurement says that the compiled kernels compute what the
module computes, and a wrong gradient does not show in the loss: on an H200 a compiled bf16 step
(SDPA on cuDNN) had the eager loss to 6e-4 and a gradient at cosine 0.948, and trained a model
30 nats worse while every logged line looked normal (docs/gpu.md). So the first step of every
process that trains compiled (a run's first step, and the first after each resume) runs the batch
through the compiled net and then through the plain module, from the same weights and RNG state
(parity.compare_step), and compares the two gradients over all parameters at once.

The verdict reads the gradient's cosine against a bound per precision (COSINE_BOUND) and the loss's
relative difference against parity's tolerance. Both paths sum the same products in other orders:
in fp32 the cosine stays above 0.99999; under bf16 autocast a fused kernel keeps in fp32 what eager
rounds to 8 bits of mantissa, which moves the cosine by about 1e-5 (0.999995 on the H200, above
0.9999 on a CPU). A wrong kernel moves it by 1e-2 or more. The bounds sit between.

What follows a failed check is `train.compile_check`: stop (a UserError: one line, exit 2, before
any update from the wrong gradient), eager (a warning; the step is applied with the eager gradient
and the run goes on uncompiled), or skip (no check at all).
"""

from dataclasses import dataclass

import torch

from vitmask.train.parity import StepParity

COSINE_BOUND = {"fp32": 0.9999, "bf16": 0.999, "fp16": 0.999}


@dataclass(frozen=True)
class CompileCheck:
    parity: StepParity
    device: str  # "cpu", "cuda:0"
    precision: str  # the precision the step ran in (auto resolved)
    attention: str  # sdpa.attention_name

    @property
    def bound(self) -> float:
        return COSINE_BOUND[self.precision]

    @property
    def ok(self) -> bool:
        return self.parity.grad_cos >= self.bound and self.parity.loss_rel <= self.parity.tol

    def figures(self) -> str:
        p = self.parity
        return (
            f"gradient cosine {p.grad_cos:.6f} (bound {self.bound}), largest relative difference "
            f"{p.worst_rel:.2e} ({p.worst_param}), loss relative difference {p.loss_rel:.1e}"
        )

    def line(self) -> str:
        """The line every checked run prints and keeps in its run dir."""
        verdict = "agrees" if self.ok else "DISAGREES"
        return (
            f"compile check at step {self.parity.step}: the compiled step {verdict} with eager: {self.figures()}; "
            f"{self.device}, {self.precision}, attention {self.attention}"
        )

    def failure(self) -> str:
        """The one line of a stopped run: what disagreed, where, and the settings that avoid it."""
        return (
            f"the compiled training step's gradient disagrees with the eager step's at step {self.parity.step} "
            f"on {self.device} ({self.precision}, attention {self.attention}): {self.figures()}; train eager with "
            "--set train.compile=false, or let the run go on eager with --set train.compile_check=eager "
            "(docs/gpu.md#the-compiled-step-checks-itself)"
        )

    def warning(self) -> str:
        return (
            f"the compiled training step's gradient disagrees with the eager step's at step {self.parity.step} "
            f"on {self.device} ({self.precision}, attention {self.attention}): {self.figures()}; "
            "train.compile_check=eager: this step and the rest of the run go on eager"
        )

    def scalars(self) -> dict[str, float]:
        """What TensorBoard (and any logger) keeps of it."""
        return {
            "compile_check/grad_cosine": self.parity.grad_cos,
            "compile_check/max_rel_diff": self.parity.worst_rel,
            "compile_check/loss_rel_diff": self.parity.loss_rel,
        }


def device_name(device: torch.device) -> str:
    """The device in the check's line: `cpu`, or `cuda:K (the GPU's name)`."""
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
