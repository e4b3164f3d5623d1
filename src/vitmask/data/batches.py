"""Images in memory or packed on disk, and batches built from them on the device.

A split is one uint8 tensor (n, H, W) of 0/1 pixels, held on the training device, or for
`data.source: packed` a `packed.PackedImages` indexed the same way (packed rows gathered from a
memory map, or from the device, and unpacked there). A batch is an index op plus on-device
patchify and masking: no DataLoader, no per-sample Python.

Training order (`EpochOrder`): an epoch is a seeded permutation of the training split, computed
for any positions by a Feistel bijection, so no index of the split's size is ever built; the
image at global position q of the stream is perm_{q // n}(q % n). Batch s is positions
s * B .. s * B + B - 1, so the sampler's whole state is the step: (seed, epoch, position) follow.

Shapes: B batch, N patches, P pixels per patch, M masked patches per image.
"""

from dataclasses import dataclass

import numpy as np
import torch

from vitmask.config import Config
from vitmask.data import packed, shapes, sources
from vitmask.data.masking import draw_mask, draw_num_masked
from vitmask.data.patches import patches_to_classes, patchify
from vitmask.data.prefetch import StepImages
from vitmask.errors import UserError
from vitmask.sizes import num_masked

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
    seed = cfg.split_seed
    if data.source == "shapes":
        return LabelledSplits(
            *shapes.make_labelled_splits(data.num_train, data.num_val, data.num_test, data.image_size, seed)
        )
    if data.source == "packed":
        return load_packed_splits(cfg)
    images, labels = sources.load_source_labelled(data, seed)
    return LabelledSplits(images, None, labels) if isinstance(labels, str) else LabelledSplits(images, labels)


def load_packed_splits(cfg: Config) -> LabelledSplits:
    """The splits of a packed directory (packed.py), as PackedImages on the CPU: nothing is read but
    the headers (and the labels, 8 bytes an image). The split is the one stored at pack time."""
    ds = packed.open_packed(cfg.data.path)
    packed.check_matches_config(ds, cfg.data.image_size)
    images = {k: ds.split(k) for k in SPLITS}
    if ds.labels is None:
        return LabelledSplits(images, None, f"the packed dataset {ds.root} has no labels; pack a labelled source")
    return LabelledSplits(images, {k: ds.split_labels(k) for k in SPLITS})


