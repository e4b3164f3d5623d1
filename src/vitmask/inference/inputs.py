"""What `vitmask predict --input PATH` reads, as batches of named binary images.

- an image file (PNG, JPEG, BMP): one image, named by its file name;
- a folder: every PNG, JPEG and BMP file under it, recursively, in sorted order (as data.source
  folder reads one), each named by its path under the folder; a file that cannot be read stops
  the run with one line naming it;
- an .npz archive: the image array `--npz-key` (default images), read as data.source npz reads it,
  each image named by its index;
- a pack dir (`vitmask pack`): all its rows in order, or one split (`--split`), each image named by
  its index (the row, or the place in the split). Its images were binarized when it was packed,
  so its image size, threshold, invert and fit must be the model's. It gets every check a
  training run's pack gets: the open checks, then each block of rows against its CRC-32 the first
  time one of its rows is read, whole pack or split (a damaged block is one line, nothing written).

A file in .npy format (one array) given as an .npz is refused in one line, as data.source npz
refuses it (`sources.refuse_single_array`).

Every image goes through the model's processor (data/processor.py), the preprocessing it was trained
with, a batch at a time; a pack's rows are unpacked a batch at a time. `open_input` checks the path
before any model is loaded or anything read.

Shapes: b images of a batch, S image side.
"""

import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from vitmask.data import packed
from vitmask.data.processor import ImageProcessor
from vitmask.data.sources import IMAGE_SUFFIXES, read_npz, refuse_single_array
from vitmask.errors import UserError

SPLITS = ("train", "val", "test")
KINDS = "an image file (PNG, JPG, JPEG, BMP), a folder of them, an .npz archive or a pack dir (vitmask pack)"


@dataclass
class ImageInput:
    """Named images to classify, read a batch at a time by `batches`."""

    path: Path
    kind: str  # image | folder | npz | pack
    count: int
    split: str | None = None
    files: list[Path] = field(default_factory=list)  # image, folder: the files, in order
    npz_key: str = "images"
    pack: packed.PackedDataset | None = None  # pack: the opened pack (its open checks passed)

    def check(self, processor: ImageProcessor) -> None:
        """Refuse an input the model cannot read as it was trained (a pack binarized otherwise)."""
        if self.pack is not None:
            check_pack_matches(self.pack, processor)

    def batches(self, processor: ImageProcessor, size: int) -> Iterator[tuple[list[str], torch.Tensor]]:
        """(names, (b, S, S) uint8 0/1 pixels) of `size` images at a time, in order."""
        if self.kind in ("image", "folder"):
            for start in range(0, len(self.files), size):
                files = self.files[start : start + size]
                names = [f.name if self.kind == "image" else f.relative_to(self.path).as_posix() for f in files]
                yield names, processor(files).pixels
        elif self.kind == "npz":
            yield from self._npz_batches(processor, size)
        else:
            yield from self._pack_batches(processor, size)

    def _npz_batches(self, processor: ImageProcessor, size: int):
        cfg = processor.data_config()
        gray = read_npz(replace(cfg, source="npz", path=str(self.path), npz_key=self.npz_key))[0]["all"]  # (n, H, W)
        for start in range(0, len(gray), size):
            chunk = gray[start : start + size]
            yield (
                [str(i) for i in range(start, start + len(chunk))],
                processor.binarize_gray(chunk, f"the images of {self.path}"),
            )

    def _pack_batches(self, processor: ImageProcessor, size: int):
        """A pack's rows a batch at a time, each block of rows checked against its CRC-32 the first
        time one of its rows is read (packed.BlockCheck: a damaged block is one line, DamagedRows)."""
        ds = self.pack
        cpu = torch.device("cpu")
        if self.split:
            images = ds.split(self.split)
        else:
            images = packed.PackedImages(ds.rows, (0, len(ds.rows)), ds.height, ds.width, cpu, ds.check)
        for start in range(0, len(images), size):
            chunk = images[start : start + size]  # (b, S, S)
            yield [str(i) for i in range(start, start + len(chunk))], chunk


