"""Which patches are hidden, and what the model sees in their place.

Convention (as in MAE's `random_masking`): a boolean mask of shape (B, N) with True = masked,
plus the indices of the masked patches, (B, M). Every image in a batch hides exactly
M = round(ratio * N) patches (Python's round), clamped to [1, N - 1], so every shape is static
and the loss needs no boolean indexing.
"""

import torch


def num_masked(num_patches: int, ratio: float) -> int:
    """Patches hidden per image: round(ratio * N), at least 1 and at most N - 1."""
    return min(max(round(ratio * num_patches), 1), num_patches - 1)


def random_mask(
    batch: int,
    num_patches: int,
    num_mask: int,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hide `num_mask` uniformly chosen patches per image.

    Returns ids (B, M) int64, the masked patch indices, and mask (B, N) bool, True = masked.
    """
    noise = torch.rand(batch, num_patches, generator=generator, device=device)  # (B, N)
    ids = noise.argsort(dim=1)[:, :num_mask]  # (B, M)
    mask = torch.zeros(batch, num_patches, dtype=torch.bool, device=device)  # (B, N)
    mask.scatter_(1, ids, True)
    return ids, mask


def mask_to_ids(mask: torch.Tensor) -> torch.Tensor:
    """(B, N) bool with the same count M in every row -> (B, M) int64 indices, ascending."""
    m = int(mask[0].sum())
    # a stable sort puts the True positions first, in index order
    return mask.to(torch.int8).argsort(dim=1, descending=True, stable=True)[:, :m]  # (B, M)


def apply_fill(patches: torch.Tensor, mask: torch.Tensor, fill: float) -> torch.Tensor:
    """(B, N, P) float pixels, (B, N) mask -> (B, N, P) with masked patches set to `fill`."""
    return patches.masked_fill(mask.unsqueeze(-1), fill)