def training_images(images, cfg: Config, device: torch.device):
    """The train split where the sampler gathers from: an in-memory split moved to `device`; a
    packed one with its rows copied to the device by `data.on_device` (auto: on CUDA when the rows
    take under half the free memory; true: always, refused when they do not fit; false: never, rows
    gathered from the memory map through pinned memory)."""
    if not isinstance(images, packed.PackedImages):
        return images.to(device)
    images = images.to(device)
    policy = cfg.data.on_device
    if policy is False or (policy == "auto" and device.type != "cuda"):
        return images
    from vitmask.runtime.memory import available_bytes, gib

    free = available_bytes(device)
    need = images.packed_bytes
    if policy == "auto" and (free is None or need > free // 2):
        return images
    if free is not None and need > free:
        raise UserError(
            f"data.on_device is true but the packed train split takes {gib(need)} and {device} has {gib(free)} free; "
            "set data.on_device=auto or false to gather batches from the memory map"
        )
    return images.rows_to_device()


def mix64(*words: int) -> int:
    """A 63-bit hash of integers (splitmix64 steps): seeds of generators and of permutation rounds."""
    x = 0x9E3779B97F4A7C15
    for w in words:
        x = (x ^ (w & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
        x = (x * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 29
    return x >> 1


class EpochOrder:
    """The seeded permutations of range(n), one per epoch, evaluated at any positions.

    A balanced Feistel network of `ROUNDS` rounds over 2b bits (4^b >= n) is a bijection of
    [0, 4^b); positions that land at or past n are walked through it again until they fall inside
    (cycle walking), which keeps it a bijection of [0, n). Every step is uint64 arithmetic in NumPy
    on the CPU (wrapping multiplication), the same on any machine and for any number of processes.

    NumPy's cost is per call, not per element: a batch of 256 positions costs as much as 16,384.
    `indices` therefore evaluates a whole block of `BLOCK` consecutive positions of an epoch at once
    and keeps the last block; consecutive batches read from it. The block is a function of (seed,
    epoch, block number) alone, so caching it changes no index.
    """

    ROUNDS = 6
    BLOCK = 1 << 16  # positions of an epoch evaluated at once by `indices` (512 KiB of int64)

    def __init__(self, n: int, seed: int):
        if n < 1:
            raise UserError(
                "the train split holds no images, so there is no epoch to draw batches from; give the source more "
                "images, or lower data.val_fraction and data.test_fraction"
            )
        self.n, self.seed = n, seed
        bits = max(2, (n - 1).bit_length())
        self.half = np.uint64((bits + 1) // 2)  # bits of each Feistel half
        self.low = np.uint64((1 << int(self.half)) - 1)
        self._block: tuple[tuple[int, int], np.ndarray] | None = None  # ((epoch, block), its indices)

    def _round(self, r: np.ndarray, key: np.uint64) -> np.ndarray:
        t = (r ^ key) * np.uint64(0x9E3779B97F4A7C15)
        t ^= t >> np.uint64(29)
        t *= np.uint64(0xBF58476D1CE4E5B9)
        return (t ^ (t >> np.uint64(32))) & self.low

    def _feistel(self, x: np.ndarray, keys: list) -> np.ndarray:
        left, right = x >> self.half, x & self.low
        for k in keys:
            left, right = right, left ^ self._round(right, k)
        return (left << self.half) | right

    def permute(self, epoch: int, pos: np.ndarray) -> np.ndarray:
        """(k,) uint64 positions in [0, n) of `epoch` -> (k,) uint64 indices of the split."""
        keys = [np.uint64(mix64(self.seed, epoch, i)) for i in range(self.ROUNDS)]
        y = self._feistel(pos, keys)
        out = np.flatnonzero(y >= self.n)
        while len(out):
            y[out] = self._feistel(y[out], keys)
            out = out[y[out] >= self.n]
        return y

    def __call__(self, epoch: int, pos: torch.Tensor) -> torch.Tensor:
        """(k,) int64 positions in [0, n) of `epoch` -> (k,) int64 indices of the split."""
        return torch.from_numpy(self.permute(epoch, pos.numpy().astype(np.uint64)).astype(np.int64))

    def block(self, epoch: int, block: int) -> np.ndarray:
        """(<= BLOCK,) int64 indices at positions block * BLOCK .. of `epoch` (the last block is shorter)."""
        cached = self._block  # one read: a prefetching thread may replace it meanwhile
        if cached is None or cached[0] != (epoch, block):
            first = block * self.BLOCK
            pos = np.arange(first, min(first + self.BLOCK, self.n), dtype=np.uint64)
            cached = ((epoch, block), self.permute(epoch, pos).astype(np.int64))
            self._block = cached
        return cached[1]

    def indices(self, start: int, count: int) -> torch.Tensor:
        """(count,) int64 split indices at global stream positions start .. start + count - 1."""
        out = np.empty(count, dtype=np.int64)
        done = 0
        while done < count:  # one pass per block touched: once for a batch inside a block
            epoch, pos = divmod(start + done, self.n)
            block, offset = divmod(pos, self.BLOCK)
            take = min(count - done, self.n - pos, self.BLOCK - offset)
            out[done : done + take] = self.block(epoch, block)[offset : offset + take]
            done += take
        return torch.from_numpy(out)


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
    """Draws training batches from the train split (a tensor or PackedImages); its state is the step.

    Batch s is the positions s * B .. s * B + B - 1 of the epoch stream (`EpochOrder`, seeded by
    seed + 1), with masks from a device generator and the masked count M from a CPU generator,
    both seeded afresh from (seed, s). Every rank computes the same global batch (B indices and
    masks, cheap) and gathers only its own contiguous shard, so the ranks see disjoint images and
    a run resumed at step s on any number of processes sees the same global batches.

    `prefetch` (prefetch.StepImages; default: on for a packed split gathered from its memory map
    for a CUDA device) gathers batch s + 1's rows in a background thread while step s runs; the
    batches are the same either way.
    """

    def __init__(self, images, cfg: Config, rank: int = 0, world: int = 1, prefetch: bool | None = None):
        self.images = images
        self.patch_size = cfg.data.patch_size
        self.global_batch = cfg.data.batch_size
        self.num_patches = cfg.data.num_patches
        self.grid = cfg.data.grid
        self.mask_cfg = cfg.mask
        self.num_mask = num_masked(self.num_patches, cfg.mask.ratio)
        per_rank = self.global_batch // world
        self.shard = slice(rank * per_rank, (rank + 1) * per_rank)
        self.step_images = StepImages(images, self.global_batch, self.shard, prefetch)
        self.seed = cfg.seed + 1
        self.order = EpochOrder(len(images), self.seed)
        self.generator = torch.Generator(device=images.device)
        self.count_generator = torch.Generator()  # CPU: M per batch
        self.step = 0  # batches drawn: the next batch is batch `step`

    def seek(self, step: int) -> None:
        """Make the next batch batch `step` (a resumed run's step)."""
        self.step = int(step)

    def next_num_mask(self) -> int:
        """M for the next batch, from mask.ratio_schedule (masking.draw_num_masked), on the CPU."""
        self.count_generator.manual_seed(mix64(self.seed, self.step, 2))
        return draw_num_masked(self.mask_cfg, self.num_patches, self.count_generator)

    def sample(self) -> Batch:
        m = self.next_num_mask()
        self.generator.manual_seed(mix64(self.seed, self.step, 1))
        dev = self.images.device
        ids, mask = draw_mask(self.mask_cfg, self.global_batch, self.grid, m, self.generator, dev)  # (B, M), (B, N)
        _, images = self.step_images(self.order, self.step)  # (b, H, W), this rank's shard
        self.step += 1
        return make_batch(images, self.patch_size, ids[self.shard], mask[self.shard])

    def close(self) -> None:
        """Stop the prefetching thread, if any."""
        self.step_images.close()

    def position(self) -> tuple[int, int]:
        """(epoch, position in it) of the next batch's first image."""
        return divmod(self.step * self.global_batch, len(self.images))

    def state_dict(self) -> dict:
        epoch, position = self.position()
        return {"seed": self.seed, "epoch": epoch, "position": position, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        """Take a saved state's seed and step (a checkpoint of the generator-state sampler has
        neither: the trainer seeks to its step, with this run's seed)."""
        if "seed" in state:
            self.seed = int(state["seed"])
            self.order = EpochOrder(len(self.images), self.seed)
        if "step" in state:
            self.seek(state["step"])


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
