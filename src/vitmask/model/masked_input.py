"""What the model reads of a masked image: the hidden patches replaced by the fill, and the indices
of the hidden and of the visible patches.

Masks are drawn by data/masking.py: a (B, N) bool, True = masked, with the same count M in every
row. Applying one to the tokens is the model's: `apply_fill` puts `mask.fill` in place of the
hidden pixels (the single stack), `mask_to_ids` and `visible_ids` give the indices the model
gathers (the last block computes the M hidden tokens only; an encoder-decoder's encoder runs on
the N - M visible ones, gathered dense).

Shapes: B batch, N patches, P pixels per patch, M masked patches per image, V = N - M visible.
"""

import torch


def mask_to_ids(mask: torch.Tensor) -> torch.Tensor:
    """(B, N) bool with the same count M in every row -> (B, M) int64 indices, ascending.

    Reads M from the first row: a host sync, so the training step passes the ids it drew instead."""
    m = int(mask[0].sum())
    # a stable sort puts the True positions first, in index order
    return mask.to(torch.int8).argsort(dim=1, descending=True, stable=True)[:, :m]  # (B, M)


def visible_ids(mask: torch.Tensor, num_masked: int) -> torch.Tensor:
    """mask (B, N) bool, True = masked, exactly `num_masked` per row -> (B, N - M) visible indices, ascending.

    A stable sort of (not masked) puts the visible positions first, in index order; the count comes
    from the caller (ids.shape[1]), so there is no host sync.
    """
    n = mask.shape[1]
    return (~mask).to(torch.int8).argsort(dim=1, descending=True, stable=True)[:, : n - num_masked]  # (B, V)


def apply_fill(patches: torch.Tensor, mask: torch.Tensor, fill: float) -> torch.Tensor:
    """(B, N, P) float pixels, (B, N) mask -> (B, N, P) with masked patches set to `fill`."""
    return patches.masked_fill(mask.unsqueeze(-1), fill)
