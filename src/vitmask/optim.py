"""The optimizer and the learning-rate schedule.

Weight decay applies to weight matrices only. A parameter is exempt when it has fewer than two
dimensions (biases, LayerNorm weights) or its name is the positional embedding (`pos`) or the mask
embedding (`mask_token`): decaying those pulls them towards zero for no gain in generalisation.

The schedule is a multiplier on `train.lr`: a linear warmup from 0 over `warmup_steps`, then
constant, a cosine decay or a linear decay, the last two reaching `min_lr` at `max_steps`. It is a
`LambdaLR`, so its state is plain data in the checkpoint.
"""

import math

import torch

from vitmask.config import TrainConfig

NO_DECAY_NAMES = ("pos", "mask_token")


def decays(name: str, param: torch.nn.Parameter) -> bool:
    """Whether weight decay applies to the parameter called `name` (a dotted state-dict name)."""
    return param.ndim >= 2 and name.split(".")[-1] not in NO_DECAY_NAMES


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two optimizer groups: the decayed weight matrices, and everything else with decay 0."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if decays(n, p)], "weight_decay": weight_decay},
        {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0},
    ]


def build_optimizer(model: torch.nn.Module, t: TrainConfig) -> torch.optim.Optimizer:
    cls = torch.optim.AdamW if t.optimizer == "adamw" else torch.optim.Adam
    # on CUDA the fused kernel updates every tensor in one launch; the CPU keeps the default (foreach)
    fused = next(model.parameters()).is_cuda
    return cls(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=fused or None)


def lr_factor(step: int, t: TrainConfig) -> float:
    """The lr of optimisation step `step` (0-based) divided by `train.lr`."""
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    if t.schedule == "constant":
        return 1.0
    span = max(t.max_steps - t.warmup_steps - 1, 1)
    progress = min((step - t.warmup_steps) / span, 1.0)
    floor = t.min_lr / t.lr
    if t.schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, t: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, t))
