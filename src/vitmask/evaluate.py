"""Scoring a model on masked patches.

All sums are kept as tensors on the device while the split streams through in batches; they are
read back once, at the end.

Shapes: B batch, N patches, M masked patches per image, C token classes.
"""

import torch
import torch.nn.functional as F
from tqdm import tqdm

from vitmask.config import Config
from vitmask.data import eval_batches
from vitmask.patches import patches_to_classes, patchify


def class_counts(images: torch.Tensor, patch_size: int, num_classes: int) -> torch.Tensor:
    """(C,) int64 count of each token class over every patch of `images` (n, H, W)."""
    classes = patches_to_classes(patchify(images, patch_size))  # (n, N)
    return torch.bincount(classes.flatten(), minlength=num_classes)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    images: torch.Tensor,
    cfg: Config,
    ratio: float,
    seed: int,
    majority_class: int,
    batch_size: int = 256,
    max_batches: int = 0,
    progress: bool = False,
) -> dict[str, float]:
    """Masked-patch loss and accuracies of `model` on `images` (n, H, W), at mask `ratio`.

    Returns loss (mean cross-entropy in nats per masked patch), acc (all masked patches),
    acc_nonempty (masked patches whose true class is not 0, the empty patch), majority_acc
    (always predicting `majority_class`, on the same masks) and the counts behind them.
    """
    was_training = model.training
    model.eval()
    dev = images.device
    loss_sum = torch.zeros((), device=dev, dtype=torch.float64)
    correct = torch.zeros((), device=dev, dtype=torch.long)
    majority = torch.zeros((), device=dev, dtype=torch.long)
    nonempty_correct = torch.zeros((), device=dev, dtype=torch.long)
    nonempty = torch.zeros((), device=dev, dtype=torch.long)
    count = 0
    batches = eval_batches(images, cfg, ratio, seed, batch_size)
    total = -(-len(images) // batch_size)
    if max_batches:
        total = min(total, max_batches)
    for i, batch in enumerate(tqdm(batches, total=total, desc="eval", leave=False, disable=not progress)):
        if max_batches and i >= max_batches:
            break
        logits = model(batch.patches, batch.mask, batch.ids).float()  # (B, M, C)
        targets = batch.targets.gather(1, batch.ids)  # (B, M)
        loss_sum += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        hit = logits.argmax(-1) == targets  # (B, M)
        filled = targets != 0
        correct += hit.sum()
        majority += (targets == majority_class).sum()
        nonempty_correct += (hit & filled).sum()
        nonempty += filled.sum()
        count += targets.numel()
    model.train(was_training)
    n_nonempty = int(nonempty)
    return {
        "loss": float(loss_sum) / count,
        "acc": int(correct) / count,
        "acc_nonempty": int(nonempty_correct) / n_nonempty if n_nonempty else float("nan"),
        "majority_acc": int(majority) / count,
        "masked_patches": count,
        "nonempty_patches": n_nonempty,
    }
