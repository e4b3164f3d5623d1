"""Images as a user has them -> what a vitmask model takes: `ImageProcessor`.

A processor holds a model's preprocessing, the data keys it was trained with (image size, patch
size, threshold, invert, fit), and applies it the way training data went through it, with the same
code (`preprocess.binarize_images`, `imagefile.read_gray`, `preprocess.to_gray_uint8`):

    images -> gray levels 0..255 -> fitted to image_size (data.fit) -> thresholded (data.threshold,
    data.invert) -> binary pixels (B, S, S) -> patches (B, N, P) -> token classes (B, N)

It takes one image, a batch, or a list of images (docs/python.md has the full rules):

- a numpy array or torch tensor (H, W): one gray image;
- (H, W, C) with C = 1, 3 or 4 (channels last: gray, RGB, RGBA): one image. An array of 3 dimensions
  whose last axis is 1, 3 or 4 is always read so, never as a batch of images 1, 3 or 4 pixels
  wide: pass those as (B, H, W, 1) or as a list;
- (B, H, W) with W not 1, 2, 3 or 4: a batch of B gray images (so a (3, H, W) array is 3 gray
  images: channels first is never read); a last axis of 2 (gray and alpha, or images 2 pixels
  wide?) is refused;
- (B, H, W, C) with C = 1, 3 or 4: a batch of channels-last images. A 4-dimensional array whose last
  axis is not 1, 3 or 4 but whose second is (channels first, (B, C, H, W)) is refused;
- a PIL image of any mode (imagefile.gray_levels); an image file's path (str or os.PathLike);
- a list or tuple of any of these, each one image (not a batch), of any sizes.

Array values follow the rules of an npz source (`to_gray_uint8`): bool, and integers all 0 or 1,
are binary pixels; other integers 0..255; floats in [0, 1]; RGB is read by its luma, alpha dropped.
torch dtypes numpy cannot hold (bfloat16, the float8 types) are read as float32; sparse, quantized,
nested and meta tensors, complex values, empty images and other types are refused in one line (a
UserError), as is an image of another size than image_size when the fit is none.

Fit (data.fit, preprocess.fit_images): how an image of another size is brought to image_size. The
processor applies its own, the one the model was trained with; `fit=` of `__call__`, `binarize` and
the models' methods chooses another for one call (pad, center_crop, resize, or none to refuse
other sizes), as `vitmask predict --fit` does. `invert=` and `threshold=` choose the processor's
other two keys for one call, as `vitmask predict --invert/--no-invert --threshold` do; they are
how the model's training images were made binary, so a value that contradicts the processor's is
refused (a UserError naming both) unless `force_preprocessing=True` (`with_preprocessing`).

Patches are numbered row by row over the image; a patch's p*p pixels are read row by row, 1 =
foreground, and the first pixel is the most significant bit of its token class (patches.py):
class = sum of pixel_i * 2^(p*p - 1 - i).

`ImageProcessor.from_config(cfg)` builds it from a config (a checkpoint's), `from_pretrained(DIR)`
from an export dir's config.json (its `data` entry). The Python API's models carry theirs as
`.processor`.

Shapes: B images, H, W their sides, S image_size, N patches, P pixels per patch.
"""

import numbers
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch

from vitmask.config import Config, DataConfig
from vitmask.data.imagefile import gray_levels, read_gray
from vitmask.data.jsonfile import read_json
from vitmask.data.patches import patches_to_classes, patchify
from vitmask.data.preprocess import FITS, binarize_images, to_gray_uint8
from vitmask.errors import UserError
from vitmask.pretrained import check_model_arg, resolve_model_path

MAX_IMAGE_SIZE = 8192  # pixels a side: a 67M-pixel image, under Pillow's limit on opening one (89M)
MAX_PATCH_SIZE = 4  # data.patch_size's limit: 2^16 token classes
CHANNELS = (1, 3, 4)  # a channels-last axis: gray, RGB, RGBA
FIT_CHOICE = "fit='pad', 'center_crop' or 'resize' (vitmask predict --fit)"


