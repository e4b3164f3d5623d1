"""Real image sources: torchvision datasets, idx files, image folders and npz archives.

Each reader hands over grayscale uint8 images (0..255) under the split names the source itself
has: {"train", "test"} (and "val" for a folder that has one) where the source comes with a
split, else {"all"}. `load_source_splits` binarizes them through `preprocess` (one path for every
source) and carves the missing splits out by seeded fractions:

- a source with train and test: val is `data.val_fraction` of train;
- a source without: test is `data.test_fraction` and val `data.val_fraction` of all the images.

The same seed gives the same split. The result is the `load_splits` contract: {"train", "val",
"test"} of uint8 (n, S, S) in {0, 1}, on the CPU.
"""

import difflib
import gzip
import math
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from vitmask.config import DataConfig
from vitmask.errors import UserError
from vitmask.memory import available_bytes, check_bytes, check_images_fit
from vitmask.preprocess import binarize_images, binarize_list, load_image_file, to_gray_uint8

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")
# idx image files: train-images-idx3-ubyte, t10k-images-idx3-ubyte.gz, emnist-...-images-idx3-ubyte, ...
IDX_SUFFIXES = ("idx3-ubyte", "idx3-ubyte.gz")

Raw = torch.Tensor | list[torch.Tensor]  # (n, H, W) uint8, or n images (H, W) of mixed sizes


def warn(msg: str) -> None:
    """One line on stderr that does not stop the run."""
    print(f"vitmask: warning: {msg}", file=sys.stderr)


