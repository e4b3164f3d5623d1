"""One preprocessing path for every image source: grayscale -> fit to size -> binarize.

Every source hands over grayscale images as uint8 (n, H, W) in 0..255 (or one file at a time via
`load_image_file`, or an array of any dtype via `to_gray_uint8`); `binarize_images` fits them to
`data.image_size` by `data.fit` and thresholds them at `data.threshold` (a fraction of 255),
optionally inverted, giving uint8 (n, S, S) in {0, 1}; `binarize_list` does the same for images of
mixed sizes. Inpainting a user's image goes through the same function as training data.
"""

from pathlib import Path

import torch
import torch.nn.functional as F

from vitmask.config import DataConfig
from vitmask.errors import UserError

FITS = ("pad", "resize", "center_crop", "none")


def load_image_file(path: str | Path) -> torch.Tensor:
    """One image file (PNG, JPEG, BMP, ...) -> (H, W) uint8 grayscale, every image mode read by
    `imagefile.read_gray` (16-bit, float, CMYK, EXIF orientation, ...). Not an image -> UserError."""
    from vitmask.data.imagefile import read_gray

    return torch.from_numpy(read_gray(path))


def fit_images(images: torch.Tensor, size: int, fit: str, background: int = 0) -> torch.Tensor:
    """(n, H, W) uint8 -> (n, size, size) uint8.

    pad: centre the image on a canvas of gray level `background` (cropping the centre of any side
    longer than size; `binarize_images` passes the level that thresholds to background: black, or
    white for `data.invert`, so the canvas never becomes ink);
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
    out = torch.full((n, size, size), background, dtype=torch.uint8, device=images.device)
    ch, cw = min(h, size), min(w, size)
    sy, sx = (h - ch) // 2, (w - cw) // 2  # source offsets (crop)
    dy, dx = (size - ch) // 2, (size - cw) // 2  # destination offsets (pad)
    out[:, dy : dy + ch, dx : dx + cw] = images[:, sy : sy + ch, sx : sx + cw]
    return out


def binarize_images(images: torch.Tensor, cfg: DataConfig) -> torch.Tensor:
    """(n, H, W) uint8 grayscale -> (n, image_size, image_size) uint8 in {0, 1}. The canvas around a
    padded image is background after the threshold and `invert`: black paper, or white with invert."""
    fitted = fit_images(images, cfg.image_size, cfg.fit, background=255 if cfg.invert else 0)
    binary = fitted.float() >= cfg.threshold * 255.0
    if cfg.invert:
        binary = ~binary
    return binary.to(torch.uint8)


def binarize_list(images: list[torch.Tensor], cfg: DataConfig) -> torch.Tensor:
    """Images of mixed sizes, each (H, W) uint8 grayscale -> (n, image_size, image_size) uint8 in
    {0, 1}, in the same order. Images of one size go through `binarize_images` together."""
    out = torch.empty(len(images), cfg.image_size, cfg.image_size, dtype=torch.uint8)
    by_size: dict[tuple[int, int], list[int]] = {}
    for i, img in enumerate(images):
        by_size.setdefault(tuple(img.shape), []).append(i)
    for idx in by_size.values():
        out[idx] = binarize_images(torch.stack([images[i] for i in idx]), cfg)
    return out


# ITU-R 601-2 luma, the weights PIL's convert("L") uses
LUMA = (0.299, 0.587, 0.114)


def to_gray_uint8(array, what: str) -> torch.Tensor:
    """An image array (n, H, W) or (n, H, W, C), C in 1, 3, 4 (channels last), -> (n, H, W) uint8 0..255.

    bool arrays, and integer arrays whose values are all 0 or 1, read as 0/1 images; other integer
    arrays must lie in 0..255; float arrays must lie in [0, 1]. RGB is converted with PIL's luma
    weights; an alpha channel is dropped. `what` names the array in errors.
    """
    import numpy as np

    a = np.asarray(array)
    channels_ok = a.ndim == 3 or (a.ndim == 4 and a.shape[-1] in (1, 3, 4))
    if not channels_ok or 0 in a.shape:
        raise UserError(f"{what} has shape {a.shape}; store the images as an array (n, H, W) or (n, H, W, C)")
    if a.dtype == np.uint8 and a.ndim == 3 and a.max() > 1:
        return torch.from_numpy(np.ascontiguousarray(a))  # the common case: gray levels already
    if a.dtype == np.bool_:
        scale = 1.0
    elif np.issubdtype(a.dtype, np.integer):
        lo, hi = int(a.min()), int(a.max())
        if lo < 0 or hi > 255:
            raise UserError(f"{what} holds integers in [{lo}, {hi}]; scale them to 0..255 (or 0/1)")
        scale = 1.0 if hi <= 1 else 1 / 255
    elif np.issubdtype(a.dtype, np.floating):
        if not np.isfinite(a).all():
            raise UserError(f"{what} holds NaN or inf values; store finite levels in [0, 1] (or uint8 0..255)")
        lo, hi = float(a.min()), float(a.max())
        if not (0.0 <= lo and hi <= 1.0):
            raise UserError(f"{what} holds floats in [{lo:g}, {hi:g}]; scale them to [0, 1] (or store uint8 0..255)")
        scale = 1.0
    else:
        raise UserError(f"{what} has dtype {a.dtype}; store the images as integers 0..255, floats in [0, 1] or bools")
    x = a.astype(np.float32) * scale  # (n, H, W[, C]) in [0, 1]
    if x.ndim == 4:
        x = x[..., 0] if x.shape[-1] == 1 else x[..., :3] @ np.array(LUMA, dtype=np.float32)  # (n, H, W)
    return torch.from_numpy(np.rint(x * 255).astype(np.uint8))
