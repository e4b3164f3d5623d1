"""Pictures as files: images tiled in a grid, and PNG files of them.

`tile` lays images out as torchvision's `make_grid` does (row by row, `nrow` a row, `padding` pixels of
`pad_value` before and between the tiles, empty tiles of the last row left `pad_value`; one image
alone is returned as it is, without padding), and `save_png` rounds to 8 bits as torchvision's
`save_image` does, so the files are byte for byte the ones torchvision writes (tests/test_grid.py).
vitmask does not import torchvision for them: its import brings torch's compiler with it, about two
seconds of every command's start.

Shapes: B images, C channels (1 or 3), H x W pixels.
"""

import math

import torch
import torch.nn.functional as F


def tile(images: torch.Tensor, nrow: int, padding: int, pad_value: float) -> torch.Tensor:
    """images (B, C, H, W) in [0, 1], C 1 (drawn grey) or 3 -> (3, H', W'): `nrow` images a row,
    H' = rows * (H + padding) + padding, W' = min(nrow, B) * (W + padding) + padding; one image (B = 1)
    comes back as it is, (3, H, W), without padding."""
    if images.size(1) == 1:
        images = images.expand(-1, 3, -1, -1)  # (B, 3, H, W)
    b, c, h, w = images.shape
    if b == 1:
        return images[0]  # (3, H, W)
    cols = min(nrow, b)
    rows = math.ceil(b / cols)
    cells = images.new_full((rows * cols, c, h, w), pad_value)
    cells[:b] = images  # (rows*cols, 3, H, W): the last row's empty tiles stay pad_value
    cells = F.pad(cells, (0, padding, 0, padding), value=pad_value)  # (rows*cols, 3, H+p, W+p)
    cells = cells.view(rows, cols, c, h + padding, w + padding).permute(2, 0, 3, 1, 4)  # (3, rows, H+p, cols, W+p)
    body = cells.reshape(c, rows * (h + padding), cols * (w + padding))
    return F.pad(body, (padding, 0, padding, 0), value=pad_value)  # (3, H', W')


def save_png(image: torch.Tensor, fp) -> None:
    """(3, H, W), (1, H, W) or (H, W) values in [0, 1] -> an RGB PNG at `fp` (a path, or a file object
    with a .png name): each value v becomes the byte floor(255 v + 0.5), clamped to 0..255."""
    from PIL import Image

    if image.dim() == 2:
        image = image.unsqueeze(0)  # (1, H, W)
    if image.size(0) == 1:
        image = image.expand(3, -1, -1)  # (3, H, W)
    pixels = image.mul(255).add_(0.5).clamp_(0, 255).permute(1, 2, 0).to("cpu", torch.uint8).numpy()  # (H, W, 3)
    Image.fromarray(pixels).save(fp, format=None)