def _existing(path: str, what: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise UserError(f"data.path {p} does not exist; point data.path at {what}")
    return p


# ---- splits ---------------------------------------------------------------------------------------
def split_fractions(n: int, fractions: tuple[float, ...], seed: int) -> list[torch.Tensor]:
    """A seeded permutation of range(n) cut into len(fractions) + 1 index sets: round(f * n) for each
    fraction (at least 1), in order, then the rest. The same n, fractions and seed give the same sets."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))  # (n,)
    counts = [max(1, round(f * n)) for f in fractions]
    if sum(counts) >= n:
        raise UserError(
            f"only {n} images: too few to hold out {' and '.join(map(str, counts))} of them and still train; "
            "add images or lower data.val_fraction / data.test_fraction"
        )
    return list(torch.split(perm, [*counts, n - sum(counts)]))


def make_splits(parts: dict[str, torch.Tensor], cfg: DataConfig, seed: int) -> dict[str, torch.Tensor]:
    """Binarized images under a source's own split names -> {"train", "val", "test"} (see module doc)."""
    if "all" in parts:
        images = parts["all"]
        test, val, train = split_fractions(len(images), (cfg.test_fraction, cfg.val_fraction), seed)
        return {"train": images[train], "val": images[val], "test": images[test]}
    out = dict(parts)
    if "val" not in out:
        val, train = split_fractions(len(parts["train"]), (cfg.val_fraction,), seed)
        out["train"], out["val"] = parts["train"][train], parts["train"][val]
    return {k: out[k] for k in ("train", "val", "test")}


def load_source_splits(cfg: DataConfig, seed: int) -> dict[str, torch.Tensor]:
    """The splits of a non-built-in source: read, binarize, split."""
    readers = {"torchvision": read_torchvision, "idx": read_idx, "folder": read_folder, "npz": read_npz}
    raw = readers[cfg.source](cfg)
    check_images_fit(sum(len(v) for v in raw.values()), cfg.image_size)
    binary = {k: binarize_list(v, cfg) if isinstance(v, list) else binarize_images(v, cfg) for k, v in raw.items()}
    return make_splits(binary, cfg, seed)


# ---- torchvision ----------------------------------------------------------------------------------
def read_torchvision(cfg: DataConfig) -> dict[str, Raw]:
    """A torchvision dataset by name, its own train/test split, under root data.path."""
    from torchvision import datasets

    root = Path(cfg.path)
    cls = getattr(datasets, cfg.name)
    kwargs = {"split": cfg.emnist_split} if cfg.name == "EMNIST" else {}
    try:
        if cfg.name == "Omniglot":  # background = the training alphabets, evaluation = the rest
            sets = {k: cls(root, background=k == "train", download=cfg.download) for k in ("train", "test")}
        else:
            sets = {k: cls(root, train=k == "train", download=cfg.download, **kwargs) for k in ("train", "test")}
    except RuntimeError as e:
        if not cfg.download and "not found" in str(e).lower():
            raise UserError(
                f"torchvision dataset {cfg.name} not found under {root} and data.download is false; "
                f"set data.download=true to fetch it, or point data.path at the root that holds {cfg.name}/"
            ) from None
        why = " ".join(str(e).split())  # one line
        raise UserError(f"could not load torchvision dataset {cfg.name} into {root} ({why}); check data.path") from None
    except OSError as e:  # no network, a refused connection, a full disk
        raise UserError(
            f"could not download torchvision dataset {cfg.name} into {root} ({e.__class__.__name__}); "
            "check the network, or fetch the files by hand and set data.download=false"
        ) from None
    if cfg.name == "Omniglot":  # PNG files behind a per-item API: a loop at load time, not in the hot path
        return {k: [torch.from_numpy(_pil_array(ds[i][0])) for i in range(len(ds))] for k, ds in sets.items()}
    out = {k: ds.data for k, ds in sets.items()}  # (n, 28, 28) uint8, the MNIST family
    if cfg.name == "EMNIST":  # EMNIST's files hold every image transposed
        out = {k: v.transpose(1, 2).contiguous() for k, v in out.items()}
    return out


def _pil_array(img):
    import numpy as np

    return np.array(img.convert("L"), dtype=np.uint8)  # (H, W)


# ---- idx ------------------------------------------------------------------------------------------
def read_idx_file(path: Path) -> torch.Tensor:
    """One idx image file, gzipped or not -> (n, H, W) uint8, read by torchvision's own reader."""
    from torchvision.datasets.mnist import read_image_file

    try:
        if path.suffix == ".gz":  # torchvision's reader opens a plain file: gunzip to a temporary one
            with gzip.open(path, "rb") as src, tempfile.NamedTemporaryFile(suffix=".idx") as tmp:
                shutil.copyfileobj(src, tmp)
                tmp.flush()
                return read_image_file(tmp.name)
        return read_image_file(str(path))
    except (AssertionError, KeyError, TypeError, ValueError, RuntimeError, OSError, EOFError) as e:
        raise UserError(
            f"{path} is not a readable idx image file ({e.__class__.__name__}); "
            "pass MNIST-format image files such as t10k-images-idx3-ubyte.gz"
        ) from None


def read_idx(cfg: DataConfig) -> dict[str, Raw]:
    """idx image files in the folder data.path (or one file). Files named t10k-* or test-* are the
    test split, the others train; with only one kind there, all of it is split by fractions."""
    root = _existing(cfg.path, "a folder of idx files such as t10k-images-idx3-ubyte.gz")
    files = [root] if root.is_file() else sorted(p for p in root.iterdir() if p.name.endswith(IDX_SUFFIXES))
    plain = {p.name for p in files}
    files = [p for p in files if not (p.suffix == ".gz" and p.stem in plain)]  # a file and its .gz: read the file
    if not files:
        raise UserError(f"no idx image files (*idx3-ubyte or *idx3-ubyte.gz) in {root}; point data.path at them")
    groups: dict[str, list[torch.Tensor]] = {}
    for p in files:
        kind = "test" if p.name.startswith(("t10k", "test")) or "-test-" in p.name else "train"
        groups.setdefault(kind, []).append(read_idx_file(p))
    if len(groups) == 1:
        return {"all": _cat(next(iter(groups.values())), root)}
    return {k: _cat(v, root) for k, v in groups.items()}


def _cat(images: list[torch.Tensor], root: Path) -> torch.Tensor:
    if len({tuple(x.shape[1:]) for x in images}) > 1:
        raise UserError(f"the idx files in {root} hold images of different sizes; keep one dataset per folder")
    return torch.cat(images)


# ---- folder ---------------------------------------------------------------------------------------
def read_folder(cfg: DataConfig) -> dict[str, Raw]:
    """Every PNG, JPEG or BMP file under data.path, recursively, in sorted order. Subfolders train/
    and test/ (and optionally val/) are the source's own split. Unreadable files are skipped with
    one warning that counts them (data.bad_files=skip) or stop the run (data.bad_files=fail)."""
    root = _existing(cfg.path, "a folder of PNG, JPEG or BMP files")
    if not root.is_dir():
        raise UserError(f"data.path {root} is not a folder; point data.path at a folder of PNG, JPEG or BMP files")
    own = {k: root / k for k in ("train", "val", "test") if (root / k).is_dir()}
    groups = own if {"train", "test"} <= set(own) else {"all": root}
    files = {
        k: sorted(p for p in d.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
        for k, d in groups.items()
    }
    total = sum(map(len, files.values()))
    if total == 0:
        raise UserError(f"no PNG, JPEG or BMP files under {root}; point data.path at a folder of images")
    bad: list[tuple[Path, str]] = []
    out: dict[str, Raw] = {}
    free = available_bytes(torch.device("cpu"))
    budget, held = (free // 2 if free is not None else None), 0  # full-size images, before fitting
    for k, paths in files.items():
        images = []
        for p in paths:
            try:
                image = load_image_file(p)
            except UserError as e:
                if cfg.bad_files == "fail":
                    raise UserError(
                        f"{e} (data.bad_files is fail: remove the file, or set data.bad_files=skip)"
                    ) from None
                bad.append((p, str(e)))
                continue
            held += image.numel()
            if budget is not None and held > budget:
                raise UserError(
                    f"the images under {root} take more than {held / 2**30:.1f} GiB at full size, over half the free "
                    "memory; shrink them first, or use fewer"
                )
            images.append(image)
        if not images and total > len(bad):
            raise UserError(f"{groups[k]} holds no readable images; put PNG, JPEG or BMP files in it")
        out[k] = images
    if len(bad) == total:
        raise UserError(f"none of the {total} image files under {root} could be read (first: {bad[0][1]})")
    if bad:
        warn(f"skipped {len(bad)} of {total} image files under {root} that could not be read (first: {bad[0][1]})")
    return out


# ---- npz ------------------------------------------------------------------------------------------
def read_npz(cfg: DataConfig) -> dict[str, Raw]:
    """The array data.npz_key of the NumPy archive data.path; split by fractions."""
    import zipfile

    import numpy as np

    path = _existing(cfg.path, "a .npz file holding an image array")
    try:
        with np.load(path, allow_pickle=False) as archive:
            if not hasattr(archive, "files"):
                raise ValueError("a single array, not an archive")
            if cfg.npz_key not in archive.files:
                near = difflib.get_close_matches(cfg.npz_key, archive.files, n=1)
                hint = f"did you mean '{near[0]}'? " if near else ""
                raise UserError(
                    f"{path} has no array '{cfg.npz_key}' (it holds: {', '.join(archive.files) or 'nothing'}); "
                    f"{hint}set data.npz_key to the key of the image array"
                )
            with archive.zip.open(f"{cfg.npz_key}.npy") as member:  # the header first: shape and dtype
                fmt = np.lib.format
                header = fmt.read_array_header_1_0 if fmt.read_magic(member) == (1, 0) else fmt.read_array_header_2_0
                shape, _, dtype = header(member)
            what = f"array '{cfg.npz_key}' of {path}, {shape} {dtype},"
            check_bytes(math.prod(shape) * (dtype.itemsize + 8), what, "store fewer or smaller images")
            array = archive[cfg.npz_key]
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as e:
        raise UserError(
            f"{path} is not a readable .npz archive ({e.__class__.__name__}); save the images with numpy.savez"
        ) from None
    return {"all": to_gray_uint8(array, f"array '{cfg.npz_key}' of {path}")}