@dataclass(frozen=True)
class ProcessedImages:
    """What a processor gives: the binary images, with their patches and token classes."""

    pixels: torch.Tensor  # (B, S, S) uint8 0/1, 1 = foreground
    patch_size: int

    def __post_init__(self) -> None:
        x = self.pixels
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[1] != x.shape[2]:
            what = f"of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else f"of type {type(x).__name__}"
            raise UserError(
                f"ProcessedImages.pixels is {what}; it takes a (B, S, S) uint8 tensor of 0/1 pixels, as a processor "
                "gives: model.processor(images)"
            )
        if x.dtype not in (torch.uint8, torch.bool):
            raise UserError(f"ProcessedImages.pixels has dtype {x.dtype}; it takes uint8 0/1 pixels")
        size = check_integer(self.patch_size, "ProcessedImages.patch_size", 1, MAX_PATCH_SIZE)
        if x.shape[1] % size:
            raise UserError(f"ProcessedImages: {x.shape[1]}-pixel images do not cut into {size}x{size} patches")
        object.__setattr__(self, "patch_size", size)
        if x.dtype == torch.bool:
            object.__setattr__(self, "pixels", x.to(torch.uint8))

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


# ---- argument checks --------------------------------------------------------------------------------
def check_integer(value, what: str, lo: int, hi: int) -> int:
    """An integer (Python's or numpy's, not a bool) in [lo, hi], as an int; else a UserError naming `what`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise UserError(
            f"{what} must be an integer from {lo} to {hi}, got {short(value)} (type {type(value).__name__})"
        )
    if not lo <= int(value) <= hi:
        raise UserError(f"{what} must be an integer from {lo} to {hi}, got {short(value)}")
    return int(value)


def check_fit(fit, what: str = "fit") -> str:
    """A fit name (preprocess.FITS), or a UserError naming `what`."""
    if not isinstance(fit, str) or fit not in FITS:
        raise UserError(f"{what} must be one of {', '.join(FITS)}, got {short(fit)}")
    return fit


def check_path(path, what: str = "path") -> Path:
    """A path argument: a str or os.PathLike, not empty, no NUL character, one the system can look at."""
    if not isinstance(path, (str, os.PathLike)):
        raise UserError(f"{what} must be a path (a str or Path), got type {type(path).__name__}")
    text = os.fspath(path)
    if isinstance(text, bytes):
        raise UserError(f"{what} is a bytes path; pass a str or Path")
    if not text.strip():
        raise UserError(f"{what} is an empty path; pass a file's or a folder's path")
    if "\x00" in text:
        raise UserError(f"{what} holds a NUL character; pass a file's or a folder's path")
    try:
        Path(text).exists()
    except OSError as e:  # a name too long for the file system
        raise UserError(f"{what} {short(text)} cannot be looked at ({e.strerror or e.__class__.__name__})") from None
    return Path(text)


def short(value) -> str:
    """A value as an error message shows it: its repr, cut to 40 characters (an integer by its size;
    a numpy scalar as the Python value it holds)."""
    if isinstance(value, np.generic) and not isinstance(value, (np.bool_, np.void)):
        value = value.item()
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**40:
        return f"an integer of {len(str(abs(value))) if abs(value) < 10**4000 else 'over 4000'} digits"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True)
class ImageProcessor:
    """A model's preprocessing (the data keys it was trained with): images in, `ProcessedImages` out.

    image_size: an integer 1..8192, divisible by patch_size; patch_size: 1..4; threshold: a real number
    in [0, 1]; invert: a bool; fit: pad, resize, center_crop or none. Other types are refused (a
    UserError), not read by their truth: `invert="no"` is an error, not True."""

    image_size: int
    patch_size: int = 2
    threshold: float = 0.5
    invert: bool = False
    fit: str = "pad"

    def __post_init__(self) -> None:
        size = check_integer(self.image_size, "ImageProcessor: image_size", 1, MAX_IMAGE_SIZE)
        patch = check_integer(self.patch_size, "ImageProcessor: patch_size", 1, MAX_PATCH_SIZE)
        t = self.threshold
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Real):
            raise UserError(
                f"ImageProcessor: threshold must be a number in [0, 1], got {short(t)} (type {type(t).__name__})"
            )
        if not 0.0 <= float(t) <= 1.0:  # NaN fails too
            raise UserError(f"ImageProcessor: threshold must be a number in [0, 1], got {short(t)}")
        if not isinstance(self.invert, (bool, np.bool_)):
            raise UserError(
                f"ImageProcessor: invert must be True or False, got {short(self.invert)} "
                f"(type {type(self.invert).__name__})"
            )
        fit = check_fit(self.fit, "ImageProcessor: fit")
        if size % patch:
            raise UserError(f"ImageProcessor: image_size {size} must be divisible by patch_size {patch}")
        for name, value in (("image_size", size), ("patch_size", patch), ("threshold", float(t)), ("fit", fit)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "invert", bool(self.invert))

    def data_config(self) -> DataConfig:
        """The processor's keys as a DataConfig (what `preprocess` reads)."""
        return DataConfig(
            image_size=self.image_size,
            patch_size=self.patch_size,
            threshold=self.threshold,
            invert=self.invert,
            fit=self.fit,
        )

    def with_fit(self, fit: str | None) -> "ImageProcessor":
        """This processor with another fit (None: this one's)."""
        return self if fit is None else replace(self, fit=check_fit(fit))

    def with_preprocessing(
        self,
        fit: str | None = None,
        invert=None,
        threshold=None,
        force_preprocessing: bool = False,
        cli: bool = False,
    ) -> "ImageProcessor":
        """This processor with another fit, invert or threshold for one call (None: this one's). An
        invert or threshold other than this processor's, which is how the model's training images
        were made binary, is refused in one line naming both unless `force_preprocessing`; `cli`:
        the message names the command line's flags (--invert, --threshold, --force-preprocessing)."""
        if not isinstance(force_preprocessing, (bool, np.bool_)):
            raise UserError(
                f"force_preprocessing must be True or False, got {short(force_preprocessing)} "
                f"(type {type(force_preprocessing).__name__})"
            )
        proc = self.with_fit(fit)
        force = "--force-preprocessing" if cli else "force_preprocessing=True"
        if invert is not None:
            if not isinstance(invert, (bool, np.bool_)):
                raise UserError(
                    f"invert must be True, False or None, got {short(invert)} (type {type(invert).__name__})"
                )
            invert = bool(invert)
            if invert != self.invert and not force_preprocessing:
                given = ("--invert" if invert else "--no-invert") if cli else f"invert={invert}"
                leave = "--invert/--no-invert" if cli else "invert"
                raise UserError(
                    f"{given} contradicts the model's preprocessing: its training images were made binary with "
                    f"data.invert {str(self.invert).lower()}; leave {leave} out, or pass {force} to apply it"
                )
            proc = replace(proc, invert=invert)
        if threshold is not None:
            name = "--threshold" if cli else "threshold"
            if isinstance(threshold, (bool, np.bool_)) or not isinstance(threshold, numbers.Real):
                raise UserError(
                    f"{name} must be a number in [0, 1], got {short(threshold)} (type {type(threshold).__name__})"
                )
            if not 0.0 <= float(threshold) <= 1.0:  # NaN fails too
                raise UserError(f"{name} must be a number in [0, 1], got {short(threshold)}")
            threshold = float(threshold)
            if threshold != self.threshold and not force_preprocessing:
                given = f"--threshold {threshold}" if cli else f"threshold={threshold}"
                raise UserError(
                    f"{given} contradicts the model's preprocessing: its training images were made binary at "
                    f"data.threshold {self.threshold}; leave {name} out, or pass {force} to apply it"
                )
            proc = replace(proc, threshold=threshold)
        return proc

    @classmethod
    def from_config(cls, cfg: Config | DataConfig) -> "ImageProcessor":
        """The processor of a config (a checkpoint's: `checkpoint_config(path)`), or of its data section."""
        if not isinstance(cfg, (Config, DataConfig)):
            raise UserError(f"ImageProcessor.from_config takes a Config or a DataConfig, got type {type(cfg).__name__}")
        d = cfg.data if isinstance(cfg, Config) else cfg
        return cls(d.image_size, d.patch_size, d.threshold, d.invert, d.fit)

    @classmethod
    def from_dict(cls, data: dict) -> "ImageProcessor":
        """The processor of an export's config.json `data` entry (extra entries, such as bit_order, ignored)."""
        if not isinstance(data, dict):
            raise UserError(f"the data entry is of type {type(data).__name__}, not a mapping of the processor's keys")
        keys = [f.name for f in fields(cls)]
        missing = [k for k in keys if k not in data]
        if missing:
            raise UserError(f"the data entry names no {missing[0]}; it needs {', '.join(keys)}")
        return cls(**{k: data[k] for k in keys})

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ImageProcessor":
        """The processor of an export dir (`vitmask export`) or a shipped model's name (`resolve_model_path`:
        a path wins), from its config.json. For a .pt checkpoint:
        `ImageProcessor.from_config(vitmask.store.checkpoint.checkpoint_config(path))`, or the
        `.processor` of `vitmask.load_classifier(path)` / `vitmask.load_masked_model(path)`."""
        checked = check_path(path, "ImageProcessor.from_pretrained's path")
        check_model_arg(path, call="ImageProcessor.from_pretrained")  # ./mnist is a path, mnist a name
        file = resolve_model_path(path if isinstance(path, str) else checked) / "config.json"
        if not file.is_file():
            raise UserError(
                f"{path} is not an export dir (no config.json); pass a folder written by vitmask export, or build "
                "the processor of a .pt checkpoint with ImageProcessor.from_config(checkpoint_config(path))"
            )
        meta = read_json(file, "export the model again")
        if not isinstance(meta, dict) or not isinstance(meta.get("data"), dict):
            raise UserError(f"{file} holds no data entry (a mapping of the processor's keys); export the model again")
        try:
            return cls.from_dict(meta["data"])
        except UserError as e:
            raise UserError(f"{file}: {e}; export the model again") from None

    # ---- images in --------------------------------------------------------------------------------
    def __call__(
        self, images, fit: str | None = None, invert=None, threshold=None, force_preprocessing: bool = False
    ) -> ProcessedImages:
        """Images (the kinds of docs/python.md#images) -> ProcessedImages: pixels (B, S, S), patches, classes.
        `fit` (pad, center_crop, resize, none) fits images of another size instead of the processor's fit;
        `invert` and `threshold` must agree with the processor's unless `force_preprocessing`."""
        return ProcessedImages(self.binarize(images, fit, invert, threshold, force_preprocessing), self.patch_size)

    def binarize(
        self, images, fit: str | None = None, invert=None, threshold=None, force_preprocessing: bool = False
    ) -> torch.Tensor:
        """Images -> (B, S, S) uint8 0/1: fitted (by `fit`, else the processor's), thresholded, inverted
        as in training (`invert`, `threshold`: see `with_preprocessing`)."""
        proc = self.with_preprocessing(fit, invert, threshold, force_preprocessing)
        if isinstance(images, (list, tuple)):
            if not images:
                raise UserError("no images given (an empty list); pass one image or a list of them")
            names = [str(x) if isinstance(x, (str, os.PathLike)) else f"image {i}" for i, x in enumerate(images)]
            grays = [gray_image(x, name) for x, name in zip(images, names, strict=True)]
            out = torch.empty(len(grays), self.image_size, self.image_size, dtype=torch.uint8)
            by_size: dict[tuple[int, int], list[int]] = {}
            for i, gray in enumerate(grays):
                by_size.setdefault(tuple(gray.shape), []).append(i)
            for idx in by_size.values():  # images of one size together
                out[idx] = proc.binarize_gray(torch.stack([grays[i] for i in idx]), names[idx[0]])
            return out
        if isinstance(images, (np.ndarray, torch.Tensor)):
            what = "the images" if is_batch(images) else "the image"
            return proc.binarize_gray(gray_batch(images, what), what)
        return proc.binarize_gray(gray_image(images, "the image").unsqueeze(0), "the image")

    def binarize_gray(self, gray: torch.Tensor, what: str = "the images") -> torch.Tensor:
        """(n, H, W) uint8 gray levels -> (n, S, S) uint8 0/1 by this processor's fit, threshold and
        invert; with fit none, images of another size are refused naming the fits to choose from."""
        _, h, w = gray.shape
        s = self.image_size
        if self.fit == "none" and (h, w) != (s, s):
            raise UserError(
                f"{what}: {h}x{w} pixels, but the model takes {s}x{s} images and the fit is none; choose how to fit "
                f"other sizes: {FIT_CHOICE}"
            )
        return binarize_images(gray, self.data_config())


