"""Patches and token classes.

Shapes: B batch, H = W image side, p patch side, g = H / p patches per side, N = g * g patches,
P = p * p pixels per patch, C = 2^P token classes.

Patches are numbered row-major over the grid. Inside a patch the pixels are read row-major, and
the first pixel is the most significant bit of the patch's class. For 2x2 patches:

    [a b]
    [c d]   ->   class = 8a + 4b + 2c + d

so [[0, 0], [0, 1]] is class 1 and [[1, 0], [0, 0]] is class 8, matching the column order of the
logit table in docs/notation.md ([0,0,0,0], [0,0,0,1], ..., [1,1,1,1]).
"""

import torch


def patchify(images: torch.Tensor, p: int) -> torch.Tensor:
    """(B, H, W) -> (B, N, P). Any dtype; a view-free reshape, no copy of the data semantics."""
    b, h, w = images.shape
    g_h, g_w = h // p, w // p
    x = images.reshape(b, g_h, p, g_w, p)  # (B, gh, p, gw, p)
    x = x.permute(0, 1, 3, 2, 4)  # (B, gh, gw, p, p)
    return x.reshape(b, g_h * g_w, p * p)  # (B, N, P)


def unpatchify(patches: torch.Tensor, p: int) -> torch.Tensor:
    """(B, N, P) -> (B, H, W) for a square grid; the inverse of `patchify`."""
    b, n, _ = patches.shape
    g = int(round(n**0.5))
    if g * g != n:
        raise ValueError(f"unpatchify needs a square number of patches, got {n}")
    x = patches.reshape(b, g, g, p, p)  # (B, g, g, p, p)
    x = x.permute(0, 1, 3, 2, 4)  # (B, g, p, g, p)
    return x.reshape(b, g * p, g * p)  # (B, H, W)


def bit_weights(num_bits: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(P,) int64 weights 2^(P-1), ..., 2, 1: the first pixel is the most significant bit."""
    return 2 ** torch.arange(num_bits - 1, -1, -1, device=device, dtype=torch.long)


def patches_to_classes(patches: torch.Tensor) -> torch.Tensor:
    """(..., P) binary pixels (any dtype, values 0/1) -> (...) int64 class ids in [0, 2^P)."""
    w = bit_weights(patches.shape[-1], patches.device)
    return (patches.long() * w).sum(-1)


def classes_to_patches(classes: torch.Tensor, num_bits: int) -> torch.Tensor:
    """(...) int64 class ids -> (..., P) uint8 pixels; the inverse of `patches_to_classes`."""
    w = bit_weights(num_bits, classes.device)
    return ((classes.unsqueeze(-1) // w) % 2).to(torch.uint8)


def patch_mask_to_pixels(mask: torch.Tensor, p: int) -> torch.Tensor:
    """(B, N) bool patch mask -> (B, H, W) bool pixel mask: every pixel of a masked patch is True."""
    return unpatchify(mask.unsqueeze(-1).expand(-1, -1, p * p), p)  # (B, H, W)


def patch_label(cls: int, p: int) -> str:
    """A class as its pixel rows, e.g. class 9 of a 2x2 patch -> '10/01'."""
    bits = "".join(map(str, classes_to_patches(torch.tensor(cls), p * p).tolist()))
    return "/".join(bits[i : i + p] for i in range(0, len(bits), p))


def class_counts(images: torch.Tensor, patch_size: int, num_classes: int, chunk: int = 1 << 14) -> torch.Tensor:
    """(C,) int64 count of each token class over every patch of `images` (n, H, W), `chunk` images at
    a time (anything indexed like a tensor: a packed split too)."""
    total = torch.zeros(num_classes, dtype=torch.long, device=images.device)
    for start in range(0, len(images), chunk):
        classes = patches_to_classes(patchify(images[start : start + chunk], patch_size))  # (chunk, N)
        total += torch.bincount(classes.flatten(), minlength=num_classes)
    return total
