"""The masked-patch metrics, computed in one place for training logs, evaluation and inpainting.

`MaskedPatchMetrics` is fed the predicted and true classes of masked patches (and, optionally, the
summed cross-entropy of those patches) batch after batch. It keeps sums as tensors on the device,
so feeding it never waits for the device; `read()` copies them back once. From the sums come:

- loss: mean cross-entropy in nats per masked patch (only when losses were fed);
- acc: masked patches given their true class;
- acc_nonempty: the same over masked patches whose true class is not 0 (the empty patch);
- bit_acc: pixels of the masked patches predicted right: P - popcount(pred XOR true) per patch,
  since a class's bits are its pixels;
- masked_patches, nonempty_patches: the counts behind them;

and, with `by_class=True`, the per-class accuracy and the most frequent confusions.

A new metric is a new sum in `add` and a ratio in `read`; the reporter (report.py) logs every name
in `SCALARS` under train/ and val/ and in the hparams table.

Shapes: B batch, M masked patches per image, C token classes, P pixels per patch, K = B * M.
"""

import torch

from vitmask.data.patches import classes_to_patches
from vitmask.runtime import distributed
from vitmask.runtime.distributed import World

SCALARS = ("loss", "acc", "acc_nonempty", "bit_acc")  # the numbers logged for training and validation
SUMS = ("loss", "hits", "nonempty", "nonempty_hits", "wrong_bits")  # slots of the device sums
MAX_CONFUSION_CLASSES = 1024  # a dense C x C confusion matrix is kept up to this many classes
TOP_CONFUSIONS = 5


def popcounts(num_classes: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(C,) int64: how many pixels are set in each class's patch (its number of 1 bits)."""
    bits = num_classes.bit_length() - 1
    return classes_to_patches(torch.arange(num_classes, device=device), bits).sum(-1).long()  # (C,)


class MaskedPatchMetrics:
    """Device-side sums behind the masked-patch metrics of one predictor (no host sync until `read`)."""

    def __init__(self, num_classes: int, device: torch.device | str, by_class: bool = False):
        c = num_classes
        self.num_classes = c
        self.bits_per_patch = c.bit_length() - 1
        self.device = torch.device(device)
        self._popcount = popcounts(c, device)  # (C,)
        self._sums = torch.zeros(len(SUMS), dtype=torch.float64, device=device)  # in SUMS order
        self.patches = 0  # masked patches fed so far, known on the host without a sync
        self.has_loss = False
        self.by_class = by_class
        if by_class:
            z = lambda *s: torch.zeros(*s, dtype=torch.long, device=device)  # noqa: E731
            self.class_total, self.class_hits = z(c), z(c + 1)  # the last slot of class_hits takes misses
            self.confusion = z(c * c) if c <= MAX_CONFUSION_CLASSES else None  # (C * C,) true * C + pred

    def add(self, pred: torch.Tensor, targets: torch.Tensor, loss_sum: torch.Tensor | None = None) -> None:
        """pred, targets (B, M) int64 classes of the masked patches; loss_sum: their summed cross-entropy."""
        pred, targets = pred.flatten(), targets.flatten()  # (K,)
        hit = pred == targets  # (K,)
        nonempty = targets != 0  # (K,)
        loss = loss_sum.detach().double() if loss_sum is not None else hit.new_zeros((), dtype=torch.float64)
        wrong_bits = self._popcount[pred ^ targets].sum()  # the pixels where the two patches differ
        self._sums += torch.stack([loss, hit.sum(), nonempty.sum(), (hit & nonempty).sum(), wrong_bits]).double()
        self.patches += targets.numel()
        self.has_loss |= loss_sum is not None
        if self.by_class:
            ones = torch.ones_like(targets)  # (K,)
            self.class_total.scatter_add_(0, targets, ones)
            self.class_hits.scatter_add_(0, torch.where(hit, targets, self.num_classes), ones)
            if self.confusion is not None:
                self.confusion.scatter_add_(0, targets * self.num_classes + pred, ones)

    def reset(self) -> None:
        """Start a new window (the trainer's logging window): every sum back to zero."""
        self._sums.zero_()
        self.patches = 0
        if self.by_class:
            self.class_total.zero_()
            self.class_hits.zero_()
            if self.confusion is not None:
                self.confusion.zero_()

    def read(self, world: World | None = None) -> dict[str, float]:
        """The metrics so far (one host sync), summed over the ranks of `world` when given.

        Returns acc, acc_nonempty, bit_acc, masked_patches, nonempty_patches, and loss when losses
        were fed. A ratio with nothing to count is NaN.
        """
        sums = torch.cat([self._sums, self._sums.new_tensor([self.patches])])  # (S + 1,)
        if world is not None:
            sums = distributed.all_sum(sums, world)
        loss, hits, nonempty, nonempty_hits, wrong_bits, patches = sums.tolist()
        ratio = lambda num, den: num / den if den else float("nan")  # noqa: E731
        out = {
            "acc": ratio(hits, patches),
            "acc_nonempty": ratio(nonempty_hits, nonempty),
            "bit_acc": 1.0 - ratio(wrong_bits, patches * self.bits_per_patch),
            "masked_patches": int(patches),
            "nonempty_patches": int(nonempty),
        }
        return {"loss": ratio(loss, patches), **out} if self.has_loss else out

    def per_class(self) -> list[dict]:
        """One row per class that occurs among the masked patches: class, patches, acc."""
        total, hits = self.class_total.tolist(), self.class_hits[:-1].tolist()
        return [{"class": c, "patches": t, "acc": k / t} for c, (t, k) in enumerate(zip(total, hits, strict=True)) if t]

    def confusions(self, top: int = TOP_CONFUSIONS) -> list[dict]:
        """The `top` most frequent (true, predicted) pairs with true != predicted; share = of the true class."""
        if self.confusion is None:
            return []
        c = self.num_classes
        off = self.confusion.view(c, c).clone()  # (C, C)
        off.fill_diagonal_(0)
        counts, flat = off.flatten().topk(min(top, c * c))
        total = self.class_total.tolist()
        rows = []
        for n, i in zip(counts.tolist(), flat.tolist(), strict=True):
            if n:
                t, p = divmod(i, c)
                rows.append({"true": t, "pred": p, "patches": n, "share": n / total[t]})
        return rows