# ---- reading images -------------------------------------------------------------------------------------
def is_batch(array) -> bool:
    """Whether an array or tensor is a batch: (B, H, W) with W not 1, 3 or 4, or (B, H, W, C) (a
    nested tensor counts as one: it is refused)."""
    if isinstance(array, torch.Tensor) and array.is_nested:
        return True
    return array.ndim == 4 or (array.ndim == 3 and array.shape[-1] not in CHANNELS)


def as_array(x, what: str) -> np.ndarray:
    """A numpy array, or a torch tensor (any device) as one: dtypes numpy cannot hold (bfloat16, float8)
    as float32; sparse, quantized, nested and meta tensors refused."""
    if isinstance(x, np.ma.MaskedArray) and np.ma.getmaskarray(x).any():
        raise UserError(f"{what} is a masked array with masked pixels, which have no gray level; pass x.filled(0)")
    if isinstance(x, np.ndarray):
        return np.asarray(x)  # a subclass (matrix, masked array, memmap) as a plain array
    if x.is_nested or x.layout != torch.strided:
        kind = "a nested tensor" if x.is_nested else f"a {x.layout} tensor"
        raise UserError(f"{what} is {kind}; pass a dense tensor (x.to_dense()) or a numpy array")
    if x.is_meta:
        raise UserError(f"{what} is a tensor on the meta device, which holds no values; pass one with its pixels")
    if x.is_quantized:
        raise UserError(f"{what} is a quantized tensor; pass x.dequantize() or the gray levels as uint8")
    x = x.detach()
    if x.is_floating_point() and x.dtype not in (torch.float16, torch.float32, torch.float64):
        x = x.float()  # bfloat16, float8: exact in float32
    return x.cpu().resolve_conj().resolve_neg().numpy()


