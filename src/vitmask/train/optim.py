"""The optimizer and the learning-rate schedule.

Weight decay applies to weight matrices only. A parameter is exempt when it has fewer than two
dimensions (biases, LayerNorm weights) or its name is the positional embedding (`pos`) or the mask
embedding (`mask_token`): decaying those pulls them towards zero for no gain in generalisation.

`train.optimizer: muon` updates the weight matrices inside the transformer blocks with Muon
(Nesterov momentum, then Newton-Schulz orthogonalisation of the update; Jordan et al. 2024) and
everything else (patch embedding, head, positions, mask embedding, biases, norms) with AdamW, as
Muon's authors prescribe. Muon's step is scaled to AdamW's update RMS (Moonshot's
`match_rms_adamw`), so both share `train.lr`, its schedule and `train.weight_decay`.
`Muon` here is torch.optim.Muon's algorithm, hyperparameters and state dict, with two changes:
the Newton-Schulz iteration runs in `train.muon_dtype` on every device (fp32 by default; torch's
always casts to bf16, which a CPU without bf16 instructions emulates about 100x slower, and which
makes a CPU and a GPU run different arithmetic); and matrices of one shape, an (R, S) one with the
(S, R) ones transposed, are orthogonalised together as one batch, with the momentum, decay and
update as foreach ops. The momentum buffers are made once, on the first step, not looked up and
allocated per step.

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


NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic's a, b, c (Jordan et al. 2024; torch's defaults)


def orthogonalize(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """(..., R, S) -> (..., R, S): each matrix pushed towards U V^T of its SVD U S V^T (Muon's zeroth power).

    Each matrix is scaled to Frobenius norm 1 (so its spectral norm is at most 1), then `steps` of
    the quintic X <- a X + (b A + c A^2) X with A = X X^T on its wide orientation (R <= S, where
    A is the smaller Gram matrix). Singular values end near 1 (within about 0.7 to 1.2), not at 1.
    Runs in g's dtype. Each step is three batched matmuls with the sums folded in (`baddbmm`): on a
    CPU the separate element-wise ops cost more than the matmuls of these small matrices.
    """
    a, b, c = NS_COEFFICIENTS
    tall = g.shape[-2] > g.shape[-1]
    x = g.mT if tall else g  # (..., r, s) with r <= s
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp_min(eps)
    x = x.reshape(-1, *x.shape[-2:])  # (k, r, s)
    for _ in range(steps):
        gram = x @ x.mT  # (k, r, r)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A^2
        x = torch.baddbmm(x, poly, x, beta=a)  # a X + (b A + c A^2) X
    x = x.reshape(*g.shape[:-2], *x.shape[-2:])
    return x.mT if tall else x


def rms_matched_lr(lr: float, shape: tuple[int, int]) -> float:
    """Muon's lr for a (R, S) matrix, scaled so its update's RMS matches AdamW's (~0.2): lr * 0.2 * sqrt(max(R, S))."""
    return lr * 0.2 * math.sqrt(max(shape[0], shape[1]))


MUON_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Muon(torch.optim.Muon):
    """torch.optim.Muon (its defaults, checks and state: one `momentum_buffer` per matrix) with a
    step that orthogonalises in `dtype` on every device, every shape as one batch."""

    def __init__(self, params, dtype: torch.dtype = torch.float32, **kwargs):
        super().__init__(params, **kwargs)
        self.dtype = dtype

    def momentum_buffers(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each matrix's momentum buffer, made (zeros) on its first step only."""
        state = self.state
        missing = [p for p in params if "momentum_buffer" not in state[p]]
        for p in missing:
            state[p]["momentum_buffer"] = torch.zeros_like(p)
        return [state[p]["momentum_buffer"] for p in params]

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            if group["adjust_lr_fn"] != "match_rms_adamw":
                raise ValueError("vitmask's Muon scales its lr to AdamW's RMS only (adjust_lr_fn='match_rms_adamw')")
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            bufs = self.momentum_buffers(params)
            torch._foreach_lerp_(bufs, grads, 1 - group["momentum"])
            updates = torch._foreach_lerp(grads, bufs, group["momentum"]) if group["nesterov"] else bufs
            if group["weight_decay"]:
                torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
            # one batch per shape, an (R, S) matrix with the (S, R) ones as its transpose: all wide
            by_shape: dict[tuple[int, int], list[int]] = {}
            for i, p in enumerate(params):
                by_shape.setdefault((min(p.shape), max(p.shape)), []).append(i)
            for shape, index in by_shape.items():
                tall = [params[i].shape[0] > params[i].shape[1] for i in index]
                stacked = torch.stack([updates[i].mT if t else updates[i] for i, t in zip(index, tall, strict=True)])
                # stacked: (k, r, s) with r <= s
                ortho = orthogonalize(stacked.to(self.dtype), group["ns_steps"], group["eps"]).unbind(0)  # k x (r, s)
                steps = [(o.mT if t else o).to(params[i].dtype) for i, o, t in zip(index, ortho, tall, strict=True)]
                # rms_matched_lr reads max(R, S), the same for every matrix of the batch
                torch._foreach_add_([params[i] for i in index], steps, alpha=-rms_matched_lr(group["lr"], shape))


def is_hidden_matrix(name: str, param: torch.nn.Parameter) -> bool:
    """Whether Muon updates `name`: a weight matrix of a transformer block (the encoder's or a decoder's)."""
    return param.ndim == 2 and "blocks" in name.split(".")


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the blocks' weight matrices and AdamW for every other parameter, as one optimizer.

    The two inner optimizers own the parameters and their state; `param_groups` is their groups'
    list (the same dicts), so an lr scheduler, a GradScaler and `zero_grad` see every parameter.
    The state dict holds both inner ones.
    """

    def __init__(self, model: torch.nn.Module, t: TrainConfig):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        hidden = [p for n, p in named if is_hidden_matrix(n, p)]
        rest = [(n, p) for n, p in named if not is_hidden_matrix(n, p)]
        # Nesterov momentum 0.95 and 5 Newton-Schulz steps: torch's (and Muon's authors') defaults
        self.muon = Muon(
            hidden,
            dtype=MUON_DTYPES[t.muon_dtype],
            lr=t.lr,
            weight_decay=t.weight_decay,
            adjust_lr_fn="match_rms_adamw",
        )
        self.adamw = torch.optim.AdamW(
            [
                {"params": [p for n, p in rest if decays(n, p)], "weight_decay": t.weight_decay},
                {"params": [p for n, p in rest if not decays(n, p)], "weight_decay": 0.0},
            ],
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            eps=t.eps,
        )
        super().__init__([p for _, p in named], {"lr": t.lr})
        self.param_groups = self.muon.param_groups + self.adamw.param_groups

    @property
    def state(self) -> dict:
        """Every parameter's state (read-only), from whichever inner optimizer owns the parameter."""
        return {**self.muon.state, **self.adamw.state}

    @state.setter
    def state(self, value) -> None:  # Optimizer.__init__ assigns an empty one; the inner ones own it
        pass

    @torch.no_grad()
    def step(self, closure=None) -> None:
        self.muon.step()
        self.adamw.step()

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if set(state_dict) != {"muon", "adamw"}:
            raise ValueError("not a Muon + AdamW state (keys 'muon' and 'adamw')")
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])


def build_optimizer(model: torch.nn.Module, t: TrainConfig) -> torch.optim.Optimizer:
    if t.optimizer == "muon":
        return MuonAdamW(model, t)
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
