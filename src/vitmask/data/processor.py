"""Images as a user has them -> what a vitmask model takes: `ImageProcessor`.

A processor holds a model's preprocessing, the data keys it was trained with (image size, patch
size, threshold, invert, fit), and applies it the way training data went through it, with the same
code (`preprocess.binarize_images`, `imagefile.read_gray`, `preprocess.to_gray_uint8`):

    images -> gray levels 0..255 -> fitted to image_size (data.fit) -> thresholded (data.threshold,
    data.invert) -> binary pixels (B, S, S) -> patches (B, N, P) -> token classes (B, N)

It takes a uint8 (or bool, 0/1 integer, float in [0, 1]) array or torch tensor of one gray image
(H, W), a batch (B, H, W) or a channels-last batch (B, H, W, C); a PIL image of any mode; an image
file's path; or a list of any of these, one image each, of any sizes. Arrays follow the rules of
an npz source (`to_gray_uint8`): values all 0 or 1 are read as binary pixels, RGB by its luma.

Patches are numbered row by row over the image; a patch's p*p pixels are read row by row, 1 =
foreground, and the first pixel is the most significant bit of its token class (patches.py):
class = sum of pixel_i * 2^(p*p - 1 - i).

`ImageProcessor.from_config(cfg)` builds it from a config (a checkpoint's), `from_pretrained(DIR)`
from an export dir's config.json (its `data` entry). The Python API's models carry theirs as
`.processor`.

Shapes: B images, H, W their sides, S image_size, N patches, P pixels per patch.
"""

import json
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch

from vitmask.config import Config, DataConfig
from vitmask.data.imagefile import gray_levels, read_gray
from vitmask.data.patches import patches_to_classes, patchify
from vitmask.data.preprocess import binarize_images, binarize_list, to_gray_uint8
from vitmask.errors import UserError


@dataclass(frozen=True)
class ProcessedImages:
    """What a processor gives: the binary images, with their patches and token classes."""

    pixels: torch.Tensor  # (B, S, S) uint8 0/1, 1 = foreground
    patch_size: int

    @property
    def patches(self) -> torch.Tensor:
        """(B, N, P) float32 0/1: what `model(patches, mask)` and the classifier take."""
        return patchify(self.pixels, self.patch_size).float()

    @property
    def classes(self) -> torch.Tensor:
        """(B, N) int64 token class of every patch."""
        return patches_to_classes(patchify(self.pixels, self.patch_size))

    def __len__(self) -> int:
        return len(self.pixels)

    def to(self, device: torch.device | str) -> "ProcessedImages":
        return ProcessedImages(self.pixels.to(device), self.patch_size)


@dataclass(frozen=True)
class ImageProcessor:
    """A model's preprocessing (the data keys it was trained with): images in, `ProcessedImages` out."""

    image_size: int
    patch_size: int = 2
    threshold: float = 0.5
    invert: bool = False
    fit: str = "pad"

    def __post_init__(self) -> None:
        self.data_config()  # the config's own checks: sizes, threshold range, fit

    def data_config(self) -> DataConfig:
        """The processor's keys as a DataConfig (what `preprocess` reads)."""
        return DataConfig(
            image_size=self.image_size,
            patch_size=self.patch_size,
            threshold=self.threshold,
            invert=self.invert,
            fit=self.fit,
        )

    @classmethod
    def from_config(cls, cfg: Config | DataConfig) -> "ImageProcessor":
        """The processor of a config (a checkpoint's: `checkpoint_config(path)`), or of its data section."""
        d = cfg.data if isinstance(cfg, Config) else cfg
        return cls(d.image_size, d.patch_size, d.threshold, d.invert, d.fit)

    @classmethod
    def from_dict(cls, data: dict) -> "ImageProcessor":
        """The processor of an export's config.json `data` entry (extra entries, such as bit_order, ignored)."""
        keys = [f.name for f in fields(cls)]
        missing = [k for k in keys if k not in data]
        if missing:
            raise UserError(f"the data entry names no {missing[0]}; it needs {', '.join(keys)}")
        try:
            return cls(**{k: data[k] for k in keys})
        except TypeError as e:
            raise UserError(f"the data entry is not a processor's ({e})") from None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ImageProcessor":
        """The processor of an export dir (`vitmask export`), from its config.json. For a .pt checkpoint:
        `ImageProcessor.from_config(vitmask.store.checkpoint.checkpoint_config(path))`, or the
        `.processor` of `vitmask.load_classifier(path)` / `vitmask.load_masked_model(path)`."""
        file = Path(path) / "config.json"
        if not file.is_file():
            raise UserError(
                f"{path} is not an export dir (no config.json); pass a folder written by vitmask export, or build "
                "the processor of a .pt checkpoint with ImageProcessor.from_config(checkpoint_config(path))"
            )
        try:
            meta = json.loads(file.read_text())
            data = meta["data"]
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            why = e.__class__.__name__
            raise UserError(f"{file} holds no readable data entry ({why}); export the model again") from None
        if not isinstance(data, dict):
            raise UserError(f"{file}: its data entry is not a mapping; export the model again")
        try:
            return cls.from_dict(data)
        except UserError as e:
            raise UserError(f"{file}: {e}; export the model again") from None

    # ---- images in --------------------------------------------------------------------------------
    def __call__(self, images) -> ProcessedImages:
        """Images (see the module docstring) -> ProcessedImages: pixels (B, S, S), patches, classes."""
        return ProcessedImages(self.binarize(images), self.patch_size)

    def binarize(self, images) -> torch.Tensor:
        """Images -> (B, S, S) uint8 0/1: fitted, thresholded, inverted as in training."""
        cfg = self.data_config()
        if isinstance(images, (list, tuple)):
            if not images:
                raise UserError("no images given (an empty list); pass one image or a list of them")
            return binarize_list([gray_image(x, f"image {i}") for i, x in enumerate(images)], cfg)
        if isinstance(images, (np.ndarray, torch.Tensor)) and images.ndim in (3, 4):
            return binarize_images(to_gray_uint8(as_array(images), "the images"), cfg)  # (B, H, W[, C])
        return binarize_images(gray_image(images, "the image").unsqueeze(0), cfg)


def as_array(x) -> np.ndarray:
    """A numpy array or a torch tensor (any device) as a numpy array."""
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def gray_image(image, what: str) -> torch.Tensor:
    """One image (a path, a PIL image, an array or tensor (H, W) or (H, W, C)) -> (H, W) uint8 gray levels."""
    from PIL import Image

    if isinstance(image, (str, Path)):
        return torch.from_numpy(read_gray(image))
    if isinstance(image, Image.Image):
        image.load()
        return torch.from_numpy(gray_levels(image, Path(what)))
    if isinstance(image, (np.ndarray, torch.Tensor)):
        a = as_array(image)
        if a.ndim == 2:
            return to_gray_uint8(a[None], what)[0]  # (H, W)
        if a.ndim == 3 and a.shape[-1] in (1, 3, 4):
            return to_gray_uint8(a[None], what)[0]  # (H, W, C) -> (H, W)
        raise UserError(
            f"{what} has shape {tuple(a.shape)}; pass one image as (H, W) or (H, W, C), or a batch (B, H, W) "
            "outside a list"
        )
    raise UserError(
        f"{what} is a {type(image).__name__}; pass a numpy array, a torch tensor, a PIL image or an image file's path"
    )
