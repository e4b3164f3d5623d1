"""Reading one image file as 8-bit gray, for every mode Pillow opens, or refusing it in one line.

Pillow's own `convert("L")` clips rather than scales the deep modes (a 16-bit PNG comes out
almost all white, a float image almost all black) and drops transparency. Here each mode gets a
gray level 0..255 that means what the file means:

- 1, L, P, RGB, RGBX, CMYK, YCbCr, HSV: Pillow's conversion to L (ITU-R 601-2 luma for colour);
- LAB: its L (lightness) channel;
- I;16, I;16B, I;16L, I;16N: v * 255 / 65535, rounded;
- I (32-bit integers): read as 16-bit levels, as 16-bit PNG and PGM files open in it; values
  outside 0..65535 are refused;
- F (32-bit floats): v * 255 for v in [0, 1], as vitmask reads float arrays; values outside
  [0, 1], NaN or inf are refused;
- LA, La, PA, RGBA, RGBa, and any mode with a transparent colour (PNG tRNS): as without alpha
  when every pixel is opaque; transparent pixels are refused (their gray level is undefined).

The EXIF orientation is applied, so a photo reads the way viewers show it. Only the first frame
of an animation is read. Images over Pillow's decompression-bomb limit (`Image.MAX_IMAGE_PIXELS`)
are refused, as are files Pillow cannot decode (any error it raises).
"""

import warnings
from pathlib import Path

import numpy as np

from vitmask.errors import UserError

SIXTEEN_BIT = ("I;16", "I;16B", "I;16L", "I;16N")
ALPHA = ("LA", "La", "PA", "RGBA", "RGBa")


def read_gray(path: str | Path) -> np.ndarray:
    """The image file at `path` -> (H, W) uint8 gray levels; anything else is a one-line UserError."""
    from PIL import Image, ImageOps

    path = Path(path)
    if path.exists() and not path.is_file():
        raise UserError(f"{path} is not a file; pass a PNG, JPEG or BMP file")
    if not path.is_file():
        raise UserError(f"image not found: {path}; pass an existing PNG, JPEG or BMP file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as im:
                try:
                    im = ImageOps.exif_transpose(im)  # a copy, loaded
                except Exception:  # a broken EXIF block: read the pixels as stored
                    im.load()
                return gray_levels(im, path)
    except UserError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise UserError(
            f"{path} is too large to open safely (over Pillow's limit of {Image.MAX_IMAGE_PIXELS:,} pixels); "
            "shrink it first"
        ) from None
    except Exception as e:  # Pillow raises OSError, SyntaxError, ValueError, struct.error, ... for bad files
        raise UserError(
            f"{path} is not a readable image ({e.__class__.__name__}); pass a PNG, JPEG or BMP file"
        ) from None


def gray_levels(im, path: Path) -> np.ndarray:
    """A loaded Pillow image of any mode -> (H, W) uint8, by the table in the module docstring."""
    mode = im.mode
    if "transparency" in im.info and mode not in ALPHA:  # a transparent colour (P, L, RGB, ... with tRNS)
        try:
            keyed = im.convert("RGBA")
        except ValueError:
            keyed = None
        if keyed is not None and np.asarray(keyed.getchannel("A")).min() < 255:
            raise UserError(
                f"{path} has transparent pixels (mode {mode} with a transparent colour), which have no gray level; "
                "flatten it onto a background (e.g. white) and save it again"
            )
    if mode in ALPHA:
        if mode in ("PA", "La"):
            im, mode = im.convert("RGBA"), "RGBA"
        alpha = np.asarray(im.getchannel("A"))
        if alpha.size and alpha.min() < 255:
            raise UserError(
                f"{path} has transparent pixels (mode {mode}), which have no gray level; "
                "flatten it onto a background (e.g. white) and save it again"
            )
        im = im.convert("RGB" if mode.startswith("RGB") else "L")
    if mode in SIXTEEN_BIT:
        v = np.asarray(im).astype(np.uint32)  # (H, W) 0..65535
        return ((v * 255 + 32767) // 65535).astype(np.uint8)
    if mode == "I":
        v = np.asarray(im).astype(np.int64)
        if v.size and (v.min() < 0 or v.max() > 65535):
            raise UserError(
                f"{path} holds 32-bit values in [{v.min()}, {v.max()}]; vitmask reads mode I as 16-bit "
                "levels 0..65535: save it as an 8- or 16-bit grayscale PNG"
            )
        return ((v * 255 + 32767) // 65535).astype(np.uint8)
    if mode == "F":
        v = np.asarray(im).astype(np.float64)
        if v.size and not (np.isfinite(v).all() and v.min() >= 0.0 and v.max() <= 1.0):
            raise UserError(
                f"{path} holds floating-point values outside [0, 1] (or NaN/inf); vitmask reads float "
                "images as levels in [0, 1]: scale them, or save an 8-bit grayscale PNG"
            )
        return np.rint(v * 255).astype(np.uint8)
    if mode == "LAB":
        return np.array(im.getchannel("L"), dtype=np.uint8)
    try:
        return np.array(im.convert("L"), dtype=np.uint8)
    except ValueError:
        raise UserError(
            f"{path} is an image of mode {mode}, which vitmask cannot turn into gray levels; "
            "save it as a grayscale or RGB PNG"
        ) from None
