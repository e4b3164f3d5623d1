"""Iterative decoding of masked patches: inpainting part of an image, or generating whole images.

A masked-patch model trained over all mask ratios is an any-order autoregressive model (Hoogeboom
et al. 2021, "Autoregressive Diffusion Models"): whatever is visible, it gives p(x_i | visible) for
every hidden patch i. Decoding fills the hidden patches over `steps` rounds. In each round the model
predicts every hidden patch, each gets a class (the most likely one at temperature 0, else a draw
from softmax(logits / temperature)), some of them are kept and shown to the model as visible from
then on, and the rest are predicted again. A row hiding M patches runs T = min(steps, M) rounds,
and every round fixes at least one patch. How many follows MaskGIT's cosine schedule (Chang et al.
2022): after round t of T, floor(M cos(pi/2 * t / T)) of the M hidden patches stay hidden, except
where that would leave no fewer hidden than the round before (the first rounds of a long schedule,
where the cosine is flat): there the round fixes one patch. So `steps` >= M fixes one patch a
round. Which ones are kept is the `order`:

- `confidence` (MaskGIT): the most probable ones, ranked by the model's log-probability of the
  class each got, plus Gumbel noise scaled by `choice_temperature * (1 - (t + 1) / T)`: MaskGIT's
  randomised choice, annealed to none by the last round (MaskGIT uses 4.5; 0 keeps strictly the most
  confident);
- `random`: a uniformly random subset of the hidden patches (random-order sampling). With
  steps >= M and temperature 1, every round fixes one patch drawn from its conditional: an exact
  draw from the model's random-order (ARDM) distribution, the one `likelihood` bounds.

Temperature 0 with the `confidence` order and no choice noise is deterministic: the one-shot fill
(steps = 1: every hidden patch gets its most likely class at once) or the most-confident-first fill
that `vitmask inpaint` has always made. Random draws come from a `torch.Generator` on the model's
device, so a seed repeats a result there. Everything is batched on the device; rows may hide
different counts (`predict_every_patch`: an encoder-decoder model gets one call per distinct count).
Each round is a stop point (signals.check_stop). An `on_round` hook sees each round's state as it
ends (`DecodeRound`: what the round fixed, with the probability of each patch's class): the steps
of an iterative fill, shown one by one (vitmask demo). It reads the round and changes nothing. Each
round also counts one on a `progress.Progress` when one is given (`sample_images(progress=True)`:
`vitmask sample`'s rounds, with an ETA).

Shapes: B images, H = W side, N patches, P pixels per patch, C classes, T rounds.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vitmask.data.patches import classes_to_patches, patches_to_classes, patchify, unpatchify
from vitmask.errors import UserError
from vitmask.model.vit import predict_every_patch
from vitmask.progress import Progress
from vitmask.signals import check_stop

ORDERS = ("confidence", "random")


@dataclass(frozen=True)
class DecodeOptions:
    steps: int = 1  # rounds of decoding: min(steps, hidden patches), each fixing at least one hidden patch
    temperature: float = 0.0  # 0: the most likely class; T > 0: a draw from softmax(logits / T)
    order: str = "confidence"  # which patches a round keeps: confidence (MaskGIT) | random
    choice_temperature: float = 0.0  # confidence: scale of the Gumbel noise on the ranking (MaskGIT: 4.5)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise UserError(f"--steps must be at least 1, got {self.steps}")
        if not 0 <= self.temperature < math.inf:  # also refuses NaN
            raise UserError(
                f"--temperature must be >= 0 and finite (0 = the most likely class), got {self.temperature}"
            )
        if self.order not in ORDERS:
            raise UserError(f"--order must be one of {', '.join(ORDERS)}, got '{self.order}'")
        if not 0 <= self.choice_temperature < math.inf:
            raise UserError(
                f"--choice-temperature must be >= 0 and finite (0 = no noise), got {self.choice_temperature}"
            )

    @property
    def deterministic(self) -> bool:
        """Whether decoding draws nothing at random (every call gives the same classes)."""
        return self.temperature == 0 and self.order == "confidence" and self.choice_temperature == 0


@dataclass(frozen=True)
class DecodeRound:
    """The state of decoding as one round ends, given to `decode_masked`'s `on_round` hook."""

    index: int  # the round, 0 first
    rounds: int  # T: the rounds of the row hiding the most patches, min(steps, its hidden count)
    picked: torch.Tensor  # (B, N) bool: the patches this round fixed
    classes: torch.Tensor  # (B, N) int64: every patch's class after the round (hidden ones: their input's)
    hidden: torch.Tensor  # (B, N) bool: the patches still hidden after the round
    probability: torch.Tensor  # (B, N) float32: the model's probability (its softmax at temperature 1) of the
    # class each patch hidden as the round began got in it; NaN for the patches visible then


