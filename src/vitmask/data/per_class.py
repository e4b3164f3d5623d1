"""A bounded, seeded subset of a labelled dataset: at most K images of each class from each split.

`vitmask probe --per-class K` and `vitmask finetune` with `finetune.per_class: K` read this subset
instead of the whole splits, so a corpus of any size (a pack of 50 million drawings) is probed or
fine-tuned on a few thousand images a class, in memory. The choice (`per_class_positions`) is a
seeded permutation of the split, the first K images of each class in it kept, then put back in the
split's order: the same labels and seed give the same images, on any machine. The seed is the
split's (`data.split_seed`, else `seed`) and the split's name, so probe and finetune with the same
K read the same images, whatever their other seeds.

`unpacked_splits` turns the (subset) splits of a pack into in-memory images, refusing in one line
those too large to hold.

Shapes: n images of a split, k kept.
"""

import torch

from vitmask.config import Config
from vitmask.data.batches import SPLITS, LabelledSplits, mix64
from vitmask.data.packed import PackedImages
from vitmask.runtime.memory import check_bytes

PER_CLASS_STREAM = 5  # mix64(seed, stream, split): the draws of the subset (the training streams are 1..4)


def per_class_positions(labels: torch.Tensor, per_class: int, seed: int) -> torch.Tensor:
    """labels (n,) int64 -> (k,) int64 positions, ascending: for every class, `per_class` of its images
    (all of them when it has fewer), chosen by a permutation seeded by `seed`. No per-image Python."""
    n = len(labels)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))  # (n,) a random order
    by_class = order[torch.sort(labels[order], stable=True).indices]  # (n,) grouped by class, random within
    grouped = labels[by_class]  # (n,) sorted labels
    first = torch.searchsorted(grouped, grouped, right=False)  # (n,) where each one's class starts
    rank = torch.arange(n) - first  # (n,) place within its class
    return by_class[rank < per_class].sort().values  # (k,)


def take_per_class(data: LabelledSplits, per_class: int, cfg: Config) -> LabelledSplits:
    """At most `per_class` images of each class from each split (0: the data as it is). Images of a pack
    stay packed until `unpacked_splits`; the labels follow their images."""
    if per_class == 0 or data.labels is None:
        return data
    seed = cfg.split_seed
    images, labels = {}, {}
    for i, split in enumerate(SPLITS):
        pos = per_class_positions(data.labels[split], per_class, mix64(seed, PER_CLASS_STREAM, i))  # (k,)
        x = data.images[split]
        images[split] = x.subset(pos.numpy()) if isinstance(x, PackedImages) else x[pos]
        labels[split] = data.labels[split][pos]
    return LabelledSplits(images, labels, data.no_labels)


def check_unpackable(data: LabelledSplits, fix: str) -> None:
    """Refuse, in one line ending in `fix`, splits of a pack too large to unpack into memory with their
    features (about 5 bytes a pixel); nothing is unpacked (in-memory splits pass)."""
    packed = [x for x in data.images.values() if isinstance(x, PackedImages)]
    if packed:
        count, pixels = sum(len(x) for x in packed), packed[0].height * packed[0].width
        check_bytes(count * pixels * 5, f"{count:,} packed images unpacked, with their features,", fix)


def unpacked_splits(data: LabelledSplits, fix: str) -> LabelledSplits:
    """The splits of a pack unpacked into memory (in-memory splits as they are); splits too large to
    hold with their features (about 5 bytes a pixel) are refused in one line ending in `fix`."""
    check_unpackable(data, fix)
    if not any(isinstance(x, PackedImages) for x in data.images.values()):
        return data
    images = {s: x.unpacked() if isinstance(x, PackedImages) else x for s, x in data.images.items()}
    return LabelledSplits(images, data.labels, data.no_labels)
