"""Validation during training: the val split's masked-patch metrics, the reconstruction grid, and the
best validation loss so far.

The metrics are `evaluate` (scores.py) at `mask.ratio` on the validation images: `train.eval_images`
of the val split, spread evenly over it (`scores.validation_images`; the whole split when it holds no
more, or when eval_images is 0), with masks drawn from the config's seed, so every evaluation of a
run scores the same images under the same masks. The grid shows the split's first eight images
under fixed masks, the same at every evaluation. Both run under the training precision.

Both are stop points: `evaluate` checks for a recorded stop signal once per batch and the grid
once it is drawn (signals.check_stop), so a SIGTERM ends a validation of any size within a batch.

Shapes: B grid images, N patches.
"""

import math

import torch

from vitmask.config import Config
from vitmask.data.batches import Batch, make_batch
from vitmask.data.masking import random_mask
from vitmask.data.packed import PackedImages, spread
from vitmask.data.patches import class_counts
from vitmask.evaluate.pictures import reconstruction_grid
from vitmask.evaluate.scores import evaluate, validation_images
from vitmask.runtime.process import autocast
from vitmask.signals import check_stop
from vitmask.sizes import num_masked

GRID_IMAGES = 8  # val images in the TensorBoard reconstruction grid
COUNTED_IMAGES = 1 << 20  # packed train splits: images the majority class is counted over


class Validator:
    def __init__(self, cfg: Config, splits: dict[str, torch.Tensor], device: torch.device):
        self.cfg = cfg
        self.device = device
        self.images = validation_images(splits["val"], cfg).to(device)
        self.grid_images = splits["val"][:GRID_IMAGES].to(device)  # (B, H, W): the split's first images
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
        images = self.grid_images
        g = torch.Generator(device=self.device).manual_seed(c.seed)
        n = c.data.num_patches
        ids, mask = random_mask(len(images), n, num_masked(n, c.mask.ratio), g, self.device)
        return make_batch(images, c.data.patch_size, ids, mask)

    def evaluate(self, model: torch.nn.Module, max_batches: int | None = None, ratio: float | None = None) -> dict:
        """Validation metrics at `ratio` (default mask.ratio) on the validation images (the first
        `max_batches` batches of them, when given). A recorded stop signal raises `Stopped` within a batch."""
        c = self.cfg
        ratio = c.mask.ratio if ratio is None else ratio
        with autocast(c.train.precision, self.device):
            return evaluate(model, self.images, c, ratio, c.seed, self.majority_class, max_batches=max_batches or 0)

    @torch.no_grad()
    def reconstruction(self, model: torch.nn.Module) -> torch.Tensor:
        """(3, H', W') grid of the fixed val images: original, masked, predicted, errors."""
        b = self.grid_batch
        was_training = model.training
        model.eval()
        with autocast(self.cfg.train.precision, self.device):
            pred = model(b.patches, b.mask).argmax(-1)  # (B, N)
        model.train(was_training)
        grid = reconstruction_grid(self.grid_images, b.mask, pred, self.cfg.data.patch_size)
        check_stop()  # a stop point once the grid is drawn (the module docstring)
        return grid

    def improved(self, val: dict) -> bool:
        """Whether `val` beats the best validation loss so far; if so it becomes the best."""
        if val["loss"] < self.best_loss:
            self.best_loss = val["loss"]
            return True
        return False
