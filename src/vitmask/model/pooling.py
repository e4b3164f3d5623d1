"""Pooling a model's tokens into one feature vector per image: the mean of all tokens, or the means
of the cells of a G x G grid over the patch grid, concatenated (where the strokes are is kept).

`pool_tokens` is what `vitmask probe`, the online probe, the fine-tuned classifier and the Python
API's `features` pool by; `pool_visible` pools the tokens of the visible patches only, laid out the
same way (the classifier when patches are hidden from an encoder that drops them). `feature_name`
says in words which tokens are pooled and how (the probe's report, a classifier's model card).

Shapes: n images, N patches of a g x g grid (N = g * g), V visible patches, D token width, G cells
per side of the pooling grid.
"""

import math
from collections.abc import Sequence

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


def as_layers(layer: int | Sequence[int] | None) -> tuple[int | None, ...]:
    """--layer as a tuple: (None,) for the final normalised tokens (None), else the blocks in the order
    given. An empty sequence names no layer: a ValueError (probe.check_layer refuses it first)."""
    if layer is None:
        return (None,)
    layers = (layer,) if isinstance(layer, int) else tuple(layer)
    if not layers:
        raise ValueError("an empty list of layers names no layer; None is the final normalised tokens")
    return layers


def feature_name(layer: int | Sequence[int] | None, grid: int | None = None, patch_grid: int = 0) -> str:
    """What the features are, in words, e.g. "mean of block 2's output tokens" or "means of the
    4x4 grid's cells (4x4 patches each) of the final normalised tokens"."""
    layers = as_layers(layer)
    if len(layers) > 1:
        zero = " (0: the embedded patches)" if 0 in layers else ""
        tokens = f"the output tokens of blocks {', '.join(map(str, layers))}{zero}, each block's concatenated"
    elif layers[0] is None:
        tokens = "the final normalised tokens"
    else:
        tokens = "the embedded patches (layer 0)" if layers[0] == 0 else f"block {layers[0]}'s output tokens"
    if grid is None:
        return f"mean of {tokens}"
    return f"means of the {grid}x{grid} grid's cells ({cell_sides(patch_grid, grid)}) of {tokens}"


def cell_sides(patch_grid: int, grid: int) -> str:
    """The cells' sides in patches, in words: "4x4 patches each" (16 in 4), or where `grid` does not
    divide the patch grid "4x4 patches each, neighbours sharing a row or column" (14 in 4) or "3 to 4
    patches a side" (8 in 3)."""
    sides = {-(-(i + 1) * patch_grid // grid) - i * patch_grid // grid for i in range(grid)}  # ceil(end) - floor(start)
    if len(sides) > 1:
        return f"{min(sides)} to {max(sides)} patches a side"
    (c,) = sides
    return f"{c}x{c} patches each" + ("" if patch_grid % grid == 0 else ", neighbours sharing a row or column")
