"""Real image sources: torchvision datasets, idx files, image folders, npz archives and npy folders.

Each reader hands over grayscale uint8 images (0..255) under the split names the source itself
has: {"train", "test"} (and "val" for a folder that has one) where the source comes with a
split, else {"all"}. `load_source_splits` binarizes them through `preprocess` (one path for every
source) and carves the missing splits out by seeded fractions:

- a source with train and test: val is `data.val_fraction` of train;
- a source without: test is `data.test_fraction` and val `data.val_fraction` of all the images.

The same seed gives the same split. The result is the `load_splits` contract: {"train", "val",
"test"} of uint8 (n, S, S) in {0, 1}, on the CPU.

Labels come with the images where the source has them (torchvision targets, an idx labels file
beside each images file, a folder's class subfolders, an npz labels array): each reader returns
them beside its images, one int64 per image kept (a skipped file takes its label with it), and
the split is carved by the same indices, so they stay aligned. A source without labels returns,
instead, one line saying why and how to provide them: a plain str where the source has none (no
labels array, no labels file, no class subfolders), an `UnusableLabels` (a str too) where labels are
there but cannot be used (a labels file or array that cannot be read or does not match the images,
labels for some of the images only), which `vitmask pack` refuses rather than drop. Reading labels
never fails a load: the images, their order and the split are the same with or without them.
"""

import difflib
import gzip
import math
import shutil
import tempfile
from pathlib import Path
from urllib.error import URLError

import torch

from vitmask.config import DataConfig
from vitmask.data.preprocess import binarize_images, binarize_list, load_image_file, to_gray_uint8
from vitmask.errors import UserError, warn
from vitmask.runtime.memory import available_bytes, check_bytes, check_images_fit

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")
# idx image files: train-images-idx3-ubyte, t10k-images-idx3-ubyte.gz, emnist-...-images-idx3-ubyte, ...
IDX_SUFFIXES = ("idx3-ubyte", "idx3-ubyte.gz")

Raw = torch.Tensor | list[torch.Tensor]  # (n, H, W) uint8, or n images (H, W) of mixed sizes
# int64 (n,) class indices per part of a source, aligned with its images; or why there are none and how to add them
Labels = dict[str, torch.Tensor] | str


class UnusableLabels(str):
    """Why a source's labels, though there, cannot be used (a labels file or array that cannot be read
    or does not match the images, labels for some of the images only), and how to fix them: the line
    a reader returns instead of labels, where a source that has no labels at all returns a plain str."""


def _existing(path: str, what: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise UserError(f"data.path {p} does not exist; point data.path at {what}")
    return p


# ---- splits ---------------------------------------------------------------------------------------
def split_fractions(
    n: int, fractions: tuple[float, ...], seed: int, dtype: torch.dtype = torch.int64
) -> list[torch.Tensor]:
    """A seeded permutation of range(n) cut into len(fractions) + 1 index sets: round(f * n) for each
    fraction (at least 1), in order, then the rest. The same n, fractions and seed give the same sets
    (int32 holds the same values as int64, in half the memory)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed), dtype=dtype)  # (n,)
    counts = [max(1, round(f * n)) for f in fractions]
    if sum(counts) >= n:
        raise UserError(
            f"only {n} images: too few to hold out {' and '.join(map(str, counts))} of them and still train; "
            "add images or lower data.val_fraction / data.test_fraction"
        )
    return list(torch.split(perm, [*counts, n - sum(counts)]))


def split_plan(
    sizes: dict[str, int], cfg: DataConfig, seed: int, dtype: torch.dtype = torch.int64
) -> dict[str, tuple[str, torch.Tensor | None]]:
    """Where each of train/val/test comes from, given the sizes of a source's own parts: (part,
    indices into it), or (part, None) for the whole part in order (see module doc)."""
    if "all" in sizes:
        test, val, train = split_fractions(sizes["all"], (cfg.test_fraction, cfg.val_fraction), seed, dtype)
        return {"train": ("all", train), "val": ("all", val), "test": ("all", test)}
    plan: dict[str, tuple[str, torch.Tensor | None]] = {k: (k, None) for k in sizes}
    if "val" not in sizes:
        val, train = split_fractions(sizes["train"], (cfg.val_fraction,), seed, dtype)
        plan["train"], plan["val"] = ("train", train), ("train", val)
    return {k: plan[k] for k in ("train", "val", "test")}


def take(parts: dict[str, torch.Tensor], plan: dict[str, tuple[str, torch.Tensor | None]]) -> dict[str, torch.Tensor]:
    """Apply a `split_plan` to per-part tensors (images or their labels)."""
    return {k: parts[part] if idx is None else parts[part][idx] for k, (part, idx) in plan.items()}


def make_splits(parts: dict[str, torch.Tensor], cfg: DataConfig, seed: int) -> dict[str, torch.Tensor]:
    """Binarized images under a source's own split names -> {"train", "val", "test"} (see module doc)."""
    return take(parts, split_plan({k: len(v) for k, v in parts.items()}, cfg, seed))


