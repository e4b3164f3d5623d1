"""Inpainting: which patches to fill (boxes or a mask image), and scoring a fill.

Boxes are `x0,y0,x1,y1` in pixel coordinates of the preprocessed image (image_size x image_size,
after fitting and binarizing): x is the column, y the row, (0, 0) the top-left pixel, x0/y0
inclusive and x1/y1 exclusive, as in a Python slice. A box masks every patch it touches. A mask
image is read in the coordinates of the user's original image, fitted like the image, and masks
every patch holding at least one of its white pixels (gray level >= 128).

The filling itself (one-shot or iterative, most likely class or sampled) is
`sampling.decode_masked`; `fill_image` fills one image with it as `vitmask inpaint` does (and
vitmask demo, which calls it, so the page's fill is the CLI's), with `inpaint_options`.

Shapes: B images, H = W side, N patches, P pixels per patch, M masked patches per image, C classes.
"""

from collections.abc import Callable

import torch

from vitmask.config import DataConfig
from vitmask.data.patches import patches_to_classes, patchify
from vitmask.data.preprocess import fit_images
from vitmask.errors import UserError
from vitmask.evaluate.metrics import MaskedPatchMetrics
from vitmask.evaluate.pictures import paste_predictions
from vitmask.generate.sampling import DecodeOptions, DecodeRound, decode_masked


def parse_box(text: str, size: int) -> tuple[int, int, int, int]:
    """'x0,y0,x1,y1' -> ints, checked to lie inside a size x size image and to be non-empty."""
    try:
        x0, y0, x1, y1 = (int(v) for v in text.split(","))
    except ValueError:
        raise UserError(f"--box expects x0,y0,x1,y1 as four integers (e.g. --box 8,8,24,24), got '{text}'") from None
    if not (0 <= x0 < x1 <= size and 0 <= y0 < y1 <= size):
        raise UserError(
            f"--box {text} is outside the {size}x{size} preprocessed image or empty; "
            f"use 0 <= x0 < x1 <= {size} and 0 <= y0 < y1 <= {size} (x1, y1 exclusive)"
        )
    return x0, y0, x1, y1


def boxes_to_mask(boxes: list[tuple[int, int, int, int]], size: int) -> torch.Tensor:
    """(size, size) bool pixel mask, True inside any box."""
    pix = torch.zeros(size, size, dtype=torch.bool)
    for x0, y0, x1, y1 in boxes:
        pix[y0:y1, x0:x1] = True
    return pix


def mask_image_to_pixels(mask_gray: torch.Tensor, image_shape: tuple[int, int], cfg: DataConfig) -> torch.Tensor:
    """A mask image (h, w) uint8 gray in the original image's coordinates -> (S, S) bool pixel mask."""
    if tuple(mask_gray.shape) != tuple(image_shape):
        (mh, mw), (ih, iw) = mask_gray.shape, image_shape
        raise UserError(
            f"the mask image is {mw}x{mh} pixels but the image is {iw}x{ih}; draw the mask on a copy of the image"
        )
    fitted = fit_images(mask_gray.unsqueeze(0), cfg.image_size, cfg.fit)[0]  # (S, S) uint8
    return fitted >= 128


def pixels_to_patches(pix: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(S, S) bool pixel mask -> (N,) bool, True for every patch holding a masked pixel."""
    return patchify(pix.unsqueeze(0), patch_size)[0].any(-1)  # (N,)


def check_patch_mask(mask: torch.Tensor) -> None:
    """A fill needs at least one masked patch and one visible one."""
    n = mask.numel()
    if not bool(mask.any()):
        raise UserError("the boxes or mask cover no patch; give a --box or --mask over the part to fill")
    if bool(mask.all()):
        raise UserError(f"the boxes or mask cover all {n} patches, leaving the model nothing to see; mask less")


def inpaint_options(
    iterative: bool, steps: int, temperature: float = 0.0, order: str = "confidence", choice_temperature: float = 0.0
) -> DecodeOptions:
    """`vitmask inpaint`'s decoding options, every value checked: one round (the one-shot fill) unless
    `iterative`, else `steps` rounds."""
    options = DecodeOptions(steps, temperature, order, choice_temperature)  # checks every value
    return options if iterative else DecodeOptions(1, temperature, order, choice_temperature)


def fill_image(
    model: torch.nn.Module,
    picture: torch.Tensor,
    mask: torch.Tensor,
    patch_size: int,
    options: DecodeOptions,
    seed: int,
    samples: int = 1,
    on_round: Callable[[DecodeRound], None] | None = None,
) -> torch.Tensor:
    """picture (S, S) 0/1, mask (N,) True = fill -> (K, S, S) uint8: `samples` completions of the masked
    patches (visible ones kept), drawn by `decode_masked` with `options` from a generator on the model's
    device seeded with `seed`. `on_round`: decode_masked's hook (rows: the completions)."""
    check_patch_mask(mask)
    device = next(model.parameters()).device
    mask = mask.to(device).unsqueeze(0).expand(samples, -1)  # (K, N)
    picture = picture.to(device).unsqueeze(0).expand(samples, -1, -1)  # (K, S, S)
    generator = torch.Generator(device=device).manual_seed(seed)
    classes = decode_masked(model, picture, mask, patch_size, options, generator, on_round)  # (K, N)
    return paste_predictions(picture, mask, classes, patch_size)  # (K, S, S)


def fill_accuracy(
    model: torch.nn.Module,
    images: torch.Tensor,
    mask: torch.Tensor,
    patch_size: int,
    steps: int = 1,
    batch_size: int = 256,
    options: DecodeOptions | None = None,
    generator: torch.Generator | None = None,
) -> dict[str, float]:
    """Fill `images` (n, H, W) under `mask` (n, N) and score the fill.

    The fill is `decode_masked` with `options` (default: the most likely classes over `steps`
    rounds). Returns the masked-patch metrics of the fill (metrics.py): acc (masked patches given
    their true class), acc_nonempty (the same over masked patches whose true class is not 0),
    bit_acc and the counts behind them.
    """
    options = options or DecodeOptions(steps=steps)
    scores = MaskedPatchMetrics(2 ** (patch_size**2), images.device)
    for start in range(0, len(images), batch_size):
        chunk, m = images[start : start + batch_size], mask[start : start + batch_size]  # (B, H, W), (B, N)
        truth = patches_to_classes(patchify(chunk, patch_size))  # (B, N)
        guess = decode_masked(model, chunk, m, patch_size, options, generator)  # (B, N)
        scores.add(guess[m], truth[m])  # (K,) the masked patches
    return scores.read()
