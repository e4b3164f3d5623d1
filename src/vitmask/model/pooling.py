"""Pooling a model's tokens into one feature vector per image: the mean of all tokens, or the means
of the cells of a G x G grid over the patch grid, concatenated (where the strokes are is kept).

`pool_tokens` is what `vitmask probe`, the online probe, the fine-tuned classifier and the Python
API's `features` pool by; `pool_visible` pools the tokens of the visible patches only, laid out the
same way (the classifier when patches are hidden from an encoder that drops them).

Shapes: n images, N patches of a g x g grid (N = g * g), V visible patches, D token width, G cells
per side of the pooling grid.
"""

import math

import torch
import torch.nn.functional as F


def pool_tokens(tokens: torch.Tensor, grid: int | None = None) -> torch.Tensor:
    """tokens (n, N, D) of a g x g patch grid (row-major, as `patchify` numbers them) -> features.

    grid None: (n, D), the mean over the N tokens. grid G (1..g): (n, G*G*D), the mean of each of
    the G x G cells; cells row-major, each cell's D features together. Cell i spans patch rows (and
    columns) floor(i g / G) to ceil((i + 1) g / G) - 1, as torch's AdaptiveAvgPool2d cuts them: c x c
    patches each when G divides g (c = g / G).
    """
    if grid is None:
        return tokens.mean(1)  # (n, D)
    n, num_tokens, d = tokens.shape
    g = math.isqrt(num_tokens)
    maps = tokens.transpose(1, 2).reshape(n, d, g, g)  # (n, D, g, g): patch r * g + c at row r, column c
    cells = F.adaptive_avg_pool2d(maps, grid)  # (n, D, G, G)
    return cells.permute(0, 2, 3, 1).flatten(1)  # (n, G, G, D) -> (n, G*G*D)


def pool_visible(tokens: torch.Tensor, keep: torch.Tensor, num_patches: int, grid: int | None) -> torch.Tensor:
    """tokens (n, V, D) at the patches keep (n, V) of N -> features as `pool_tokens` lays them out, each
    the mean of the visible tokens it covers (a cell without one: 0)."""
    if grid is None:
        return tokens.mean(1)  # (n, D)
    b, _, d = tokens.shape
    counted = torch.cat([tokens, tokens.new_ones(b, tokens.shape[1], 1)], -1)  # (n, V, D + 1): a 1 to count
    full = counted.new_zeros(b, num_patches, d + 1).scatter(1, keep.unsqueeze(-1).expand_as(counted), counted)
    cells = pool_tokens(full, grid).view(b, grid * grid, d + 1)  # (n, G*G, D + 1) cell means over all N
    return (cells[..., :d] / cells[..., d:].clamp_min(1e-6)).flatten(1)  # (n, G*G*D): over the visible only
