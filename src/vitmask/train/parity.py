"""Compile parity: the compiled training step computes the eager step's loss and gradients.

`train.compile` wraps the network in torch.compile (inductor kernels; with
`compile_mode: reduce-overhead` on CUDA, replayed CUDA graphs). Nothing guarantees that those
kernels compute what the eager module computes, so this check measures it on the run itself: at a
checked step, the step's batch goes through the compiled net (forward and backward of every
micro-batch), the gradients are copied out, the same batch goes through the plain module from the
same weights and the same RNG state, and the two are compared. The step then goes on with the
compiled gradients, so a checked run follows the path of an unchecked one.

Tolerances are relative: |loss_c - loss_e| / |loss_e| and ||g_c - g_e|| / ||g_e|| over all
parameters at once, where both differ only by the order of floating-point sums. In fp32 (inductor
fuses and reorders reductions) they stay within 1e-4; under bf16 autocast each matmul rounds its
inputs to 8 bits of mantissa and a fused kernel may keep an intermediate in fp32 where eager
rounds it, so the bound is 3e-2. A wrong kernel, a stale replay or an overwritten gradient is
off by far more (order 1).
"""

import math
from dataclasses import dataclass

import torch

TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2, "fp16": 3e-2}


def tolerance(precision: str) -> float:
    """The relative bound for a step run at `precision` (fp32, bf16 or fp16: what autocast uses)."""
    return TOLERANCE[precision]


@dataclass(frozen=True)
class StepParity:
    step: int  # the step checked (0-based: the number of steps before it)
    loss_compiled: float
    loss_eager: float
    loss_rel: float  # |loss_c - loss_e| / |loss_e|
    grad_rel: float  # ||g_c - g_e|| / ||g_e||, over every parameter with a gradient
    grad_cos: float  # cosine between g_c and g_e, over every parameter with a gradient
    worst_param: str  # the parameter whose gradient differs most, relative to its own norm
    worst_rel: float
    tol: float

    @property
    def ok(self) -> bool:
        return self.loss_rel <= self.tol and self.grad_rel <= self.tol

    def line(self) -> str:
        verdict = "ok" if self.ok else "MISMATCH"
        return (
            f"step {self.step:>6}  loss {self.loss_compiled:.6f} compiled, {self.loss_eager:.6f} eager  "
            f"rel {self.loss_rel:.2e}  grad rel {self.grad_rel:.2e} (worst {self.worst_param} {self.worst_rel:.2e})  "
            f"tol {self.tol:.0e}  {verdict}"
        )


def _grads(named: list[tuple[str, torch.nn.Parameter]]) -> dict[str, torch.Tensor]:
    """Each parameter's summed gradient, copied out in fp32 (out of a CUDA graph's pool, if there)."""
    return {n: p.grad.detach().float().clone() for n, p in named if p.grad is not None}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (0 when both are 0)."""
    diff, ref = float((a - b).norm()), float(b.norm())
    return diff / ref if ref > 0 else (0.0 if diff == 0 else math.inf)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """a . b / (||a|| ||b||), in float64 (1 when both are 0, 0 when one is)."""
    a, b = a.double(), b.double()
    norms = float(a.norm() * b.norm())
    if norms == 0:
        return 1.0 if float(a.norm()) == float(b.norm()) else 0.0
    return float(a @ b) / norms


@dataclass
class ComparedStep:
    """Both passes of one step over one batch: the verdict, and what each pass left for the update."""

    parity: StepParity
    compiled: tuple  # what Trainer.backward returned for the compiled pass
    eager: tuple  # and for the eager one
    grads_compiled: dict[str, torch.Tensor]  # each parameter's gradient (fp32 copies)
    grads_eager: dict[str, torch.Tensor]

    def apply(self, trainer, use: str = "compiled") -> dict[str, torch.Tensor]:
        """The step's update from the `use` pass's gradients (compiled or eager), as Trainer.train_step does."""
        grads, outputs = (self.grads_compiled, self.compiled) if use == "compiled" else (self.grads_eager, self.eager)
        for n, p in trainer.model.named_parameters():
            if p.requires_grad:
                p.grad = grads[n].to(p.dtype) if n in grads else None
        return trainer.apply_step(*outputs)


def compare_step(trainer, batch, precision: str) -> ComparedStep:
    """Forward and backward of `batch` through `trainer`'s compiled net and then through its plain
    module, from the same weights and the same RNG state; no update yet (ComparedStep.apply)."""
    named = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
    devices = [trainer.device] if trainer.device.type == "cuda" else []
    trainer.net.train()
    with torch.random.fork_rng(devices=devices):  # the eager pass draws what the compiled one drew
        compiled = trainer.backward(batch)
    g_compiled = _grads(named)
    trainer.optimizer.zero_grad(set_to_none=True)
    with trainer.eager():
        trainer.net.train()
        with torch.random.fork_rng(devices=devices):
            eager = trainer.backward(batch)
    g_eager = _grads(named)
    if set(g_compiled) != set(g_eager):
        missing = sorted(set(g_compiled) ^ set(g_eager))
        raise AssertionError(f"the compiled and eager steps gave gradients to different parameters: {missing[:4]}")
    loss_c = float(torch.stack(compiled[0]).mean())
    loss_e = float(torch.stack(eager[0]).mean())
    names = sorted(g_eager)
    flat_c = torch.cat([g_compiled[n].flatten() for n in names])
    flat_e = torch.cat([g_eager[n].flatten() for n in names])
    per_param = {n: _relative(g_compiled[n], g_eager[n]) for n in names}
    worst = max(per_param, key=per_param.get)
    result = StepParity(
        step=trainer.step,
        loss_compiled=loss_c,
        loss_eager=loss_e,
        loss_rel=abs(loss_c - loss_e) / max(abs(loss_e), 1e-12),
        grad_rel=_relative(flat_c, flat_e),
        grad_cos=_cosine(flat_c, flat_e),
        worst_param=worst,
        worst_rel=per_param[worst],
        tol=tolerance(precision),
    )
    return ComparedStep(result, compiled, eager, g_compiled, g_eager)


def checked_step(trainer, batch, precision: str) -> StepParity:
    """One training step of `trainer` (whose net is compiled) over `batch`, checked against eager.

    The compiled pass runs first and its gradients drive the update, as in `Trainer.train_step`.
    """
    compared = compare_step(trainer, batch, precision)
    compared.apply(trainer, "compiled")
    return compared.parity


def check_run(trainer, steps: int, every: int, precision: str, on_result=None) -> list[StepParity]:
    """Train `steps` steps, checking every `every`-th one (steps 0, every, 2 * every, ...).

    `on_result` is called with each StepParity as it is known (a script prints it).
    """
    results = []
    while trainer.step < steps:
        batch = trainer.sampler.sample()
        if trainer.step % every == 0:
            results.append(checked_step(trainer, batch, precision))
            if on_result is not None:
                on_result(results[-1])
        else:
            trainer.train_step(batch)
    return results
