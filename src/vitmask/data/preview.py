"""`vitmask preview`: a look at the data before a long run.

A PNG grid of sample training images, each row of images followed by a row of the same images
with their masks drawn (the configured strategy at `mask.ratio`, masked patches tinted blue:
light on foreground, dark on background), and the statistics of the splits: image counts,
foreground pixel fraction, the most common patch classes, the share of empty patches, and how many
images preprocessing left blank (no pixel on) or nearly blank (under NEARLY_BLANK of their pixels
on). When more than BLANK_WARN_SHARE of the images are blank or nearly blank, one warning line on
stderr says so (a resize that thins strokes below the threshold, a wrong threshold or invert); when
the train split is more than half foreground, one line says the images look inverted and names
data.invert (binarization.warn_if_inverted).

Shapes: B images, H = W side, N patches, P pixels per patch, C token classes.
"""

from pathlib import Path

import torch

from vitmask.config import Config
from vitmask.data.batches import SPLITS, eval_batches
from vitmask.data.binarization import warn_if_inverted
from vitmask.data.grid import save_png, tile
from vitmask.data.patches import class_counts, patch_label, patch_mask_to_pixels
from vitmask.errors import UserError, warn
from vitmask.outputs import Replaces, write_atomically
from vitmask.sizes import num_masked

MASK_TINT = torch.tensor([0.2, 0.45, 1.0])  # masked patches: the pixel's gray level blended with this
PAD = 2  # pixels between grid cells (grid.tile's padding)
NEARLY_BLANK = 0.01  # an image with some pixels on but fewer than this share of them is nearly blank
BLANK_WARN_SHARE = 0.1  # more than this share of blank or nearly blank images: a warning


def dataset_stats(splits: dict[str, torch.Tensor], cfg: Config, top: int = 5) -> dict:
    """Counts per split, foreground fraction per split, and the patch-class histogram of train."""
    data = cfg.data
    counts = class_counts(splits["train"], data.patch_size, data.num_classes)  # (C,)
    share = counts.double() / counts.sum()  # (C,)
    order = share.argsort(descending=True)[:top]
    return {
        "images": {k: len(splits[k]) for k in SPLITS},
        "foreground": {k: foreground_share(splits[k]) for k in SPLITS},
        "empty_patch_share": float(share[0]),
        "top_classes": [(int(c), float(share[c])) for c in order],
        "blank": {k: blank_counts(splits[k]) for k in SPLITS},
    }


def blank_counts(images, chunk: int = 1 << 14) -> tuple[int, int]:
    """(blank, nearly blank) images of `images` (n, H, W) 0/1 (a tensor or a packed split): no pixel on;
    some, but fewer than NEARLY_BLANK of the image's pixels. Counted `chunk` images at a time."""
    n, h, w = images.shape
    limit = NEARLY_BLANK * h * w
    blank = nearly = 0
    for s in range(0, n, chunk):
        on = images[s : s + chunk].sum(dim=(1, 2), dtype=torch.int64)  # (c,) pixels on per image
        blank += int((on == 0).sum())
        nearly += int(((on > 0) & (on < limit)).sum())
    return blank, nearly


def blank_line(stats: dict) -> str:
    """The statistics' line on blank and nearly blank images, over every split."""
    total = sum(stats["images"].values())
    blank = sum(b for b, _ in stats["blank"].values())
    nearly = sum(nb for _, nb in stats["blank"].values())
    return (
        f"blank after preprocessing: {blank:,} images blank, {nearly:,} nearly blank "
        f"(under {NEARLY_BLANK:.0%} of pixels on), of {total:,}"
    )


def warn_if_blank(stats: dict, cfg: Config) -> None:
    """One warning line on stderr when more than BLANK_WARN_SHARE of all images are blank or nearly blank."""
    data = cfg.data
    total = sum(stats["images"].values())
    lost = sum(b + nb for b, nb in stats["blank"].values())
    if total and lost / total > BLANK_WARN_SHARE:
        warn(
            f"{lost:,} of {total:,} images ({lost / total:.0%}) are blank or nearly blank after preprocessing "
            f"(under {NEARLY_BLANK:.0%} of pixels on; data.fit {data.fit} to {data.image_size}x{data.image_size}, "
            f"data.threshold {data.threshold}, data.invert {str(data.invert).lower()}): look at the preview; "
            "resize thins strokes below the threshold (try data.fit=pad or a larger data.image_size), "
            "or set another data.threshold or data.invert"
        )


