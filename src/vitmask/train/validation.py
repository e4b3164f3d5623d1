"""Validation during training: the val split's masked-patch metrics, the reconstruction grid, and the
best validation loss so far.

The metrics are `evaluate` (evaluate.py) at `mask.ratio` on `train.eval_batches` batches, with masks
drawn from the config's seed, so every evaluation of a run scores the same masks. The grid shows
eight fixed val images under fixed masks, the same at every evaluation. Both run under the
training precision.

Shapes: B grid images, N patches.
"""

import math

import torch

from vitmask.config import Config
from vitmask.data.batches import Batch, make_batch
from vitmask.data.masking import num_masked, random_mask
from vitmask.data.packed import PackedImages, spread
from vitmask.data.patches import class_counts
from vitmask.evaluate.scores import evaluate
from vitmask.runtime.process import autocast

GRID_IMAGES = 8  # val images in the TensorBoard reconstruction grid
COUNTED_IMAGES = 1 << 20  # packed train splits: images the majority class is counted over


class Validator:
    def __init__(self, cfg: Config, splits: dict[str, torch.Tensor], device: torch.device):
        self.cfg = cfg
        self.device = device
        self.images = splits["val"].to(device)
        train = splits["train"]
        if isinstance(train, PackedImages):  # a corpus of any size: the majority class of 2^20 images spread over it
            train = spread(train, COUNTED_IMAGES)
        counts = class_counts(train, cfg.data.patch_size, cfg.data.num_classes)
        self.majority_class = int(counts.argmax())  # of the train split, for majority_acc
        self.grid_batch = self._grid_batch()
        self.best_loss = math.inf  # the lowest validation loss so far (saved with the run)

    def _grid_batch(self) -> Batch:
        """Fixed val images and masks for the reconstruction grid, the same at every evaluation."""
        c = self.cfg
        images = self.images[:GRID_IMAGES]
        g = torch.Generator(device=self.device).manual_seed(c.seed)
        n = c.data.num_patches
        ids, mask = random_mask(len(images), n, num_masked(n, c.mask.ratio), g, self.device)
        return make_batch(images, c.data.patch_size, ids, mask)

    def evaluate(self, model: torch.nn.Module, max_batches: int | None = None, ratio: float | None = None) -> dict:
        """Validation metrics at `ratio` (default mask.ratio) on train.eval_batches (or max_batches) batches."""
        c = self.cfg
        limit = c.train.eval_batches if max_batches is None else max_batches
        ratio = c.mask.ratio if ratio is None else ratio
        with autocast(c.train.precision, self.device):
            return evaluate(model, self.images, c, ratio, c.seed, self.majority_class, max_batches=limit)

    @torch.no_grad()
    def reconstruction(self, model: torch.nn.Module) -> torch.Tensor:
        """(3, H', W') grid of the fixed val images: original, masked, predicted, errors."""
        from vitmask.evaluate.pictures import reconstruction_grid  # imports torchvision: only when a grid is drawn

        b = self.grid_batch
        was_training = model.training
        model.eval()
        with autocast(self.cfg.train.precision, self.device):
            pred = model(b.patches, b.mask).argmax(-1)  # (B, N)
        model.train(was_training)
        return reconstruction_grid(self.images[: len(pred)], b.mask, pred, self.cfg.data.patch_size)

    def improved(self, val: dict) -> bool:
        """Whether `val` beats the best validation loss so far; if so it becomes the best."""
        if val["loss"] < self.best_loss:
            self.best_loss = val["loss"]
            return True
        return False