def gray_batch(images, what: str = "the images") -> torch.Tensor:
    """An array or tensor of one image or a batch (the layouts of the module docstring) -> (B, H, W) uint8."""
    a = as_array(images, what)
    if a.ndim == 3 and a.shape[-1] == 2:
        raise UserError(
            f"{what}: shape {tuple(a.shape)}, which is one gray-and-alpha image or a batch of images 2 pixels wide; "
            "pass x[..., 0] for the gray levels, or the batch as (B, H, 2, 1)"
        )
    if a.ndim == 2:
        a = a[None]  # (1, H, W)
    elif a.ndim == 3 and not is_batch(a):
        a = a[None]  # (1, H, W, C)
    elif a.ndim == 4 and a.shape[-1] not in CHANNELS:
        hint = (
            "channels first is not read: pass channels last, images.permute(0, 2, 3, 1) (numpy: "
            "images.transpose(0, 2, 3, 1))"
            if a.shape[1] in CHANNELS
            else "a batch is (B, H, W) or (B, H, W, C) with C = 1, 3 or 4"
        )
        raise UserError(f"{what}: shape {tuple(a.shape)}; {hint}")
    elif a.ndim not in (3, 4):
        raise UserError(
            f"{what}: shape {tuple(a.shape)}; pass one image (H, W) or (H, W, C), or a batch (B, H, W) or "
            "(B, H, W, C), C = 1, 3 or 4"
        )
    if 0 in a.shape:
        raise UserError(f"{what}: shape {tuple(images.shape)}, no pixels; pass images of at least 1x1 pixels")
    if a.dtype == np.uint8 and not a.flags.writeable:
        a = a.copy()  # torch warns on tensors of read-only memory
    return to_gray_uint8(a, what)