def load_source_labelled(cfg: DataConfig, seed: int) -> tuple[dict[str, torch.Tensor], Labels]:
    """The splits of a non-built-in source (read, binarize, split) and their labels, split alike:
    {"train", "val", "test"} of int64 (n,), or the line saying why the source has none."""
    readers = {
        "torchvision": read_torchvision,
        "idx": read_idx,
        "folder": read_folder,
        "npz": read_npz,
        "npy": read_npy,
    }
    raw, labels = readers[cfg.source](cfg)
    check_images_fit(sum(len(v) for v in raw.values()), cfg.image_size)
    binary = {k: binarize_list(v, cfg) if isinstance(v, list) else binarize_images(v, cfg) for k, v in raw.items()}
    plan = split_plan({k: len(v) for k, v in binary.items()}, cfg, seed)
    return take(binary, plan), labels if isinstance(labels, str) else take(labels, plan)


def load_source_splits(cfg: DataConfig, seed: int) -> dict[str, torch.Tensor]:
    """The splits of a non-built-in source: read, binarize, split."""
    return load_source_labelled(cfg, seed)[0]


# ---- torchvision ----------------------------------------------------------------------------------
def read_torchvision(cfg: DataConfig) -> tuple[dict[str, Raw], Labels]:
    """A torchvision dataset by name, its own train/test split, under root data.path; its targets."""
    from torchvision import datasets

    root = Path(cfg.path)
    cls = getattr(datasets, cfg.name)
    kwargs = {"split": cfg.emnist_split} if cfg.name == "EMNIST" else {}
    # the folders a download makes (root/<name>/raw, Omniglot's root/omniglot-py) and root's missing parents:
    # those that are new and still empty are removed again when the download fails
    made = [d for d in (root / cfg.name / "raw", root / cfg.name, root / "omniglot-py", root, *root.parents)]
    made = [d for d in made if not d.exists()]
    try:
        if cfg.name == "Omniglot":  # background = the training alphabets, evaluation = the rest
            sets = {k: cls(root, background=k == "train", download=cfg.download) for k in ("train", "test")}
        else:
            sets = {k: cls(root, train=k == "train", download=cfg.download, **kwargs) for k in ("train", "test")}
    except (RuntimeError, OSError) as e:
        remove_empty(made)
        raise UserError(torchvision_failed(cfg, root, e)) from None
    if cfg.name == "Omniglot":  # PNG files behind a per-item API: a loop at load time, not in the hot path
        images = {k: [torch.from_numpy(_pil_array(ds[i][0])) for i in range(len(ds))] for k, ds in sets.items()}
        return images, (
            "Omniglot's background (train) and evaluation (test) sets hold different characters, so a probe "
            "trained on one cannot be scored on the other; use a labelled folder or npz of Omniglot images"
        )
    out = {k: ds.data for k, ds in sets.items()}  # (n, 28, 28) uint8, the MNIST family
    if cfg.name == "EMNIST":  # EMNIST's files hold every image transposed
        out = {k: v.transpose(1, 2).contiguous() for k, v in out.items()}
    targets = {k: torch.as_tensor(ds.targets).long() for k, ds in sets.items()}  # (n,), QMNIST: (n, 8)
    return out, {k: t[:, 0] if t.dim() == 2 else t for k, t in targets.items()}  # QMNIST's class is column 0