def unmask_counts(num_masked: int, steps: int) -> list[int]:
    """Patches fixed in each of T = min(steps, M) rounds (one round when M = 0), M = `num_masked`:
    each at least one (when M > 0), summing to M.

    After round t, min(floor(M cos(pi/2 * t / T)), left_{t-1} - 1) patches stay hidden (left_0 = M,
    left_T = 0): the cosine schedule, a patch a round where it is flat. No round runs out of patches:
    cos(pi/2 * t / T) = sin(pi/2 * (T - t) / T) >= (T - t) / T and M >= T, so the cosine leaves at
    least T - t hidden, one for each round still to come.
    """
    rounds = max(1, min(steps, num_masked))
    counts, before = [], num_masked
    for t in range(1, rounds + 1):
        remaining = min(math.floor(num_masked * math.cos(math.pi / 2 * t / rounds)), before - 1) if t < rounds else 0
        counts.append(before - remaining)
        before = remaining
    return counts


def unmask_schedule(num_hidden: torch.Tensor, steps: int) -> torch.Tensor:
    """(B,) hidden counts -> (T, B) int64 patches fixed per round, on the CPU.

    A row hiding M patches runs the min(steps, M) rounds of `unmask_counts` (one, fixing none, when
    M = 0) and fixes none after them; T is the longest row's. Computed once per distinct count, not
    per row.
    """
    counts = num_hidden.detach().cpu().long()  # (B,)
    per_count = {m: unmask_counts(m, steps) for m in counts.unique().tolist()}
    table = torch.zeros(max(map(len, per_count.values())), len(counts), dtype=torch.long)  # (T, B)
    for m, ks in per_count.items():
        table[: len(ks), counts == m] = torch.tensor(ks, dtype=torch.long).unsqueeze(1)
    return table