def check_pack_matches(ds: packed.PackedDataset, processor: ImageProcessor) -> None:
    """A pack's images were binarized when packed: its size and binarization must be the model's."""
    h = ds.header
    ours = {
        "image size": processor.image_size,
        "threshold": processor.threshold,
        "invert": processor.invert,
        "fit": processor.fit,
    }
    theirs = {
        "image size": ds.height if ds.height == ds.width else (ds.height, ds.width),
        "threshold": h.get("threshold"),
        "invert": h.get("invert"),
        "fit": h.get("fit"),
    }
    for key, want in ours.items():
        if theirs[key] != want:
            raise UserError(
                f"the pack {ds.root} was binarized with {key} {theirs[key]} but the model was trained with "
                f"{key} {want}; pack the source again with the model's data keys (vitmask pack --set ...), "
                "or pass the images"
            )


def open_input(path: Path, split: str | None = None, npz_key: str = "images") -> ImageInput:
    """Check `--input` (and `--split`, for a pack) and list what it holds; nothing is read yet but names."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"--input {path} does not exist; pass {KINDS}")
    if not os.access(path, os.R_OK) or (path.is_dir() and not os.access(path, os.X_OK)):
        raise UserError(f"cannot read --input {path} (permission denied); pass a readable path")
    if split is not None and split not in SPLITS:
        raise UserError(f"unknown --split '{split}'; use one of {', '.join(SPLITS)}")
    if path.is_dir() and packed.is_packed_dir(path):
        ds = packed.open_packed(path)
        count = len(ds.rows) if split is None else len(ds.split(split))
        return ImageInput(path, "pack", count, split, pack=ds)
    if split is not None:
        raise UserError(
            f"--split picks a split of a pack dir (vitmask pack), and --input {path} is not one; leave --split out"
        )
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
        if not files:
            raise UserError(f"--input {path} is a folder with no {', '.join(IMAGE_SUFFIXES)} files; pass {KINDS}")
        return ImageInput(path, "folder", len(files), files=files)
    if not path.is_file():
        raise UserError(f"--input {path} is not a regular file or a folder; pass {KINDS}")
    suffix = path.suffix.lower()
    if suffix in IMAGE_SUFFIXES:
        return ImageInput(path, "image", 1, files=[path])
    if suffix == ".npz":
        return ImageInput(path, "npz", npz_count(path, npz_key), npz_key=npz_key)
    raise UserError(f"--input {path}: '{path.suffix or path.name}' is not an input predict reads; pass {KINDS}")


def npz_count(path: Path, key: str) -> int:
    """The number of images of the array `key` of an npz archive (read from its header only)."""
    import zipfile

    try:
        refuse_single_array(path, f"--input {path}", "save the images in an archive with numpy.savez(path, images=...)")
        with np.load(path, allow_pickle=False) as archive:
            if not hasattr(archive, "files"):
                raise ValueError("a single array, not an archive")
            if key not in archive.files:
                raise UserError(
                    f"--input {path} has no array '{key}' (it holds: {', '.join(archive.files) or 'nothing'}); "
                    "pass --npz-key with the key of the image array"
                )
            with archive.zip.open(f"{key}.npy") as member:
                fmt = np.lib.format
                header = fmt.read_array_header_1_0 if fmt.read_magic(member) == (1, 0) else fmt.read_array_header_2_0
                shape = header(member)[0]
    except UserError:
        raise
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as e:
        raise UserError(
            f"--input {path} is not a readable .npz archive ({e.__class__.__name__}); save the images with numpy.savez"
        ) from None
    if len(shape) not in (3, 4) or 0 in shape:
        raise UserError(
            f"array '{key}' of --input {path} has shape {shape}; store the images as (n, H, W) or (n, H, W, C)"
        )
    return shape[0]
