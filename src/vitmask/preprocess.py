"""One preprocessing path for every image source: grayscale -> fit to size -> binarize.

Every source hands over grayscale images as uint8 (n, H, W) in 0..255 (or one file at a time via
`load_image_file`); `binarize_images` fits them to `data.image_size` by `data.fit` and thresholds
them at `data.threshold` (a fraction of 255), optionally inverted, giving uint8 (n, S, S) in {0, 1}.
Inpainting a user's image goes through the same function as training data.
"""

from pathlib import Path

import torch
import torch.nn.functional as F

from vitmask.config import DataConfig
from vitmask.errors import UserError

FITS = ("pad", "resize", "center_crop", "none")


def load_image_file(path: str | Path) -> torch.Tensor:
    """One image file (PNG, JPEG, BMP, ...) -> (H, W) uint8 grayscale. Not an image -> UserError."""
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    if not path.is_file():
        raise UserError(f"image not found: {path}; pass an existing PNG, JPEG or BMP file")
    try:
        with Image.open(path) as im:
            gray = im.convert("L")
            data = torch.frombuffer(bytearray(gray.tobytes()), dtype=torch.uint8)
            return data.view(gray.height, gray.width)
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise UserError(
            f"{path} is not a readable image ({e.__class__.__name__}); pass a PNG, JPEG or BMP file"
        ) from None


def fit_images(images: torch.Tensor, size: int, fit: str) -> torch.Tensor:
    """(n, H, W) uint8 -> (n, size, size) uint8.

    pad: centre the image on a black canvas (cropping the centre of any side longer than size);
    resize: bilinear resize to size x size; center_crop: crop the centre (padding any side shorter
    than size); none: the images must already be size x size.
    """
    n, h, w = images.shape
    if fit == "none":
        if (h, w) != (size, size):
            raise UserError(
                f"images are {h}x{w} but data.image_size is {size} and data.fit is none; "
                "set data.fit to pad, resize or center_crop"
            )
        return images
    if fit == "resize":
        x = F.interpolate(images.unsqueeze(1).float(), size=(size, size), mode="bilinear", antialias=True)
        return x.squeeze(1).round().clamp(0, 255).to(torch.uint8)
    # pad and center_crop both centre the image on a size x size canvas; they differ in intent,
    # and in that pad is the choice for images smaller than size, center_crop for larger ones
    out = torch.zeros(n, size, size, dtype=torch.uint8, device=images.device)
    ch, cw = min(h, size), min(w, size)
    sy, sx = (h - ch) // 2, (w - cw) // 2  # source offsets (crop)
    dy, dx = (size - ch) // 2, (size - cw) // 2  # destination offsets (pad)
    out[:, dy : dy + ch, dx : dx + cw] = images[:, sy : sy + ch, sx : sx + cw]
    return out


def binarize_images(images: torch.Tensor, cfg: DataConfig) -> torch.Tensor:
    """(n, H, W) uint8 grayscale -> (n, image_size, image_size) uint8 in {0, 1}."""
    fitted = fit_images(images, cfg.image_size, cfg.fit)
    binary = fitted.float() >= cfg.threshold * 255.0
    if cfg.invert:
        binary = ~binary
    return binary.to(torch.uint8)
