"""Baselines a model must beat, scored on the same masks: three ways to guess a masked patch's class
without a network.

- majority: the most frequent class over every patch of the train split.
- position: the most frequent class at each patch position, over the train split.
- neighbour: a lookup table from the 8-neighbour context of a masked patch to the most frequent
  centre class, learned from masked patches of the train split under masks of the same ratio. Each
  neighbour reads as its class when visible, MASKED when hidden and OUTSIDE beyond the image edge.
  A context never seen in training backs off to the 4-neighbour (up, down, left, right) table,
  then to the per-position majority.

Ties in every table go to the smallest class, so the baselines are exact and deterministic. All
fitting and lookup is tensor ops (unique, scatter, searchsorted): no per-patch Python. Fitting the
tables is a stop point per batch (signals.check_stop).

Shapes: n images, B batch, N = g * g patches, M masked patches per image, C token classes,
K contexts in a table.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vitmask.config import Config
from vitmask.data.batches import eval_batches
from vitmask.data.patches import patches_to_classes, patchify
from vitmask.signals import check_stop

NAMES = ("majority", "position", "neighbour")
LABELS = {"majority": "majority class", "position": "per-position majority", "neighbour": "8-neighbour table"}

# (dy, dx) of the neighbours, row by row; the 4-neighbour table uses a subset
EIGHT = ((-1, -1), (-1, 0), (-1, 1), (0, -1), (0, 1), (1, -1), (1, 0), (1, 1))
FOUR = ((-1, 0), (0, -1), (0, 1), (1, 0))
INT64_MAX = 2**63 - 1


@dataclass
class ContextTable:
    """Sorted context codes (K,) and the most frequent centre class of each (K,)."""

    offsets: tuple[tuple[int, int], ...]
    keys: torch.Tensor  # (K,) int64, ascending
    values: torch.Tensor  # (K,) int64 centre classes


@dataclass
class Baselines:
    num_classes: int
    grid: int  # patches per image side
    majority: int  # most frequent class overall
    position: torch.Tensor  # (N,) int64 most frequent class per position
    tables: list[ContextTable]  # 8-neighbour then 4-neighbour; empty when the codes would overflow int64

    def predict(self, classes: torch.Tensor, mask: torch.Tensor, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """classes (B, N) true classes, mask (B, N) True = masked, ids (B, M) -> name: (B, M) guesses.

        The true classes of masked patches are never read: they are replaced by MASKED first.
        """
        b, m = ids.shape
        pos = self.position.gather(0, ids.flatten()).view(b, m)  # (B, M)
        out = {"majority": torch.full_like(ids, self.majority), "position": pos}
        if self.tables:
            guess = pos
            for table in reversed(self.tables):  # the finest table decides where it knows the context
                codes = context_codes(classes, mask, self.grid, self.num_classes, table.offsets).gather(1, ids)
                guess = lookup(table, codes, guess)
            out["neighbour"] = guess
        return out


def codes_fit(num_classes: int, num_neighbours: int) -> bool:
    """Whether the context code of `num_neighbours` neighbours, times C, fits in int64."""
    return (num_classes + 2) ** num_neighbours * num_classes <= INT64_MAX


def context_codes(
    classes: torch.Tensor, mask: torch.Tensor, grid: int, num_classes: int, offsets: tuple[tuple[int, int], ...]
) -> torch.Tensor:
    """(B, N) classes and mask -> (B, N) int64 code of each patch's neighbours at `offsets`.

    A neighbour reads as its class (0..C-1), C when masked, C + 1 outside the image; the code is
    those digits in base C + 2, first offset most significant.
    """
    masked, outside = num_classes, num_classes + 1
    b = classes.shape[0]
    seen = classes.masked_fill(mask, masked).view(b, grid, grid)  # (B, g, g)
    padded = F.pad(seen, (1, 1, 1, 1), value=outside)  # (B, g + 2, g + 2)
    code = torch.zeros_like(seen)  # (B, g, g)
    for dy, dx in offsets:
        code = code * (num_classes + 2) + padded[:, 1 + dy : 1 + dy + grid, 1 + dx : 1 + dx + grid]
    return code.view(b, grid * grid)  # (B, N)


def fit_table(codes: torch.Tensor, centres: torch.Tensor, num_classes: int, offsets) -> ContextTable:
    """codes (S,) contexts and centres (S,) classes -> the table of each context's most frequent centre."""
    pairs, counts = torch.unique(codes * num_classes + centres, return_counts=True)  # sorted by context, then class
    ctx, cls = pairs // num_classes, pairs % num_classes
    keys, which = torch.unique_consecutive(ctx, return_inverse=True)  # (K,), (pairs,)
    best = torch.zeros(len(keys), dtype=counts.dtype, device=counts.device)
    best = best.scatter_reduce(0, which, counts, "amax")  # (K,) top count per context
    candidate = torch.where(counts == best[which], cls, torch.full_like(cls, num_classes))
    values = torch.full_like(keys, num_classes).scatter_reduce(0, which, candidate, "amin")  # smallest top class
    return ContextTable(tuple(offsets), keys, values)


def lookup(table: ContextTable, codes: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """The table's class for each code (any shape), or `fallback` (same shape) where it is unknown."""
    if len(table.keys) == 0:
        return fallback
    at = torch.searchsorted(table.keys, codes).clamp(max=len(table.keys) - 1)
    found = table.keys[at] == codes
    return torch.where(found, table.values[at], fallback)


def fit_baselines(
    train: torch.Tensor, cfg: Config, ratio: float, seed: int, batch_size: int = 1024, strategy: str | None = None
) -> Baselines:
    """Fit all three baselines on `train` (n, H, W) 0/1 images, on their device.

    The neighbour tables see masked patches of `train` under masks of `strategy` (default the
    evaluation's, data.eval_strategy) drawn at `ratio` from `seed`.
    """
    data = cfg.data
    c, n_patches = data.num_classes, data.num_patches
    classes = patches_to_classes(patchify(train, data.patch_size))  # (n, N)
    counts = torch.bincount(classes.flatten(), minlength=c)  # (C,)
    at = torch.arange(n_patches, device=train.device).expand_as(classes)  # (n, N)
    by_pos = torch.bincount((at * c + classes).flatten(), minlength=n_patches * c).view(n_patches, c)  # (N, C)
    tables = []
    if codes_fit(c, len(EIGHT)):
        for offsets in (EIGHT, FOUR):
            codes, centres = [], []
            for batch in eval_batches(train, cfg, ratio, seed, batch_size, strategy):
                check_stop()
                ctx = context_codes(batch.targets, batch.mask, data.grid, c, offsets)  # (B, N)
                codes.append(ctx.gather(1, batch.ids).flatten())
                centres.append(batch.masked_targets.flatten())
            tables.append(fit_table(torch.cat(codes), torch.cat(centres), c, offsets))
    return Baselines(c, data.grid, int(counts.argmax()), by_pos.argmax(1), tables)