def foreground_share(images, chunk: int = 1 << 14) -> float:
    """The share of foreground pixels of `images` (n, H, W) 0/1 (a tensor or a packed split), counted
    `chunk` images at a time; NaN for no images."""
    if len(images) == 0:
        return float("nan")
    ones = sum(int(images[s : s + chunk].sum(dtype=torch.int64)) for s in range(0, len(images), chunk))
    n, h, w = images.shape
    return ones / (n * h * w)


def format_stats(stats: dict, cfg: Config) -> str:
    data, mask = cfg.data, cfg.mask
    n_mask = num_masked(data.num_patches, mask.ratio)
    lo, hi = mask.ratio_range or (0, 1)
    counts = f"{num_masked(data.num_patches, lo)}..{num_masked(data.num_patches, hi)}"
    ranged = {
        "fixed": "",
        "uniform": f"; training draws M uniformly from {counts} per batch",
        "cosine": f"; training draws M from {counts} per batch, ratio cos(pi/2 u) in [{lo}, {hi}]",
    }[mask.ratio_schedule]
    lines = [
        f"source {data.source}" + ("" if data.source == "shapes" else f" ({data.path})"),
        f"images {data.image_size}x{data.image_size}, patches {data.patch_size}x{data.patch_size}: "
        f"{data.num_patches} per image, {data.num_classes} classes",
        f"mask {mask.strategy}, ratio {mask.ratio} ({n_mask} of {data.num_patches} patches){ranged}",
        f"{'split':<6} {'images':>8}  foreground",
    ]
    for k in SPLITS:
        lines.append(f"{k:<6} {stats['images'][k]:>8,}  {stats['foreground'][k]:.4f}")
    lines.append(f"empty patches (train) {stats['empty_patch_share']:.4f}")
    top = ", ".join(f"{c} [{patch_label(c, data.patch_size)}] {s:.4f}" for c, s in stats["top_classes"])
    lines.append(f"most common patch classes (train): {top}")
    lines.append(blank_line(stats))
    return "\n".join(lines)


def preview_grid(images: torch.Tensor, cfg: Config, seed: int, per_row: int = 8, scale: int = 4) -> torch.Tensor:
    """images (B, H, W) 0/1 -> (3, H', W') float in [0, 1]: rows of `per_row` images, each followed
    by the same images with their masks drawn, every pixel scaled up `scale` times."""
    p = cfg.data.patch_size
    batch = next(eval_batches(images, cfg, cfg.mask.ratio, seed, len(images), cfg.mask.strategy))  # training's kind
    gray = images.float().unsqueeze(1).expand(-1, 3, -1, -1)  # (B, 3, H, W)
    pix_mask = patch_mask_to_pixels(batch.mask, p)  # (B, H, W)
    masked = torch.where(pix_mask.unsqueeze(1), 0.45 * gray + 0.55 * MASK_TINT.view(1, 3, 1, 1), gray)
    rows = []
    for start in range(0, len(images), per_row):
        rows += [gray[start : start + per_row], masked[start : start + per_row]]
    cells = torch.cat(rows)  # (2B, 3, H, W), row by row
    cells = cells.repeat_interleave(scale, dim=2).repeat_interleave(scale, dim=3)  # (2B, 3, sH, sW)
    return tile(cells, nrow=per_row, padding=PAD, pad_value=0.5)


def write_preview(
    splits: dict[str, torch.Tensor], cfg: Config, out: Path, count: int, seed: int, replaces: Replaces = None
) -> dict:
    """Write the grid of `count` seeded random training images to `out` (a .png; its missing folders
    made; `replaces`: the file it may replace, outputs.write_atomically); return the stats (and
    warn when many images are blank or nearly blank, or when they look inverted)."""
    if out.suffix.lower() != ".png":
        raise UserError(f"--out {out} must be a .png file, e.g. --out preview.png")
    if count < 1:
        raise UserError(f"--count must be >= 1, got {count}")
    train = splits["train"]
    if count > len(train):
        warn(f"--count {count} is more than the {len(train)} training images; showing all {len(train)}")
    pick = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))[:count]
    grid = preview_grid(train[pick], cfg, seed, per_row=min(8, count))
    write_atomically(out, lambda f: save_png(grid, f), "--out", replaces=replaces)
    stats = dataset_stats(splits, cfg)
    warn_if_blank(stats, cfg)
    warn_if_inverted(stats["foreground"]["train"], cfg.data, "the training images", cfg.data.source == "packed")
    return stats
