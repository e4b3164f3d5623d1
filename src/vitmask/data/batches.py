"""Images in memory, and batches built from them on the device.

A split is one uint8 tensor (n, H, W) of 0/1 pixels, held on the training device. A batch is an
index op plus on-device patchify and masking: no DataLoader, no per-sample Python.

Shapes: B batch, N patches, P pixels per patch, M masked patches per image.
"""

from dataclasses import dataclass

import torch

from vitmask.config import Config
from vitmask.data import shapes, sources
from vitmask.data.masking import draw_mask, draw_num_masked, num_masked
from vitmask.data.patches import patches_to_classes, patchify

SPLITS = ("train", "val", "test")


def load_splits(cfg: Config) -> dict[str, torch.Tensor]:
    """The train/val/test images of the configured source, (n, H, W) uint8 in {0, 1}, on the CPU."""
    return load_labelled_splits(cfg).images


@dataclass
class LabelledSplits:
    """The images of each split and, where the source has them, their labels (the same images in
    the same order as `load_splits`: labels never change training)."""

    images: dict[str, torch.Tensor]  # split -> (n, H, W) uint8 in {0, 1}, on the CPU
    labels: dict[str, torch.Tensor] | None  # split -> (n,) int64 class of each image; None: the source has none
    no_labels: str = ""  # why labels is None, and how to provide them


def load_labelled_splits(cfg: Config) -> LabelledSplits:
    """The train/val/test images of the configured source with their labels (see sources, shapes)."""
    data = cfg.data
    seed = cfg.seed if data.split_seed is None else data.split_seed  # other training seeds, the same test images
    if data.source == "shapes":
        return LabelledSplits(
            *shapes.make_labelled_splits(data.num_train, data.num_val, data.num_test, data.image_size, seed)
        )
    images, labels = sources.load_source_labelled(data, seed)
    return LabelledSplits(images, None, labels) if isinstance(labels, str) else LabelledSplits(images, labels)


@dataclass
class Batch:
    patches: torch.Tensor  # (B, N, P) float 0/1 pixels, unmasked
    targets: torch.Tensor  # (B, N) int64 token classes
    mask: torch.Tensor  # (B, N) bool, True = masked
    ids: torch.Tensor  # (B, M) int64 indices of the masked patches

    @property
    def masked_targets(self) -> torch.Tensor:
        """(B, M) int64 true classes of the masked patches, in the order of `ids`."""
        return self.targets.gather(1, self.ids)  # (B, M)

    def split(self, parts: int) -> list["Batch"]:
        """`parts` equal micro-batches along B (views, no copy)."""
        if parts == 1:
            return [self]
        fields = (self.patches, self.targets, self.mask, self.ids)
        return [Batch(*chunk) for chunk in zip(*(f.chunk(parts) for f in fields), strict=True)]


def make_batch(images: torch.Tensor, patch_size: int, ids: torch.Tensor, mask: torch.Tensor) -> Batch:
    """images (B, H, W) uint8 plus a mask -> a Batch, on the images' device."""
    pix = patchify(images, patch_size)  # (B, N, P) uint8
    return Batch(pix.float(), patches_to_classes(pix), mask, ids)


class BatchSampler:
    """Draws training batches from an in-memory split with its own generator.

    Every rank draws the same global batch (indices and masks) and keeps its own contiguous shard,
    so the ranks see disjoint images and a world of any size follows the same data stream.

    The count M of masked patches is drawn once per batch from `mask.ratio_schedule` by a CPU
    generator of the sampler's own: reading it back costs no device sync, every rank draws the same
    M, and its state is saved with the sampler's.
    """

    def __init__(self, images: torch.Tensor, cfg: Config, rank: int = 0, world: int = 1):
        self.images = images
        self.patch_size = cfg.data.patch_size
        self.global_batch = cfg.data.batch_size
        self.num_patches = cfg.data.num_patches
        self.grid = cfg.data.grid
        self.mask_cfg = cfg.mask
        self.num_mask = num_masked(self.num_patches, cfg.mask.ratio)
        per_rank = self.global_batch // world
        self.shard = slice(rank * per_rank, (rank + 1) * per_rank)
        self.generator = torch.Generator(device=images.device).manual_seed(cfg.seed + 1)
        self.count_generator = torch.Generator().manual_seed(cfg.seed + 2)  # CPU: M per batch

    def next_num_mask(self) -> int:
        """M for the next batch, from mask.ratio_schedule (masking.draw_num_masked), on the CPU."""
        return draw_num_masked(self.mask_cfg, self.num_patches, self.count_generator)

    def sample(self) -> Batch:
        dev = self.images.device
        idx = torch.randint(len(self.images), (self.global_batch,), generator=self.generator, device=dev)
        m = self.next_num_mask()
        ids, mask = draw_mask(self.mask_cfg, self.global_batch, self.grid, m, self.generator, dev)  # (B, M), (B, N)
        s = self.shard
        return make_batch(self.images[idx[s]], self.patch_size, ids[s], mask[s])

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "count_generator": self.count_generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        if "count_generator" in state:  # absent from checkpoints written before ratio ranges
            self.count_generator.set_state(state["count_generator"])


def eval_strategy(cfg: Config, strategy: str | None = None) -> str:
    """The masks evaluation uses: `strategy` if given, else the configured one with mixed read as
    random, so runs trained on mixed masks validate on the same scattered masks as random ones."""
    if strategy is not None:
        return strategy
    return "random" if cfg.mask.strategy == "mixed" else cfg.mask.strategy


def eval_batches(
    images: torch.Tensor, cfg: Config, ratio: float, seed: int, batch_size: int, strategy: str | None = None
):
    """Yield Batches covering `images` in order, with masks of `eval_strategy(cfg, strategy)` drawn
    from a generator seeded by `seed`, so the same split, ratio and seed always give the same masks.
    The `centre` strategy ignores `ratio`: every image hides the centre box."""
    dev = images.device
    g = torch.Generator(device=dev).manual_seed(seed)
    m = num_masked(cfg.data.num_patches, ratio)
    strategy = eval_strategy(cfg, strategy)
    for start in range(0, len(images), batch_size):
        chunk = images[start : start + batch_size]
        ids, mask = draw_mask(cfg.mask, len(chunk), cfg.data.grid, m, g, dev, strategy)  # (B, M), (B, N)
        yield make_batch(chunk, cfg.data.patch_size, ids, mask)
