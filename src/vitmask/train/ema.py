"""An exponential moving average (EMA) of a model's weights, for `train.ema_decay`.

The EMA is a copy of the model (`module`, in fp32, in eval mode) whose parameters move towards the
trained ones after every optimizer step:

    ema <- decay_t * ema + (1 - decay_t) * weights,   decay_t = min(ema_decay, (1 + t) / (10 + t))

where t is the number of updates before this one (0 at the first step). The warm-up term (timm's
`ModelEma` and TensorFlow's `ExponentialMovingAverage` with `num_updates`) keeps the first updates
from averaging in the random initial weights for thousands of steps: decay_t is 0.1 at the first
update, 0.5 at t = 8, 0.9 at t = 80, 0.99 at t = 881 and 0.999 at t = 8990, capped by ema_decay.

The update is one `_foreach_lerp_` over the parameters with a Python float, so it costs no host
sync; buffers (the rotary and sin-cos tables, which are constants) are copied. The EMA's state dict is a
plain model state dict: checkpoints save it as `ema`, and exports and evaluation load it into a
model like any other weights.
"""

import copy

import torch
from torch import nn


def ema_decay_at(decay: float, t: int) -> float:
    """decay_t of update `t` (0-based): min(decay, (1 + t) / (10 + t))."""
    return min(decay, (1 + t) / (10 + t))


class WeightEMA:
    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.module = copy.deepcopy(model).float().eval().requires_grad_(False)  # the averaged weights
        self._ema_params = list(self.module.parameters())
        self._ema_buffers = list(self.module.buffers())

    @torch.no_grad()
    def update(self, model: nn.Module, t: int) -> None:
        """Move the EMA towards `model`'s weights by 1 - decay_t of update `t` (no host sync)."""
        weight = 1.0 - ema_decay_at(self.decay, t)
        params = [p.detach().float() for p in model.parameters()]
        torch._foreach_lerp_(self._ema_params, params, weight)
        for mine, theirs in zip(self._ema_buffers, model.buffers(), strict=True):
            mine.copy_(theirs)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The EMA weights as a model state dict (fp32)."""
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.module.load_state_dict(state)