def gumbel(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """Standard Gumbel noise, -log(-log(u)) with u ~ U(0, 1): argmax(logits + noise) draws from softmax(logits)."""
    u = torch.rand(shape, generator=generator, device=device).clamp_min(torch.finfo(torch.float32).tiny)
    return -torch.log(-torch.log(u))


@torch.inference_mode()
def decode_masked(
    model: torch.nn.Module,
    images: torch.Tensor,
    mask: torch.Tensor,
    patch_size: int,
    options: DecodeOptions = DecodeOptions(),
    generator: torch.Generator | None = None,
    on_round: Callable[[DecodeRound], None] | None = None,
    progress: Progress | None = None,
) -> torch.Tensor:
    """images (B, H, W) 0/1, mask (B, N) True = hidden -> (B, N) int64 classes, every patch decided.

    Visible patches keep their class; hidden ones are decoded as the module docstring says. Rows
    may hide different counts, all of them included (a fully hidden canvas generates an image).
    T = min(steps, M) rounds for the row hiding the most patches, M; every one of them fixes a patch
    of that row; no round runs when no patch is hidden. `on_round` is called as each round ends; it
    draws nothing from `generator`, so the classes are the same with it.
    """
    pix = patchify(images, patch_size).float()  # (B, N, P)
    classes = patches_to_classes(pix)  # (B, N)
    hidden = mask.clone()  # (B, N)
    schedule = unmask_schedule(mask.sum(1), options.steps)  # (T, B), CPU
    rounds = len(schedule) if bool(schedule.any()) else 0  # none when nothing is hidden
    schedule = schedule.to(mask.device)
    for t in range(rounds):
        check_stop()
        logp = predict_every_patch(model, pix, hidden).float().log_softmax(-1)  # (B, N, C)
        if options.temperature == 0:
            guess = logp.argmax(-1)  # (B, N)
        else:
            guess = (logp / options.temperature + gumbel(logp.shape, generator, logp.device)).argmax(-1)  # (B, N)
        if options.order == "random":
            score = torch.rand(hidden.shape, generator=generator, device=hidden.device)  # (B, N)
        else:
            score = logp.gather(-1, guess.unsqueeze(-1)).squeeze(-1)  # (B, N) log p of the chosen class
            noise = options.choice_temperature * (1 - (t + 1) / rounds)
            if noise > 0:
                score = score + noise * gumbel(score.shape, generator, score.device)
        score = torch.where(hidden, score.clamp_min(-1e30), -math.inf)  # visible patches rank last
        rank = score.argsort(dim=1, descending=True, stable=True).argsort(dim=1)  # (B, N): 0 = kept first
        pick = rank < schedule[t].unsqueeze(1)  # (B, N), only hidden patches: k <= hidden count
        probability = logp.gather(-1, guess.unsqueeze(-1)).squeeze(-1).exp() if on_round else None  # (B, N)
        was_hidden = hidden
        classes = torch.where(pick, guess, classes)
        pix = torch.where(pick.unsqueeze(-1), classes_to_patches(guess, pix.shape[-1]).float(), pix)
        hidden = hidden & ~pick
        if on_round is not None:
            on_round(DecodeRound(t, rounds, pick, classes, hidden, torch.where(was_hidden, probability, math.nan)))
        if progress is not None:
            progress.update()  # a round done
    return classes


@torch.inference_mode()
def sample_images(
    model: torch.nn.Module,
    n: int,
    image_size: int,
    patch_size: int,
    options: DecodeOptions,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    batch_size: int = 256,
    on_round: Callable[[DecodeRound], None] | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """Generate `n` images from a fully masked canvas: (n, H, W) uint8 0/1, in batches of `batch_size`
    (`on_round`: decode_masked's hook, for each batch). With `progress`, the rounds of every batch
    report on stderr (progress.py)."""
    grid = image_size // patch_size
    rounds = len(unmask_counts(grid * grid, options.steps))  # per batch: min(steps, N)
    out = []
    bar = Progress(-(-n // batch_size) * rounds, "sample", "rounds", enabled=progress)  # a bar, or lines in a log
    for start in range(0, n, batch_size):
        b = min(batch_size, n - start)
        canvas = torch.zeros(b, image_size, image_size, dtype=torch.uint8, device=device)  # (b, H, W)
        hidden = torch.ones(b, grid * grid, dtype=torch.bool, device=device)  # (b, N): all masked
        classes = decode_masked(model, canvas, hidden, patch_size, options, generator, on_round, bar)  # (b, N)
        out.append(unpatchify(classes_to_patches(classes, patch_size**2), patch_size).to(torch.uint8))
    bar.close()
    return torch.cat(out)  # (n, H, W)


def sample_from_seed(
    model: torch.nn.Module,
    n: int,
    image_size: int,
    patch_size: int,
    options: DecodeOptions,
    seed: int,
    device: torch.device | str = "cpu",
    on_round: Callable[[DecodeRound], None] | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """`sample_images` drawn from a generator on `device` seeded with `seed`: (n, H, W) uint8 0/1, the
    images `vitmask sample --seed SEED` writes (and vitmask demo shows) for the same options."""
    generator = torch.Generator(device=device).manual_seed(seed)
    return sample_images(
        model, n, image_size, patch_size, options, generator, device, on_round=on_round, progress=progress
    )
