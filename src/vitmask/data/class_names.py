"""The names of a labelled source's classes, so that a classifier's answers read as names.

`source_names` gives the names of a source's label values 0, 1, ...: the built-in shapes' kinds, a
folder's class subfolders (`sources.folder_classes`: sorted, as torchvision's ImageFolder and
`sources.folder_labels` number them), an npy folder's file names (sorted), a pack's `classes`, an
npz archive's labels where they are not numbers (numbered in sorted order by `sources.npz_labels`),
a torchvision dataset's `classes` (FashionMNIST's `T-shirt/top`, ..., MNIST's `0 - zero`, ...;
EMNIST's of its split). idx files and an npz of integer labels have none. `vitmask pack` writes
them into the pack's header (`pack_classes`), so a pack names its classes as its source did, and
`vitmask finetune` keeps beside each class's label value its name (`class_names`), from a source or
from a pack alike. Reading names never fails: where a source has none, or its names cannot be
matched to its label values, the values, as text, are the names.
"""

import json
from pathlib import Path

from vitmask.config import DataConfig
from vitmask.data import shapes, sources


def class_names(data: DataConfig, values: list[int]) -> list[str]:
    """One name for each label value in `values` (the classes in the classifier's order)."""
    try:
        names = source_names(data)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        names = None
    if names is None or any(not 0 <= v < len(names) for v in values):
        return [str(v) for v in values]
    return [str(names[v]) for v in values]


def pack_classes(data: DataConfig, num_values: int) -> list[str]:
    """The `classes` a pack's header holds for labels 0 .. num_values - 1: the source's names, or the
    values as text where it has none (or too few for its labels)."""
    return class_names(data, list(range(num_values)))


def source_names(data: DataConfig) -> list[str] | None:
    """The names of the source's label values 0, 1, ... (None: it has none, or they are the numbers)."""
    if data.source == "shapes":
        return list(shapes.KINDS)
    if data.source == "folder":
        parts = sources.folder_parts(Path(data.path))
        classes = sources.folder_classes(parts, sources.folder_files(parts))
        return None if isinstance(classes, Path) else classes
    if data.source == "npy":
        return sorted(p.stem for p in Path(data.path).iterdir() if p.suffix == ".npy" and p.is_file())
    if data.source == "packed":
        classes = json.loads((Path(data.path) / "header.json").read_text()).get("classes")
        return [str(c) for c in classes] if isinstance(classes, list) else None
    if data.source == "npz":
        return npz_names(Path(data.path), data.npz_labels_key)
    if data.source == "torchvision":
        return torchvision_names(data)
    return None


def torchvision_names(data: DataConfig) -> list[str] | None:
    """What the torchvision dataset's `classes` holds, read from its class (nothing is loaded or
    downloaded): target t is named classes[t]. EMNIST's depend on its split (`classes_split_dict`);
    Omniglot has none."""
    from torchvision import datasets

    cls = getattr(datasets, data.name)
    if data.name == "EMNIST":
        return list(cls.classes_split_dict[data.emnist_split])
    classes = getattr(cls, "classes", None)
    return list(classes) if isinstance(classes, (list, tuple)) and classes else None


def npz_names(path: Path, key: str) -> list[str] | None:
    """The sorted distinct labels of an npz archive whose labels are not integers >= 0 (as npz_labels numbers them)."""
    import numpy as np

    with np.load(path, allow_pickle=False) as archive:
        if key not in archive.files:
            return None
        labels = archive[key]
    if np.issubdtype(labels.dtype, np.integer) and (labels.size == 0 or labels.min() >= 0):
        return None
    return [str(v) for v in np.unique(labels)]
