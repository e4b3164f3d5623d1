"""Pictures of what a model predicts: one grid, shown in TensorBoard and written as PNG.

Rows, one column per image: the original; the masked input (hidden patches grey); the prediction
with the visible patches kept; the errors: pixels of masked patches predicted wrongly in red
(a missing foreground pixel) or orange (a spurious one), masked patches tinted blue. Given several
predictions (one-shot vs iterative inpainting), the last two rows repeat for each.

Shapes: B images, H = W side, N patches, P pixels per patch.
"""

import torch

from vitmask.data.grid import save_png, tile
from vitmask.data.patches import classes_to_patches, patch_mask_to_pixels, patchify, unpatchify

RED = torch.tensor([1.0, 0.1, 0.1])
ORANGE = torch.tensor([1.0, 0.6, 0.0])
BLUE_TINT = torch.tensor([0.0, 0.0, 0.35])


def paste_predictions(images: torch.Tensor, mask: torch.Tensor, pred: torch.Tensor, patch_size: int) -> torch.Tensor:
    """images (B, H, W) 0/1, mask (B, N), pred (B, N) classes -> (B, H, W) uint8 with the masked
    patches replaced by the predicted ones and the visible patches kept."""
    pix = patchify(images, patch_size)  # (B, N, P)
    guess = classes_to_patches(pred, patch_size**2).to(pix.dtype)  # (B, N, P)
    return unpatchify(torch.where(mask.unsqueeze(-1), guess, pix), patch_size)  # (B, H, W)


def reconstruction_grid(
    images: torch.Tensor, mask: torch.Tensor, preds: torch.Tensor | list[torch.Tensor], patch_size: int
) -> torch.Tensor:
    """images (B, H, W) 0/1, mask (B, N), preds one (B, N) tensor of classes or a list of them ->
    (3, H', W') float image in [0, 1], one column per image: the original, the masked input, then a
    prediction row and an error row for each prediction."""
    preds = [preds] if isinstance(preds, torch.Tensor) else preds
    images, mask = images.detach().cpu(), mask.detach().cpu()
    orig = images.float()  # (B, H, W)
    pix_mask = patch_mask_to_pixels(mask, patch_size)  # (B, H, W) bool
    masked_in = torch.where(pix_mask, torch.full_like(orig, 0.5), orig)
    rgb = lambda g: g.unsqueeze(1).expand(-1, 3, -1, -1)  # noqa: E731 - (B, H, W) -> (B, 3, H, W)
    rows = [rgb(orig), rgb(masked_in)]
    for pred in preds:
        filled = paste_predictions(images, mask, pred.detach().cpu(), patch_size).float()  # (B, H, W)
        err = rgb(filled).clone()
        err += pix_mask.unsqueeze(1).float() * BLUE_TINT.view(1, 3, 1, 1)
        missing = (filled < orig).unsqueeze(1)  # (B, 1, H, W)
        spurious = (filled > orig).unsqueeze(1)
        err = torch.where(missing, RED.view(1, 3, 1, 1), err)
        err = torch.where(spurious, ORANGE.view(1, 3, 1, 1), err).clamp(0, 1)
        rows += [rgb(filled), err]
    return tile(torch.cat(rows), nrow=len(images), padding=2, pad_value=0.3)


def save_binary_image(image: torch.Tensor, path, scale: int = 1) -> None:
    """(H, W) 0/1 image -> a black-and-white PNG, each pixel drawn as a scale x scale block."""
    big = image.detach().cpu().float().repeat_interleave(scale, 0).repeat_interleave(scale, 1)  # (sH, sW)
    save_png(big, path)


def save_grid(grid: torch.Tensor, path, scale: int = 1) -> None:
    """Write a grid as PNG, each pixel drawn as a scale x scale block."""
    if scale > 1:
        grid = grid.repeat_interleave(scale, 1).repeat_interleave(scale, 2)  # (3, sH', sW')
    save_png(grid, path)


def image_grid(images: torch.Tensor, nrow: int, hole: torch.Tensor | None = None, patch_size: int = 1) -> torch.Tensor:
    """images (B, H, W) 0/1 -> (3, H', W') grid in [0, 1], `nrow` images a row (samples, completions).

    With `hole` (B, N) bool, the pixels of its patches (`patch_size` a side) are drawn grey.
    """
    x = images.detach().cpu().float()  # (B, H, W)
    if hole is not None:
        x = torch.where(patch_mask_to_pixels(hole.detach().cpu(), patch_size), 0.5, x)  # (B, H, W)
    return tile(x.unsqueeze(1), nrow=nrow, padding=2, pad_value=0.3)