def torchvision_failed(cfg: DataConfig, root: Path, e: Exception) -> str:
    """The one-line error of a torchvision dataset that could not be loaded or downloaded."""
    text = str(e)
    if isinstance(e, RuntimeError):
        if not cfg.download and "not found" in text.lower():
            return (
                f"torchvision dataset {cfg.name} not found under {root} and data.download is false; "
                f"set data.download=true to fetch it, or point data.path at the root that holds {cfg.name}/"
            )
        if cfg.download and ("download" in text.lower() or "corrupted" in text.lower()):  # every mirror failed
            return download_failed(cfg, root, text.strip().splitlines()[-1])
        why = " ".join(text.split())  # one line
        return f"could not load torchvision dataset {cfg.name} into {root} ({why}); check data.path"
    if isinstance(e, URLError) or isinstance(e.__cause__ or e.__context__, URLError):  # no network, refused
        return download_failed(cfg, root, text)
    return (  # a full disk, no permission
        f"could not write torchvision dataset {cfg.name} into {root} ({e.__class__.__name__}: {e}); "
        "check the free space and the permissions of data.path"
    )


def remove_empty(folders: list[Path]) -> None:
    """Remove each of `folders` (deepest first) that exists and is empty: what a failed download made."""
    for d in folders:
        try:
            d.rmdir()
        except OSError:  # absent, or not empty
            pass


IDX_DATASETS = ("MNIST", "FashionMNIST", "KMNIST")  # torchvision sets whose idx files the idx source reads as they are


def download_failed(cfg: DataConfig, root: Path, why: str) -> str:
    """The one-line error of a torchvision download that failed: the network is unreachable, or the
    server refused; how to point vitmask at files the user has, or fetches elsewhere."""
    why = " ".join(why.split())
    local = (
        f"point vitmask at {cfg.name}'s idx files if you have them (--set data.source=idx --set data.path=DIR, "
        "DIR the folder of *-idx3-ubyte files or one such file), or "
        if cfg.name in IDX_DATASETS
        else ""
    )
    return (
        f"could not download torchvision dataset {cfg.name} into {root}: the network is unreachable or the "
        f"download failed ({why}); {local}download it on a machine with a network (the same command) and copy "
        f"its {root}/ folder to this one's {root}/, then run again"
    )


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


def read_idx_labels(path: Path) -> torch.Tensor:
    """One idx labels file, gzipped or not -> (n,) int64, read by torchvision's own reader."""
    from torchvision.datasets.mnist import read_label_file

    if path.suffix == ".gz":
        with gzip.open(path, "rb") as src, tempfile.NamedTemporaryFile(suffix=".idx") as tmp:
            shutil.copyfileobj(src, tmp)
            tmp.flush()
            return read_label_file(tmp.name)
    return read_label_file(str(path))


def idx_labels_beside(images_file: Path, n: int) -> torch.Tensor | str:
    """The labels of an idx images file, from the file beside it with `images-idx3-ubyte` read as
    `labels-idx1-ubyte` (plain or gzipped): (n,) int64, or why there are none (no such file), or why
    they cannot be used (`UnusableLabels`: unreadable, or not one per image)."""
    stem = images_file.name.removesuffix(".gz")
    name = stem.replace("images-idx3-ubyte", "labels-idx1-ubyte").replace("idx3-ubyte", "idx1-ubyte")
    found = [p for p in (images_file.with_name(name), images_file.with_name(name + ".gz")) if p.is_file()]
    if not found:
        return f"there is no labels file {name}[.gz] beside {images_file}; put the idx labels file next to it"
    try:
        labels = read_idx_labels(found[0])
    except (AssertionError, KeyError, TypeError, ValueError, RuntimeError, OSError, EOFError) as e:
        return UnusableLabels(f"{found[0]} is not a readable idx labels file ({e.__class__.__name__}); replace it")
    if len(labels) != n:
        return UnusableLabels(
            f"{found[0]} holds {len(labels)} labels for the {n} images of {images_file}; pass the matching file"
        )
    return labels


