"""Images in memory, and batches built from them on the device.

A split is one uint8 tensor (n, H, W) of 0/1 pixels, held on the training device. A batch is an
index op plus on-device patchify and masking: no DataLoader, no per-sample Python.

Shapes: B batch, N patches, P pixels per patch, M masked patches per image.
"""

from dataclasses import dataclass

import torch

from vitmask import shapes
from vitmask.config import Config
from vitmask.masking import num_masked, random_mask
from vitmask.patches import patches_to_classes, patchify

SPLITS = ("train", "val", "test")


def load_splits(cfg: Config) -> dict[str, torch.Tensor]:
    """The train/val/test images of the configured source, (n, H, W) uint8 in {0, 1}, on the CPU."""
    d = cfg.data
    return shapes.make_splits(d.num_train, d.num_val, d.num_test, d.image_size, cfg.seed)


@dataclass
class Batch:
    patches: torch.Tensor  # (B, N, P) float 0/1 pixels, unmasked
    targets: torch.Tensor  # (B, N) int64 token classes
    mask: torch.Tensor  # (B, N) bool, True = masked
    ids: torch.Tensor  # (B, M) int64 indices of the masked patches


def make_batch(images: torch.Tensor, patch_size: int, ids: torch.Tensor, mask: torch.Tensor) -> Batch:
    """images (B, H, W) uint8 plus a mask -> a Batch, on the images' device."""
    pix = patchify(images, patch_size)  # (B, N, P) uint8
    return Batch(pix.float(), patches_to_classes(pix), mask, ids)


class BatchSampler:
    """Draws training batches from an in-memory split with its own generator.

    Every rank draws the same global batch (indices and masks) and keeps its own contiguous shard,
    so the ranks see disjoint images and a world of any size follows the same data stream.
    """

    def __init__(self, images: torch.Tensor, cfg: Config, rank: int = 0, world: int = 1):
        self.images = images
        self.patch_size = cfg.data.patch_size
        self.global_batch = cfg.data.batch_size
        self.num_patches = cfg.data.num_patches
        self.num_mask = num_masked(self.num_patches, cfg.mask.ratio)
        per_rank = self.global_batch // world
        self.shard = slice(rank * per_rank, (rank + 1) * per_rank)
        self.generator = torch.Generator(device=images.device).manual_seed(cfg.seed + 1)

    def sample(self) -> Batch:
        dev = self.images.device
        idx = torch.randint(len(self.images), (self.global_batch,), generator=self.generator, device=dev)
        ids, mask = random_mask(self.global_batch, self.num_patches, self.num_mask, self.generator, dev)
        s = self.shard
        return make_batch(self.images[idx[s]], self.patch_size, ids[s], mask[s])

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


def eval_batches(images: torch.Tensor, cfg: Config, ratio: float, seed: int, batch_size: int):
    """Yield Batches covering `images` in order, with masks drawn from a generator seeded by `seed`,
    so the same split, ratio and seed always give the same masks."""
    dev = images.device
    g = torch.Generator(device=dev).manual_seed(seed)
    n_patches = cfg.data.num_patches
    m = num_masked(n_patches, ratio)
    for start in range(0, len(images), batch_size):
        chunk = images[start : start + batch_size]
        ids, mask = random_mask(len(chunk), n_patches, m, g, dev)
        yield make_batch(chunk, cfg.data.patch_size, ids, mask)