def gray_image(image, what: str) -> torch.Tensor:
    """One image (a path, a PIL image, an array or tensor (H, W) or (H, W, C)) -> (H, W) uint8 gray levels."""
    from PIL import Image

    if isinstance(image, (str, os.PathLike)):
        check_path(image, what)
        try:
            return torch.from_numpy(read_gray(image))
        except OSError as e:  # a name too long, a path the system refuses to look at
            raise UserError(f"{what}: cannot read {short(str(image))} ({e.strerror or e.__class__.__name__})") from None
    if isinstance(image, Image.Image):
        if image.width == 0 or image.height == 0:
            raise UserError(
                f"{what}: a {image.width}x{image.height} PIL image, no pixels; pass images of at least 1x1 pixels"
            )
        image.load()
        return torch.from_numpy(gray_levels(image, Path(what)))
    if isinstance(image, (np.ndarray, torch.Tensor)):
        if image.ndim == 2 or (image.ndim == 3 and image.shape[-1] in CHANNELS):
            return gray_batch(image, what)[0]  # (H, W)
        raise UserError(
            f"{what}: shape {tuple(image.shape)}; an entry of a list is one image, (H, W) or (H, W, C) with C = 1, "
            "3 or 4; pass a batch (B, H, W) as one array, outside a list"
        )
    raise UserError(
        f"{what} is of type {type(image).__name__}; pass a numpy array, a torch tensor, a PIL image or an image "
        "file's path"
    )