def read_idx(cfg: DataConfig) -> tuple[dict[str, Raw], Labels]:
    """idx image files in the folder data.path (or one file). Files named t10k-* or test-* are the
    test split, the others train; with only one kind there, all of it is split by fractions. The
    labels are the `*labels-idx1-ubyte[.gz]` file beside each images file. A file beside its own .gz
    is read once: torchvision's raw folder (`<root>/MNIST/raw`, each file plain and gzipped) reads as
    torchvision's train and test, and its `t10k-images-idx3-ubyte` alone as the test set split by
    fractions."""
    root = _existing(cfg.path, "a folder of idx files such as t10k-images-idx3-ubyte.gz")
    files = [root] if root.is_file() else sorted(p for p in root.iterdir() if p.name.endswith(IDX_SUFFIXES))
    plain = {p.name for p in files}
    files = [p for p in files if not (p.suffix == ".gz" and p.stem in plain)]  # a file and its .gz: read the file
    if not files:
        raise UserError(f"no idx image files (*idx3-ubyte or *idx3-ubyte.gz) in {root}; point data.path at them")
    groups: dict[str, list[torch.Tensor]] = {}
    labels: dict[str, list[torch.Tensor]] = {}
    missing: list[str] = []  # why a file has no labels, file by file
    for p in files:
        kind = "test" if p.name.startswith(("t10k", "test")) or "-test-" in p.name else "train"
        groups.setdefault(kind, []).append(read_idx_file(p))
        found = idx_labels_beside(p, len(groups[kind][-1]))
        if isinstance(found, str):
            missing.append(found)
        else:
            labels.setdefault(kind, []).append(found)
    parts = {"all" if len(groups) == 1 else k: _cat(v, root) for k, v in groups.items()}
    unusable = next((m for m in missing if isinstance(m, UnusableLabels)), None)
    if unusable is not None:
        return parts, unusable
    if missing and labels:  # labels beside some files only: the others' are not there
        return parts, UnusableLabels(f"{missing[0]} (the other idx files have theirs)")
    if missing:
        return parts, missing[0]
    return parts, {"all" if len(labels) == 1 else k: torch.cat(v) for k, v in labels.items()}


def _cat(images: list[torch.Tensor], root: Path) -> torch.Tensor:
    if len({tuple(x.shape[1:]) for x in images}) > 1:
        raise UserError(f"the idx files in {root} hold images of different sizes; keep one dataset per folder")
    return torch.cat(images)


# ---- folder ---------------------------------------------------------------------------------------
def read_folder(cfg: DataConfig) -> tuple[dict[str, Raw], Labels]:
    """Every PNG, JPEG or BMP file under data.path, recursively, in sorted order. Subfolders train/
    and test/ (and optionally val/) are the source's own split. Unreadable files are skipped with
    one warning that counts them (data.bad_files=skip) or stop the run (data.bad_files=fail).
    Labels: see `folder_labels`."""
    root = _existing(cfg.path, "a folder of PNG, JPEG or BMP files")
    if not root.is_dir():
        raise UserError(f"data.path {root} is not a folder; point data.path at a folder of PNG, JPEG or BMP files")
    groups = folder_parts(root)
    files = folder_files(groups)
    total = sum(map(len, files.values()))
    if total == 0:
        raise UserError(f"no PNG, JPEG or BMP files under {root}; point data.path at a folder of images")
    bad: list[tuple[Path, str]] = []
    out: dict[str, Raw] = {}
    free = available_bytes(torch.device("cpu"))
    budget, held = (free // 2 if free is not None else None), 0  # full-size images, before fitting
    kept: dict[str, list[Path]] = {k: [] for k in files}  # the files read, in the order of their images
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
            kept[k].append(p)
        if not images and total > len(bad):
            raise UserError(f"{groups[k]} holds no readable images; put PNG, JPEG or BMP files in it")
        out[k] = images
    if len(bad) == total:
        raise UserError(f"none of the {total} image files under {root} could be read (first: {bad[0][1]})")
    if bad:
        warn(f"skipped {len(bad)} of {total} image files under {root} that could not be read (first: {bad[0][1]})")
    return out, folder_labels(groups, files, kept)


def folder_parts(root: Path) -> dict[str, Path]:
    """A folder source's own parts: its train/, test/ (and val/) subfolders where it has train/ and
    test/, else the folder itself as "all"."""
    own = {k: root / k for k in ("train", "val", "test") if (root / k).is_dir()}
    return own if {"train", "test"} <= set(own) else {"all": root}


def folder_files(parts: dict[str, Path]) -> dict[str, list[Path]]:
    """The PNG, JPEG and BMP files under each part, recursively, sorted (readable or not)."""
    return {
        k: sorted(p for p in d.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
        for k, d in parts.items()
    }


def folder_classes(parts: dict[str, Path], files: dict[str, list[Path]]) -> list[str] | Path:
    """The class names of a folder source, sorted, class i the i-th (as torchvision's ImageFolder):
    the first-level subfolders that hold image files under any part. Counted over every image file,
    readable or not, so the names and `folder_labels`' indices agree whatever a read skips. A file
    outside a class subfolder means the folder has no classes: that file is returned instead."""
    names = set()
    for k, paths in files.items():
        for p in paths:
            under = p.relative_to(parts[k]).parts
            if len(under) == 1:
                return p
            names.add(under[0])
    return sorted(names)


def folder_labels(parts: dict[str, Path], files: dict[str, list[Path]], kept: dict[str, list[Path]]) -> Labels:
    """As torchvision's ImageFolder: an image's class is the first-level subfolder it lies in under
    its part's folder (train/, val/, test/, or data.path itself), numbered by `folder_classes` over
    every split (one shared index). `kept`: the files read, in the order of their images. A file
    outside a class folder means the folder has no labels: unusable ones (`UnusableLabels`) where
    other images lie in class subfolders."""
    classes = folder_classes(parts, files)
    if isinstance(classes, Path):
        why = (
            f"{classes} is not in a class subfolder; to label a folder, put each class's images in a "
            f"subfolder named after it ({classes.parent}/CLASS/...), as torchvision's ImageFolder reads them"
        )
        in_classes = any(len(p.relative_to(parts[k]).parts) > 1 for k, paths in files.items() for p in paths)
        return UnusableLabels(f"{why} (the other images are)") if in_classes else why
    index = {c: i for i, c in enumerate(classes)}
    return {
        k: torch.tensor([index[p.relative_to(parts[k]).parts[0]] for p in paths], dtype=torch.long)
        for k, paths in kept.items()
    }


# ---- npz ------------------------------------------------------------------------------------------
def refuse_single_array(path: Path, label: str, fix: str) -> None:
    """Refuse, in one line, a file in .npy format (one array, whatever the file's name) where an .npz
    archive is read (np.load would return the array, not an archive): data.source npz and `vitmask
    predict --input`. `label` names the file as the command does; `fix` is what to do instead."""
    with open(path, "rb") as f:
        if f.read(6) == b"\x93NUMPY":
            raise UserError(f"{label} is a single NumPy array (.npy), not an .npz archive; {fix}")


def read_npz(cfg: DataConfig) -> tuple[dict[str, Raw], Labels]:
    """The array data.npz_key of the NumPy archive data.path; split by fractions. Labels: the array
    data.npz_labels_key of the same archive (see `npz_labels`)."""
    import zipfile

    import numpy as np

    path = _existing(cfg.path, "a .npz file holding an image array")
    try:
        refuse_single_array(path, str(path), "set data.source: npy to read it, or save the images with numpy.savez")
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
            labels = npz_labels(archive, cfg.npz_labels_key, path, len(array))
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as e:
        raise UserError(
            f"{path} is not a readable .npz archive ({e.__class__.__name__}); save the images with numpy.savez"
        ) from None
    images = {"all": to_gray_uint8(array, f"array '{cfg.npz_key}' of {path}")}
    return images, labels if isinstance(labels, str) else {"all": labels}


def npz_labels(archive, key: str, path: Path, n: int) -> torch.Tensor | str:
    """The labels array `key` of an open npz archive: (n,) int64, or why there are none (no such array),
    or why they cannot be used (`UnusableLabels`: unreadable, or not one per image). Integers >= 0 are
    kept as they are; any other values (strings, negative numbers) are numbered in sorted order."""
    import zipfile

    import numpy as np

    fix = f"save one label per image under '{key}' (numpy.savez(..., labels=y)) or set data.npz_labels_key"
    if key not in archive.files:
        return f"{path} has no array '{key}' (it holds: {', '.join(archive.files)}); {fix}"
    try:
        a = archive[key]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:  # e.g. an object array (no pickles)
        return UnusableLabels(f"array '{key}' of {path} cannot be read ({e.__class__.__name__}); {fix}")
    if a.shape != (n,):
        return UnusableLabels(f"array '{key}' of {path} has shape {a.shape}, but there are {n} images; {fix}")
    if np.issubdtype(a.dtype, np.integer) and (n == 0 or a.min() >= 0):
        return torch.from_numpy(a.astype(np.int64))
    return torch.from_numpy(np.unique(a, return_inverse=True)[1].reshape(n).astype(np.int64))


# ---- npy (the Quick, Draw! layout) ----------------------------------------------------------------
NPY_CHUNK = 1 << 16  # images read from a memory-mapped file at a time


class NpyFile:
    """One `<name>.npy` of an npy folder, memory-mapped: (n, H, W) images of one class, `name`.

    The file holds uint8 gray levels 0..255, or 0/1 values (uint8, bool or another integer type),
    as (n, H*W) with H*W a square (Quick, Draw!'s (n, 784)) or as (n, H, W). `count` is how many
    are taken: the first min(n, data.max_per_class). Opening reads the .npy header and, for the
    value range, the taken images once.
    """

    def __init__(self, path: Path, max_per_class: int):
        import numpy as np

        self.path, self.name = path, path.stem
        fix = "store (n, 784) or (n, H, W) uint8 gray levels 0..255 (or 0/1) per class, as Quick, Draw! does"
        try:
            a = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise UserError(f"{path} is not a readable .npy file ({e.__class__.__name__}); {fix}") from None
        if not (a.dtype == np.bool_ or np.issubdtype(a.dtype, np.integer)):
            raise UserError(f"{path} has dtype {a.dtype}; {fix}")
        side = math.isqrt(a.shape[1]) if a.ndim == 2 else 0
        if a.ndim == 2 and side * side == a.shape[1] and side > 0:
            a = a.reshape(len(a), side, side)  # a view of the memory map
        if a.ndim != 3 or 0 in a.shape[1:]:
            raise UserError(f"{path} has shape {a.shape}, not (n, H*W) with H*W a square or (n, H, W); {fix}")
        self.array = a  # (n, H, W) memmap
        self.count = len(a) if max_per_class == 0 else min(len(a), max_per_class)
        lo, hi = self._range()
        if lo < 0 or hi > 255:
            raise UserError(f"{path} holds values in [{lo}, {hi}]; {fix}")
        self.scale = 255 if hi <= 1 else 1  # 0/1 files: 1 is full foreground

    def _range(self) -> tuple[int, int]:
        lo, hi = 0, 0
        for start in range(0, self.count, NPY_CHUNK):
            part = self.array[start : start + NPY_CHUNK]
            lo, hi = min(lo, int(part.min())), max(hi, int(part.max()))
        return lo, hi

    def gray_chunks(self, chunk: int = NPY_CHUNK):
        """The taken images in order, as uint8 (k, H, W) gray levels 0..255, `chunk` at a time."""
        import numpy as np

        for start in range(0, self.count, chunk):
            part = np.array(self.array[start : min(start + chunk, self.count)])  # read: a copy
            if self.scale != 1 or part.dtype != np.uint8:
                part = (part.astype(np.uint16) * self.scale).astype(np.uint8)
            yield torch.from_numpy(np.ascontiguousarray(part))


def npy_files(cfg: DataConfig) -> list[NpyFile]:
    """The `*.npy` files of the folder data.path, sorted by name (a file's place is its label)."""
    root = _existing(cfg.path, "a folder of <category>.npy files, as Quick, Draw!'s numpy_bitmap")
    if not root.is_dir():
        raise UserError(f"data.path {root} is not a folder; point data.path at a folder of <category>.npy files")
    paths = sorted(p for p in root.iterdir() if p.suffix == ".npy" and p.is_file())
    if not paths:
        raise UserError(f"no .npy files in {root}; put one <category>.npy per class there (Quick, Draw! layout)")
    return [NpyFile(p, cfg.max_per_class) for p in paths]


def read_npy(cfg: DataConfig) -> tuple[dict[str, Raw], Labels]:
    """Every `<name>.npy` of the folder data.path (the first data.max_per_class of each), in sorted
    file order, as one part split by fractions; an image's label is its file's place in that order."""
    files = npy_files(cfg)
    check_images_fit(sum(f.count for f in files), max(max(f.array.shape[1:]) for f in files))
    images, labels = [], []
    for i, f in enumerate(files):
        images += list(f.gray_chunks())
        labels.append(torch.full((f.count,), i, dtype=torch.long))
    if len({tuple(x.shape[1:]) for x in images}) > 1:
        flat = [img for chunk in images for img in chunk]  # mixed sizes: one image at a time, fitted later
        return {"all": flat}, {"all": torch.cat(labels)}
    return {"all": torch.cat(images)}, {"all": torch.cat(labels)}
